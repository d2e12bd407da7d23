"""What an O_DIRECT expert read costs the CPU: straight into an aligned slot vs through a bounce buffer.

Usage:
    python -m bench.direct_read --store runs/bench/serve/store/experts-float32.safetensors \\
        [--reads 40] [--repeats 5] [--json OUT]

`offload.store.ExpertStore.read_into` with io=direct, on one thread, reading `--reads` experts
of the store (random (layer, expert) pairs, the same in every condition: O_DIRECT, so every
byte comes from the disk) into one slot. Two conditions, interleaved `--repeats` times:
`aligned` (a 4096-aligned slot, `blocks.aligned_empty`, as the cache's are: the expert's whole
blocks land in the slot, no copy) and `bounce` (the same slot one element off alignment: the
read lands in the thread's bounce buffer and a `Tensor.copy_` moves it, what every direct read
did before format 2 of the store). Per condition: the median GB/s (wall) and CPU seconds per
GB read (`time.thread_time` of the reading thread: what the read takes from the compute
thread's cores on a machine with few of them), with ranges; `bounced_reads` proves which path
ran. Needs a quiet machine (timings); a store built by bench.serve_memory is a good input.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.record import command, emit
from tensorbend.offload.blocks import aligned_empty
from tensorbend.offload.store import ExpertStore, StoreConfig

CONDITIONS = ("aligned", "bounce")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", type=Path, required=True, help="an expert store (safetensors)")
    ap.add_argument("--reads", type=int, default=40, help="experts read per condition and repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    store = ExpertStore.open(args.store, StoreConfig("direct"))
    n = store.expert_nbytes  # (the slots hold bytes: the dtype is moot here)
    slots = {
        "aligned": aligned_empty(1, n, torch.uint8)[0],
        "bounce": torch.empty(n + 1, dtype=torch.uint8)[1:],
    }
    rng = random.Random(args.seed)
    keys = [(rng.randrange(store.num_layers), rng.randrange(store.num_experts))
            for _ in range(args.reads)]  # fmt: skip
    got: dict[str, dict[str, list]] = {c: {"gb_s": [], "cpu_s_per_gb": []} for c in CONDITIONS}
    bounced: dict[str, int] = {}
    for rep in range(args.repeats):
        for cond in CONDITIONS:
            b0 = store.bounced_reads
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            nbytes = sum(store.read_into(m, e, slots[cond]) for m, e in keys)
            wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
            bounced[cond] = store.bounced_reads - b0
            got[cond]["gb_s"].append(nbytes / wall / 1e9)
            got[cond]["cpu_s_per_gb"].append(cpu / (nbytes / 1e9))
            print(f"repeat {rep} {cond}: {nbytes / wall / 1e9:.2f} GB/s, "
                  f"{cpu / (nbytes / 1e9):.3f} CPU s/GB", file=sys.stderr)  # fmt: skip
    store.close()
    rows = [
        {"condition": c, "bounced_reads": bounced[c],
         **{k: statistics.median(v) for k, v in got[c].items()},
         **{f"{k}_range": [min(v), max(v)] for k, v in got[c].items()}}
        for c in CONDITIONS
    ]  # fmt: skip
    res = {
        "bench": "direct_read",
        "command": command("direct_read", argv),
        "store": str(args.store),
        "expert_bytes": store.expert_nbytes,
        "reads": args.reads,
        "repeats": args.repeats,
        "results": rows,
        "cpu_ratio_bounce_vs_aligned": rows[1]["cpu_s_per_gb"] / rows[0]["cpu_s_per_gb"],
    }
    return emit(res, args.json)


if __name__ == "__main__":
    sys.exit(main())
