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
  ages       (LFRU) every score count / (age + 1) moves at every step, but keys of one count
             keep their order: buckets by count, walked while a bucket can still hold the
             lowest score (cache/ages.py).

Every index skips entries that are not evictable (loading or pinned) by setting them aside and
putting them back. Time (`now`) never goes backwards. tests/test_victim_heap.py replays random
and planted traces through both and asserts identical victims for every policy.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from operator import neg

from tensorbend.cache.admission import AdmitAll, prefetch_worth
from tensorbend.cache.ages import AgesIndex, Evictable
from tensorbend.cache.policies import INF, LRU, Key
from tensorbend.cache.resident import Placement, ResidentSet


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
        self._touch = None if _is_base(self.policy.touch, LRU.touch) else self.policy.touch
        adm_touch = self.admission.touch
        self._adm_touch = None if _is_base(adm_touch, AdmitAll.touch) else adm_touch
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


def _is_base(method, base) -> bool:
    """Whether a bound method is `base` itself (a no-op worth not calling)."""
    return getattr(method, "__func__", None) is base


class _StaticIndex:
    """One heap per pool of negated ranks [(-rank, version, key)], each at least the key's
    current rank: a use only lowers a rank, so a used key (its stored recency is stale) is
    re-ranked when it reaches the top; a top whose stored rank is current is the highest."""

    tracks_uses = False  # `used` does nothing (IndexedResidentSet skips it)

    def __init__(self, rs: ResidentSet):
        assert rs.policy.use_lowers_rank or rs.policy.ranking == "scheduled", rs.policy.name
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
            _compact(heap, self.version)

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
    """Ranks that hold until a known step (heap + calendar), and groups ranked by their head.

    `policy.schedule(key, recency, now)` -> (until, group, order). heaps[pool]: [(order,
    version, key)] for keys outside groups (order = the rank negated), each current until its
    step; groups[pool][g]: [(order, version, key)], the head ranks highest in g at every step;
    due: until -> [(version, key)], a calendar (steps come one by one; a heap would cost a
    log per use).

    Of a pool's groups only those whose head could outrank the best so far are ranked:
    heads[pool] holds (order, version, key, g) with, for every group, an entry at or below
    its lowest current order (pushed when a key becomes its head; a stale one is replaced by
    the group's head when it comes up), and `policy.group_bound(g, order, now)` bounds the
    first rank field of g's keys from that order on, falling as the order grows across the
    pool's groups. Walking heads in order stops at the first bound below the best rank; a
    group's top is ranked by `policy.group_rank(g, order, now)` (its `rank`, from the order),
    once per step unless it moved (a use, a placement, a hint of its group)."""

    tracks_uses = True

    def __init__(self, rs: ResidentSet):
        super().__init__(rs)
        self.groups: dict[int, dict[int, list]] = {}
        self.heads: dict[int, list] = {}
        self.due: dict[int, list] = {}  # step -> [(version, key)] whose rank runs out then
        self.done = -1  # due steps up to this one were handled
        self.bound = getattr(rs.policy, "group_bound", None)
        self.group_rank = getattr(rs.policy, "group_rank", None)
        self.memo: dict = {}  # (pool, group) -> (its top's entry, its rank) at memo_now
        self.memo_now = -1
        self.seen: tuple | None = None  # (forward, ahead, after_first) of the last forecast
        self.schedule, self.recency = rs.policy.schedule, rs._recency
        self.per_layer = rs.pool == "per_layer"
        self.limit = 4 * rs.capacity + 64  # entries in a heap before its stale ones go

    def put(self, key: Key, now: int) -> None:
        until, group, order = self.schedule(key, self.recency[key], now)
        assert until > now, (key, now, until)
        v = self.version[key] = self.version.get(key, 0) + 1
        item = (order, v, key)
        p = key[0] if self.per_layer else 0
        if group is None:
            heap = self.heaps.get(p) or self.heaps.setdefault(p, [])
        else:
            groups = self.groups.get(p) or self.groups.setdefault(p, {})
            heap = groups.get(group)
            if heap is None:
                heap = groups[group] = []
            if not heap or item < heap[0]:  # a new head (a lower one keeps its entry valid)
                heads = self.heads.get(p) or self.heads.setdefault(p, [])
                heapq.heappush(heads, (*item, group))
                if len(heads) > 4 * len(groups) + 16:  # (it is walked at every miss: kept small)
                    self._reheads(p)
        heapq.heappush(heap, item)
        if len(heap) > self.limit:
            _compact(heap, self.version)
        if until != INF:
            t = int(until) if until > self.done else self.done + 1  # (a float: earlier is safe)
            due = self.due.get(t)
            if due is None:
                self.due[t] = [(v, key)]
            else:
                due.append((v, key))

    used = put  # a use may raise a rank (NextUse) or move it in time

    def hinted(self, key: Key, now: int) -> None:
        # a hint, even of an absent key, may move its layer's group (Predicted: the visit)
        self.memo.pop((key[0] if self.per_layer else 0, key[0]), None)
        if key in self.recency:
            self.put(key, now)

    def rebuild(self, now: int) -> None:
        """A forecast arrived: the ranks it may have changed anew (`policy.forecast_changes`
        against a copy of the last forecast), or every rank when there is no such rule."""
        policy, seen = self.rs.policy, self.seen
        changes = getattr(policy, "forecast_changes", None)
        self.seen = policy.forward, [r[:] for r in policy.ahead], [r[:] for r in policy.after_first]
        if changes is None or seen is None:
            self.rebuild_all(now)
            return
        recency, version, due, done = self.rs._recency, self.version, self.due, self.done
        moved, until = changes(seen, now)
        for key in moved:
            if key in recency:
                self.put(key, now)
        for step, key in until:
            if key in recency:
                due.setdefault(step if step > done else done + 1, []).append((version[key], key))

    def rebuild_all(self, now: int) -> None:
        """Every rank anew: put's entries, heapified at once."""
        self.heaps, self.groups, self.heads, self.due = {}, {}, {}, {}
        for key in self.rs:
            p, group, item, until = self._entry(key, now)
            if group is None:
                self.heaps.setdefault(p, []).append(item)
            else:
                self.groups.setdefault(p, {}).setdefault(group, []).append(item)
            if until != INF:
                t = int(until) if until > self.done else self.done + 1
                self.due.setdefault(t, []).append((item[1], key))
        for heap in self.heaps.values():
            heapq.heapify(heap)
        for p, groups in self.groups.items():
            for heap in groups.values():
                heapq.heapify(heap)
            self._reheads(p)

    def victim(self, pool: int, now: int, evictable: Evictable) -> Key | None:
        version = self.version
        if now > self.done:  # the ranks that ran out at the steps since the last search
            due, recency, put = self.due, self.recency, self.put
            steps = range(self.done + 1, now + 1)
            if len(steps) > 64 + len(due):  # a long gap: the due steps alone
                steps = sorted(t for t in due if t <= now)
            for t in steps:
                for v, key in due.pop(t, ()):
                    if version[key] == v and key in recency:
                        put(key, now)
            self.done = now
        rank, recency = self.rs.policy.rank, self.rs._recency
        best, best_rank = _top(self.heaps.get(pool, []), version, evictable), None
        if best is not None:
            best = best[-1]
            best_rank = rank(best, recency[best], now)
        heads = self.heads.get(pool)
        if not heads:
            return best
        groups, bound, aside, seen = self.groups[pool], self.bound, [], set()
        if now != self.memo_now:
            self.memo, self.memo_now = {}, now
        memo, group_rank = self.memo, self.group_rank
        while heads:
            value, v, key, g = entry = heads[0]
            if best is not None and bound(g, value, now) < best_rank[0]:
                break  # no key of this or any later group outranks best
            heapq.heappop(heads)
            if g in seen:
                continue  # a duplicate
            heap = groups[g]
            while heap and version[heap[0][2]] != heap[0][1]:
                heapq.heappop(heap)  # stale
            if not heap:
                continue  # an empty group needs no entry
            if heap[0][2] != key or heap[0][1] != v:
                heapq.heappush(heads, (*heap[0], g))  # its head now: back in order
                continue
            aside.append(entry)
            seen.add(g)
            item = _top(heap, version, evictable)
            if item is not None:
                known = memo.get((pool, g))  # its rank this step, unless it moved since
                if known is not None and known[0] is item:
                    r = known[1]
                else:
                    r = group_rank(g, item[0], now)
                    memo[pool, g] = item, r
                if best is None or r > best_rank:
                    best, best_rank = item[-1], r
        for entry in aside:
            heapq.heappush(heads, entry)
        return best

    def _entry(self, key: Key, now: int) -> tuple:
        """(pool, group, heap entry, until) of key's rank from now on; a new version."""
        until, group, order = self.schedule(key, self.recency[key], now)
        assert until > now, (key, now, until)
        v = self.version[key] = self.version.get(key, 0) + 1
        return self.rs.pool_of(key), group, (order, v, key), until

    def _reheads(self, p: int) -> None:
        """heads[p] anew: each group's current head."""
        heads, version = [], self.version
        for g, heap in self.groups.get(p, {}).items():
            while heap and version[heap[0][2]] != heap[0][1]:
                heapq.heappop(heap)  # stale
            if heap:
                heads.append((*heap[0], g))
        heapq.heapify(heads)
        self.heads[p] = heads


class _ScanIndex:
    """`policy.choose(candidates, now)` over the pool's evictable entries (ranking `scan`)."""

    tracks_uses = False

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


def _top(heap: list, version: dict, evictable: Evictable) -> tuple | None:
    """The first current entry of an evictable key in a heap of (..., version, key); the rest
    stay."""
    aside, found = [], None
    while heap:
        item = heap[0]
        key = item[-1]
        if version[key] != item[-2]:
            heapq.heappop(heap)  # stale
            continue
        if evictable is None or evictable(key):
            found = item
            break
        aside.append(heapq.heappop(heap))
    for entry in aside:
        heapq.heappush(heap, entry)
    return found
