"""The Python victim index driven through a whole trace: THE replay's test oracle and the
bench's "index" column.

Usage:
    >>> from tensorbend.cache.replay import ReplayConfig, planted_trace, replay
    >>> ids_FLK = planted_trace(prompts=2, tokens=8, layers=3, experts=8, top_k=2)
    >>> cfg = ReplayConfig("lfru", slots=6)
    >>> index_replay(ids_FLK, cfg).victims() == replay(ids_FLK, cfg).victims()
    True

`cache.replay.replay` (the numba kernel) must make the placements that the runtime's own
`cache.victim_heap.IndexedResidentSet` makes with the policy and admission rule built from the
same `ReplayConfig`, fed the same events: the next layer's exact hints and prefetches, each
demand (placed on a miss with the step's demands used before it pinned), the forecast after
each forward. This walks those events one by one in Python (tests/test_replay.py compares the
two on planted and random traces; bench/replay_speed.py times both).
"""

from __future__ import annotations

import numpy as np

from tensorbend.cache.admission import make_admission
from tensorbend.cache.oracle import steps_by_key
from tensorbend.cache.policies import LFRU, LFU, LRU, NextUse
from tensorbend.cache.predicted import Predicted, Reuse
from tensorbend.cache.replay import Forecasts, ReplayConfig, Replayed, as_padded
from tensorbend.cache.resident import ResidentSet
from tensorbend.cache.victim_heap import IndexedResidentSet

_OUTCOMES = {"admitted": 0, "refused": 1, "blocked": 2}  # cache/kernel.py's OUTCOMES, indexed
_RULES = {"lru": lambda L, d: LRU(), "lfu": lambda L, d: LFU(), "lfru": lambda L, d: LFRU(),
          "predicted": Predicted, "reuse": lambda L, d: Reuse(L)}  # fmt: skip


def index_replay(ids_FLK, cfg: ReplayConfig, num_experts: int = 0, seen_FLK=None,
                 forecasts: Forecasts | None = None, rs: ResidentSet | None = None) -> Replayed:  # fmt: skip
    """`cache.replay.replay`'s result, event by event through the Python index (rs: the
    resident set to drive instead, built as `resident_set` builds it: a reference scan)."""
    ids, n_FL = as_padded(ids_FLK)
    F, L, _ = ids.shape
    E = max(num_experts, 1 + int(ids.max(initial=-1)))
    if seen_FLK is not None:
        E = max(E, 1 + int(as_padded(seen_FLK)[0].max(initial=-1)))
    rows = _rows(ids, n_FL)
    rs = rs if rs is not None else resident_set(cfg, L, rows if seen_FLK is None else seen_FLK)
    judge = NextUse(_steps(rows, L), L) if cfg.judge else None
    placed_P, misses_F, tally = [], np.zeros(F, np.int64), {"prefetches": 0, "good": 0, "n": 0}

    def place(key, now, when, evictable=None):
        best = None
        if judge is not None and when is None and not rs.has_room(key):
            cands = [k for k in rs if rs.pool_of(k) == rs.pool_of(key) and evictable(k)]
            best = max((judge.next_use(k, now) for k in cands), default=None)
        placed = rs.place(key, now, when, evictable)
        if best is not None and placed.victim is not None:
            tally["n"] += 1
            tally["good"] += judge.next_use(placed.victim, now) >= best
        v = -1 if placed.victim is None else placed.victim[0] * E + placed.victim[1]
        placed_P.append((now, key[0] * E + key[1], _OUTCOMES[placed.outcome], v))

    for f in range(F):
        for m in range(L):
            now = f * L + m
            f2, m2 = (f, m + 1) if m + 1 < L else (f + 1, 0)
            for e in rows[f2][m2] if cfg.hints and f2 < F else ():
                rs.hint((m2, e), now + 1)
                if (m2, e) not in rs:
                    tally["prefetches"] += 1
                    place((m2, e), now, now + 1)
            pinned: set = set()
            for e in rows[f][m]:
                if not rs.use((m, e), now):
                    misses_F[f] += 1
                    place((m, e), now, None, lambda k, pinned=pinned: k not in pinned)
                pinned.add((m, e))
        if forecasts is not None:
            ahead, after = (a[f].reshape(L, E).tolist() for a in forecasts)
            rs.set_forecast(f, ahead, after)
    placements = tuple(np.array(c, np.int64).reshape(-1) for c in zip(*placed_P, strict=True))
    return Replayed(
        misses=int(misses_F.sum()), prefetches=tally["prefetches"], evictions=rs.evictions,
        misses_F=misses_F, good=tally["good"], judged=tally["n"], num_experts=E,
        placements=placements or tuple(np.zeros(0, np.int64) for _ in range(4)),
    )  # fmt: skip


def resident_set(cfg: ReplayConfig, num_layers: int, seen_FLK, cls=IndexedResidentSet):
    """The resident set `cfg` describes: its policy (Belady over seen_FLK), admission, pool."""
    L = num_layers
    if cfg.eviction == "next_use":
        beyond = _RULES[cfg.beyond](L, cfg.decay) if cfg.foresight is not None else None
        policy = NextUse(_steps(_rows(*as_padded(seen_FLK)), L), L, cfg.foresight, beyond)
    else:
        policy = _RULES[cfg.eviction](L, cfg.decay)
    adm = make_admission(cfg.admission, L, cfg.admission_window, cfg.fallback)
    return cls(cfg.slots, L, policy, pool=cfg.pool, admission=adm)


def _rows(ids: np.ndarray, n_FL: np.ndarray) -> list:
    F, L, _ = ids.shape
    return [[ids[f, m, : n_FL[f, m]].tolist() for m in range(L)] for f in range(F)]


def _steps(rows: list, L: int) -> dict:
    return steps_by_key((f * L + m, m, e) for f, layers in enumerate(rows)
                        for m, ids in enumerate(layers) for e in ids)  # fmt: skip
