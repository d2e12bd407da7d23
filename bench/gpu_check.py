"""`make gpu-check`: the GPU regime in one prepared script, under 8 minutes on one CUDA GPU,
with nothing but the repository (no network, no setup step).

Usage:
    python -m bench.gpu_check [--out DIR] [--budget-s 450]     # DIR: $OUT, else runs/gpu-check
    python -m bench.gpu_check --dry-run --out DIR               # the same steps on the CPU, tiny

Without CUDA (and without --dry-run) it prints one line, `gpu-check: skipped: ...`, and exits 0
(SKIP_RC) having run nothing. With a GPU, each step under its own time limit (the whole within
`--budget-s`):
 1. the CUDA tests (the ones that skip without a GPU: the device path of the offload runtime,
    pinned staging and the copy stream; generate on cuda equal to resident) -> cuda_tests.xml;
 2. zoo:default with its experts widened `--factor` times (`bench.inflate`: the same routers and
    text; 32x makes each expert 6.3 MB in float32, so a miss is a real transfer, not a kernel
    launch) under DIR/ckpt;
 3. a trace of zoo:default (its first 64 prompts, 16 teacher-forced tokens each) and ours (d1)
    trained on its train split, checked on its val split: the inflated model has the same
    fingerprint, so it loads there (the runs below use test prompts only);
 4. `tensorbend measure --device cuda` on the inflated model's test prompts at 25% cache, each row
    `--repeats` times, interleaved and rotated (a fresh process each: its resident reference on
    the GPU, then the offloaded run; experts beyond the cache in the store on local disk, read
    into pinned staging and copied on their own stream; `--link none`): lru and lfru with
    frequency admission (the best of them is the best cache), spec_gate as a prefetcher, and
    ours (d1), both prefetchers with the same cache and admission -> run_*.json;
 5. summary.json: per row the median decode tok/s [range], stall and bytes per token, greedy
    text equal to the resident GPU model in every repeat, the median [range] of per-repeat
    ratios to the best cache and to spec_gate, and the predictor's measured seconds per decode
    token and their share of the decode step.
`--dry-run` runs steps 2-5 on the CPU with a model widened 2x, 12 trace prompts and 2 repeats of
2 prompts x 8 tokens (a minute or two; tests/test_gpu_check.py runs it). A step that fails or
runs out of time is recorded in summary.json (`steps`) and the script exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
ROWS = {  # label -> `tensorbend measure` flags (every row: 25% cache, --link none)
    "lru": ["--policy", "lru"],
    "lfru/adm=frequency": ["--policy", "lfru", "--admission", "frequency"],
    "d1:spec_gate": ["--policy", "prefetch", "--baseline", "spec_gate"],
    "d1:tensorbend": ["--policy", "prefetch", "--predictor", "{ours}"],
}
GPU = {"factor": 32, "trace_prompts": 64, "epochs": 3, "prompts": 4, "tokens": 32, "repeats": 3}
DRY = {"factor": 2, "trace_prompts": 12, "epochs": 1, "prompts": 2, "tokens": 8, "repeats": 2}


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    import torch

    if not a.dry_run and not torch.cuda.is_available():
        print(
            f"gpu-check: skipped: no CUDA device here (torch {torch.__version__}, "
            "torch.cuda.is_available() is False); run `make gpu-check` on a machine with one "
            "GPU, or `python -m bench.gpu_check --dry-run` for its steps on the CPU"
        )
        return SKIP_RC
    size = DRY if a.dry_run else GPU
    device = "cpu" if a.dry_run else "cuda"
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
        steps.append(
            {
                "step": name,
                "rc": rc,
                "seconds": round(time.monotonic() - s, 1),
                "command": " ".join(cmd),
            }
        )
        print(f"gpu-check: {name}: rc={rc} ({time.monotonic() - s:.0f} s)", file=sys.stderr)
        return rc == 0

    py = sys.executable
    if not a.dry_run:
        step(
            "cuda tests",
            [
                py,
                "-m",
                "pytest",
                "-q",
                "-rs",
                "-p",
                "no:cacheprovider",
                f"--junitxml={out}/cuda_tests.xml",
                *CUDA_TESTS,
            ],
            150,
        )
    from bench.inflate import inflate
    from tensorbend.zoo import resolve_model

    ckpt = inflate(resolve_model("zoo:default"), out / f"ckpt-x{size['factor']}", size["factor"])
    trace, ours = out / "trace", out / "ours_d1.safetensors"
    ok = step(
        "collect",
        [
            py,
            "-m",
            "tensorbend",
            "collect",
            "--model",
            "zoo:default",
            "--out",
            str(trace),
            "--max-new-tokens",
            "16",
            "--decode",
            "teacher",
            "--split",
            "all",
            "--max-prompts",
            str(size["trace_prompts"]),
            "--features",
            "ids",
            "weights",
            "gate_input",
            "layer_input",
            "--quiet",
            "--overwrite",
        ],
        120,
    )
    ok = ok and step(
        "train",
        [
            py,
            "-m",
            "tensorbend",
            "train",
            "--trace",
            str(trace),
            "--out",
            str(ours),
            "--lookahead",
            "d1",
            "--epochs",
            str(size["epochs"]),
            "--quiet",
        ],
        90,
    )
    labels = [k for k in ROWS if ok or k != "d1:tensorbend"]
    runs: dict[str, list[dict]] = {k: [] for k in labels}
    for r in range(size["repeats"]):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:  # rotated
            path = out / f"run_{label.replace('/', '_').replace(':', '_')}_{r}.json"
            cmd = [
                py,
                "-m",
                "tensorbend",
                "run",
                "--model",
                str(ckpt),
                "--device",
                device,
                "--cache-frac",
                "0.25",
                "--link",
                "none",
                "--split",
                "test",
                "--max-prompts",
                str(size["prompts"]),
                "--max-new-tokens",
                str(size["tokens"]),
                "--store-dir",
                str(out / "store"),
                "--json",
                str(path),
                "--quiet",
                *[f.format(ours=ours) for f in ROWS[label]],
            ]
            if step(f"run {label} #{r}", cmd, 60):
                runs[label].append(json.loads(path.read_text()))
    summary = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)",
        "regime": "gpu: real CUDA compute, experts beyond the cache on local disk, read into "
        "pinned staging and copied on their own stream"
        if device == "cuda"
        else "dry run: cpu",
        "model": f"zoo:default x{size['factor']} (bench.inflate)",
        "sizes": size,
        "steps": steps,
        "rows": summarize(runs),
        "seconds": round(time.monotonic() - t0, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["rows"], indent=1))
    return 0 if all(s["rc"] == 0 for s in steps) else 1


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per row (its repeats, in repeat order): the median decode tok/s [range], stall and bytes
    per token, output equal to the resident model in every repeat, the median [range] of
    per-repeat ratios to the best cache (lru or lfru, by median) and to spec_gate, and the
    prediction's seconds per decode token and their share of the decode step (seconds
    predicting per token x tokens per second). Rows missing a repeat are compared on the
    repeats they have."""
    med = {k: statistics.median(r["decode_tok_s"] for r in rs) for k, rs in runs.items() if rs}
    caches = [k for k in ("lru", "lfru/adm=frequency") if k in med]
    best = max(caches, key=med.get) if caches else None
    out = {}
    for k, rs in runs.items():
        if not rs:
            continue
        tok = [r["decode_tok_s"] for r in rs]
        pred = [r.get("decode_predict_s_per_token") for r in rs]
        out[k] = {
            "decode_tok_s": med[k],
            "decode_tok_s_range": [min(tok), max(tok)],
            "repeats": len(rs),
            "stall_s_per_token": statistics.median(r["stall_s_per_token"] for r in rs),
            "bytes_read_per_token": statistics.median(r["bytes_read_per_token"] for r in rs),
            "output_matches_resident": all(r.get("output_matches_resident") for r in rs),
            "vs_best_cache": _ratios(rs, runs.get(best)),
            "vs_spec_gate": _ratios(rs, runs.get("d1:spec_gate")),
            "predict_s_per_token": None if None in pred else statistics.median(pred),
            "predict_share_of_step": None
            if None in pred
            else statistics.median(p * t for p, t in zip(pred, tok, strict=True)),
        }
    return {"best_cache": best, "runs": out}


def _ratios(rs: list[dict], ref: list[dict] | None) -> dict | None:
    """The median [range] of per-repeat ratios of decode tok/s to `ref`'s."""
    if not ref:
        return None
    xs = sorted(a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(rs, ref, strict=False))
    return {"median": statistics.median(xs), "range": [xs[0], xs[-1]]}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--out", default=None, help="folder for every file (default: $OUT, else runs/gpu-check)"
    )
    p.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget, seconds")
    p.add_argument("--dry-run", action="store_true", help="the same steps on the CPU, tiny")
    return p


if __name__ == "__main__":
    sys.exit(main())
