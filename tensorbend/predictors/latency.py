"""A predictor's latency: microseconds to score one token for one target layer, at batch 1.

Usage:
    us = us_per_token(predictor, rows, n=50)     # rows: Trace.load(predictor.lookahead.features)

n tokens spread over the rows are scored one at a time for every target layer, on one CPU
thread (batch-1 scoring is latency-bound; extra threads only add synchronisation), after one
warm-up pass that fills lazy caches. None when nothing can be timed (n = 0, an oracle, no
target layer, fewer than 2 rows). The number is only meaningful on a quiet machine.
"""

from __future__ import annotations

import time

import torch

from tensorbend.predictors.base import sources_from_rows


def us_per_token(pred, rows, n: int) -> float | None:
    """Mean microseconds to score one token for one target layer (batch 1, one CPU thread)."""
    la = pred.lookahead
    targets = list(la.targets(rows["expert_ids_TLK"].shape[1]))
    T = rows["expert_ids_TLK"].shape[0]
    if n == 0 or pred.needs_truth or not targets or T < 2:
        return None
    idx_N = torch.linspace(1, T - 1, steps=min(n, T - 1)).long()
    one = {k: v[idx_N] for k, v in rows.items()}
    one["prev_row_T"] = torch.full((len(idx_N),), -1)  # timing only; prev lookup is free
    single = [
        (m, src.row(i))
        for m in targets
        for src in [sources_from_rows(one, la, m)]
        for i in range(len(idx_N))
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # batch-1 scoring is latency-bound; extra threads only add sync cost
    try:
        for m, s in single[: len(targets)]:  # warm-up (lazy caches)
            pred.scores(m, s)
        t0 = time.perf_counter()
        for m, s in single:
            pred.scores(m, s)
        return (time.perf_counter() - t0) / len(single) * 1e6
    finally:
        torch.set_num_threads(threads)
