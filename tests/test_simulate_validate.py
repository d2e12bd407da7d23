"""Plumbing of bench/simulate_validate.py on a tiny model (timings are not checked: the bench
itself is run alone on a quiet machine)."""

import json
import sys
from pathlib import Path

from tiny_models import save_checkpoint, write_prompts

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import simulate_validate  # noqa: E402


def test_validation_bench_writes_both_sides_per_policy(tmp_path, capsys):
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    prompts = write_prompts(tmp_path / "p.jsonl", n=4, continuation_every=1)
    rc = simulate_validate.main(
        [
            "--model",
            str(ckpt),
            "--prompts",
            str(prompts),
            "--split",
            "all",
            "--max-prompts",
            "2",
            "--max-new-tokens",
            "3",
            "--baseline",
            "random",
            "--link",
            "20MB/s,20us",
            "--json",
            str(tmp_path / "v.json"),
            "--doc",
            str(tmp_path / "v.md"),
        ]
    )
    assert rc == 0
    out = json.loads((tmp_path / "v.json").read_text())
    assert [r["policy"] for r in out["rows"]] == list(simulate_validate.POLICIES)
    assert "lfru" in simulate_validate.POLICIES and "resident" not in simulate_validate.POLICIES
    for r in out["rows"]:
        for k in ("decode_tok_s", "stall_s_per_token", "bytes_read_per_token"):
            assert r[f"runtime_{k}"] >= 0 and r[f"simulated_{k}"] >= 0
    # no cache: every decode demand is read, on both sides
    od = out["rows"][0]
    assert od["simulated_bytes_read_per_token"] == od["runtime_bytes_read_per_token"]
    cal = out["calibration"]
    assert cal["expert_bytes"] > 0 and cal["attn_s"] > 0 and cal["expert_s"] > 0
    doc = (tmp_path / "v.md").read_text()
    assert doc.count("\n| ") == 1 + 6 and "bar: 15%" in doc  # header + one row per policy
    capsys.readouterr()
