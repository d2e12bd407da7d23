"""Eviction by estimated next use: `Predicted` (the within-token predictors' hints, else use
rates) and `Reuse` (Belady on the cross-token horizon's forecast of each next use).

Usage (what policy `prefetch` builds, cache/config.py; the interface is cache/policies.py's):
    >>> from tensorbend.cache.resident import ResidentSet
    >>> rs = ResidentSet(capacity=2, num_layers=1, policy=Predicted(1))
    >>> [rs.access((0, e), step) for step, e in enumerate([0, 1, 0, 2, 0])]
    [False, False, True, False, True]

Both rank (next use, tie, -recency), where tie is -inf for a predicted or forecast use (ties:
least recent, as everywhere) and -log(decayed count) for an estimate from use rates, so that
of two equal estimates (only rounding makes two distinct counts equal) the less used leaves
first. Their ranking is `scheduled` (cache/scheduled.py indexes them).
"""

from __future__ import annotations

from itertools import compress
from math import ceil, exp, log
from operator import ne
from typing import ClassVar

from tensorbend.cache.oracle import INF, Key
from tensorbend.cache.policies import LRU, Ranking


class Predicted(LRU):
    """Evict the farthest *estimated* next use; keep what is predicted soon.

    A predicted expert (`hint(key, step)`, step not passed yet) is next used at that step. Any
    other expert of MoE layer m can next be used when layer m comes round again, which is
    one forward later if a prediction for that visit left it out; we stretch that visit by the
    odds against use, (1 - p) / p visits, where p is the expert's recent use rate per visit
    (decayed count, `decay` per forward). Without predictions this is a layer-cycle-aware LFU.

    The decayed count is kept as its logarithm referred to step 0 (count at step t =
    exp(log_count + t * log(decay) / L)): it then stays constant between uses, and at every step
    the estimates of one layer's unpredicted experts are in the order of their log counts
    (the estimate is a non-increasing function of the count; every operation on the way is
    monotone in IEEE arithmetic). `cache/victim_heap.py` relies on that order.
    """

    name = "predicted"
    ranking: ClassVar[Ranking] = "scheduled"

    def __init__(self, num_layers: int, decay: float = 0.9):
        assert 0.0 < decay <= 1.0, decay
        self.L, self.decay = num_layers, decay
        self._per_step = log(decay) / num_layers  # log of the decay of a count per step
        self.hints: dict[Key, int] = {}
        self.layer_hint: dict[int, int] = {}  # m -> latest predicted step of layer m
        self.log_count: dict[Key, float] = {}  # key -> log(decayed count) referred to step 0
        self._clock = -1  # latest step seen: hints at or before it have passed
        self._reach_at, self._reach = None, 0

    def touch(self, key: Key, now: int) -> None:
        if now > self._clock:
            self._clock = now
        g = self.log_count.get(key)  # (the count inline: every use calls it)
        count = 0.0 if g is None else exp(g + now * self._per_step)
        self.log_count[key] = log(count + 1.0) - now * self._per_step

    def hint(self, key: Key, when: int) -> None:
        old = self.hints.get(key)
        if old is None or old <= self._clock or when < old:  # the earliest pending prediction
            self.hints[key] = when
        self.layer_hint[key[0]] = max(when, self.layer_hint.get(key[0], -1))
        self._reach_at = None  # (`group_bound`'s reach, for the step it was computed at)

    def hint_many(self, hints: list[tuple[Key, int]]) -> None:
        hints_d, layer_hint, clock = self.hints, self.layer_hint, self._clock  # (hint, inline)
        for key, when in hints:
            old = hints_d.get(key)
            if old is None or old <= clock or when < old:
                hints_d[key] = when
            layer_hint[key[0]] = max(when, layer_hint.get(key[0], -1))
        self._reach_at = None

    def next_use(self, key: Key, now: int) -> float:
        h = self.hints.get(key)
        if h is not None and h > now:
            return h
        return self._estimate(key, now)

    def rank(self, key: Key, recency: int, now: int) -> tuple:
        h = self.hints.get(key)
        if h is not None and h > now:
            return (h, -INF, -recency)
        return (self._estimate(key, now), -self.log_count.get(key, -INF), -recency)

    def schedule(self, key: Key, recency: int, now: int) -> tuple[float, int | None, tuple]:
        """(until, group, order): a predicted key's rank is -order until its step; the others
        move with their layer's group m, where `order` orders them (the lowest log count,
        then the least recent, ranks highest in the group at every step)."""
        h = self.hints.get(key)
        if h is not None and h > now:
            return h, None, (-h, INF, recency)  # the rank (h, -INF, -recency), negated
        return INF, key[0], (self.log_count.get(key, -INF), recency)

    def _estimate(self, key: Key, now: int) -> float:
        m, L = key[0], self.L
        visit = now - now % L + m
        if visit <= now:
            visit += L
        if self.layer_hint.get(m, -1) >= visit:
            visit += L  # the predicted set for that visit excludes this expert
        return visit + self._odds(self.log_count.get(key), now)

    def group_bound(self, group: int, value: tuple, now: int) -> float:
        """For `cache/victim_heap.py`: at least the first rank field of every key of layer
        `group` whose group value is `value` or after it (a larger log count). The next
        visit is at most now + L, one predicted without the key one visit later (`_reach`),
        and the odds only fall as the count rises."""
        if self._reach_at != now:
            self._reach_at, self._reach = now, self._farthest_visit(now)
        return (now + self._reach) + self._odds(value[0], now)

    def _farthest_visit(self, now: int) -> int:
        """The latest next visit of any layer, less now: L, or more where a prediction for
        the layer's next visit left some of its experts out (their visit one later)."""
        L, reach = self.L, self.L
        for m, h in self.layer_hint.items():
            if h > now:
                visit = now - now % L + m
                if visit <= now:
                    visit += L
                if h >= visit and visit - now + L > reach:
                    reach = visit - now + L
        return reach

    def group_rank(self, group: int, order: tuple, now: int) -> tuple:
        """`rank` of the key of layer `group` whose group order is (log count, recency)."""
        g, recency = order
        L = self.L
        visit = now - now % L + group
        if visit <= now:
            visit += L
        if self.layer_hint.get(group, -1) >= visit:
            visit += L
        return (visit + self._odds(g, now), -g, -recency)

    def _odds(self, g: float | None, now: int) -> float:
        """L * (1 - p) / p (p floored at 1e-3) for the use rate p of log count g (None or -inf:
        never used, p = 0): how far past its layer's next visit an estimate puts the key."""
        p = 0.0 if g is None else min(1.0, exp(g + now * self._per_step) * (1 - self.decay))
        return self.L * (1 - p) / max(p, 1e-3)


class Reuse(Predicted):
    """Belady with predicted distances: evict the farthest expected next use of a forecast.

    A cross-token predictor (`predictors.horizon`) forecasts, after forward f, when every
    (layer m, expert e) is next used; `set_forecast(f, ahead, after_first)` takes the expected
    step of that use ([L][E] lists, `Forecast.next_use_steps`): with every forecast class still
    ahead, and once layer m of forward f + 1 has passed without the expert (that class dropped,
    the rest renormalised). Hints (within-token predictions of an exact step) come first.
    Before any forecast: `Predicted`.
    """

    name = "reuse"
    FLOOR = -1  # the group of keys whose forecast has passed: all next used "at now + 1"

    def __init__(self, num_layers: int):
        super().__init__(num_layers)
        self.forward: int | None = None
        self.ahead: list | None = None
        self.after_first: list | None = None

    def set_forecast(self, forward: int, ahead_LE: list, after_first_LE: list) -> None:
        """The forecast made after forward `forward`, replacing the last one."""
        self.forward, self.ahead, self.after_first = forward, ahead_LE, after_first_LE

    def next_use(self, key: Key, now: int) -> float:
        if self.ahead is None:
            return super().next_use(key, now)
        hint = self.hints.get(key)
        if hint is not None and hint > now:
            return hint
        return max(self._forecast(key, now), now + 1)  # a stale forecast never says "past"

    def rank(self, key: Key, recency: int, now: int) -> tuple:
        if self.ahead is None:
            return super().rank(key, recency, now)
        return (self.next_use(key, now), -INF, -recency)

    def schedule(self, key: Key, recency: int, now: int) -> tuple[float, int | None, tuple]:
        """As Predicted before a forecast; then a forecast value v holds until the step at
        which v <= now + 1 or layer m of forward f + 1 passes; keys past that (ranked now + 1,
        ties by recency) form the group FLOOR."""
        if self.ahead is None:
            return super().schedule(key, recency, now)
        hint = self.hints.get(key)
        if hint is not None and hint > now:
            return hint, None, (-hint, INF, recency)  # the rank, negated
        m, e = key
        first = (self.forward + 1) * self.L + m  # where `ahead` gives way to `after_first`
        switch = first if first > now and self.ahead[m][e] != self.after_first[m][e] else INF
        value = self._forecast(key, now)
        if value <= now + 1:
            return switch, self.FLOOR, (recency,)
        until = INF if value == INF else ceil(value) - 1
        return min(switch, until), None, (-value, INF, recency)

    def forecast_changes(self, old: tuple, now: int) -> tuple[list[Key], list[tuple]]:
        """For `cache/victim_heap.py`, after `set_forecast`: (keys whose rank at step now
        may differ from the one under the forecast `old` = (forward, ahead, after_first),
        the one before; [(step, key)]: keys whose rank holds only until that step, a switch
        to come). Every other key keeps its rank for as long as it did: a value the same,
        an old switch still to come is earlier than a new one would be, and one passed
        re-ranked its key (or will, at the next miss)."""
        f_old, ahead_old, after_old = old
        L, moved, until = self.L, [], []
        E = range(len(self.ahead[0])) if self.ahead else range(0)
        for m in range(L):
            ahead, after = self.ahead[m], self.after_first[m]
            was = ahead_old[m] if (f_old + 1) * L + m > now else after_old[m]
            if ahead != was:  # (rows compared at once: most agree; then only their switches)
                moved += [(m, e) for e in compress(E, map(ne, ahead, was))]
            if ahead != after:
                step = (self.forward + 1) * L + m
                until += [(step, (m, e)) for e in compress(E, map(ne, ahead, after))]
        return moved, until

    def _forecast(self, key: Key, now: int) -> float:
        m, e = key
        first = (self.forward + 1) * self.L + m  # the step of forecast class 1
        return self.ahead[m][e] if first > now else self.after_first[m][e]

    def group_bound(self, group: int, value: tuple, now: int) -> float:
        """FLOOR: every key ranks now + 1 first; before a forecast, Predicted's layers."""
        return now + 1 if group == self.FLOOR else super().group_bound(group, value, now)

    def group_rank(self, group: int, order: tuple, now: int) -> tuple:
        if group == self.FLOOR:
            return (now + 1, -INF, -order[0])
        return super().group_rank(group, order, now)
