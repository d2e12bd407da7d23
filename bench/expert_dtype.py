"""Compute a bf16 checkpoint's experts in bf16, or upcast them to float32 into the slot? One
expert's forward timed both ways on this CPU.

Usage:
    python -m bench.expert_dtype [--sizes 2048x768 128x64] [--tokens 1 8] [--repeats 7] \\
        [--calls 200] [--threads 1] [--touch-mb 256] [--json OUT]

For each size DxI (hidden x expert intermediate: 2048x768 is Qwen3-30B-A3B's, 128x64 the zoo
model's) and token count T (1: a decode step's token; 8: a short prefill's share of one
expert), the forward that `offload/layer.py` runs on a cache slot (SwiGLU: gate_up_proj
[2I, D], down_proj [D, I]) is timed with bf16 weights and activations (what transformers'
eager bf16 model computes) and with float32 ones (the slot upcast at load), interleaved
`--repeats` times, `--calls` forwards each, cycling through `--touch-mb` of distinct experts
(one expert called again and again would run from the CPU's caches); per case the median microseconds per forward and
the ratio f32 / bf16 (above 1: bf16 is faster). Upcasting also doubles the slot's bytes, so
it would have to be faster to be worth half the cache. Needs a quiet machine (timings).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench.record import command, emit

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["2048x768", "128x64"], help="DxI")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200, help="forwards per case and repeat")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--touch-mb", type=int, default=256,
                    help="float32 MB of distinct experts the calls cycle through (past the "
                         "CPU's caches: a slot's weights come from memory, as in serving)")  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for size in args.sizes:
        D, inter = (int(x) for x in size.split("x"))
        g = torch.Generator().manual_seed(0)
        n_exp = max(1, -(-args.touch_mb * 10**6 // (3 * D * inter * 4)))
        w32 = [{"gate_up_proj": torch.randn(2 * inter, D, generator=g) * D**-0.5,
                "down_proj": torch.randn(D, inter, generator=g) * inter**-0.5}
               for _ in range(n_exp)]  # fmt: skip
        for T in args.tokens:
            x32 = torch.randn(T, D, generator=g)
            cases = {n: ([{k: t.to(d) for k, t in w.items()} for w in w32], x32.to(d))
                     for n, d in DTYPES.items()}  # fmt: skip
            us: dict[str, list[float]] = {n: [] for n in DTYPES}
            for w, x in cases.values():
                _timed(w, x, 20)  # warm-up
            for rep in range(args.repeats):
                for n, (w, x) in cases.items():
                    us[n].append(_timed(w, x, args.calls))
                print(f"{size} T={T} repeat {rep}: " + ", ".join(
                    f"{n} {us[n][-1]:.1f} us" for n in DTYPES), file=sys.stderr)  # fmt: skip
            med = {n: statistics.median(v) for n, v in us.items()}
            rows.append({"D": D, "I": inter, "tokens": T, "experts": n_exp,
                         **{f"{n}_us": round(med[n], 2) for n in DTYPES},
                         **{f"{n}_us_range": [round(min(us[n]), 2), round(max(us[n]), 2)]
                            for n in DTYPES},
                         "f32_over_bf16": round(med["float32"] / med["bfloat16"], 3),
                         "faster": min(med, key=med.get)})  # fmt: skip
    res = {
        "bench": "expert_dtype",
        "command": command("expert_dtype", argv),
        "threads": args.threads,
        "repeats": args.repeats,
        "calls": args.calls,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "results": rows,
    }
    return emit(res, args.json)


def _timed(ws: list[dict[str, torch.Tensor]], x: torch.Tensor, calls: int) -> float:
    """Mean microseconds of one SwiGLU expert forward (`offload/layer.py`'s `_swiglu_expert`),
    each call on the next of the experts `ws`."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        for i in range(calls):
            w = ws[i % len(ws)]
            gate, up = F.linear(x, w["gate_up_proj"]).chunk(2, dim=-1)
            F.linear(F.silu(gate) * up, w["down_proj"])
        return (time.perf_counter() - t0) / calls * 1e6


if __name__ == "__main__":
    sys.exit(main())
