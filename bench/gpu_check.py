"""`make gpu-check`: the GPU regime in one prepared script, under 8 minutes on one CUDA GPU.

Usage:
    python -m bench.gpu_check [--out DIR] [--budget-s 450]     # DIR: $OUT, else runs/gpu-check

On a machine without CUDA it prints one line, `gpu-check: skipped: ...`, and exits 0 (SKIP_RC)
having run nothing. With a GPU, each step under its own time limit (the whole within
`--budget-s`):
 1. the CUDA tests (the ones that skip without a GPU: the device path of the offload runtime,
    pinned staging and the copy stream; generate on cuda equal to resident) -> cuda_tests.xml;
 2. a trace of zoo:default (train prompts, 24 new tokens) and ours (d1) trained on it;
 3. `tensorbend run --device cuda` on zoo:default's test prompts at 25% cache (the experts
    exceed the GPU's budget: three quarters live in host memory and are copied over PCIe per
    miss, `--link none`: real transfers, real GPU compute): lru and lfru with frequency
    admission (the best of them is the best cache), spec_gate as a prefetcher, and ours (d1),
    both prefetchers with the same cache and admission -> run_*.json;
 4. summary.json: per row decode tok/s, stall and bytes per token, ratios to the best cache and
    to spec_gate, and prediction seconds per decode token as a share of the GPU decode step
    (`decode_predict_s_per_token` x `decode_tok_s`).
Every file lands under one folder. A step that fails or runs out of time is recorded in
summary.json (`steps`) and the script exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SKIP_RC = 0
CUDA_TESTS = [
    "tests/test_offload_config.py",
    "tests/test_serving.py::test_cuda_generate_equals_resident",
    "tests/test_memory.py",
]
ROWS = {  # label -> `tensorbend run` flags (every row: 25% cache, --device cuda, --link none)
    "lru": ["--policy", "lru"],
    "lfru/adm=frequency": ["--policy", "lfru", "--admission", "frequency"],
    "d1:spec_gate": ["--policy", "prefetch", "--baseline", "spec_gate"],
    "d1:tensorbend": ["--policy", "prefetch", "--predictor", "{ours}"],
}


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"gpu-check: skipped: no CUDA device here (torch {torch.__version__}, "
              "torch.cuda.is_available() is False); run `make gpu-check` on a machine with one GPU")  # fmt: skip
        return SKIP_RC
    out = Path(a.out or os.environ.get("OUT") or "runs/gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    t0, steps = time.monotonic(), []

    def step(name: str, cmd: list[str], limit: float) -> bool:
        left = a.budget_s - (time.monotonic() - t0)
        s = time.monotonic()
        try:
            rc = subprocess.run(cmd, timeout=max(1.0, min(limit, left))).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        steps.append({"step": name, "rc": rc, "seconds": round(time.monotonic() - s, 1),
                      "command": " ".join(cmd)})  # fmt: skip
        print(f"gpu-check: {name}: rc={rc}", file=sys.stderr)
        return rc == 0

    py = sys.executable
    step("cuda tests", [py, "-m", "pytest", "-q", "-rs", f"--junitxml={out}/cuda_tests.xml",
                        *CUDA_TESTS], 150)  # fmt: skip
    trace, ours = out / "trace", out / "ours_d1.safetensors"
    ok = step("collect", [py, "-m", "tensorbend", "collect", "--model", "zoo:default", "--out",
                          str(trace), "--max-new-tokens", "24", "--decode", "teacher", "--features",
                          "ids", "weights", "gate_input", "layer_input", "--quiet", "--overwrite"], 120)  # fmt: skip
    ok = ok and step("train", [py, "-m", "tensorbend", "train", "--trace", str(trace), "--out",
                               str(ours), "--lookahead", "d1", "--epochs", "3", "--quiet"], 90)  # fmt: skip
    rows = {}
    for label, flags in ROWS.items():
        if label == "d1:tensorbend" and not ok:
            continue
        path = out / f"run_{label.replace('/', '_').replace(':', '_')}.json"
        cmd = [py, "-m", "tensorbend", "run", "--model", "zoo:default", "--device", "cuda",
               "--cache-frac", "0.25", "--link", "none", "--max-prompts", "4",
               "--max-new-tokens", "32", "--json", str(path), "--quiet",
               *[f.format(ours=ours) for f in flags]]  # fmt: skip
        if step(f"run {label}", cmd, 60):
            rows[label] = json.loads(path.read_text())
    summary = {"device": torch.cuda.get_device_name(0), "steps": steps, "rows": summarize(rows),
               "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["rows"], indent=1))
    return 0 if all(s["rc"] == 0 for s in steps) else 1


def summarize(rows: dict[str, dict]) -> dict:
    """Per row: tok/s, stall and bytes per token, over the best cache and spec_gate, and the
    prediction's share of the decode step (seconds predicting per token x tokens per second)."""
    caches = [k for k in ("lru", "lfru/adm=frequency") if k in rows]
    best = max(caches, key=lambda k: rows[k]["decode_tok_s"] or 0) if caches else None
    out = {}
    for k, r in rows.items():
        tok_s, pred = r.get("decode_tok_s"), r.get("decode_predict_s_per_token")
        out[k] = {
            "decode_tok_s": tok_s,
            "stall_s_per_token": r.get("stall_s_per_token"),
            "bytes_read_per_token": r.get("bytes_read_per_token"),
            "output_matches_resident": r.get("output_matches_resident"),
            "vs_best_cache": _ratio(tok_s, best and rows[best]["decode_tok_s"]),
            "vs_spec_gate": _ratio(tok_s, rows.get("d1:spec_gate", {}).get("decode_tok_s")),
            "predict_share_of_step": None if not (tok_s and pred is not None) else pred * tok_s,
        }
    return {"best_cache": best, "runs": out}


def _ratio(x, y) -> float | None:
    return x / y if x and y else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="folder for every file (default: $OUT, else "
                   "runs/gpu-check)")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget, seconds")
    return p


if __name__ == "__main__":
    sys.exit(main())
