"""A ResidentSet that finds victims through a heap when the policy's ranks only change on use.

Usage:
    >>> from tensorbend.offload.policies import LFU
    >>> rs = make_indexed(capacity=2, num_layers=1, policy=LFU())
    >>> [rs.access((0, e), step) for step, e in enumerate([0, 0, 1, 2, 1])]
    [False, True, False, False, False]
    >>> sorted(rs)
    [(0, 0), (0, 1)]

`offload.resident.ResidentSet.victim` ranks every entry of the pool (the policy's `rank`) at
each eviction: exact and simple, and the simulator's cost (a 60-layer geometry evicts on most
of its ~10^5 misses from pools of hundreds of entries). For LRU, LFU and NextUse with full
foresight a key's rank can only change when the key itself is used or placed (for NextUse:
its next use is passed only by using it; every step in its list is a demand), so a heap of
ranks with lazy invalidation returns the same victim: the policy's own `rank`, computed when
the key last changed, highest first, ties by recency as in ResidentSet. Every other policy
(LFRU, Predicted, NextUse with bounded foresight: ranks move with the clock) scans as
ResidentSet does, remembering ranks while the clock stands still (MemoResidentSet).
tests/test_simulate_runtime.py checks both give ResidentSet's victims on random sequences.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from tensorbend.offload.policies import LFU, LRU, Key, NextUse
from tensorbend.offload.resident import ResidentSet


def make_indexed(capacity: int, num_layers: int, policy: LRU, **kw) -> ResidentSet:
    """An IndexedResidentSet when the policy's ranks are static between uses, else a
    MemoResidentSet (ranks kept while the clock stands still)."""
    static = type(policy) in (LRU, LFU) or (type(policy) is NextUse and policy.foresight is None)
    cls = IndexedResidentSet if static else MemoResidentSet
    return cls(capacity, num_layers, policy, **kw)


class MemoResidentSet(ResidentSet):
    """ResidentSet.victim through a heap of ranks that is rebuilt whenever the clock moves.

    While the clock stands still a key's rank changes only when the key is used or placed, or
    a key of its layer is hinted (the policies' ranks depend on the clock, the key's own uses,
    and the hints of its layer); such keys are re-ranked before the next victim query."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._heaps: dict[int, list] = {}
        self._version: dict[Key, int] = {}
        self._by_layer: dict[int, set[Key]] = {}
        self._dirty: set[Key] = set()
        self._dirty_layers: set[int] = set()
        self._heap_now: int | None = None

    def use(self, key: Key, now: int) -> bool:
        self._dirty.add(key)
        return super().use(key, now)

    def hint(self, key: Key, when: int) -> None:
        self._dirty_layers.add(key[0])
        super().hint(key, when)

    def set_forecast(self, forward: int, ahead_LE: list, after_first_LE: list) -> None:
        """A new cross-token forecast (policies.Reuse) moves every rank: re-rank all."""
        self.policy.set_forecast(forward, ahead_LE, after_first_LE)
        self._heap_now = None

    def remove(self, key: Key) -> None:
        super().remove(key)
        self._by_layer[key[0]].discard(key)
        self._version[key] = self._version.get(key, 0) + 1

    def victim(
        self, key: Key, now: int, evictable: Callable[[Key], bool] | None = None
    ) -> Key | None:
        if now != self._heap_now:
            self._heaps, self._heap_now = {}, now
            self._dirty, self._dirty_layers = set(self._recency), set()
        for m in self._dirty_layers:
            self._dirty |= self._by_layer.get(m, set())
        for k in self._dirty:
            if k in self._recency:
                _push_rank(self, k, now)
        self._dirty, self._dirty_layers = set(), set()
        return _pop_victim(self, self._heaps.get(self.pool_of(key), []), evictable)

    def _add(self, key: Key) -> None:
        super()._add(key)
        self._by_layer.setdefault(key[0], set()).add(key)
        self._dirty.add(key)


class IndexedResidentSet(ResidentSet):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._heaps: dict[int, list] = {}  # pool -> [(negated rank, version, key)]
        self._version: dict[Key, int] = {}

    def use(self, key: Key, now: int) -> bool:
        hit = super().use(key, now)
        if hit:
            self._index(key, now)
        return hit

    def remove(self, key: Key) -> None:
        super().remove(key)
        self._version[key] = self._version.get(key, 0) + 1  # heap entries go stale

    def victim(
        self, key: Key, now: int, evictable: Callable[[Key], bool] | None = None
    ) -> Key | None:
        return _pop_victim(self, self._heaps.get(self.pool_of(key), []), evictable)

    def _add(self, key: Key) -> None:
        super()._add(key)
        self._index(key, None)

    def _index(self, key: Key, now: int | None) -> None:
        _push_rank(self, key, self._now if now is None else now)

    def place(self, key: Key, now: int, when=None, evictable=None):
        self._now = now
        return super().place(key, now, when, evictable)


def _push_rank(rs, key: Key, now: int) -> None:
    """Push key's current rank (negated: heapq pops the highest rank first)."""
    v = rs._version.get(key, 0) + 1
    rs._version[key] = v
    neg = tuple(-x for x in rs.policy.rank(key, rs._recency[key], now))
    heapq.heappush(rs._heaps.setdefault(rs.pool_of(key), []), (neg, v, key))


def _pop_victim(rs, heap: list, evictable) -> Key | None:
    """The highest-ranked current entry that is evictable; the others stay in the heap."""
    aside, found = [], None
    while heap:
        item = heapq.heappop(heap)
        k = item[2]
        if k not in rs._recency or rs._version.get(k) != item[1]:
            continue  # stale
        aside.append(item)
        if evictable is None or evictable(k):
            found = k
            break
    for item in aside:
        heapq.heappush(heap, item)
    return found
