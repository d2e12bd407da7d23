"""The discrete-event run: a compute thread and I/O threads in event time, over the runtime's
slot table, request queue and wire.

Usage (simulator.py builds the work and the resident set; one `EventRun` per simulated run):
    >>> from tensorbend.cache.transfers import Link
    >>> from tensorbend.cache.policies import LRU
    >>> from tensorbend.cache.resident import ResidentSet
    >>> work = [ForwardWork(phase=1, tokens=1, layers=[LayerWork(demand=[(0, 1), (1, 1)])])]
    >>> run = EventRun(ResidentSet(0, 1, LRU()), IOThreads(Link(5.0), 1, float("inf")),
    ...                times=Times(attn_s=lambda n: 1.0, expert_s=lambda n: 0.5,
    ...                            forward_s=lambda n: 0.0), scratch=2, unit_bytes=10)
    >>> run.run(work)
    >>> s = run.stats[1]; s.misses, s.stall_s, s.bytes_read, run.seconds[1]
    (2, 3.5, 20, 5.5)

Per forward: `forward_s` (dense layers, head), then per MoE layer g (step = forward * L + g):
predictions issued before attention (pre_attn), `attn_s`, the router (claims: hit if ready,
late if still loading, miss -> demand load, `miss_s` each; stale prefetches cancelled),
predictions issued at the router (dN, same_layer; `predict_s` each; a cross-token forecast
`forecast_s`, its next-forward prefetches included), then each expert computed
(`expert_s` for the tokens routed to it) as soon as it is ready; waiting for one is the stall.

Shared with the runtime, not copied: claims, slots, pins, bypass (staging `scratch` slots),
victims, waste and counters are `cache.slots.SlotTable` (the table `offload.cache.ExpertCache`
drives under its lock) over the same `cache.resident.ResidentSet` and policies; the request
queue and the wire are `cache.transfers` (as `offload.loader.Loader` and
`offload.store.ExpertStore` use them), served by simulated I/O threads (`IOThreads`, the
loader's threads in event time). An entry is
ready at the time its booked transfer arrives; the completion (its counters) is applied at that
time, after any request a thread starts at the same instant (so an entry evicted at the very
instant it lands is not counted as read: the simulator has always done so, and
tests/test_cache_model.py keeps its numbers). Counters are `CacheStats`, per phase (0 prefill,
1 decode).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from tensorbend.cache.policies import INF, Key
from tensorbend.cache.resident import ResidentSet
from tensorbend.cache.slots import CacheStats, SlotTable
from tensorbend.cache.transfers import DEMAND, Link, Request, RequestQueue, Wire


@dataclass
class LayerWork:
    demand: list[tuple[int, int]]  # (expert, tokens routed to it), ascending expert id
    at_start: list[tuple[int, list[int]]] = field(
        default_factory=list
    )  # (target layer, ranked ids)
    at_router: list[tuple[int, list[int]]] = field(default_factory=list)
    forecast: tuple | None = None  # (forward, ahead_LE, after_first_LE) for predicted.Reuse
    ahead: list[tuple[int, list[int]]] = field(default_factory=list)  # prefetched, not hinted


@dataclass
class ForwardWork:
    phase: int  # 0 prefill, 1 decode
    tokens: int
    layers: list[LayerWork]


@dataclass(frozen=True)
class Times:
    attn_s: Callable[[int], float]  # tokens -> seconds before the router
    expert_s: Callable[[int], float]  # tokens on the expert -> seconds
    forward_s: Callable[[int], float]  # tokens -> seconds outside the MoE layers
    predict_s: float = 0.0  # one prediction (one target layer)
    miss_s: float = 0.0  # compute-thread overhead of a demand miss
    forecast_s: float = 0.0  # one cross-token forecast (its next-forward prefetches included)


class EventRun:
    """One simulated run: the compute thread's work over a `SlotTable`, loads by `io`."""

    def __init__(
        self, resident: ResidentSet, io: IOThreads, times: Times, scratch: int, unit_bytes: int
    ):
        self.rs, self.io, self.times = resident, io, times
        self.slots = SlotTable(resident, scratch, unit_bytes)
        self.nbytes = unit_bytes
        self.done: list[tuple[float, Key]] = []  # heap of loads in flight: (completion, key)
        self.stats = {0: CacheStats(), 1: CacheStats()}
        self.seconds = {0: 0.0, 1: 0.0}
        self.tokens = {0: 0, 1: 0}
        self.t = 0.0

    @property
    def total(self) -> CacheStats:
        """The whole run's counters."""
        return self.slots.stats

    def preload(self, keys: list[Key]) -> None:
        """Start with these experts resident and ready (policy resident: every expert)."""
        self.slots.preload(keys, at=0.0)

    def run(self, work: list[ForwardWork]) -> None:
        L = self.L = len(work[0].layers) if work else 1
        for f, fw in enumerate(work):
            t0, before = self.t, self.total.copy()
            self.t += self.times.forward_s(fw.tokens)
            for g, lw in enumerate(fw.layers):
                self._layer(f * L + g, f * L, lw, fw.tokens)
            self.stats[fw.phase].add(self.total, before)
            self.seconds[fw.phase] += self.t - t0
            self.tokens[fw.phase] += fw.tokens
        self._advance(self.t)
        self.slots.finalize(self.t)

    # ------------------------------------------------------------ compute thread

    def _layer(self, step: int, base: int, lw: LayerWork, tokens: int) -> None:
        self._predict(lw.at_start)
        self.t += self.times.attn_s(tokens)
        self._advance(self.t)
        self.slots.now = step
        for e, _ in lw.demand:
            if self.slots.claim((step - base, e), self.t) == "absent":
                self.t += self.times.miss_s
                self.io.queue.demand((step - base, e), self.t)
        self.total.prefetch_cancelled += self.io.queue.cancel_stale(step)
        if lw.forecast is not None:  # a cross-token forecast, as the runtime's last-layer hook
            self.t += self.times.forecast_s
            self.rs.set_forecast(*lw.forecast)
            self._predict(lw.ahead, hint=False, cost=0.0)
        self._predict(lw.at_router)
        pending = {(step - base, e): n for e, n in lw.demand}
        entries = self.slots.entries
        while pending:
            self._advance(self.t)
            ready = [k for k in pending if self.slots.ready(k, self.t)]
            if not ready:
                landing = [entries[k].ready_at for k in pending if k in entries]
                nxt = min(landing + [self._next_io()])
                assert nxt > self.t and nxt < INF, "simulated run is stuck"
                self.total.stall_s += nxt - self.t
                self.t = nxt
                continue
            for k in ready:
                self.t += self.times.expert_s(pending.pop(k))
                self._advance(self.t)
                self.slots.release(k)
                self.io.retry_blocked(self.t, self._start)

    def _predict(self, preds: list[tuple[int, list[int]]], hint: bool = True, cost=None) -> None:
        """Hint each predicted (layer, expert) for its step and queue its prefetch, in rank
        order; each list costs `predict_s` (`cost` instead, where the forecast paid for it)."""
        entries, queue = self.slots.entries, self.io.queue
        for when, ids in preds:
            self.t += self.times.predict_s if cost is None else cost
            for rank, e in enumerate(ids):
                key = (when % self.L, e)
                if hint:
                    self.rs.hint(key, when)
                if key not in entries and queue.prefetch(key, when, rank, self.t):
                    self.total.prefetch_issued += 1

    # ------------------------------------------------------------ I/O side

    def _advance(self, t: float) -> None:
        """Run the I/O threads up to time t, applying load completions in time order (a
        transfer booked later never completes earlier: the wire is serialised)."""
        while True:
            first = self.done[0] if self.done else None
            c = first[0] if first else INF
            if self.io.queue:
                self.io.advance(min(t, c), self._start)
            if c > t:
                return
            if self.done[0] is first:
                heapq.heappop(self.done)
            else:  # a start at c completed at c too (no wire time) and sorts first
                self.done.remove(first)
                heapq.heapify(self.done)
            if self.slots.finish(first[1], self.nbytes):
                self.io.retry_blocked(c, self._start)

    def _next_io(self) -> float:
        return min(self.io.next_free(), self.done[0][0] if self.done else INF)

    def _start(self, req: Request, s: float) -> float | None:
        """What a free I/O thread does with `req` at time s; returns when it is free again
        (None: a demand blocked until a slot frees up)."""
        demand = req.kind == DEMAND
        if req.key in self.slots.entries:
            return s
        entry = self.slots.reserve(req.key, demand, req.when, s)
        if entry is None:  # a prefetch is dropped (counted); a demand waits for a slot
            return None if demand else s
        entry.ready_at = done = self.io.wire.book(s, self.nbytes)
        heapq.heappush(self.done, (done, req.key))
        return done


Start = Callable[[Request, float], float | None]  # (request, start time) -> thread free at


class IOThreads:
    """The I/O threads in event time: `threads` readers serving the shared request queue and
    wire. Each takes the best request queued by the time it is free (`RequestQueue.pop`) and
    stays busy until `start` says (a read keeps its thread until the bytes arrived, as
    `ExpertStore.read_into` sleeps until its booking ends); a prefetch taken while the wire is
    booked more than the queue's backlog ahead goes back, and its thread waits until it is not
    (`RequestQueue.deferral`); a demand that finds no cache slot
    blocks its thread (`start` returns None) until `retry_blocked`. Time only moves forward:
    the caller advances the threads to the compute thread's time before it queues anything.

        >>> io = IOThreads(Link(bandwidth_Bps=5.0, latency_s=0.5), 2, max_backlog_s=float("inf"))
        >>> io.queue.demand((0, 1), at=0.0)
        >>> io.queue.prefetch((1, 4), when=7, rank=0, at=0.0)
        True
        >>> started = []
        >>> io.advance(10.0, lambda req, s: started.append((req.key, s)) or io.wire.book(s, 10))
        >>> started, io.wire.free_at           # 10 bytes at 5 B/s: 2 s each, back to back
        ([((0, 1), 0.0), ((1, 4), 0.0)], 4.0)
    """

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
            wait = self.queue.deferral(req, self.wire.backlog(s))
            if wait > 0:  # booked too far ahead: back to the queue, as `Loader._take` does
                self.queue.put_back(req)
                self.free_at[i] = s + wait
                continue
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
