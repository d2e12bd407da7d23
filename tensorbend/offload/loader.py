"""I/O threads that read experts from the store into cache slots, demand loads first.

Usage (the session does this per policy run):
    loader = Loader(store, cache, threads=2, max_backlog_s=0.5 * link.seconds(nbytes))
    loader.demand((m, e))                       # the router of layer m asked for expert e
    loader.prefetch((m, e), priority=0, when=step)   # a prediction for step `when`
    loader.cancel_stale(now)                    # layer `now` started: older prefetches are moot
    loader.close()

One priority queue: every demand load before any prefetch, prefetches by the step they are
needed at (soonest first: a prediction for the next token's layers waits behind this token's),
then by the prediction's rank, then first come. A demand for a queued prefetch upgrades it. Prefetches
whose step has come (`cancel_stale`) are cancelled; one is dropped when the emulated link is
busy for more than `max_backlog_s` (wrong prefetches then use idle link time instead of
delaying demand loads). Whether a prefetch may evict, and what, is the cache's question.

CUDA: reads land in a pinned staging buffer per thread, then one copy stream moves them into
the slot; the copy waits for the compute stream to finish with the slot's previous expert.
"""

from __future__ import annotations

import heapq
import threading

import torch

from tensorbend.offload.cache import ExpertCache
from tensorbend.offload.policies import INF, Key
from tensorbend.offload.store import ExpertStore

DEMAND, PREFETCH = 0, 1


class Loader:
    """I/O threads serving one priority queue: demand loads first, then prefetches by rank."""

    def __init__(
        self, store: ExpertStore, cache: ExpertCache, threads: int = 2, max_backlog_s: float = INF
    ):
        self.store, self.cache = store, cache
        self.max_backlog_s = max_backlog_s
        self._heap: list[list] = []  # [kind, (when, rank), seq, key, when, alive]
        self._queued: dict[Key, list] = {}
        self._seq = 0
        self._cond = threading.Condition()
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
        with self._cond:
            req = self._queued.get(key)
            if req is not None and req[0] == DEMAND:
                return
            if req is not None:
                req[5] = False  # upgraded: the demand below replaces it
            self._push(DEMAND, (0, 0), key, INF)

    def prefetch(self, key: Key, priority: float, when: int) -> bool:
        """Queue a prefetch of key, used at step `when`; False if queued or cached already."""
        with self._cond:
            if key in self._queued or key in self.cache.entries:
                return False
            self._push(PREFETCH, (when, priority), key, when)
            self.cache.stats.prefetch_issued += 1
            return True

    def cancel_stale(self, now: int) -> None:
        """Drop queued prefetches for steps that have started (their use is now or past)."""
        with self._cond:
            for req in self._heap:
                if req[5] and req[0] == PREFETCH and req[4] <= now:
                    req[5] = False
                    self._queued.pop(req[3], None)
                    self.cache.stats.prefetch_cancelled += 1

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.cache.abort()  # an I/O thread waiting for a slot must not outlive the run
        for t in self._threads:
            t.join()

    def _push(self, kind: int, priority: tuple, key: Key, when: float) -> None:
        self._seq += 1
        req = [kind, priority, self._seq, key, when, True]
        heapq.heappush(self._heap, req)
        self._queued[key] = req
        self._cond.notify()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._heap:
                    self._cond.wait()
                if self._closed:
                    return
                kind, _, _, key, when, alive = heapq.heappop(self._heap)
                if not alive:
                    continue
                self._queued.pop(key, None)
            demand = kind == DEMAND
            if not demand and self.store.backlog_s() > self.max_backlog_s:
                self.cache.stats.prefetch_dropped += 1  # the link is busy: demand loads come first
                continue
            try:
                slot = self.cache.start_load(key, demand=demand, block=demand, when=when)
                if slot is None:
                    continue
                nbytes = self._read(key, slot)
                self.cache.finish_load(key, nbytes)
            except BaseException as e:  # noqa: BLE001 - handed to the compute thread, re-raised there
                self.cache.fail_load(key, e)

    def _read(self, key: Key, slot: int) -> int:
        m, e = key
        slot_flat = self.cache.buffer(slot)
        if not self._cuda:
            return self.store.read_into(m, e, slot_flat)
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = torch.empty_like(slot_flat, device="cpu").pin_memory()
        nbytes = self.store.read_into(m, e, staging)
        freed = self.cache.slot_free_event(slot)
        with torch.cuda.stream(self._stream):
            if freed is not None:
                self._stream.wait_event(freed)  # the compute stream is done with the old expert
            slot_flat.copy_(staging, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()  # READY means the bytes are in the slot; staging is free again
        return nbytes
