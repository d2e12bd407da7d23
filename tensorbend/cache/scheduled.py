"""The scheduled index: ranks that hold until a known step, and groups that move together.

Usage (what `cache.victim_heap.IndexedResidentSet` builds for a policy with ranking
"scheduled": NextUse and its bounded oracles, Predicted, Reuse):
    >>> from tensorbend.cache.policies import NextUse
    >>> from tensorbend.cache.victim_heap import IndexedResidentSet
    >>> steps = {(0, 0): [0, 3], (0, 1): [1, 9], (0, 2): [2, 4]}
    >>> rs = IndexedResidentSet(capacity=3, num_layers=1, policy=NextUse(steps, 1))
    >>> for step, e in enumerate([0, 1, 2]):
    ...     _ = rs.access((0, e), step)
    >>> rs.victim((0, 3), 2)                 # next used at 3, 9, 4: (0, 1) is needed last
    (0, 1)

`policy.schedule(key, recency, now)` says what the key's rank is and until which step it
stays so (a use, a placement, a hint or a forecast asks again). Ranks that move at every step
move together in groups whose members keep one order among themselves (Predicted: one layer's
unpredicted experts, whose estimates keep the order of their log counts; Reuse: the experts
whose forecast has passed, all "next used at now + 1", ties by recency): each group is a heap
in that order, so only its head can be the victim. The victim is the highest rank among the
heap's top and those heads; heads are walked by their order and the walk stops at the first
whose bound (`policy.group_bound`) is below the best rank, which for Predicted leaves a few of
the L layers' heads to rank.
"""

from __future__ import annotations

import heapq
from heapq import heappush
from math import ceil

from tensorbend.cache.heaps import compact, first_live
from tensorbend.cache.policies import INF, Key
from tensorbend.cache.resident import Evictable, ResidentSet


class ScheduledIndex:
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
        self.rs = rs
        self.pools = range(len(rs._size))
        self.heaps: list[list] = [[] for _ in self.pools]  # per pool
        self.version: dict[Key, int] = {}
        self.groups: list[dict[int, list]] = [{} for _ in self.pools]
        self.heads: list[list] = [[] for _ in self.pools]
        self.due: dict[int, list] = {}  # step -> [(version, key)] whose rank runs out then
        self.done = -1  # due steps up to this one were handled
        self.bound = getattr(rs.policy, "group_bound", None)
        self.group_rank = getattr(rs.policy, "group_rank", None)
        self.memo: dict = {}  # (pool, group) -> (its top's entry, its rank) at memo_now
        self.memo_now = -1
        self.seen: tuple | None = None  # (forward, ahead, after_first) of the last forecast
        self.pending = False  # a forecast not applied yet (at the next victim search)
        self.put_pending: dict[Key, None] = {}  # keys ranked meanwhile (by a newer forecast)
        self.hinted_keys: dict[Key, None] = {}  # hinted since the last search (applied there)
        self.schedule, self.recency = rs.policy.schedule, rs._recency
        self.per_layer = rs.pool == "per_layer"
        self.limit = 4 * rs.capacity + 64  # entries in a heap before its stale ones go
        version = self.version

        def stale(item: tuple) -> bool:  # an entry whose key was re-ranked or left since
            return version[item[-1]] != item[-2]

        self.stale = stale

    def put(self, key: Key, now: int) -> None:
        if self.pending:
            self.put_pending[key] = None
        until, group, order = self.schedule(key, self.recency[key], now)
        assert until > now, (key, now, until)
        version = self.version
        v = version[key] = version.get(key, 0) + 1
        item = (order, v, key)
        p = key[0] if self.per_layer else 0
        if group is None:
            heap = self.heaps[p]
        else:
            groups = self.groups[p]
            heap = groups.get(group)
            if heap is None:
                heap = groups[group] = []
            if not heap or item < heap[0]:  # a new head (a lower one keeps its entry valid)
                heads = self.heads[p]
                heappush(heads, (*item, group))
                if len(heads) > 4 * len(groups) + 16:  # (it is walked at every miss: kept small)
                    self._reheads(p)
        heappush(heap, item)
        if len(heap) > self.limit:
            compact(heap, version)
        if until != INF:
            t = ceil(until)  # the first step the rank may differ (steps are integers)
            if t <= self.done:
                t = self.done + 1
            due = self.due.get(t)
            if due is None:
                self.due[t] = [(v, key)]
            else:
                due.append((v, key))

    used = put  # a use may raise a rank (NextUse) or move it in time

    def drop(self, key: Key, now: int) -> None:
        self.version[key] += 1  # its entries go stale

    def hinted(self, key: Key, now: int) -> None:
        """A hint moved key's rank (the policy knows it already): re-ranked at the next victim
        search (`_apply_hints`), like a forecast. Hints come on the compute thread, several
        per MoE layer; a victim search runs on an I/O thread, at a miss (never, when the
        cache holds everything), and ranks the key from the policy as it is then, which is
        what re-ranking it at every hint would have left."""
        self.hinted_keys[key] = None

    def _apply_hints(self, now: int) -> None:
        keys, self.hinted_keys = self.hinted_keys, {}
        for key in keys:
            # a hint, even of an absent key, may move its layer's group (Predicted: the visit)
            self.memo.pop((key[0] if self.per_layer else 0, key[0]), None)
            if key in self.recency:
                self.put(key, now)

    def rebuild(self, now: int) -> None:
        """A forecast arrived: applied at the next victim search (`_apply_forecast`). A
        forecast comes on the compute thread once per forward, under the cache's lock; a
        victim is asked for on an I/O thread, at a miss, often forwards later (or never, when
        the cache holds everything), so the work leaves the critical path, and several
        forecasts in between cost one application. Uses, placements and hints meanwhile rank
        their keys under the policy's newest forecast, as a fresh entry would; those keys are
        ranked again when it is applied (a later forecast may have come since)."""
        self.pending = True

    def _apply_forecast(self, now: int) -> None:
        """The ranks the newest forecast may have changed anew (`policy.forecast_changes`
        against a copy of the last applied one), or every rank when there is no such rule."""
        self.pending = False
        policy, seen = self.rs.policy, self.seen
        ranked_meanwhile, self.put_pending = self.put_pending, {}
        changes = getattr(policy, "forecast_changes", None)
        self.seen = policy.forward, [r[:] for r in policy.ahead], [r[:] for r in policy.after_first]
        if changes is None or seen is None:
            self.rebuild_all(now)
            return
        recency, version, due, done = self.rs._recency, self.version, self.due, self.done
        moved, until = changes(seen, now)
        for key in (*moved, *ranked_meanwhile):  # (ranked by a forecast older than this one)
            if key in recency:
                self.put(key, now)
        for step, key in until:
            if key in recency:
                due.setdefault(step if step > done else done + 1, []).append((version[key], key))

    def rebuild_all(self, now: int) -> None:
        """Every rank anew: put's entries, heapified at once."""
        self.heaps, self.due = [[] for _ in self.pools], {}
        self.groups, self.heads = [{} for _ in self.pools], [[] for _ in self.pools]
        for key in self.rs:
            p, group, item, until = self._entry(key, now)
            if group is None:
                self.heaps[p].append(item)
            else:
                self.groups[p].setdefault(group, []).append(item)
            if until != INF:
                t = max(ceil(until), self.done + 1)
                self.due.setdefault(t, []).append((item[1], key))
        for heap in self.heaps:
            heapq.heapify(heap)
        for p, groups in enumerate(self.groups):
            for heap in groups.values():
                heapq.heapify(heap)
            self._reheads(p)

    def victim(self, pool: int, now: int, evictable: Evictable) -> Key | None:
        if self.pending:
            self._apply_forecast(now)
        if self.hinted_keys:
            self._apply_hints(now)
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
        best, best_rank = first_live(self.heaps[pool], self.stale, evictable), None
        if best is not None:
            best = best[-1]
            best_rank = rank(best, recency[best], now)
        heads = self.heads[pool]
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
            item = first_live(heap, self.stale, evictable)
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
        for g, heap in self.groups[p].items():
            while heap and version[heap[0][2]] != heap[0][1]:
                heapq.heappop(heap)  # stale
            if heap:
                heads.append((*heap[0], g))
        heapq.heapify(heads)
        self.heads[p] = heads
