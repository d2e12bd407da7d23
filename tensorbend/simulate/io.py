"""The simulator's I/O threads: the runtime's request queue and wire, served in event time.

Usage (events.py drives it; `start` decides what a free thread does with a request and
returns when that thread is free again):
    >>> from tensorbend.cache.transfers import Link
    >>> io = IOThreads(Link(bandwidth_Bps=5.0, latency_s=0.5), threads=2, max_backlog_s=float("inf"))
    >>> io.queue.demand((0, 1), at=0.0)
    >>> io.queue.prefetch((1, 4), when=7, rank=0, at=0.0)
    True
    >>> started = []
    >>> io.advance(10.0, lambda req, s: started.append((req.key, s)) or io.wire.book(s, 10))
    >>> started, io.wire.free_at               # 10 bytes at 5 B/s: 2 s each, back to back
    ([((0, 1), 0.0), ((1, 4), 0.0)], 4.0)

`queue` and `wire` are `cache.transfers.RequestQueue` and `Wire`, the objects the runtime's
`offload.loader.Loader` threads and `offload.store.ExpertStore` use with the wall clock. What
is simulated here is only the threads: each of `threads` takes the best request queued by the
time it is free (`RequestQueue.pop`), and stays busy until `start` says (a read keeps its
thread until the bytes arrived, as `ExpertStore.read_into` sleeps until its booking ends). A
demand that finds no cache slot blocks its thread (`start` returns None) until
`retry_blocked`, called when a slot may have freed up. Time only moves forward: the caller
advances the threads to the compute thread's time before it queues anything at that time.
"""

from __future__ import annotations

from collections.abc import Callable

from tensorbend.cache.transfers import Link, Request, RequestQueue, Wire
from tensorbend.offload.policies import INF

Start = Callable[[Request, float], float | None]  # (request, start time) -> thread free at


class IOThreads:
    def __init__(self, link: Link, threads: int, max_backlog_s: float):
        self.link = link
        self.wire = Wire(link)
        self.queue = RequestQueue(max_backlog_s)
        self.free_at = [0.0] * threads  # when each thread can start its next request
        self.blocked: list[tuple[int, Request]] = []  # demands waiting for a cache slot

    def advance(self, t: float, start: Start) -> None:
        """Start every request a free thread takes by time t."""
        while self.queue:
            i = min(range(len(self.free_at)), key=self.free_at.__getitem__)
            s = max(self.free_at[i], self.queue.next_arrival())
            if s > t:
                return
            req = self.queue.pop(s)
            free = start(req, s)
            if free is None:
                self.blocked.append((i, req))
                self.free_at[i] = INF
            else:
                self.free_at[i] = free

    def retry_blocked(self, t: float, start: Start) -> None:
        """A slot may have freed up at time t: blocked demands try again (oldest first)."""
        waiting, self.blocked = self.blocked, []
        for i, req in waiting:
            free = start(req, t)
            if free is None:
                self.blocked.append((i, req))
            else:
                self.free_at[i] = free

    def next_free(self) -> float:
        """Earliest time a thread could start a queued request (INF when nothing can)."""
        if not self.queue:
            return INF
        return max(min(self.free_at), self.queue.next_arrival())
