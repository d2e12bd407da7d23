"""LFRU's victim, whose score count / (age + 1) moves at every step: count buckets, heads in a
kinetic tournament.

Usage (what `cache.victim_heap.IndexedResidentSet` builds for a policy with ranking "ages"):
    >>> from tensorbend.cache.policies import LFRU
    >>> from tensorbend.cache.victim_heap import IndexedResidentSet
    >>> rs = IndexedResidentSet(capacity=3, num_layers=1, policy=LFRU())
    >>> for step, e in enumerate([0, 0, 0, 1, 2]):
    ...     _ = rs.access((0, e), step)
    >>> rs._index.victim(0, 6, None)   # (0, 1): 1 use at step 3 scores 1/4 < 3/5 and 1/3
    (0, 1)

LFRU (`policies.LFRU`) evicts the lowest score c / (now - l + 1) of a key used c times, last
at step l, ties to the least recent (recency r); a key never used scores 0. Keys of one count
c are in the order of their scores at every step: by (l, r), the oldest last use first (two
distinct l never give the same float c / (now - l + 1) for steps < 2**40, and one l gives one
score: then r decides). So each pool keeps, per count, its keys in that order (a bucket), and
the victim is the lowest (score, r) among the buckets' first evictable keys: never-used keys
(score 0, by recency) first, then the root of a `kinetic.Tournament` over the heads of the
other buckets (one leaf per count), whose duels change winner at most once.

A use moves its key to the end of the next count's bucket ((now, r) is the latest there): the
tournament replays a leaf when a bucket gets a leaf (filled) or an earlier head (a late
placement); a head that leaves (used or evicted) only ever gives way to a later key, so its
leaf may lag behind, never lead, and is caught up (or cleared, the bucket empty) when it comes
up as the root. A placement whose (l, r) is not after its
bucket's last key (a demand placed after later uses of its step, a prefetch of a key used long
ago) waits in the bucket's heap instead.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from tensorbend.cache.heaps import first_live
from tensorbend.cache.kinetic import Tournament
from tensorbend.cache.policies import Key
from tensorbend.cache.resident import Evictable, ResidentSet


class AgesIndex:
    """Per pool: count -> `_Ordered` bucket of its keys, and a Tournament over the heads."""

    tracks_uses = True

    def __init__(self, rs: ResidentSet):
        assert rs.policy.ranking == "ages", rs.policy.name
        self.rs = rs
        self.per_layer = rs.pool == "per_layer"
        self.where: dict[Key, int] = {}  # key -> its count's bucket
        self.buckets: dict[int, dict[int, _Ordered]] = {}  # pool -> count -> keys
        self.trees: dict[int, Tournament] = {}  # pool -> leaves: counts >= 1, lines of heads
        self.leaf: dict[int, dict[int, tuple]] = {}  # pool -> count -> its leaf's (l, r)

    def put(self, key: Key, now: int) -> None:
        p = key[0] if self.per_layer else 0
        c, last = self.rs.policy.line(key)
        buckets = self.buckets.get(p)
        if buckets is None:
            buckets = self.buckets[p] = {}
            self.trees[p] = Tournament(self.rs.pool_capacity(p))
            self.leaf[p] = {}
        bucket = buckets.get(c) or buckets.setdefault(c, _Ordered())
        line = (last, self.rs._recency[key])
        bucket.add(key, line)
        self.where[key] = c
        if c:
            held = self.leaf[p].get(c)
            if held is None or line < held:  # a new head, before what the leaf holds
                self._set(p, c, line, now)

    def used(self, key: Key, now: int) -> None:
        """A hit: count + 1, last use now, the newest recency: the end of the next bucket.
        The bucket it leaves keeps its leaf (a head that left only ever gives way to a later
        one: the leaf may lag, never lead; `victim` catches it up when it comes up)."""
        p = key[0] if self.per_layer else 0
        where = self.where
        c = where[key]
        buckets = self.buckets[p]
        buckets[c].discard(key)
        c += 1
        nxt = buckets.get(c)
        if nxt is None:
            nxt = buckets[c] = _Ordered()
        line = (now, self.rs._recency[key])
        nxt.append(key, line)
        where[key] = c
        if c not in self.leaf[p]:
            self._set(p, c, line, now)

    def hinted(self, key: Key, now: int) -> None:
        pass

    def rebuild(self, now: int) -> None:
        pass

    def drop(self, key: Key, now: int) -> None:
        p = key[0] if self.per_layer else 0
        self.buckets[p][self.where.pop(key)].discard(key)  # (its leaf may lag: `used`)

    def victim(self, pool: int, now: int, evictable: Evictable) -> Key | None:
        buckets = self.buckets.get(pool)
        if not buckets:
            return None
        zero = buckets.get(0)
        if zero:
            key = zero.first(evictable)
            if key is not None:
                return key  # score 0, the least recent of those
        tree, leaf = self.trees[pool], self.leaf[pool]
        stand: dict[int, Key] = {}  # count -> the evictable key its leaf holds for now
        aside, found = [], None
        while (c := tree.root(now)) is not None:
            key = stand.get(c)
            if key is None:
                bucket = buckets[c]
                key = bucket.first(None)
                if key is None:  # emptied since: its leaf goes
                    del leaf[c]
                    tree.clear(c, now)
                    continue
                line = bucket.order[key]
                if line != leaf[c]:  # its head left since: the leaf catches up
                    self._set(pool, c, line, now)
                    continue
                if evictable is not None and not evictable(key):
                    # a pinned or loading head: the bucket's first evictable key stands in
                    aside.append(c)
                    other = bucket.first(evictable)
                    if other is None:
                        tree.clear(c, now)
                    else:
                        stand[c] = other
                        tree.set(c, (c, *bucket.order[other]), now)
                    continue
            found = key
            break
        for c in aside:  # leaves back to their heads
            tree.set(c, (c, *leaf[c]), now)
        return found

    def _set(self, p: int, c: int, line: tuple, now: int) -> None:
        """Bucket c's leaf holds `line` (at or before its head's); when the tree is full, the
        leaves of emptied buckets go first (fewer non-empty buckets than slots)."""
        tree, leaf = self.trees[p], self.leaf[p]
        if c not in leaf and not tree.free:
            buckets = self.buckets[p]
            for gone in [g for g in leaf if not buckets[g]]:
                del leaf[gone]
                tree.clear(gone, now)
        leaf[c] = line
        tree.set(c, (c, *line), now)


class _Ordered:
    """Keys in the order of a sortable value: an OrderedDict of those appended in order, and
    a heap of the others ((value, key), stale once the key left or moved)."""

    __slots__ = ("order", "inline", "late")

    def __init__(self):
        self.order: dict[Key, tuple] = {}  # key -> value, every key held
        self.inline: OrderedDict[Key, None] = OrderedDict()  # values rising
        self.late: list = []

    def __bool__(self) -> bool:
        return bool(self.order)

    def append(self, key: Key, value: tuple) -> None:
        """Key, whose value is after every value held."""
        self.order[key] = value
        self.inline[key] = None

    def add(self, key: Key, value: tuple) -> None:
        inline = self.inline
        if not inline or value > self.order[next(reversed(inline))]:
            self.append(key, value)
        else:
            self.order[key] = value
            heapq.heappush(self.late, (value, key))

    def discard(self, key: Key) -> None:
        if self.order.pop(key, None) is not None:
            self.inline.pop(key, None)  # (a late key's heap entry goes stale)

    def first(self, evictable: Evictable) -> Key | None:
        """The evictable key of the lowest value (None: none)."""
        order, inline, late = self.order, self.inline, self.late
        found = None
        for k in inline:
            if evictable is None or evictable(k):
                found = k
                break
        if not late:
            return found

        def stale(item: tuple) -> bool:  # its key left, or moved since
            return item[1] in inline or order.get(item[1]) != item[0]

        item = first_live(late, stale, evictable)
        other = None if item is None else item[1]
        if other is None or (found is not None and order[found] < order[other]):
            return found
        return other
