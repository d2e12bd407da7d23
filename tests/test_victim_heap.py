"""The indexed victim search (cache/victim_heap.py) picks the linear scan's victims, ties included.

The reference is `cache.resident.ResidentSet.victim`: the evictable entry of the pool with the
highest `policy.rank`, ties (equal in every field but the last, -recency) to the least recent.
Each test replays the same work through both and compares every placement (step, key,
outcome, victim), and checks that the work had evictions and ties to decide.
"""

from __future__ import annotations

import random
from dataclasses import replace
from fractions import Fraction

import pytest

from bench.index_replay import index_replay, resident_set
from tensorbend.cache.kinetic import Tournament
from tensorbend.cache.policies import INF, LFRU, LFU, LRU, NextUse
from tensorbend.cache.predicted import Predicted, Reuse
from tensorbend.cache.replay import (
    REPLAY_POLICIES,
    ReplayConfig,
    as_padded,
    exact_forecasts,
    named,
    planted_trace,
)
from tensorbend.cache.resident import ResidentSet
from tensorbend.cache.victim_heap import IndexedResidentSet


class TieCountingSet(ResidentSet):
    """The reference scan, counting victim choices that recency decided (a tie before it)."""

    ties = 0

    def victim(self, key, now, evictable=None):
        p = self.pool_of(key)
        ranks = sorted(
            (self.policy.rank(k, self._recency[k], now) for k in self._recency
             if self.pool_of(k) == p and (evictable is None or evictable(k))),
            reverse=True,
        )  # fmt: skip
        self.ties += len(ranks) > 1 and ranks[0][:-1] == ranks[1][:-1]
        return super().victim(key, now, evictable)


def _both(name, ids, L, E, capacity, pool, admission):
    """The same events (bench/index_replay.py: `name`'s feed) through the scan and the index."""
    cfg = replace(named(name, capacity, pool), admission=admission, admission_window=2)
    fc = exact_forecasts(*as_padded(ids), E) if name == "reuse" else None
    outs = []
    for cls in (TieCountingSet, IndexedResidentSet):
        rs = resident_set(cfg, L, ids, cls)
        outs.append((rs, index_replay(ids, cfg, E, forecasts=fc, rs=rs)))
    return outs


@pytest.mark.parametrize("pool", ["global", "per_layer"])
@pytest.mark.parametrize("name", REPLAY_POLICIES)
def test_same_victims_on_planted_trace(name, pool):
    L, E, K = 4, 12, 3
    ids = planted_trace(prompts=4, tokens=24, layers=L, experts=E, top_k=K, seed=1)
    (ref, a), (_, b) = _both(name, ids, L, E, 14, pool, "all")
    assert a.victims() == b.victims()
    assert sum(v[3] is not None for v in a.victims()) > 100
    assert ref.ties > 0  # ties were decided, by recency, the same way


@pytest.mark.parametrize(
    "name, admission",
    [("lfru", "frequency"), ("prefetch", "frequency"), ("prefetch", "predicted"),
     ("reuse", "predicted"), ("belady/h=1", "frequency")],
)  # fmt: skip
def test_same_victims_with_admission(name, admission):
    L, E, K = 3, 10, 2
    ids = planted_trace(prompts=3, tokens=30, layers=L, experts=E, top_k=K, seed=2)
    (_, a), (_, b) = _both(name, ids, L, E, 7, "global", admission)
    assert a.victims() == b.victims()
    assert {v[2] for v in a.victims()} >= {"admitted", "refused"}


def _fuzz(rs: ResidentSet, seed: int, L: int, E: int, forwards: int, gaps: bool = False,
          every: int = 3) -> list:  # fmt: skip
    """Random demands (placed at once, or after the step's other demands), hints (near, far,
    between two steps, repeated), prefetches, pins, failed loads and forecasts (Reuse), in an
    order the drivers can produce; every placement's result. gaps: forwards skipped at random
    (up to 200 at a time: the clock jumps)."""
    rng, out = random.Random(seed), []
    numbers = [0]
    for _ in range(forwards - 1):
        numbers.append(numbers[-1] + (rng.choice([1, 1, 2, 50, 200]) if gaps else 1))
    for f in numbers:
        for m in range(L):
            now = f * L + m
            for _ in range(rng.randrange(3)):
                rs.hint(
                    (rng.randrange(L), rng.randrange(E)), now + rng.choice([1, 1.5, 2, L, 3 * L])
                )
            pinned = {(m, e) for e in rng.sample(range(E), 2) if (m, e) in rs}
            later = rng.random() < 0.5  # claim all, then place (placed older than later uses)
            missed = []
            for e in sorted(rng.sample(range(E), 3)):
                key = (m, e)
                if not rs.use(key, now):
                    missed.append(key)
                    if not later:
                        p = rs.place(key, now, None, lambda k, pinned=pinned: k not in pinned)
                        out.append((now, key, p.outcome, p.victim))
                pinned.add(key)
            for key in missed if later else ():
                p = rs.place(key, now, None, lambda k, pinned=pinned: k not in pinned)
                out.append((now, key, p.outcome, p.victim))
            for _ in range(rng.randrange(4)):  # predictions made at the router, then prefetches
                m2 = rng.randrange(L)  # for layer m2 of the next forward or the one after
                rs.hint((m2, rng.randrange(E)), (f + rng.choice([1, 2])) * L + m2)
            extra = (rng.randrange(L), rng.randrange(E))
            if rng.random() < 0.3 and extra not in rs:
                p = rs.place(extra, now, now + rng.randrange(1, 2 * L))
                out.append((now, extra, p.outcome, p.victim))
                if p.outcome == "admitted" and rng.random() < 0.2:
                    rs.remove(extra)  # a failed load
        if isinstance(rs.policy, Reuse) and f % every == every - 1:
            values = [now - 3, now + 1, now + 2, now + 2.5, now + L, INF]
            ahead = [[rng.choice(values) for _ in range(E)] for _ in range(L)]
            after = [[rng.choice(values) for _ in range(E)] for _ in range(L)]
            rs.set_forecast(f, ahead, after)
    return out


POLICIES = {
    "lru": lambda L, steps: LRU(),
    "lfu": lambda L, steps: LFU(),
    "lfru": lambda L, steps: LFRU(),
    "predicted": lambda L, steps: Predicted(L),
    "reuse": lambda L, steps: Reuse(L),
    "belady": lambda L, steps: NextUse(steps, L),
    "belady/h=0": lambda L, steps: NextUse(steps, L, 0),
    "belady/h=2": lambda L, steps: NextUse(steps, L, 2),
}


@pytest.mark.parametrize("pool", ["global", "per_layer"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_same_victims_on_random_work(name, pool):
    L, E = 3, 7
    steps = {}
    for f in range(200):  # a routing for NextUse: uses at random steps of each key's layer
        for m in range(L):
            for e in random.Random(f * L + m).sample(range(E), 2):
                steps.setdefault((m, e), []).append(f * L + m)
    outs = []
    for cls in (ResidentSet, IndexedResidentSet):
        rs = cls(6, L, POLICIES[name](L, steps), pool=pool)
        outs.append(_fuzz(rs, 7, L, E, 200))
    assert outs[0] == outs[1]
    assert sum(v[3] is not None for v in outs[0]) > 100


@pytest.mark.parametrize("name", ["predicted", "reuse", "belady", "belady/h=2", "lfru"])
def test_same_victims_when_the_clock_jumps(name):
    """Forwards skipped (the due ranks of many steps come at once)."""
    L, E = 3, 7
    steps = {}
    for f in range(0, 20000, 3):
        for m in range(L):
            for e in random.Random(f * L + m).sample(range(E), 2):
                steps.setdefault((m, e), []).append(f * L + m)
    outs = []
    for cls in (ResidentSet, IndexedResidentSet):
        rs = cls(6, L, POLICIES[name](L, steps))
        outs.append(_fuzz(rs, 11, L, E, 150, gaps=True))
    assert outs[0] == outs[1]
    assert sum(v[3] is not None for v in outs[0]) > 100


def test_same_victims_with_forecast_rows_reused():
    """Reuse: a caller that mutates its forecast lists in place and hands them over again
    (the index compares against its own copy of the last forecast, not the policy's lists)."""
    L, E = 3, 7
    rng = random.Random(5)
    outs = []
    for cls in (ResidentSet, IndexedResidentSet):
        rng.seed(5)
        rs = cls(6, L, Reuse(L))
        ahead = [[INF] * E for _ in range(L)]
        after = [[INF] * E for _ in range(L)]
        out = []
        for f in range(150):
            for m in range(L):
                now = f * L + m
                pinned = set()
                for e in sorted(rng.sample(range(E), 3)):
                    if not rs.use((m, e), now):
                        p = rs.place((m, e), now, None, lambda k, pinned=pinned: k not in pinned)
                        out.append((now, (m, e), p.outcome, p.victim))
                    pinned.add((m, e))
            for _ in range(rng.randrange(1, 6)):  # a few entries change, in the same lists
                table = rng.choice([ahead, after])
                table[rng.randrange(L)][rng.randrange(E)] = now + rng.choice([1, 2, L, 3 * L])
            rs.set_forecast(f, ahead, after)
        outs.append(out)
    assert outs[0] == outs[1]
    assert sum(v[3] is not None for v in outs[0]) > 100


def test_lfru_victim_skips_a_pinned_head_to_the_next_of_its_count():
    """Known answer: a used at step 0, b at 1 (one use each), c three times (2, 3, 4): at step
    5 the scores are 1/6, 1/5 and 3/2; pinning a leaves b (a's bucket, standing in), pinning a
    and b leaves c; a prefetched, never-used d (score 0) goes before all of them."""
    for cls in (ResidentSet, IndexedResidentSet):
        rs = cls(4, 1, LFRU())
        for step, e in enumerate("abccc"):
            rs.access((0, e), step)
        assert rs.victim((0, "x"), 5) == (0, "a")
        assert rs.victim((0, "x"), 5, lambda k: k != (0, "a")) == (0, "b")
        assert rs.victim((0, "x"), 5, lambda k: k not in {(0, "a"), (0, "b")}) == (0, "c")
        assert rs.victim((0, "x"), 5) == (0, "a")  # the pins were set aside, not lost
        rs.place((0, "d"), 5, 9)  # a prefetch: room for it
        assert rs.victim((0, "x"), 5) == (0, "d")
        assert rs.victim((0, "x"), 5, lambda k: k != (0, "d")) == (0, "a")


def _score(c, last, t):
    return Fraction(c, t - last + 1)


def test_tournament_duel_is_exact():
    """Winner and change step of every duel, against exact fractions at every later step."""
    rng = random.Random(3)
    for _ in range(1000):
        now = rng.randrange(5, 40)
        lines = [(rng.randrange(0, 6), rng.randrange(0, now + 1), r) for r in (1, 2)]
        lines = [(0, 0, r) if c == 0 else (c, last, r) for c, last, r in lines]
        rng.shuffle(lines)
        tree = Tournament(2)  # two leaves under the root
        for i, line in enumerate(lines):
            tree.set(i, line, now)
        w, until = tree.win[1], tree.until[1]
        for t in range(now, now + 120):
            (sa, ra), (sb, rb) = ((_score(c, last, t), r) for c, last, r in lines)
            winner = 0 if (sa, ra) < (sb, rb) else 1
            assert winner == (w if t < until else 1 - w), (lines, now, t, until)


def test_index_ranks_few_entries_per_victim():
    """The point of the index: a scan ranks every entry of the pool at each eviction; the
    index ranks a used key when it reaches the top (static: at most once per use) or the
    heads of the groups that can still hold the victim (Predicted: fewer than L)."""
    L, E, K = 8, 64, 4
    ids = planted_trace(prompts=2, tokens=40, layers=L, experts=E, top_k=K, seed=4)
    calls = {}
    for name, make in (("lfu", LFU), ("predicted", lambda: Predicted(L))):
        for cls in (ResidentSet, IndexedResidentSet):
            policy, n = make(), [0]
            for method in ("rank", "group_rank"):  # (group_rank: rank from a group's order)
                f = getattr(policy, method, None)
                if f is not None:

                    def counted(*args, f=f, n=n):
                        n[0] += 1
                        return f(*args)

                    setattr(policy, method, counted)
            rs = cls(128, L, policy)
            index_replay(ids, ReplayConfig(name, 128), E, rs=rs)
            calls[name, cls] = n[0] / rs.evictions
    assert calls["lfu", ResidentSet] > 100 and calls["predicted", ResidentSet] > 100  # ~ 128
    assert calls["lfu", IndexedResidentSet] < calls["lfu", ResidentSet] / 5
    assert calls["predicted", IndexedResidentSet] < L / 2  # a few heads of the L groups


def test_a_hint_for_an_absent_expert_moves_its_layer_within_a_step():
    """Predicted: a hint of an expert not in the cache still moves its layer's next visit (the
    predicted set excludes the others), so the victim can change within the same step."""
    changed = 0
    for seed in range(200):
        rng = random.Random(seed)
        L, E = 2, 6
        sets = [cls(4, L, Predicted(L)) for cls in (ResidentSet, IndexedResidentSet)]
        for rs in sets:
            for step in range(12):
                rs.access((step % L, rng.randrange(E)), step)  # the same draws for both sets
            rng.seed(seed)
        now = 12
        before = [rs.victim((0, E - 1), now) for rs in sets]
        absent = [k for k in ((m, e) for m in range(L) for e in range(E)) if k not in sets[0]]
        for rs in sets:
            rs.hint(absent[seed % len(absent)], now + 1 + seed % L)
        after = [rs.victim((0, E - 1), now) for rs in sets]
        assert before[0] == before[1] and after[0] == after[1]
        changed += before[0] != after[0]
    assert changed > 0


@pytest.mark.parametrize("capacity", [6, 18])
def test_same_victims_with_a_forecast_every_forward(capacity):
    """Forecasts at every forward (the runtime's rate), placements and failed loads between
    them, and no miss for many steps (capacity 18 of 21 keys): the victims stay those of the
    reference scan."""
    L, E = 3, 7
    outs = [_fuzz(cls(capacity, L, Reuse(L)), 11, L, E, 200, every=1)
            for cls in (ResidentSet, IndexedResidentSet)]  # fmt: skip
    assert outs[0] == outs[1]
    assert sum(v[3] is not None for v in outs[0]) > 20
