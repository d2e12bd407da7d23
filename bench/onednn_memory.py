"""What oneDNN holds when experts compute in bf16 on CPU: peak memory of `tensorbend generate`
with torch's oneDNN path on and off, against the import baseline + the budget.

Usage:
    python -m bench.onednn_memory --model runs/bench/serve/qwen3moe-tiny-x184 \\
        --store-dir runs/bench/serve/store-qwen3moe-tiny --max-memory 1GB \\
        --prompts runs/bench/serve/prompts.jsonl [--max-new-tokens 24] [--runs 2] [--json OUT]

Why: torch computes a bf16 (or fp16) matmul on CPU through oneDNN, which JIT-compiles a
kernel per shape and keeps kernels and scratch memory for the life of the process; none of it
exists after the imports (the import baseline), so `--reserve auto` charges it
(`serving.budget.ONEDNN_RESERVE`). Each variant runs `--runs` times, each a fresh process:
- `onednn off`: `torch.backends.mkldnn.enabled = False` before the run (torch's own bf16
  kernels; the plan then charges no oneDNN reserve);
- `onednn, not charged`: torch's default with the reserve of `onednn off` (as before the charge);
- `onednn`: torch's default, as served (the reserve charges ONEDNN_RESERVE);
- `onednn, primitive cache N`: `ONEDNN_PRIMITIVE_CACHE_CAPACITY=N` (`--capacities`; oneDNN's
  default 1024): how much of it is the cache of compiled kernels and what bounding it costs.
Peak RSS is the process's own (`getrusage`); over = peak RSS - (import baseline + budget), where
a positive number is memory the budget did not plan for. Decode tok/s and prefill seconds are
recorded for context (beside each run's `host_load`), not as a speed claim.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.record import command, emit
from bench.serve_memory import _import_rss
from tensorbend.host_load import CpuMeter
from tensorbend.memory import parse_bytes
from tensorbend.serving.budget import ONEDNN_RESERVE

RUN = (
    "import runpy, sys, torch; {pre}; sys.argv = ['tensorbend'] + sys.argv[1:]; "
    "runpy.run_module('tensorbend', run_name='__main__')"
)
VARIANTS = {  # name: (Python run before tensorbend's CLI, environment)
    "onednn off": ("torch.backends.mkldnn.enabled = False", {}),
    "onednn, not charged": ("pass", {}),
    "onednn": ("pass", {}),
}
UNCHARGED = "onednn, not charged"
"""oneDNN on with the plan of `onednn off` (`--reserve` set to its auto reserve, without
ONEDNN_RESERVE): the budget as it was before oneDNN was charged."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--store-dir", required=True)
    ap.add_argument("--max-memory", default="1GB")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--capacities", type=int, nargs="*", default=[],
                    help="also run oneDNN with these primitive cache capacities (its default: 1024)")  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    base = _import_rss()
    budget = parse_bytes(args.max_memory)
    flags = ["generate", "--model", args.model, "--store-dir", args.store_dir, "--max-memory",
             args.max_memory, "--prompts", args.prompts, "--max-new-tokens",
             str(args.max_new_tokens), "--dtype", args.dtype, "--io", "direct", "--policy",
             "lfru", "--admission", "frequency", "--quiet"]  # fmt: skip
    _run(flags, "pass", {})  # the store is built (or checked) outside the measured runs
    variants = dict(VARIANTS)
    for n in args.capacities:
        variants[f"onednn, primitive cache {n}"] = (
            "pass",
            {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(n)},
        )
    rows = []
    for r in range(args.runs):
        reserve = None
        for name, (pre, env) in variants.items():
            extra = ["--reserve", f"{reserve}B"] if name == UNCHARGED else []
            meter = CpuMeter()  # (this process and the run, against the machine)
            s = _run(flags + extra, pre, env)
            load = meter.stop().to_json()
            plan = s["memory_plan"]
            if name == "onednn off":  # (first: its reserve is the uncharged one)
                reserve = plan["reserve"]
            rows.append({"variant": name, "run": r, "peak_rss_bytes": s["peak_rss_bytes"],
                         "over_budget_bytes": s["peak_rss_bytes"] - base - budget,
                         "reserve_bytes": plan["reserve"], "cache_bytes": plan["cache"],
                         "decode_tok_s": s["decode_tok_s"], "prefill_s": s["prefill_s"],
                         "host_load": load})  # fmt: skip
            print(f"{name:28s} run {r}: peak RSS {s['peak_rss_bytes'] / 1e6:.1f} MB, over "
                  f"{rows[-1]['over_budget_bytes'] / 1e6:+.1f} MB, reserve "
                  f"{plan['reserve'] / 1e6:.1f} MB", file=sys.stderr)  # fmt: skip
    return emit({
        "bench": "onednn_memory",
        "command": command("onednn_memory", argv),
        "model": args.model,
        "dtype": args.dtype,
        "max_memory_bytes": budget,
        "import_baseline_rss_bytes": base,
        "onednn_reserve_bytes": ONEDNN_RESERVE,
        "runs": rows,
    }, args.json)  # fmt: skip


def _run(flags: list[str], pre: str, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "summary.json"
        cmd = [sys.executable, "-c", RUN.format(pre=pre), *flags, "--json", str(out)]
        run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
        if run.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{run.stderr[-2000:]}")
        return json.loads(out.read_text())


if __name__ == "__main__":
    raise SystemExit(main())
