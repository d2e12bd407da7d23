"""The compiled replay (cache/compiled.py) makes the Python resident set's placements.

The reference is `cache.resident.ResidentSet` (the victim: the evictable entry with the highest
`policy.rank`, ranked entry by entry) driven by `cache.replay.replay` with the feed
`replay_policy` builds; each test compares every placement (step, key, outcome, victim) and
checks that the work had evictions to decide.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tensorbend.cache import compiled
from tensorbend.cache.policies import NextUse
from tensorbend.cache.replay import (
    REPLAY_POLICIES,
    planted_trace,
    replay,
    replay_policy,
    steps_by_key,
)
from tensorbend.cache.resident import ResidentSet
from tensorbend.cache.victim_heap import IndexedResidentSet

pytest.importorskip("numba")


def _python(ids, name, slots, L, E, pool, cls=ResidentSet):
    policy, feed = replay_policy(name, ids, L, E)
    return replay(ids, cls(slots, L, policy, pool=pool), feed)


@pytest.mark.parametrize("pool", ["global", "per_layer"])
@pytest.mark.parametrize("name", [*REPLAY_POLICIES, "belady/h=0"])
def test_same_placements_on_planted_trace(name, pool):
    L, E, K = 4, 12, 3
    ids = planted_trace(prompts=4, tokens=24, layers=L, experts=E, top_k=K, seed=1)
    want = _python(ids, name, 14, L, E, pool)
    got = compiled.replay_compiled(ids, name, 14, E, pool)
    assert got.victims == want.victims
    assert (got.misses, got.prefetches) == (want.misses, want.prefetches)
    assert sum(v[3] is not None for v in want.victims) > 100


@pytest.mark.parametrize("name", REPLAY_POLICIES)
@pytest.mark.parametrize("slots", [0, 2, 5, 9])
def test_same_placements_on_random_routing_of_uneven_width(name, slots):
    """Layer-steps routing 1..3 experts (padded rows), per-layer pools of 0-3 slots: demands
    refused (no slot) and blocked (every slot pinned by the step) as well as admitted."""
    rng = random.Random(slots)
    L, E = 3, 6
    ids = [[sorted(rng.sample(range(E), rng.randint(1, 3))) for _ in range(L)] for _ in range(150)]
    want = _python(ids, name, slots, L, E, "per_layer", IndexedResidentSet)
    got = compiled.replay_compiled(ids, name, slots, E, "per_layer")
    assert got.victims == want.victims and got.misses == want.misses
    outcomes = {v[2] for v in want.victims}
    assert outcomes == {"refused"} if slots == 0 else "admitted" in outcomes
    if slots == 5:  # pools of 2, 2, 1: a layer-step of 3 pins them all
        assert "blocked" in outcomes


def test_arrays_and_lists_replay_alike():
    ids = planted_trace(prompts=2, tokens=16, layers=3, experts=8, top_k=2, seed=3)
    a = compiled.run(ids, "lfru", 6, 8)
    b = compiled.run(np.array(ids), "lfru", 6, 8)
    assert a.victim_P.tolist() == b.victim_P.tolist() and a.misses == b.misses > 0
    assert a.evictions == sum(v[3] is not None for v in a.replayed().victims)


def test_belady_seeing_another_trace():
    """NextUse ranking by a different routing than the demands (the zoo card's token-table
    foresight): the same placements as NextUse(steps_by_key(seen))."""
    L, E = 3, 10
    ids = planted_trace(prompts=3, tokens=20, layers=L, experts=E, top_k=2, seed=4)
    seen = planted_trace(prompts=3, tokens=20, layers=L, experts=E, top_k=2, seed=5)
    for h in (None, 1, 3):
        rs = ResidentSet(8, L, NextUse(steps_by_key(seen), L, h), pool="per_layer")
        want = replay(ids, rs)
        name = "belady" if h is None else f"belady/h={h}"
        got = compiled.replay_compiled(ids, name, 8, E, "per_layer", seen_FLK=seen)
        assert got.victims == want.victims and got.misses == want.misses


def test_bad_names_and_shapes_are_refused():
    ids = planted_trace(prompts=1, tokens=4, layers=2, experts=4, top_k=1)
    with pytest.raises(ValueError, match="unknown replay policy 'fifo'.*lru, lfu"):
        compiled.run(ids, "fifo", 2)
    with pytest.raises(ValueError, match="pool must be"):
        compiled.run(ids, "lru", 2, pool="layer")
    with pytest.raises(ValueError, match="seen_FLK covers 3 forwards x 2 layers; the demands 4"):
        compiled.run(ids, "belady", 2, seen_FLK=ids[:3])
