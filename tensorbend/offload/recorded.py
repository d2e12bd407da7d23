"""The oracle: the resident run's exact routing, known a bounded number of forwards ahead.

Usage:
    >>> import torch
    >>> from tensorbend.predictors.base import LOOKAHEADS
    >>> ids = [torch.tensor([[[0, 1], [2, 3]]]), torch.tensor([[[1, 4], [3, 0]]])]  # 2 forwards [T=1, L=2, K=2]
    >>> oracle = RecordedRouting(ids, LOOKAHEADS["d1"], foresight=2)
    >>> oracle.ahead(1)            # at step 1 (forward 0, layer 1), d1 targets step 2: forward 1, layer 0
    [((0, 1), 2), ((0, 4), 2)]
    >>> RecordedRouting(ids, LOOKAHEADS["d1"], foresight=1).ahead(1)   # forward 1 is beyond its sight
    []
    >>> oracle.steps_by_key[(1, 3)]   # what its eviction (policies.NextUse) reads
    [1, 3]

Shape legend: T tokens of a forward, L MoE layers, K top-k.

`ids_per_forward[f]` is forward f's routing [T, L, K] (the session records it from the
resident run; steps are f * L + m as everywhere). With `foresight` h the oracle knows only the
routing of steps < (now // L + h) * L: the rest of the current forward and the next h - 1
forwards (None: the whole run). It prefetches (`ahead`, called by the hooks at its lookahead's
source points: the router of layer s for dN, the input of layer m for pre_attn) the exact
experts of step now + N, when that step is within sight, also across the forward boundary;
and it evicts by Belady's MIN over what it sees (`policies.NextUse` over `steps_by_key`, built
by the policy table, cache/config.py; past its sight, its `--oracle-beyond` rule).
"""

from __future__ import annotations

import torch

from tensorbend.cache.oracle import Key, sight, steps_by_key
from tensorbend.predictors.base import Lookahead


class RecordedRouting:
    """Exact routing of a recorded run, as prefetches (`ahead`) and as an eviction policy."""

    kind = "oracle"
    needs_truth = False
    recorded_routing = True  # the Prefetcher asks `ahead(now)` instead of scores
    predicts_nothing = False
    checkpoint = None

    def __init__(
        self, ids_per_forward: list[torch.Tensor], lookahead: Lookahead, foresight: int | None
    ):
        assert foresight is None or foresight >= 0
        self.lookahead, self.foresight = lookahead, foresight
        self.L = ids_per_forward[0].shape[1] if ids_per_forward else 1
        self.experts_by_step: list[list[int]] = []  # step -> experts used, most tokens first
        for ids_TLK in ids_per_forward:
            for m in range(self.L):
                votes_E = torch.bincount(ids_TLK[:, m].flatten().long())
                order = torch.argsort(votes_E, descending=True, stable=True)
                self.experts_by_step.append(order[: int((votes_E > 0).sum())].tolist())
        self.steps_by_key: dict[Key, list[int]] = steps_by_key(
            (step, step % self.L, e) for step, es in enumerate(self.experts_by_step) for e in es
        )

    def horizon(self, now: int) -> float:
        """First step the oracle cannot see at step `now`."""
        return sight(now, self.L, self.foresight)

    def ahead(self, now: int) -> list[tuple[Key, int]]:
        """The experts of step now + distance, if within sight (most tokens first)."""
        target = now + self.lookahead.distance
        if target >= self.horizon(now) or target >= len(self.experts_by_step):
            return []
        return [((target % self.L, e), target) for e in self.experts_by_step[target]]

    def num_params(self) -> int:
        return 0
