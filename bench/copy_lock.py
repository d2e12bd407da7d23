"""Does an I/O thread's copy of an expert stall the compute thread? Forward time beside each copy.

Usage:
    python -m bench.copy_lock [--model zoo:default] [--expert-mb 18.1] [--copies-per-s 50] \\
        [--repeats 5] [--json OUT]

The compute thread runs the resident model's forward on a short prompt (batch 1, `--threads`
torch threads) while one background thread copies an expert-sized buffer `--copies-per-s`
times a second (sleeping between copies, as an I/O thread waits on the disk), the way `offload.store.ExpertStore`'s `--io direct` reads land: from a page-aligned bounce
buffer into the cache slot. Three conditions, interleaved `--repeats` times: `alone` (no
copy), `memoryview` (a memoryview slice assignment: a memcpy that holds the interpreter
lock, what the store did before) and `tensor` (`Tensor.copy_`, which releases it: what the
store does now). Per condition: the median forward ms, and the copies done per second
beside it. A forward slowed by `memoryview` and not by `tensor` is the lock, not the memory
bus. `--expert-mb` 18.1 is the expert of bench.serve_memory's inflated checkpoint, and 50 a
second about the read rate of its runs (8 tok/s x 6-7 experts read per token). Needs a
quiet machine (timings).
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import threading
import time

import torch

from bench.record import command, emit
from tensorbend.capture.hf import load_model

CONDITIONS = ("alone", "memoryview", "tensor")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="zoo:default")
    ap.add_argument("--expert-mb", type=float, default=18.1, help="bytes per copy, in MB")
    ap.add_argument("--copies-per-s", type=float, default=50.0, help="the copy thread's rate")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--forwards", type=int, default=20, help="forwards per condition and repeat")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the compute thread")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    ids = torch.randint(
        0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)
    )
    n = int(args.expert_mb * 1e6)
    bounce = mmap.mmap(-1, n + mmap.PAGESIZE)
    bounce_t = torch.frombuffer(bounce, dtype=torch.uint8)
    slot = torch.empty(n, dtype=torch.uint8)
    slot_mv = memoryview(slot.numpy())
    copies = {
        "memoryview": lambda: slot_mv.__setitem__(slice(0, n), memoryview(bounce)[100 : 100 + n]),
        "tensor": lambda: slot.copy_(bounce_t[100 : 100 + n]),
    }
    got: dict[str, list] = {c: [] for c in CONDITIONS}
    rate: dict[str, list] = {c: [] for c in CONDITIONS}
    with torch.inference_mode():
        for _ in range(3):
            model(ids)  # warm-up
        for rep in range(args.repeats):
            for cond in CONDITIONS:
                ms, per_s = _timed(model, ids, args.forwards, copies.get(cond), args.copies_per_s)
                got[cond].append(ms)
                rate[cond].append(per_s)
                print(f"repeat {rep} {cond}: {ms:.2f} ms/forward, {per_s:.0f} copies/s",
                      file=sys.stderr)  # fmt: skip
    alone = statistics.median(got["alone"])
    rows = [
        {"condition": c, "forward_ms": statistics.median(got[c]),
         "forward_ms_range": [min(got[c]), max(got[c])],
         "vs_alone": statistics.median(got[c]) / alone,
         "copies_per_s": statistics.median(rate[c])}
        for c in CONDITIONS
    ]  # fmt: skip
    res = {
        "bench": "copy_lock",
        "command": command("copy_lock", argv),
        "model": args.model,
        "expert_bytes": n,
        "copies_per_s_asked": args.copies_per_s,
        "threads": args.threads,
        "repeats": args.repeats,
        "forwards": args.forwards,
        "results": rows,
    }
    return emit(res, args.json)


def _timed(model, ids, forwards: int, copy, per_s: float) -> tuple[float, float]:
    """Median ms per forward while `copy` runs `per_s` times a second on another thread
    (None: alone), and the copies it did per second."""
    stop, done = threading.Event(), [0]

    def loop():
        period, next_at = 1.0 / per_s, time.perf_counter()
        while not stop.is_set():
            copy()
            done[0] += 1
            next_at += period
            stop.wait(max(0.0, next_at - time.perf_counter()))

    th = threading.Thread(target=loop, daemon=True) if copy is not None else None
    if th is not None:
        th.start()
        time.sleep(0.05)  # the loop is running before the first forward
    t_start, done_start, times = time.perf_counter(), done[0], []
    for _ in range(forwards):
        t0 = time.perf_counter()
        model(ids)
        times.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - t_start
    stop.set()
    if th is not None:
        th.join()
    return statistics.median(times) * 1e3, (done[0] - done_start) / elapsed


if __name__ == "__main__":
    sys.exit(main())
