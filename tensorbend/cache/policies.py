"""Eviction policies: pure bookkeeping on a logical clock, no threads, no tensors.

Usage (the same objects drive `cache.ExpertCache` and the discrete-event simulator):
    >>> from tensorbend.cache.resident import ResidentSet
    >>> rs = ResidentSet(capacity=2, num_layers=1, policy=LFRU())
    >>> misses = [step for step, e in enumerate([0, 0, 0, 1, 2, 1, 0]) if not rs.access((0, e), step)]
    >>> misses, sorted(rs)            # LFRU kept the frequent (0, 0) when (0, 2) arrived
    ([0, 3, 4, 5], [(0, 0), (0, 1)])

Keys are (MoE layer m, expert e). Time is the logical clock `step = forward * L + m` (L MoE
layers), counted over a whole run; `now` is the step of the MoE layer being computed. A
policy answers three questions and never sees how slots, loads or pins work:
  rank(key, recency, now)  -> a sortable value; of the evictable entries the highest leaves.
                              `recency` is a sequence number, larger = used or inserted later.
  next_use(key, now)       -> the estimated next step (> now) at which key is used, INF when
                              never or beyond what the policy knows, or None when the policy has
                              no notion of time (LRU, LFU, LFRU).
  admit(key, victim, ...)  -> (admission rules below) whether a missed expert takes the victim's
                              slot or is computed from a staging buffer and not kept (bypass).
and is told two things: touch(key, now) at every demand use (hit or miss), and hint(key, when)
for every prediction that key is used at step `when` (any later step, also in a later forward).

Policies:  LRU (recency only), LFU (all-time use count), LFRU (count / (age + 1), age in steps
since the last use), Predicted (farthest estimated next use from predictions + use rates) and
Reuse (Belady on a cross-token predictor's forecast of each next use), both in
cache/predicted.py, and
NextUse (Belady's MIN from a recorded routing; with `foresight` h it knows only the routing of
steps < (now // L + h) * L: the rest of the current forward and the next h - 1; keys not used
within that window rank by its `beyond` rule (default recency), so h = 0 is that rule and
h >= the run's forwards is full MIN).
Ties go to the least recent entry; `Predicted` and `Reuse` rank (next use, tie, -recency),
where tie is -inf for a predicted or forecast use (ties: least recent, as everywhere) and
-log(decayed count) for an estimate from use rates, so that of two equal estimates (only
rounding makes two distinct counts equal) the less used leaves first.

Victim search: every policy declares how its rank moves with the clock (`ranking`), and
`cache/victim_heap.py` picks the index that finds the same victim as a scan by that property:
  recency     rank is (constant, -recency): LRU
  static      rank(key, ...) changes only when key is used (and then never rises) or placed: LFU
  ages        LFRU: count / (age + 1) from `line(key) -> (count, last use)`
  scheduled   `schedule(key, recency, now)`: the rank (negated: an order, lowest first) and
              until which step it holds, or which group of keys (one order among them at
              every step) it moves with
and whether a use can only lower the key's rank (`use_lowers_rank`), which the recency, static
and ages indexes rely on: they re-rank a used key only when it comes up as a candidate.
Admission rules (which misses are kept) live in cache/admission.py.
"""

from __future__ import annotations

import bisect
from typing import ClassVar, Literal

from tensorbend.cache.oracle import INF, Key, sight

EvictionName = Literal["lru", "lfu", "lfru", "predicted", "reuse", "next_use"]
Ranking = Literal["recency", "static", "ages", "scheduled"]


class LRU:
    """Least recently used (the base: other policies override what they know more about)."""

    name = "lru"
    ranking: ClassVar[Ranking] = "recency"  # how rank moves with the clock (module docstring)
    use_lowers_rank: ClassVar[bool] = True  # a use never raises the key's rank, now or later

    def touch(self, key: Key, now: int) -> None:
        """A demand use of key at step now (hit or miss)."""

    def hint(self, key: Key, when: int) -> None:
        """A prediction: key will be used at step `when`."""

    def hint_many(self, hints: list[tuple[Key, int]]) -> None:
        """hint() for each (key, when) in order (a policy that keeps hints does it in one
        loop: a decode call hints several experts at once)."""
        for key, when in hints:
            self.hint(key, when)

    def rank(self, key: Key, recency: int, now: int) -> tuple:
        return (0, -recency)

    def next_use(self, key: Key, now: int) -> float | None:
        return None


class LFU(LRU):
    """Least frequently used: all-time demand count per key (ties: least recent)."""

    name = "lfu"
    ranking: ClassVar[Ranking] = "static"

    def __init__(self) -> None:
        self.counts: dict[Key, int] = {}

    def touch(self, key: Key, now: int) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def rank(self, key: Key, recency: int, now: int) -> tuple:
        return (-self.counts.get(key, 0), -recency)

    def order(self, key: Key, recency: int, now: int) -> tuple:
        """The rank negated, field by field (`cache/victim_heap.py` keeps heaps of these)."""
        return (self.counts.get(key, 0), recency)


class LFRU(LFU):
    """Frequency damped by age: score = uses / (steps since the last use + 1); lowest leaves."""

    name = "lfru"
    ranking: ClassVar[Ranking] = "ages"
    order = None  # (LFU's: no longer the rank negated)

    def __init__(self) -> None:
        super().__init__()
        self.last_use: dict[Key, int] = {}

    def touch(self, key: Key, now: int) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1  # (LFU's, inline: every use calls it)
        self.last_use[key] = now

    def score(self, key: Key, now: int) -> float:
        if key not in self.last_use:
            return 0.0  # inserted by a prefetch, never used
        return self.counts[key] / (now - self.last_use[key] + 1)

    def rank(self, key: Key, recency: int, now: int) -> tuple:
        return (-self.score(key, now), -recency)

    def line(self, key: Key) -> tuple[int, int]:
        """(uses, step of the last use): score = uses / (now - last + 1); (0, 0) never used."""
        return (self.counts[key], self.last_use[key]) if key in self.last_use else (0, 0)


class NextUse(LRU):
    """Belady's MIN over a recorded routing, optionally knowing only `foresight` forwards ahead.

    steps_by_key: sorted steps at which each key is used. foresight: None = the whole run;
    h = every use at a step < (now // num_layers + h) * num_layers. beyond: how keys not seen
    used within that window rank among themselves (a rule without prediction; default LRU),
    so that the bounded oracle is a ceiling over that rule. With full foresight such a key is
    never used again and any order is as good: recency.
    """

    name = "next_use"
    ranking: ClassVar[Ranking] = "scheduled"
    use_lowers_rank: ClassVar[bool] = False  # a use moves the next use later

    def __init__(
        self,
        steps_by_key: dict[Key, list[int]],
        num_layers: int,
        foresight: int | None = None,
        beyond: LRU | None = None,
    ):
        assert foresight is None or foresight >= 0
        self.steps_by_key, self.L, self.foresight = steps_by_key, num_layers, foresight
        self.beyond = beyond if beyond is not None and foresight is not None else LRU()
        self._steady = type(self.beyond) is LRU
        self.touch = self.beyond.touch  # (all a use tells NextUse; LRU's does nothing)

    def next_use(self, key: Key, now: int) -> float:
        step = self._next_step(key, now)
        return INF if step >= self.horizon(now) else step

    def horizon(self, now: int) -> float:
        """First step this policy cannot see (INF with full foresight)."""
        return sight(now, self.L, self.foresight)

    def rank(self, key: Key, recency: int, now: int) -> tuple:
        return (self.next_use(key, now), *self.beyond.rank(key, recency, now))

    def schedule(self, key: Key, recency: int, now: int) -> tuple[float, int | None, tuple]:
        """(until, group, order) for `cache/victim_heap.py`: key's rank is -order (group None:
        the rank negated, field by field) for every step < until. NextUse keys form no group:
        the next use s moves on at step s; an unseen s comes into sight at the first forward
        f with f + foresight > s // L. A `beyond` rule other than recency can change its
        order at any step: then the rank holds for this step only (the index asks again).
        With recency beyond, the order (-s, 0, recency) is packed in one integer,
        -s * 2**40 + recency (-2**100 + recency for s unseen), cheaper to compare."""
        steps = self.steps_by_key.get(key)
        step = INF
        if steps:
            i = bisect.bisect_right(steps, now)
            if i < len(steps):
                step = steps[i]
        f = self.foresight
        seen = f is None or step == INF or step < (now // self.L + f) * self.L  # (horizon)
        until = step if seen else min(step, (step // self.L - f + 1) * self.L)
        if self._steady:  # (0, -recency): constant between uses
            assert recency < _PACK, recency
            order = recency - (step * _PACK if seen and step != INF else _UNSEEN)
            return until, None, order
        tail = tuple(-x for x in self.beyond.rank(key, recency, now))
        return min(until, now + 1), None, ((-step if seen else -INF), *tail)

    def _next_step(self, key: Key, now: int) -> float:
        steps = self.steps_by_key.get(key)
        if not steps:
            return INF
        i = bisect.bisect_right(steps, now)
        return INF if i == len(steps) else steps[i]


_PACK, _UNSEEN = 1 << 40, 1 << 100  # NextUse.schedule's packed order: recency < 2**40
