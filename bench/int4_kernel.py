"""Which slots for int4 experts: one expert's forward from a bf16 slot against torch's int4
kernel on an int4 slot, and what each slot costs to fill from the store, on this CPU.

Usage:
    python -m bench.int4_kernel [--sizes 128x11776 2048x768 7168x2048] [--tokens 1 4 16 64] \\
        [--repeats 5] [--calls 50] [--touch-mb 256] [--json OUT]

For each size DxI (hidden x expert intermediate: 128x11776 is zoo:default inflated 184x, the
real-disk bench's model; 2048x768 Qwen3-30B-A3B's; 7168x2048 Kimi-K2's) and token count T (1:
a decode step; 4-64: a prefill's share of one expert), the SwiGLU forward `offload/layer.py`
runs on a slot is timed (1 thread, as decode runs on 2 cores) with bf16 weights
(`F.linear`, what a bf16 or dequantized slot computes) and on an int4 slot
(`aten._weight_int4pack_mm_for_cpu`, group 32), interleaved `--repeats` times, `--calls`
forwards each, cycling through `--touch-mb` of distinct experts (past the CPU's caches).
Then the load side, per expert on one I/O thread: dequantizing a stored int4 expert (compressed-
tensors' packing) into a bf16 slot (`int4.dequantize_expert`), repacking it into the kernel's
layout on every load (`int4.to_kernel_packing`: the option the store avoids by repacking once),
and spreading the scales of a store already in the kernel's packing (`int4.expand_scales`,
what an int4-slot load costs beyond its read); beside them, the stored bytes and the seconds
to read them at `--disk-gbs`. Writes the medians, ranges and `host_load`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench.record import command, emit
from tensorbend.host_load import CpuMeter
from tensorbend.offload import int4
from tensorbend.offload.layout import ExpertLayout

GROUP = 32


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["128x11776", "2048x768", "7168x2048"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50, help="forwards per case and repeat")
    ap.add_argument("--touch-mb", type=int, default=256, help="bf16 MB of distinct experts")
    ap.add_argument("--disk-gbs", type=float, default=1.6, help="disk GB/s for the read column")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    meter = CpuMeter()
    forward, load = [], []
    for size in args.sizes:
        D, inter = (int(x) for x in size.split("x"))
        parts = (("gate_up_proj", (2 * inter, D)), ("down_proj", (D, inter)))
        n_exp = max(1, -(-args.touch_mb * 10**6 // (3 * D * inter * 2)))
        experts = [_expert(parts, seed) for seed in range(n_exp)]
        for T in args.tokens:
            x = torch.randn(T, D, generator=torch.Generator().manual_seed(T)).bfloat16()
            us = {"bf16": [], "int4": []}
            for rep in range(args.repeats):
                for name in us:
                    us[name].append(_forward_us(experts, x, name, args.calls))
                print(
                    f"{size} T={T} repeat {rep}: bf16 {us['bf16'][-1]:.0f} us, int4 "
                    f"{us['int4'][-1]:.0f} us",
                    file=sys.stderr,
                )
            forward.append({"D": D, "I": inter, "tokens": T, **_summary(us, "bf16", "int4")})
        load.append(_load_row(D, inter, parts, experts[0], args))
    res = {
        "bench": "int4_kernel",
        "command": command("int4_kernel", argv),
        "threads": 1,
        "group": GROUP,
        "repeats": args.repeats,
        "calls": args.calls,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "forward": forward,
        "load": load,
        "host_load": meter.stop().to_json(),
    }
    return emit(res, args.json)


def _expert(parts, seed: int) -> dict:
    """One random expert: its bf16 weights (dequantized from int4: the same values both ways),
    its stored bytes in both packings, and its int4 slot."""
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(shape, generator=g).bfloat16() * shape[1] ** -0.5 for _, shape in parts]
    fmt = int4.Int4(GROUP)
    ct = torch.empty(fmt.stored_nbytes(parts), dtype=torch.uint8)
    int4.quantize_expert(fmt, ws, ct)
    dense = ExpertLayout(parts, torch.bfloat16, fmt)
    flat = torch.empty(dense.numel, dtype=torch.bfloat16)
    int4.dequantize_expert(dense, ct, flat)
    cpu = ExpertLayout(parts, torch.bfloat16, int4.Int4(GROUP, "cpu"))
    stored = torch.empty_like(ct)
    int4.to_kernel_packing(parts, ct, GROUP, stored)
    slot = torch.empty(cpu.nbytes, dtype=torch.uint8)
    slot[: stored.numel()].copy_(stored)
    int4.expand_scales(cpu, slot)
    return {
        "bf16": dense.views(flat),
        "int4": cpu.views(slot),
        "ct": ct,
        "stored": stored,
        "layouts": (dense, cpu),
    }


def _forward_us(experts: list[dict], x: torch.Tensor, kind: str, calls: int) -> float:
    """Mean microseconds of one SwiGLU expert forward on `kind` slots, cycling experts."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        for i in range(calls):
            W = experts[i % len(experts)][kind]
            if kind == "bf16":
                gate, up = F.linear(x, W["gate_up_proj"]).chunk(2, dim=-1)
                F.linear(F.silu(gate) * up, W["down_proj"])
            else:
                gate, up = int4.int4_linear(x, W["gate_up_proj"], GROUP).chunk(2, dim=-1)
                int4.int4_linear(F.silu(gate) * up, W["down_proj"], GROUP)
        return (time.perf_counter() - t0) / calls * 1e6


def _load_row(D: int, inter: int, parts, ex: dict, args) -> dict:
    """Per-expert load-side costs (ms, one thread) of each way to fill a slot."""
    dense, cpu = ex["layouts"]
    flat = torch.empty(dense.numel, dtype=torch.bfloat16)
    repacked = torch.empty_like(ex["stored"])
    slot = torch.empty(cpu.nbytes, dtype=torch.uint8)
    scratch = torch.empty(ex["stored"].numel(), dtype=torch.uint8)

    def spread():
        slot[: ex["stored"].numel()].copy_(ex["stored"])  # (the read's bytes, then the spread)
        int4.expand_scales(cpu, slot, scratch)

    ways = {
        "dequantize_to_bf16_ms": lambda: int4.dequantize_expert(dense, ex["ct"], flat),
        "repack_every_load_ms": lambda: int4.to_kernel_packing(parts, ex["ct"], GROUP, repacked),
        "int4_slot_spread_ms": spread,
    }
    ms = {k: [] for k in ways}
    for _ in range(args.repeats):
        for k, f in ways.items():
            t0 = time.perf_counter()
            f()
            ms[k].append((time.perf_counter() - t0) * 1e3)
    stored = ex["stored"].numel()
    return {
        "D": D,
        "I": inter,
        "bf16_expert_bytes": dense.numel * 2,
        "stored_bytes": stored,
        "int4_slot_bytes": cpu.nbytes,
        "read_ms_at_disk_gbs": round(stored / args.disk_gbs / 1e6, 3),
        "disk_gbs": args.disk_gbs,
        **{k: round(statistics.median(v), 3) for k, v in ms.items()},
        **{k + "_range": [round(min(v), 3), round(max(v), 3)] for k, v in ms.items()},
    }


def _summary(us: dict, a: str, b: str) -> dict:
    med = {k: statistics.median(v) for k, v in us.items()}
    ratios = sorted(x / y for x, y in zip(us[a], us[b], strict=True))
    return {
        **{f"{k}_us": round(v, 1) for k, v in med.items()},
        **{f"{k}_us_range": [round(min(us[k]), 1), round(max(us[k]), 1)] for k in us},
        "int4_speedup": round(statistics.median(ratios), 3),
        "int4_speedup_range": [round(ratios[0], 3), round(ratios[-1], 3)],
    }


if __name__ == "__main__":
    sys.exit(main())
