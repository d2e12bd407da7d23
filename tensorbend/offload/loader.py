"""I/O threads that read experts from the store into cache slots, demand loads first.

Usage (the session does this per policy run):
    loader = Loader(store, cache, threads=2, max_backlog_s=0.5 * link.seconds(nbytes),
                    guard=PrefetchGuard())
    loader.demand((m, e))                       # the router of layer m asked for expert e
    loader.prefetch((m, e), priority=0, when=step)   # a prediction for step `when`
    loader.prefetch_many([((m, e), 0, step), ...])   # several, one lock round-trip
    loader.cancel_stale(now)                    # layer `now` started: older prefetches are moot
    loader.close()

The threads serve one `cache.transfers.RequestQueue` (the simulator's I/O threads serve the
same queue in event time): demand loads first, then prefetches by the step they are needed at
and by rank; a demand upgrades a queued prefetch; stale prefetches are cancelled; a prefetch
taken while the store's wire is booked more than `max_backlog_s` ahead goes back to the queue
and its thread waits until the backlog falls to that (a demand queued meanwhile wakes it and
goes first). Whether a prefetch may evict, and what, is the cache's question
(`ExpertCache.start_load`).

A real disk has no booked wire, so there idle bandwidth is kept by thread count: at most
`prefetch_threads` (default: threads - 1 on an uncapped link, all of them on an emulated one)
reads are prefetches at once, so a demand load finds a thread of its own; and a prefetch reads
in parts (`blocks.PAUSE_CHUNK`), waiting between them while a demand read is in flight, so the
demand has the disk to itself (the waits: `prefetch_paused`). A `PrefetchGuard` turns prefetching off while it wastes: with predictions
that are all wrong, at most `slack` + threads prefetched experts are read in a run.

CUDA: reads land in a pinned staging buffer per thread, then one copy stream moves them into
the slot; the copy waits for the compute stream to finish with the slot's previous expert.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from tensorbend.cache.policies import INF, Key
from tensorbend.cache.transfers import DEMAND, RequestQueue
from tensorbend.offload.cache import ExpertCache
from tensorbend.offload.store import ExpertStore


@dataclass(frozen=True)
class PrefetchGuard:
    """Prefetch only while the prefetched experts read and not (yet) used number at most
    `slack` + `ratio` x those used (the cache's counters of the run). A predictor that is
    always wrong gets `slack` reads (+ those already started), then none; one whose
    prefetches are used at least once in 1 + ratio keeps prefetching.

        >>> from tensorbend.cache.slots import CacheStats
        >>> g = PrefetchGuard(slack=2, ratio=1.0)
        >>> g.open(CacheStats(prefetch_loaded=2)), g.open(CacheStats(prefetch_loaded=3))
        (True, False)
        >>> g.open(CacheStats(prefetch_loaded=10, prefetch_used=4))
        True
    """

    slack: int = 16
    ratio: float = 1.0

    def open(self, stats) -> bool:
        unused = stats.prefetch_loaded - stats.prefetch_used
        return unused <= self.slack + self.ratio * stats.prefetch_used


class Loader:
    """I/O threads serving one request queue: demand loads first, then prefetches by rank."""

    def __init__(
        self,
        store: ExpertStore,
        cache: ExpertCache,
        threads: int = 2,
        max_backlog_s: float = INF,
        prefetch_threads: int | None = None,
        guard: PrefetchGuard | None = None,
    ):
        self.store, self.cache = store, cache
        self.guard = guard
        if prefetch_threads is None:  # (an emulated link keeps the simulator's rule: its backlog)
            prefetch_threads = threads if store.link.capped else max(1, threads - 1)
        self._prefetch_threads = prefetch_threads
        self._prefetching = 0  # threads reading a prefetch now (guarded by _lock)
        self._demanding = 0  # threads reading a demand load now (guarded by _lock)
        self.queue = RequestQueue(max_backlog_s)  # guarded by _lock
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # threads with nothing to take
        self._deferred = threading.Condition(self._lock)  # threads holding a prefetch back
        self._demand_done = threading.Condition(self._lock)  # a demand read ended
        self._n_idle = 0  # threads waiting on _idle and not yet notified (`_wake_idle`)
        self._closed = False
        self._cuda = cache.device.type == "cuda"
        self._stream = torch.cuda.Stream(cache.device) if self._cuda else None
        self._local = threading.local()
        self._threads = [
            threading.Thread(target=self._work, daemon=True, name=f"tb-io-{i}")
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def demand(self, key: Key) -> None:
        with self._lock:
            self.queue.demand(key)
            if not self._wake_idle(1):  # else one holding a prefetch back takes it first
                self._deferred.notify()

    def prefetch(self, key: Key, priority: float, when: int) -> bool:
        """Queue a prefetch of key, used at step `when`; False if queued or cached already."""
        with self._lock:
            if not self._guard_open():
                return False
            if key in self.cache.entries or not self.queue.prefetch(key, when, priority):
                return False
            self.cache.stats.prefetch_issued += 1
            self._wake_idle(1)  # (a thread holding a prefetch back has the wire's wait)
            return True

    def prefetch_many(self, requests: list[tuple[Key, float, int]]) -> int:
        """prefetch() for each (key, priority, when) in order, under one lock round-trip;
        returns how many were queued."""
        queued, entries = 0, self.cache.entries
        requests = [r for r in requests if r[0] not in entries]  # (rechecked under the lock:
        if not requests or not self._guard_open():  # (a decode call's experts are often all
            return 0  # held, and then no lock)
        with self._lock:
            queue = self.queue
            for key, priority, when in requests:
                if key not in entries and queue.prefetch(key, when, priority):
                    queued += 1
            if queued:
                self.cache.stats.prefetch_issued += queued
                self._wake_idle(queued)
        return queued

    def cancel_stale(self, now: int) -> None:
        """Drop queued prefetches for steps that have started (their use is now or past)."""
        with self._lock:
            self.cache.stats.prefetch_cancelled += self.queue.cancel_stale(now)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._n_idle = 0
            self._idle.notify_all()
            self._deferred.notify_all()
        self.cache.abort()  # an I/O thread waiting for a slot must not outlive the run
        for t in self._threads:
            t.join()

    def _work(self) -> None:
        while True:
            with self._lock:
                req = self._take()
                if req is None:
                    return
                demand = req.kind == DEMAND
                self._demanding += demand
            cpu0 = time.thread_time()  # (this thread's CPU: not its waits for locks or the disk)
            try:
                slot = self.cache.start_load(req.key, demand=demand, block=demand, when=req.when)
                if slot is None:
                    continue
                nbytes = self._read(req.key, slot, None if demand else self._pause)
                self.cache.finish_load(req.key, nbytes)
            except BaseException as e:  # noqa: BLE001 - handed to the compute thread, re-raised there
                self.cache.fail_load(req.key, e)
            finally:
                with self._lock:
                    self.cache.stats.io_cpu_s += time.thread_time() - cpu0
                    if demand:
                        self._demanding -= 1
                        self._demand_done.notify_all()
                    else:
                        self._prefetching -= 1
                        self._deferred.notify()

    def _pause(self) -> None:
        """Between the parts of a prefetch read (real disk): wait while a demand read is in
        flight, so the demand has the disk to itself (an emulated link books its wire instead)."""
        if self.store.link.capped:
            return
        with self._lock:
            while self._demanding and not self._closed:
                self.cache.stats.prefetch_paused += 1
                self._demand_done.wait()

    def _take(self):
        """The best request this thread may start now (None: closed), under `_lock`. A prefetch
        taken while the wire is booked more than the backlog ahead goes back, and the thread
        waits until that is no longer so (or a demand comes), then takes the best again. New
        prefetches do not wake it: any of them would wait for the same wire, and each wake-up
        takes the interpreter lock from the compute thread."""
        while True:
            while not self._closed and not self.queue:
                self._n_idle += 1  # (the notifier counts it out: `_wake_idle`)
                self._idle.wait()
            if self._closed:
                return None
            req = self.queue.pop()
            if req.kind == DEMAND:
                return req
            if not self._guard_open():  # queued before the guard closed: moot now
                self.cache.stats.prefetch_dropped += 1
                continue
            wait = self.queue.deferral(req, self.store.backlog_s())
            if wait <= 0 and self._prefetching < self._prefetch_threads:
                self._prefetching += 1
                return req
            self.queue.put_back(req)
            self._deferred.wait(wait if wait > 0 else None)  # (or a prefetch read ends)

    def _guard_open(self) -> bool:
        return self.guard is None or self.guard.open(self.cache.stats)

    def _wake_idle(self, n: int) -> int:
        """Wake up to n idle threads, under `_lock`; returns how many. Counted out here, not
        by the woken thread (it runs later): a demand right after another must not count a
        thread already woken as idle, or it would wake none and wait for a deferral to end."""
        n = min(n, self._n_idle)
        if n:
            self._n_idle -= n
            self._idle.notify(n)
        return n

    def _read(self, key: Key, slot: int, pause=None) -> int:
        m, e = key
        slot_flat = self.cache.buffer(slot)
        if not self._cuda:
            return self.store.read_into(m, e, slot_flat, pause)
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = torch.empty_like(slot_flat, device="cpu").pin_memory()
        nbytes = self.store.read_into(m, e, staging, pause)
        freed = self.cache.slot_free_event(slot)
        with torch.cuda.stream(self._stream):
            if freed is not None:
                self._stream.wait_event(freed)  # the compute stream is done with the old expert
            slot_flat.copy_(staging, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()  # ready means the bytes are in the slot; staging is free again
        return nbytes
