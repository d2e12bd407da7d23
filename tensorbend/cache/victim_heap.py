"""Indexed victim search: the resident set's victims without ranking every entry at each miss.

Usage (a drop-in for `ResidentSet`, same arguments, same victims):
    >>> from tensorbend.offload.policies import LFRU
    >>> rs = IndexedResidentSet(capacity=2, num_layers=1, policy=LFRU())
    >>> misses = [step for step, e in enumerate([0, 0, 0, 1, 2, 1, 0]) if not rs.access((0, e), step)]
    >>> misses, sorted(rs)
    ([0, 3, 4, 5], [(0, 0), (0, 1)])

`offload.resident.ResidentSet.victim` is the reference: the evictable entry of the pool with
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
  ages       (LFRU) every score count / (age + 1) moves at every step; see `_Tournament`.

Every index skips entries that are not evictable (loading or pinned) by setting them aside and
putting them back. Time (`now`) never goes backwards. tests/test_victim_heap.py replays random
and planted traces through both and asserts identical victims for every policy.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from operator import neg

from tensorbend.offload.policies import INF, Key
from tensorbend.offload.resident import ResidentSet

Evictable = Callable[[Key], bool] | None


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
        if key in self._recency:
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
    current rank: a use only lowers a rank, so a used key is re-ranked when it reaches the top
    (a top whose stored rank is current is the highest)."""

    def __init__(self, rs: ResidentSet):
        self.rs = rs
        self.heaps: dict[int, list] = {}
        self.version: dict[Key, int] = {}

    def put(self, key: Key, now: int) -> None:
        """Key placed, or its rank changed otherwise than by a use."""
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
        self.version[key] += 1  # its entries go stale

    def rebuild(self, now: int) -> None:
        for key in self.rs:
            self.put(key, now)

    def victim(self, pool: int, now: int, evictable: Evictable) -> Key | None:
        heap, version = self.heaps.get(pool, []), self.version
        aside, found = [], None
        while heap:
            neg, v, key = heap[0]
            if version[key] != v:
                heapq.heappop(heap)  # stale
                continue
            current = self._neg_rank(key, now)
            if current != neg:
                heapq.heapreplace(heap, (current, v, key))  # used since: lower now
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
        self.rs = rs
        self.order: dict[int, OrderedDict] = {}
        self.late: dict[int, list] = {}  # pool -> [(recency, key)]

    def put(self, key: Key, now: int) -> None:
        p, recency = self.rs.pool_of(key), self.rs._recency[key]
        order = self.order.get(p) or self.order.setdefault(p, OrderedDict())
        if not order or recency > self.rs._recency[next(reversed(order))]:
            order[key] = None
        else:
            heapq.heappush(self.late.setdefault(p, []), (recency, key))

    def used(self, key: Key, now: int) -> None:
        order = self.order[self.rs.pool_of(key)]
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

    def put(self, key: Key, now: int) -> None:
        recency = self.rs._recency[key]
        until, group, value = self.rs.policy.schedule(key, recency, now)
        assert until > now, (key, now, until)
        v = self.version[key] = self.version.get(key, 0) + 1
        p = self.rs.pool_of(key)
        if group is None:
            heap = self.heaps.get(p) or self.heaps.setdefault(p, [])
            heapq.heappush(heap, (tuple(map(neg, value)), v, key))
        else:
            heap = self.groups.setdefault(p, {}).get(group) or self.groups[p].setdefault(group, [])
            heapq.heappush(heap, (value, v, key))
        if len(heap) > 4 * self.rs.capacity + 64:
            _compact(heap, self.version)
        if until != INF:
            heapq.heappush(self.expiry, (until, v, key))

    used = put  # a use may raise a rank (NextUse) or move it in time

    def hinted(self, key: Key, now: int) -> None:
        self.memo.clear()  # a hint may move a whole group (Predicted: its layer's next visit)
        if key in self.rs:
            self.put(key, now)

    def rebuild(self, now: int) -> None:
        self.heaps, self.groups, self.expiry, self.memo = {}, {}, [], {}
        super().rebuild(now)

    def victim(self, pool: int, now: int, evictable: Evictable) -> Key | None:
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


class _AgesIndex:
    """LFRU: one `_Tournament` per pool over the keys' (count, last use, recency). A use only
    lowers a rank at every later step (more uses, a later last use, a later recency), so a
    used key's line is refreshed when it wins the tournament, as in _StaticIndex."""

    def __init__(self, rs: ResidentSet):
        self.rs = rs
        self.trees: dict[int, _Tournament] = {}

    def put(self, key: Key, now: int) -> None:
        p = self.rs.pool_of(key)
        tree = self.trees.get(p) or self.trees.setdefault(p, _Tournament(self.rs.pool_capacity(p)))
        tree.set(key, self._line(key), now)

    def used(self, key: Key, now: int) -> None:
        pass

    def hinted(self, key: Key, now: int) -> None:
        pass

    def rebuild(self, now: int) -> None:
        pass

    def drop(self, key: Key, now: int) -> None:
        self.trees[self.rs.pool_of(key)].clear(key, now)

    def victim(self, pool: int, now: int, evictable: Evictable) -> Key | None:
        tree = self.trees.get(pool)
        return None if tree is None else tree.best(now, evictable, self._line)

    def _line(self, key: Key) -> tuple[int, int, int]:
        return (*self.rs.policy.line(key), self.rs._recency[key])


class _Tournament:
    """A kinetic tournament: the lowest LFRU score c / (now - l + 1) among lines (c, l, r).

    Exact formulation: at step t the score order of a and b is the sign of
        g(t) = (c_a - c_b) * (t + 1) + c_b * l_a - c_a * l_b      (a ranks lower iff g < 0)
    (cross-multiplied, denominators > 0), ties (g = 0) by recency r. g is linear in t, so a
    duel between two lines changes its winner at most once, at a step computed exactly in
    integers; a never-used key is (0, 0), score 0 at every step. Each node of a binary tree over
    the pool's slots holds the winner of its subtree and `until`, the first step at which its
    duel or one below it can change. A query at `now` replays only the nodes with until <= now
    (children first); an insert or removal replays its path. The root is then the entry a
    scan of `LFRU.rank` (float scores) picks: distinct fractions with c * (age + 1) < 2**51 stay
    distinct and in order as doubles, and equal ones are equal.
    """

    def __init__(self, capacity: int):
        n = 1
        while n < max(capacity, 1):
            n *= 2
        self.n = n
        self.slot: dict[Key, int] = {}
        self.free = list(range(n - 1, -1, -1))
        self.key: list[Key | None] = [None] * n
        self.c, self.last, self.r = [0] * n, [0] * n, [0] * n
        self.win = [-1] * (2 * n)  # node -> winning slot (-1: empty); leaves at n + slot
        self.until = [INF] * (2 * n)

    def set(self, key: Key, line: tuple[int, int, int], now: int) -> None:
        """Key's line (count, last use, recency), new or changed."""
        i = self.slot.get(key)
        if i is None:
            i = self.slot[key] = self.free.pop()
        self.key[i] = key
        self.c[i], self.last[i], self.r[i] = line
        self._path(i, True, now)

    def clear(self, key: Key, now: int) -> None:
        i = self.slot.pop(key)
        self.key[i] = None
        self.free.append(i)
        self._path(i, False, now)

    def best(self, now: int, evictable: Evictable, line_of) -> Key | None:
        """The lowest-scoring evictable key at step now (None: none); `line_of(key)` is the
        current line, which a stored line of a key used since can only undercut."""
        self._refresh(now)
        aside, found = [], None
        while (w := self.win[1]) >= 0:
            key = self.key[w]
            line = line_of(key)
            if line != (self.c[w], self.last[w], self.r[w]):
                self.set(key, line, now)
                continue
            if evictable is None or evictable(key):
                found = key
                break
            aside.append(w)
            self._path(w, False, now)
        for w in aside:
            self._path(w, True, now)
        return found

    def _path(self, i: int, present: bool, now: int) -> None:
        """Leaf i changed: replay its ancestors, up to the first whose duel came out as before
        with another winner (a node's winner and until, computed at any earlier step, hold
        for every step before until: the nodes above it are still right)."""
        win, until, pull = self.win, self.until, self._pull
        node = self.n + i
        win[node] = i if present else -1
        node //= 2
        while node:
            old = win[node], until[node]
            pull(node, now)
            if win[node] == old[0] != i and until[node] == old[1]:
                return
            node //= 2

    def _refresh(self, now: int) -> None:
        until, n = self.until, self.n
        if until[1] > now:
            return
        stack, order = [1], []
        while stack:
            node = stack.pop()
            if node < n and until[node] <= now:
                order.append(node)
                stack += (2 * node, 2 * node + 1)
        pull = self._pull
        for node in reversed(order):  # children before parents
            pull(node, now)

    def _pull(self, node: int, now: int) -> None:
        """Node's winner and until from its children's at step now. The duel in integers
        (class docstring): for the winner w over v, g_w(t) = slope * (t + 1) + base with slope
        = c_w - c_v; w wins for ever if slope <= 0, else until the first t with g_w(t) > 0,
        or g_w(t) >= 0 when w has the larger recency (it then wins only while g_w < 0)."""
        win, until = self.win, self.until
        a, b = win[2 * node], win[2 * node + 1]
        ua, ub = until[2 * node], until[2 * node + 1]
        below = ua if ua < ub else ub
        if a < 0 or b < 0:
            win[node], until[node] = (a if a > b else b), below
            return
        c, last, r = self.c, self.last, self.r
        ca, cb, la, lb = c[a], c[b], last[a], last[b]
        g = (ca - cb) * (now + 1) + cb * la - ca * lb
        if not (g < 0 or (g == 0 and r[a] < r[b])):
            a, b, ca, cb, la, lb = b, a, cb, ca, lb, la
        win[node] = a
        slope = ca - cb
        if slope <= 0:
            until[node] = below
            return
        base = cb * la - ca * lb
        t = -(base // slope) - 1 if r[a] > r[b] else (-base) // slope  # first g >= 0 / g > 0
        until[node] = t if t < below else below


_INDEXES = {
    "recency": _RecencyIndex,
    "static": _StaticIndex,
    "scheduled": _ScheduledIndex,
    "ages": _AgesIndex,
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
