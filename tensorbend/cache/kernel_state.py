"""The replay kernel's records: its rules, the trace it reads, the cache state and what it writes.

Usage: `cache.replay.replay` fills them from a `ReplayConfig` and a trace, and
`cache.kernel.run(rules, trace, new_state(rules, slots, L, E), out)` runs them. Plain numpy
arrays in NamedTuples, so numba compiles the kernel over them and this module loads without
numba (the victims' outcome names, `OUTCOMES`, are read after a replay).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

# eviction rules (Rules.evict; Rules.beyond: LRU..PREDICTED)
LRU, LFU, LFRU, PREDICTED, REUSE, NEXT_USE = range(6)
# admission rules (Rules.admit; Rules.fallback: NONE or ADMIT_ALL / ADMIT_FREQUENCY)
ADMIT_ALL, ADMIT_FREQUENCY, ADMIT_PREDICTED = range(3)
# placement outcomes (cache.resident.Placement.outcome)
ADMITTED, REFUSED, BLOCKED = range(3)
OUTCOMES = ("admitted", "refused", "blocked")
NONE = -1  # no key, no rule, no step
INF = math.inf
SEQ, CLOCK, FORECAST = range(3)  # State.tick: recency counter, latest step, forecast forward


class Rules(NamedTuple):
    evict: int
    beyond: int  # NEXT_USE: how keys not seen used within its sight rank
    foresight: int  # NEXT_USE: forwards it sees (NONE: the whole trace)
    admit: int
    fallback: int  # ADMIT_PREDICTED: the rule for two unknown next uses (NONE: admit)
    window: int  # ADMIT_FREQUENCY: forwards of use counts
    per_layer: bool  # pools: one per layer, else one global pool
    hints: bool  # hint and prefetch the next layer's experts (a perfect d1 predictor)
    judge: bool  # count evictions as good as Belady's (Out.tally GOOD, JUDGED)
    log_counts: bool  # keep Predicted's log counts (a rule ranks by them)
    decay: float  # Predicted's decay per forward


class ReplayInput(NamedTuple):
    ids_FLK: np.ndarray  # int64, -1 padded where a layer-step routes fewer
    n_FL: np.ndarray  # experts routed per layer-step
    num_experts: int
    seen_ptr: np.ndarray  # NEXT_USE: key k is seen used at seen_steps[seen_ptr[k]:seen_ptr[k+1]]
    seen_steps: np.ndarray
    used_ptr: np.ndarray  # the judge: the demands' own uses, same layout
    used_steps: np.ndarray
    ahead_FK: np.ndarray  # REUSE: after forward f, each key's expected next use ([0, K]: none)
    after_FK: np.ndarray  # ... once layer m of forward f + 1 has passed without it


class State(NamedTuple):
    tick: np.ndarray  # [SEQ, CLOCK, FORECAST]
    caps: np.ndarray  # slots per pool
    members: np.ndarray  # [pools, max cap] keys holding slots
    size: np.ndarray  # per pool
    pos: np.ndarray  # per key: index in members (NONE: not resident)
    missed: np.ndarray  # per key: sequence number of a pending demand (NONE: none)
    pin: np.ndarray  # per key: the step whose demand pinned it
    rec: np.ndarray  # per key: recency sequence number
    count: np.ndarray  # per key: uses
    last: np.ndarray  # per key: step of the last use (NONE: never used)
    g: np.ndarray  # per key: Predicted's log count referred to step 0 (-inf: never used)
    hint: np.ndarray  # per key: pending predicted step (NONE: none)
    layer_hint: np.ndarray  # per layer: latest predicted step
    head_L: np.ndarray  # scratch: per layer, the head of Predicted's order
    seen: np.ndarray  # [2, keys]: next seen use (float), cursor into seen_steps
    used: np.ndarray  # [2, keys]: the same for the judge
    uses_KW: np.ndarray  # per key: steps of its last `window` uses (a ring)


class Out(NamedTuple):
    step_P: np.ndarray  # per placement (empty: not recorded): step, key, outcome, victim
    key_P: np.ndarray
    outcome_P: np.ndarray
    victim_P: np.ndarray
    misses_F: np.ndarray  # demand misses per forward
    tally: np.ndarray  # [PLACEMENTS, PREFETCHES, EVICTIONS, GOOD, JUDGED]


PLACEMENTS, PREFETCHES, EVICTIONS, GOOD, JUDGED = range(5)


def new_state(rules: Rules, slots: int, L: int, E: int) -> State:
    """A cold cache of `slots` slots (per-layer pools: the first slots % L layers one more)."""
    n = L if rules.per_layer else 1
    caps = np.array(
        [slots // L + (p < slots % L) if rules.per_layer else slots for p in range(n)], np.int64
    )
    K = L * E

    def keys(v, dtype=np.int64):
        return np.full(K, v, dtype)

    return State(
        tick=np.array([0, NONE, NONE], np.int64),
        caps=caps,
        members=np.empty((n, max(1, int(caps.max()))), np.int64),
        size=np.zeros(n, np.int64),
        pos=keys(NONE),
        missed=keys(NONE),
        pin=keys(NONE),
        rec=keys(0),
        count=keys(0),
        last=keys(NONE),
        g=keys(-INF, np.float64),
        hint=keys(NONE),
        layer_hint=np.full(L, NONE, np.int64),
        head_L=np.full(L, NONE, np.int64),
        seen=np.full((2, K), -1.0),
        used=np.full((2, K), -1.0),
        uses_KW=np.full((K, max(rules.window, 1)), -(1 << 60), np.int64),
    )
