"""`make gpu-check` (bench/gpu_check.py) on a machine without CUDA: it compiles, skips with one
clear line and exit code 0, running nothing; its summary arithmetic by hand."""

import py_compile
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_check import SKIP_RC, summarize

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"


def test_the_script_compiles():
    py_compile.compile(str(SCRIPT), doraise=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device exists here: it would run")
def test_without_cuda_it_skips_with_one_line(tmp_path):
    out = tmp_path / "gpu"
    p = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(out)],
                       capture_output=True, text=True, cwd=SCRIPT.parent.parent)  # fmt: skip
    assert p.returncode == SKIP_RC == 0, p.stderr
    assert p.stdout.startswith("gpu-check: skipped: no CUDA device here (torch ")
    assert p.stdout.count("\n") == 1 and not out.exists()  # nothing ran, nothing written


def test_summary_by_hand():
    def row(tok_s, pred=None):
        return {"decode_tok_s": tok_s, "decode_predict_s_per_token": pred}

    rows = {"lru": row(40.0), "lfru/adm=frequency": row(50.0), "d1:spec_gate": row(55.0, 1e-3),
            "d1:tensorbend": row(60.0, 2e-3)}  # fmt: skip
    s = summarize(rows)
    assert s["best_cache"] == "lfru/adm=frequency"
    ours = s["runs"]["d1:tensorbend"]
    assert ours["vs_best_cache"] == 60 / 50 and ours["vs_spec_gate"] == 60 / 55
    assert abs(ours["predict_share_of_step"] - 0.12) < 1e-12  # 2 ms of a 1/60 s step
    assert s["runs"]["lru"]["predict_share_of_step"] is None
