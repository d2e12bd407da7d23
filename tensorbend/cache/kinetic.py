"""A kinetic tournament: the lowest LFRU score count / (age + 1), which moves at every step.

Usage (what `cache.ages.AgesIndex` holds per pool, over the heads of its count buckets):
    >>> t = Tournament(capacity=2)
    >>> t.set("a", (3, 0, 1), now=0)   # (count, last use, recency): 3 uses, the last at step 0
    >>> t.set("b", (1, 4, 2), now=4)
    >>> t.root(now=4)
    'a'
    >>> t.until[1]                     # the first step at which b's score is the lower
    6

At step t, a scores 3 / (t + 1) and b 1 / (t - 3): at step 4, 3/5 against 1/1: a leaves; at
step 5, 3/6 against 1/2, a tie, which goes to the least recent (a); from step 6 on (3/7
against 1/3) b leaves. The root knows that from the lines alone, without being asked again.
"""

from __future__ import annotations

from tensorbend.cache.policies import INF, Key


class Tournament:
    """A kinetic tournament: the lowest LFRU score c / (now - l + 1) among lines (c, l, r).

    Exact formulation: at step t the score order of a and b is the sign of
        g(t) = (c_a - c_b) * (t + 1) + c_b * l_a - c_a * l_b      (a ranks lower iff g < 0)
    (cross-multiplied, denominators > 0), ties (g = 0) by recency r. g is linear in t, so a
    duel between two lines changes its winner at most once, at a step computed exactly in
    integers; a never-used key is (0, 0), score 0 at every step. Each node of a binary tree over
    the pool's slots holds the winner of its subtree and `until`, the first step at which its
    duel or one below it can change. A query at `now` replays only the nodes with until <= now
    (children first); an insert or removal replays its path up to the first node that came
    out as before. The root is then the entry a scan of `LFRU.rank` (float scores) picks:
    a/b and c/d with a * d, c * b < 2**52 differ by more than their rounding when they differ,
    and equal fractions round alike.
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

    def root(self, now: int) -> Key | None:
        """The key of the lowest score at step now (None: empty)."""
        self._refresh(now)
        w = self.win[1]
        return None if w < 0 else self.key[w]

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
