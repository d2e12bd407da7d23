"""Indexed victim search: the resident set's victims without ranking every entry at each miss.

Usage (a drop-in for `ResidentSet`, same arguments, same victims):
    >>> from tensorbend.cache.policies import LFRU
    >>> rs = IndexedResidentSet(capacity=2, num_layers=1, policy=LFRU())
    >>> misses = [step for step, e in enumerate([0, 0, 0, 1, 2, 1, 0]) if not rs.access((0, e), step)]
    >>> misses, sorted(rs)
    ([0, 3, 4, 5], [(0, 0), (0, 1)])

`cache.resident.ResidentSet.victim` is the reference: the evictable entry of the pool with
the highest `policy.rank(key, recency, now)`, a tuple whose last field is -recency, so ties go
to the least recent entry (recencies are distinct) and the victim is unique. That scan costs
a rank per entry per miss: minutes per replay for pools of hundreds of experts. Here the index
is chosen by the property each policy class declares, `ranking`:

  recency    (LRU) the rank is -recency: keys in order of use (`_RecencyIndex`).
  static     (LFU) a rank changes only when its key is used or placed, and a use only lowers
             it: a heap of ranks (`policy.order`, the rank negated, where it has one), a used
             key re-ranked when it reaches the top.
  scheduled  (NextUse and its bounded oracles, Predicted, Reuse) `policy.schedule(...)`
             says until which step a rank stays as it is: a heap of ranks and a calendar of
             those steps; ranks that move at every step move together in groups, each a heap
             in its fixed order, of which only heads that can still win are ranked
             (cache/scheduled.py).
  ages       (LFRU) every score count / (age + 1) moves at every step, but keys of one count
             keep their order: buckets by count, their heads in a kinetic tournament
             (cache/ages.py, cache/kinetic.py).

Every index skips entries that are not evictable (loading or pinned) by setting them aside and
putting them back. Time (`now`) never goes backwards. tests/test_victim_heap.py replays random
and planted traces through both and asserts identical victims for every policy.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from operator import neg

from tensorbend.cache.admission import AdmitAll, prefetch_worth
from tensorbend.cache.ages import AgesIndex
from tensorbend.cache.heaps import compact, first_live
from tensorbend.cache.policies import LRU, Key
from tensorbend.cache.resident import Evictable, Placement, ResidentSet, inherited
from tensorbend.cache.scheduled import ScheduledIndex


class IndexedResidentSet(ResidentSet):
    """A ResidentSet whose `victim` asks an index chosen by `policy.ranking`.

    `use` and `place` are `ResidentSet`'s, flattened (they are the replay's hot path): the same
    events reach the policy, the admission rule and the index, minus calls to methods that do
    nothing (the base `touch`, an index that ignores uses)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._now = 0  # the latest step seen (hints carry none)
        self._index = index = _INDEXES[self.policy.ranking](self)
        self._used = index.used if index.tracks_uses else None
        self._touch = None if inherited(self.policy.touch, LRU.touch) else self.policy.touch
        adm_touch = self.admission.touch
        self._adm_touch = None if inherited(adm_touch, AdmitAll.touch) else adm_touch
        self._per_layer = self.pool == "per_layer"
        self._caps = [self.pool_capacity(p) for p in range(len(self._size))]
        self._admit_all = type(self.admission) is AdmitAll
        self._evicted: dict[Key, Placement] = {}  # victim -> Placement("admitted", victim)

    def use(self, key: Key, now: int) -> bool:
        if now > self._now:
            self._now = now
        if self._touch is not None:
            self._touch(key, now)
        if self._adm_touch is not None:
            self._adm_touch(key, now)
        self._seq = seq = self._seq + 1
        if key in self._recency:
            self._recency[key] = seq
            if self._used is not None:
                self._used(key, now)
            return True
        self._missed[key] = seq  # its recency once placed: the order of demands
        return False

    def hint(self, key: Key, when: int) -> None:
        self.policy.hint(key, when)
        self._index.hinted(key, self._now)

    def hint_many(self, hints: list[tuple[Key, int]]) -> None:
        self.policy.hint_many(hints)
        hinted, now = self._index.hinted, self._now
        for key, _ in hints:
            hinted(key, now)

    def set_forecast(self, forward: int, ahead_LE: list, after_first_LE: list) -> None:
        super().set_forecast(forward, ahead_LE, after_first_LE)
        self._index.rebuild(self._now)

    def place(self, key: Key, now: int, when=None, evictable: Evictable = None):
        assert key not in self._recency, f"{key} is resident already"
        if now > self._now:
            self._now = now
        p = key[0] if self._per_layer else 0
        if self._size[p] < self._caps[p]:
            self._add(key)
            return _ADMITTED
        if self._caps[p] == 0:
            self._missed.pop(key, None)
            return _REFUSED
        victim = self._index.victim(p, self._now, evictable)
        if victim is None:
            return _BLOCKED
        if when is None:
            ok = self._admit_all or self.admission.admit(key, victim, self.policy, now)
        else:
            ok = prefetch_worth(self.policy, victim, when, now)
        if not ok:
            self._missed.pop(key, None)
            return _REFUSED
        self.remove(victim)
        self.evictions += 1
        self._add(key)
        placed = self._evicted.get(victim)
        if placed is None:
            placed = self._evicted[victim] = Placement("admitted", victim)
        return placed

    def victim(self, key: Key, now: int, evictable: Evictable = None) -> Key | None:
        return self._index.victim(self.pool_of(key), max(self._now, now), evictable)

    def remove(self, key: Key) -> None:
        del self._recency[key]
        self._size[key[0] if self._per_layer else 0] -= 1
        self._index.drop(key, self._now)

    def _add(self, key: Key) -> None:
        self._size[key[0] if self._per_layer else 0] += 1
        seq = self._missed.pop(key, None)
        if seq is None:
            self._seq = seq = self._seq + 1
        self._recency[key] = seq
        self._index.put(key, self._now)


_ADMITTED, _REFUSED, _BLOCKED = Placement("admitted"), Placement("refused"), Placement("blocked")


class _StaticIndex:
    """One heap per pool of negated ranks [(-rank, version, key)], each at least the key's
    current rank: a use only lowers a rank, so a used key (its stored recency is stale) is
    re-ranked when it reaches the top; a top whose stored rank is current is the highest."""

    tracks_uses = False  # `used` does nothing (IndexedResidentSet skips it)

    def __init__(self, rs: ResidentSet):
        assert rs.policy.use_lowers_rank, rs.policy.name
        self.rs = rs
        self.heaps: dict[int, list] = {}
        self.version: dict[Key, int] = {}
        self.order = getattr(rs.policy, "order", None)  # the rank negated, where it says

    def put(self, key: Key, now: int) -> None:
        """Key placed, or its rank changed otherwise than by a use (hinted, a forecast)."""
        v = self.version[key] = self.version.get(key, 0) + 1
        p = key[0] if self.rs.pool == "per_layer" else 0
        heap = self.heaps.get(p) or self.heaps.setdefault(p, [])
        heapq.heappush(heap, (self._neg_rank(key, now), v, key))
        if len(heap) > 4 * self.rs.capacity + 64:
            compact(heap, self.version)

    def used(self, key: Key, now: int) -> None:
        pass

    def hinted(self, key: Key, now: int) -> None:
        pass

    def drop(self, key: Key, now: int) -> None:
        self.version[key] += 1  # its entries go stale

    def rebuild(self, now: int) -> None:
        for key in self.rs:
            self.put(key, now)

    def victim(self, pool: int, now: int, evictable: Evictable) -> Key | None:
        heap, version, recency = self.heaps.get(pool, []), self.version, self.rs._recency
        aside, found = [], None
        while heap:
            stored, v, key = heap[0]
            if version[key] != v:
                heapq.heappop(heap)  # stale
                continue
            if stored[-1] != recency[key]:  # used since (ranks hold recency last): lower now
                heapq.heapreplace(heap, (self._neg_rank(key, now), v, key))
                continue
            if evictable is None or evictable(key):
                found = key
                break
            aside.append(heapq.heappop(heap))
        for item in aside:
            heapq.heappush(heap, item)
        return found

    def _neg_rank(self, key: Key, now: int) -> tuple:
        if self.order is not None:
            return self.order(key, self.rs._recency[key], now)
        return tuple(map(neg, self.rs.policy.rank(key, self.rs._recency[key], now)))


class _RecencyIndex:
    """LRU (rank = -recency): per pool, keys oldest first in an OrderedDict; a use moves its
    key to the end (it now has the newest recency). A placement is appended too, unless its
    recency is older than the newest there (a demand placed after later uses): such keys wait
    in a heap by recency until used. The victim is the older of the two first evictable keys."""

    tracks_uses = True

    def __init__(self, rs: ResidentSet):
        assert rs.policy.use_lowers_rank, rs.policy.name
        self.rs = rs
        self.order: dict[int, OrderedDict] = {}
        self.late: dict[int, list] = {}  # pool -> [(recency, key)]
        self.per_layer = rs.pool == "per_layer"

    def put(self, key: Key, now: int) -> None:
        p, recency = self.rs.pool_of(key), self.rs._recency[key]
        order = self.order.get(p) or self.order.setdefault(p, OrderedDict())
        if not order or recency > self.rs._recency[next(reversed(order))]:
            order[key] = None
        else:
            heapq.heappush(self.late.setdefault(p, []), (recency, key))

    def used(self, key: Key, now: int) -> None:
        order = self.order[key[0] if self.per_layer else 0]  # pool_of, on the hot path
        if key in order:
            order.move_to_end(key)
        else:
            order[key] = None  # was late: its entry there goes stale

    def hinted(self, key: Key, now: int) -> None:
        pass

    def drop(self, key: Key, now: int) -> None:
        self.order[self.rs.pool_of(key)].pop(key, None)

    def rebuild(self, now: int) -> None:
        pass

    def victim(self, pool: int, now: int, evictable: Evictable) -> Key | None:
        order, late = self.order.get(pool, ()), self.late.get(pool, [])
        first = next((k for k in order if evictable is None or evictable(k)), None)
        recency, other = self.rs._recency, None
        if late:

            def stale(item: tuple) -> bool:  # its key used since, or left
                return item[1] in order or recency.get(item[1]) != item[0]

            item = first_live(late, stale, evictable)
            other = None if item is None else item[1]
        if other is None or (first is not None and recency[first] < recency[other]):
            return first
        return other


_INDEXES = {
    "recency": _RecencyIndex,
    "static": _StaticIndex,
    "scheduled": ScheduledIndex,
    "ages": AgesIndex,
}
