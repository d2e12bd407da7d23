"""The expert link in simulated time: one priority queue, I/O slots, one serialised wire.

Usage (events.py drives it; `start` decides what a free slot does with a request):
    >>> link = Link(wire_s=2.0, latency_s=0.5, slots=2, max_backlog_s=float("inf"))
    >>> link.push(DEMAND, (0, 0), (0, 1), when=float("inf"), at=0.0)
    >>> link.push(PREFETCH, (7, 0), (1, 4), when=7, at=0.0)
    >>> started = []
    >>> link.advance(10.0, lambda req, s: started.append((req.key, s)) or link.transfer(s))
    >>> started, link.wire_free
    ([((0, 1), 0.0), ((1, 4), 0.0)], 4.0)

Mirrors `offload.loader.Loader` + `offload.store.ExpertStore`: requests are demand loads
(first) or prefetches (soonest step first, then predicted rank, then age); each of `slots` I/O
threads takes the best
request queued by the time it is free; a transfer occupies the wire for `wire_s` (bytes /
bandwidth) after the wire frees up, and completes `latency_s` later, keeping its thread busy
until then. A prefetch finding the wire busy for more than `max_backlog_s` is dropped; queued
prefetches whose layer has started are cancelled (`cancel_stale`); a demand for a queued
prefetch replaces it. Time only moves forward: the caller advances the link to the compute
thread's time before it queues anything at that time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tensorbend.offload.policies import INF, Key

DEMAND, PREFETCH = 0, 1


@dataclass
class Request:
    kind: int  # DEMAND or PREFETCH
    priority: tuple  # prefetch: (step needed at, predicted rank); demand: (0, 0)
    seq: int
    key: Key
    when: float  # step the prefetched expert is needed at (INF for demand)
    at: float  # time it was queued
    alive: bool = True


class Link:
    def __init__(self, wire_s: float, latency_s: float, slots: int, max_backlog_s: float):
        self.wire_s, self.latency_s, self.max_backlog_s = wire_s, latency_s, max_backlog_s
        self.free_at = [0.0] * slots  # when each I/O slot can start its next request
        self.blocked: list[tuple[int, Request]] = []  # demand waiting for a cache slot
        self.wire_free = 0.0
        self.queued: dict[Key, Request] = {}  # alive requests by key
        self._seq = 0

    # ------------------------------------------------------------ compute side

    def push(self, kind: int, priority: tuple, key: Key, when: float, at: float) -> None:
        self._seq += 1
        req = Request(kind, priority, self._seq, key, when, at)
        self.queued[key] = req

    def demand(self, key: Key, at: float) -> None:
        req = self.queued.get(key)
        if req is not None and req.kind == DEMAND:
            return
        if req is not None:
            req.alive = False  # upgraded: the demand replaces the prefetch
        self.push(DEMAND, (0, 0), key, INF, at)

    def cancel_stale(self, now_step: int) -> int:
        """Drop queued prefetches whose target step has come; returns how many."""
        stale = [r for r in self.queued.values() if r.kind == PREFETCH and r.when <= now_step]
        for req in stale:
            req.alive = False
            del self.queued[req.key]
        return len(stale)

    # ------------------------------------------------------------ I/O side

    def advance(self, t: float, start: Callable[[Request, float], float | None]) -> None:
        """Start every request a free slot takes by time t. `start(req, s)` returns when the slot
        is free again (`transfer(s)` for a read), or None: a demand blocked for a cache slot."""
        while self.queued:
            i = min(range(len(self.free_at)), key=self.free_at.__getitem__)
            s = max(self.free_at[i], min(r.at for r in self.queued.values()))
            if s > t:
                return
            req = min(
                (r for r in self.queued.values() if r.at <= s),
                key=lambda r: (r.kind, r.priority, r.seq),
            )
            req.alive = False
            del self.queued[req.key]
            free = start(req, s)
            if free is None:
                self.blocked.append((i, req))
                self.free_at[i] = INF
            else:
                self.free_at[i] = free

    def retry_blocked(self, t: float, start: Callable[[Request, float], float | None]) -> None:
        """A slot may have freed up at time t: blocked demands try again (oldest first)."""
        waiting, self.blocked = self.blocked, []
        for i, req in waiting:
            free = start(req, t)
            if free is None:
                self.blocked.append((i, req))
            else:
                self.free_at[i] = free

    def transfer(self, s: float) -> float:
        """Book the wire for one expert from time s; returns its completion time."""
        begin = max(s, self.wire_free)
        self.wire_free = begin + self.wire_s
        return self.wire_free + self.latency_s

    def backlog(self, s: float) -> float:
        return max(0.0, self.wire_free - s)

    def next_free(self) -> float:
        """Earliest time a slot could start a queued request (INF when nothing can)."""
        if not self.queued:
            return INF
        return max(min(self.free_at), min(r.at for r in self.queued.values()))
