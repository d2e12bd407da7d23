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
             it: a heap of ranks, a used key re-ranked when it reaches the top.
  scheduled  (NextUse and its bounded oracles, Predicted, Reuse) `policy.schedule(...)`
             says until which step a rank stays as it is; a heap of ranks plus a heap of those
             steps, re-ranking a key when its step comes (or when it is used, placed, hinted, or
             a new forecast arrives). Ranks that move at every step move together in groups
             (Predicted: one layer's unpredicted experts, whose estimates keep the order of their
             log counts; Reuse: the experts whose forecast has passed, all "next used at now + 1",
             ties by recency): each group is a heap in its fixed order, and only its head is
             ranked at the miss. The victim is the highest rank among the heap's top and the
             heads: at most one entry per group, L for a global pool, 1 per layer.
  scan       (cache/evictor.py) the policy chooses among the pool's evictable entries at each
             miss (`policy.choose(candidates, now)`), scoring only those; nothing is indexed.
  ages       (LFRU) every score count / (age + 1) moves at every step: a kinetic tournament
             (cache/kinetic.py).

Every index skips entries that are not evictable (loading or pinned) by setting them aside and
putting them back. Time (`now`) never goes backwards. tests/test_victim_heap.py replays random
and planted traces through both and asserts identical victims for every policy.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from operator import neg

from tensorbend.cache.kinetic import AgesIndex, Evictable
from tensorbend.cache.policies import INF, Key
from tensorbend.cache.resident import ResidentSet


class IndexedResidentSet(ResidentSet):
    """A ResidentSet whose `victim` asks an index chosen by `policy.ranking`."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._now = 0  # the latest step seen (hints carry none)
        self._index = _INDEXES[self.policy.ranking](self)
        self._used = self._index.used

    def use(self, key: Key, now: int) -> bool:
        if now > self._now:
            self._now = now
        if ResidentSet.use(self, key, now):  # (not super(): this is the replay's hot path)
            self._used(key, now)
            return True
        return False

    def hint(self, key: Key, when: int) -> None:
        super().hint(key, when)
        self._index.hinted(key, self._now)

    def set_forecast(self, forward: int, ahead_LE: list, after_first_LE: list) -> None:
        super().set_forecast(forward, ahead_LE, after_first_LE)
        self._index.rebuild(self._now)

    def place(self, key: Key, now: int, when=None, evictable: Evictable = None):
        if now > self._now:
            self._now = now
        return super().place(key, now, when, evictable)

    def victim(self, key: Key, now: int, evictable: Evictable = None) -> Key | None:
        return self._index.victim(self.pool_of(key), max(self._now, now), evictable)

    def remove(self, key: Key) -> None:
        super().remove(key)
        self._index.drop(key, self._now)

    def _add(self, key: Key) -> None:
        super()._add(key)
        self._index.put(key, self._now)


class _StaticIndex:
    """One heap per pool of negated ranks [(-rank, version, key)], each at least the key's
    current rank: a use only lowers a rank, so a used key (its stored recency is stale) is
    re-ranked when it reaches the top; a top whose stored rank is current is the highest."""

    def __init__(self, rs: ResidentSet):
        assert rs.policy.use_lowers_rank or rs.policy.ranking == "scheduled", rs.policy.name
        self.rs = rs
        self.heaps: dict[int, list] = {}
        self.version: dict[Key, int] = {}

    def put(self, key: Key, now: int) -> None:
        """Key placed, or its rank changed otherwise than by a use (hinted, a forecast)."""
        v = self.version[key] = self.version.get(key, 0) + 1
        heap = self.heaps.setdefault(self.rs.pool_of(key), [])
        heapq.heappush(heap, (self._neg_rank(key, now), v, key))
        if len(heap) > 4 * self.rs.capacity + 64:
            _compact(heap, self.version)

    def used(self, key: Key, now: int) -> None:
        pass

    def hinted(self, key: Key, now: int) -> None:
        pass

    def drop(self, key: Key, now: int) -> None:
        self.version[key] = self.version.get(key, 0) + 1  # its entries go stale (if any)

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
        return tuple(map(neg, self.rs.policy.rank(key, self.rs._recency[key], now)))


class _RecencyIndex:
    """LRU (rank = -recency): per pool, keys oldest first in an OrderedDict; a use moves its
    key to the end (it now has the newest recency). A placement is appended too, unless its
    recency is older than the newest there (a demand placed after later uses): such keys wait
    in a heap by recency until used. The victim is the older of the two first evictable keys."""

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
        recency, aside, other = self.rs._recency, [], None
        while late:
            r, key = late[0]
            if key in order or recency.get(key) != r:
                heapq.heappop(late)  # used since, or left
            elif evictable is None or evictable(key):
                other = key
                break
            else:
                aside.append(heapq.heappop(late))
        for item in aside:
            heapq.heappush(late, item)
        if other is None or (first is not None and recency[first] < recency[other]):
            return first
        return other


class _ScheduledIndex(_StaticIndex):
    """Ranks that hold until a known step (heap + expiry heap), and groups ranked by their head.

    `policy.schedule(key, recency, now)` -> (until, group, value). heaps[pool]: [(-rank,
    version, key)] for keys outside groups (rank = value), each current until its step;
    groups[pool][g]: [(value, version, key)], the head ranks highest in g at every step;
    expiry: [(until, version, key)]. A group head's rank is kept for the rest of its step
    unless the head, its version (a use, a placement) or any hint changes it."""

    def __init__(self, rs: ResidentSet):
        super().__init__(rs)
        self.groups: dict[int, dict[int, list]] = {}
        self.expiry: list = []
        self.memo: dict = {}  # (pool, group) -> (head, its version, its rank) at memo_now
        self.memo_now: int | None = None
        self.stale = False  # a forecast arrived: every rank is re-made at the next victim

    def put(self, key: Key, now: int) -> None:
        if self.stale:  # the pending rebuild ranks every key from the state it then finds
            return
        p, group, item, until = self._entry(key, now)
        if group is None:
            heap = self.heaps.get(p) or self.heaps.setdefault(p, [])
        else:
            heap = self.groups.setdefault(p, {}).get(group) or self.groups[p].setdefault(group, [])
        heapq.heappush(heap, item)
        if len(heap) > 4 * self.rs.capacity + 64:
            _compact(heap, self.version)
        if until != INF:
            heapq.heappush(self.expiry, (until, item[1], key))

    used = put  # a use may raise a rank (NextUse) or move it in time

    def hinted(self, key: Key, now: int) -> None:
        self.memo.clear()  # a hint may move a whole group (Predicted: its layer's next visit)
        if key in self.rs:
            self.put(key, now)

    def rebuild(self, now: int) -> None:
        """Every rank anew (a forecast), made lazily at the next `victim`: a forecast arrives
        on the compute thread once per forward, a victim is asked for on an I/O thread at a
        miss (often many forwards later, or never when the cache holds everything). A rebuild
        at any step is a valid index (the one a fresh index would have), so the victims stay
        those of the reference scan; uses, placements and hints meanwhile are in the state
        the rebuild reads and need no entries of their own."""
        self.stale = True

    def _rebuild(self, now: int) -> None:
        """put's entries for every key, heapified at once."""
        self.stale = False
        self.heaps, self.groups, self.expiry, self.memo = {}, {}, [], {}
        for key in self.rs:
            p, group, item, until = self._entry(key, now)
            if group is None:
                self.heaps.setdefault(p, []).append(item)
            else:
                self.groups.setdefault(p, {}).setdefault(group, []).append(item)
            if until != INF:
                self.expiry.append((until, item[1], key))
        for heap in [*self.heaps.values(), self.expiry]:
            heapq.heapify(heap)
        for groups in self.groups.values():
            for heap in groups.values():
                heapq.heapify(heap)

    def victim(self, pool: int, now: int, evictable: Evictable) -> Key | None:
        if self.stale:
            self._rebuild(now)
        expiry, version = self.expiry, self.version
        while expiry and expiry[0][0] <= now:
            _, v, key = heapq.heappop(expiry)
            if version[key] == v and key in self.rs:
                self.put(key, now)
        if now != self.memo_now:
            self.memo, self.memo_now = {}, now
        rank, recency, memo = self.rs.policy.rank, self.rs._recency, self.memo
        best, best_rank = _top(self.heaps.get(pool, []), version, evictable), None
        if best is not None:
            best_rank = rank(best, recency[best], now)
        for g, heap in self.groups.get(pool, {}).items():
            key = _top(heap, version, evictable)
            if key is None:
                continue
            known = memo.get((pool, g))  # a group head's rank, kept while nothing moved it
            if known is not None and known[0] == key and known[1] == version[key]:
                r = known[2]
            else:
                r = rank(key, recency[key], now)
                memo[pool, g] = (key, version[key], r)
            if best is None or r > best_rank:
                best, best_rank = key, r
        return best

    def _entry(self, key: Key, now: int) -> tuple:
        """(pool, group, heap entry, until) of key's rank from now on; a new version."""
        until, group, value = self.rs.policy.schedule(key, self.rs._recency[key], now)
        assert until > now, (key, now, until)
        v = self.version[key] = self.version.get(key, 0) + 1
        item = (tuple(map(neg, value)), v, key) if group is None else (value, v, key)
        return self.rs.pool_of(key), group, item, until


class _ScanIndex:
    """`policy.choose(candidates, now)` over the pool's evictable entries (ranking `scan`)."""

    def __init__(self, rs: ResidentSet):
        self.rs = rs

    def put(self, key: Key, now: int) -> None:
        pass

    used = hinted = drop = put

    def rebuild(self, now: int) -> None:
        pass

    def victim(self, pool: int, now: int, evictable: Evictable) -> Key | None:
        per_layer = self.rs.pool == "per_layer"
        cands = [k for k in self.rs._recency if (not per_layer or k[0] == pool)
                 and (evictable is None or evictable(k))]  # fmt: skip
        return self.rs.policy.choose(cands, now) if cands else None


_INDEXES = {
    "scan": _ScanIndex,
    "recency": _RecencyIndex,
    "static": _StaticIndex,
    "scheduled": _ScheduledIndex,
    "ages": AgesIndex,
}


def _compact(heap: list, version: dict) -> None:
    """Drop stale entries (a version that is no longer the key's)."""
    heap[:] = [item for item in heap if version[item[-1]] == item[-2]]
    heapq.heapify(heap)


def _top(heap: list, version: dict, evictable: Evictable) -> Key | None:
    """The first current, evictable key of a heap of (..., version, key); the rest stay."""
    aside, found = [], None
    while heap:
        item = heap[0]
        key = item[-1]
        if version[key] != item[-2]:
            heapq.heappop(heap)  # stale
            continue
        if evictable is None or evictable(key):
            found = key
            break
        aside.append(heapq.heappop(heap))
    for item in aside:
        heapq.heappush(heap, item)
    return found
