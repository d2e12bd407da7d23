"""Admission rules: whether a missed expert takes the victim's slot, or is computed from a
staging buffer and not kept (bypass); and whether a prefetch may evict. Pure, no clock of its own.

Usage:
    >>> from tensorbend.cache.policies import LRU
    >>> adm = make_admission("frequency", num_layers=1, window=3)
    >>> for step, key in enumerate([(0, 1), (0, 2), (0, 1)]):
    ...     adm.touch(key, step)
    >>> adm.admit((0, 1), (0, 2), LRU(), 2), adm.admit((0, 2), (0, 1), LRU(), 2)
    (True, False)

Admission (`ResidentSet` asks only when a miss finds its pool full; a free slot always admits):
  AdmitAll        every miss is kept.
  AdmitFrequent   TinyLFU-style, no prediction: keep the miss only if it was used more often
                  than the victim within the last `window` forwards (counting this use), so a
                  one-off expert never pushes out one in use; a second use within the window
                  admits it against a victim used once.
  AdmitPredicted  keep the miss unless the policy's next_use says it comes back later than the
                  victim (needs a policy with next_use: Predicted or NextUse; unknown = INF and
                  a tie admits, so with nothing known it behaves like AdmitAll).
A prefetch is a different question, asked the same way for every policy: it takes a victim only
if the victim's next_use is later than the prefetch's step (None: always).
"""

from __future__ import annotations

from collections import deque
from typing import Literal

from tensorbend.cache.policies import INF, LRU, Key

AdmissionName = Literal["all", "frequency", "predicted"]


class AdmitAll:
    """Keep every miss (the classic cache)."""

    name = "all"

    def touch(self, key: Key, now: int) -> None:
        pass

    def admit(self, key: Key, victim: Key, policy: LRU, now: int) -> bool:
        return True


class AdmitFrequent(AdmitAll):
    """TinyLFU-style: admit a miss only if used more often than the victim in the window."""

    name = "frequency"

    def __init__(self, window_steps: int):
        assert window_steps >= 1
        self.window = window_steps
        self.uses: dict[Key, deque[int]] = {}

    def touch(self, key: Key, now: int) -> None:
        self.uses.setdefault(key, deque()).append(now)

    def count(self, key: Key, now: int) -> int:
        q = self.uses.get(key)
        if not q:
            return 0
        while q and q[0] <= now - self.window:
            q.popleft()
        return len(q)

    def admit(self, key: Key, victim: Key, policy: LRU, now: int) -> bool:
        return self.count(key, now) > self.count(victim, now)


class AdmitPredicted(AdmitAll):
    """Bypass a miss whose estimated next use comes after the victim's (ties admit). With a
    `fallback` rule, a tie of two unknown (INF) next uses is decided by that rule instead (the
    bounded oracle beyond its sight admits as the no-prediction cache it must beat)."""

    name = "predicted"

    def __init__(self, fallback: AdmitAll | None = None):
        self.fallback = fallback

    def touch(self, key: Key, now: int) -> None:
        if self.fallback is not None:
            self.fallback.touch(key, now)

    def admit(self, key: Key, victim: Key, policy: LRU, now: int) -> bool:
        mine, theirs = policy.next_use(key, now), policy.next_use(victim, now)
        assert mine is not None and theirs is not None, f"{policy.name} has no next_use"
        if mine == theirs == INF and self.fallback is not None:
            return self.fallback.admit(key, victim, policy, now)
        return mine <= theirs


def make_admission(
    name: AdmissionName, num_layers: int, window: int, fallback: AdmissionName | None = None
) -> AdmitAll:
    """Admission rule by name; `window` is in forwards (AdmitFrequent); `fallback`: the rule
    AdmitPredicted defers to when both next uses are unknown."""
    if name == "frequency":
        return AdmitFrequent(window * num_layers)
    if name == "predicted":
        fb = None if fallback is None else make_admission(fallback, num_layers, window)
        return AdmitPredicted(fb)
    assert name == "all", name
    return AdmitAll()


def prefetch_worth(policy: LRU, victim: Key, when: float, now: int) -> bool:
    """Evict `victim` for a prefetch used at step `when` only if the victim is needed later."""
    theirs = policy.next_use(victim, now)
    return theirs is None or theirs > when
