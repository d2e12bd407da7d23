"""`make gpu-check` (bench/gpu_check.py): without CUDA it skips with one clear line; its
`--dry-run` runs the same steps end to end on the CPU (inflated model, trace, ours trained,
every row repeated, output checked against the resident model); its summary arithmetic by hand."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_check import ROWS, SKIP_RC, summarize

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device exists here: it would run")
def test_without_cuda_it_skips_with_one_line(tmp_path):
    out = tmp_path / "gpu"
    p = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert p.returncode == SKIP_RC == 0, p.stderr
    assert p.stdout.startswith("gpu-check: skipped: no CUDA device here (torch ")
    assert p.stdout.count("\n") == 1 and not out.exists()  # nothing ran, nothing written


def test_dry_run_runs_every_step_on_the_cpu(tmp_path):
    """The dry run's steps all succeed, every row ran each repeat with greedy output equal to
    the resident model's, and the summary holds the ratios and the predictor's cost."""
    out = tmp_path / "gpu"
    p = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["device"] == "cpu (dry run)" and all(x["rc"] == 0 for x in s["steps"])
    rows = s["rows"]["runs"]
    assert set(rows) == set(ROWS) and s["rows"]["best_cache"] in ("lru", "lfru/adm=frequency")
    for k, r in rows.items():
        assert r["repeats"] == s["sizes"]["repeats"] and r["output_matches_resident"], k
        assert r["vs_best_cache"]["range"][0] <= r["vs_best_cache"]["median"]
    for k in ("d1:spec_gate", "d1:tensorbend"):
        assert rows[k]["predict_s_per_token"] > 0 and rows[k]["vs_spec_gate"] is not None


def test_summary_by_hand():
    def run(tok_s, pred=None):
        return {
            "decode_tok_s": tok_s,
            "decode_predict_s_per_token": pred,
            "stall_s_per_token": 0.001,
            "bytes_read_per_token": 10.0,
            "output_matches_resident": True,
        }

    runs = {
        "lru": [run(40.0), run(44.0), run(42.0)],
        "lfru/adm=frequency": [run(50.0), run(40.0), run(52.0)],
        "d1:spec_gate": [run(55.0, 1e-3), run(44.0, 1e-3), run(52.0, 1e-3)],
        "d1:tensorbend": [run(60.0, 2e-3), run(50.0, 2e-3), run(39.0, 2e-3)],
    }
    s = summarize(runs)
    assert s["best_cache"] == "lfru/adm=frequency"  # (median 50 against lru's 42)
    ours = s["runs"]["d1:tensorbend"]
    assert ours["decode_tok_s"] == 50.0 and ours["decode_tok_s_range"] == [39.0, 60.0]
    assert ours["vs_best_cache"] == {"median": 1.2, "range": [0.75, 1.25]}  # 60/50, 50/40, 39/52
    assert ours["vs_spec_gate"]["median"] == pytest.approx(60 / 55)  # of 60/55, 50/44, 39/52
    assert ours["predict_share_of_step"] == pytest.approx(0.1)  # 2 ms of a 1/50 s step
    assert s["runs"]["lru"]["predict_share_of_step"] is None
