"""A bounded pool of expert slots in fast memory: the tensors, the lock and the waiting.

Usage:
    >>> import torch
    >>> from tensorbend.cache.policies import LRU
    >>> cache = ExpertCache(CacheConfig(), ResidentSet(2, 1, LRU()), 4, torch.float32, 16)
    >>> cache.now = 0                               # logical clock: step = forward * L + m
    >>> cache.claim((0, 5))                         # compute thread: "ready" | "loading" | "absent"
    'absent'
    >>> slot = cache.start_load((0, 5), demand=True, block=True)   # I/O thread: reserve a slot
    >>> cache.finish_load((0, 5), 16)               # ... after reading into cache.buffer(slot)
    >>> cache.wait_ready([(0, 5)])                  # compute thread: blocks (the stall) until ready
    [(0, 5)]
    >>> cache.release((0, 5))                       # unpin after the expert ran
    >>> cache.stats.misses, cache.stats.bytes_read
    (1, 16)

Shape legend: C slots (capacity resident + scratch staging), N elements of one packed expert.

Every decision and counter is `cache.slots.SlotTable`'s (the table the simulator drives in
event time): entries loading or ready, pins, claims of absent experts, staging slots for
bypassed misses (`scratch`), victims through `resident.ResidentSet`, waste. This module adds
what the wall clock needs: the tensor pool `pool_CN` the slot indices point into, one lock
(every method is thread-safe), waiting for reads (the stall) and for free slots, errors handed
from I/O threads to the compute thread, and CUDA events. An entry is ready from the wall-clock
time its read returned (`finish_load`).

Invariants: resident entries never exceed `capacity`; demand loads block for a slot (one frees
as soon as the compute thread finishes an expert, so they cannot deadlock); prefetches never
block: refused or blocked, they are dropped. On CUDA a slot is overwritten only after the
compute stream has finished the kernels that read its previous expert (`slot_free_event`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from tensorbend.cache.policies import INF, Key
from tensorbend.cache.resident import ResidentSet
from tensorbend.cache.slots import CacheStats, SlotTable
from tensorbend.errors import StoreError
from tensorbend.offload.blocks import aligned_empty


@dataclass(frozen=True)
class CacheConfig:
    scratch: int = 1
    """Staging slots for demand loads that are not kept (bypassed misses, policy on_demand);
    not counted in the cache's capacity."""
    device: str = "cpu"
    """Where slots live: cpu, or cuda[:N] (reads then go through pinned staging + a copy stream)."""
    wait_timeout_s: float = 300.0
    """A wait longer than this means a bug or a dead disk: raise instead of hanging."""

    def __post_init__(self) -> None:
        assert self.scratch >= 1 and self.wait_timeout_s > 0, self


class ExpertCache:
    """Tensor slots over a `SlotTable`; every method is thread-safe."""

    def __init__(
        self,
        cfg: CacheConfig,
        resident: ResidentSet,
        numel: int,
        dtype: torch.dtype,
        nbytes: int,
    ):
        self.cfg, self.resident, self.nbytes = cfg, resident, nbytes
        self.slots = SlotTable(resident, cfg.scratch, nbytes)
        self.capacity = resident.capacity
        self.entries = self.slots.entries  # read without the lock only for "is it there"
        self.device = torch.device(cfg.device)
        rows = self.capacity + cfg.scratch
        self.pool_CN = (  # (on the CPU every slot 4096-aligned: direct reads land with no copy)
            aligned_empty(rows, numel, dtype)
            if self.device.type == "cpu"
            else torch.empty(rows, numel, dtype=dtype, device=self.device)
        )
        self._cond = threading.Condition()
        self.waits = 0  # wait_ready calls that blocked (the compute thread waited for a load)
        self._error: BaseException | None = None
        self._slot_events: dict[int, torch.cuda.Event] = {}
        self._views: list[dict | None] = [None] * (self.capacity + cfg.scratch)  # per slot

    @property
    def stats(self) -> CacheStats:
        return self.slots.stats

    @property
    def now(self) -> int:
        return self.slots.now

    @now.setter
    def now(self, step: int) -> None:
        self.slots.now = step

    def buffer(self, slot: int) -> torch.Tensor:
        return self.pool_CN[slot]

    def views(self, key: Key, layout) -> dict[str, torch.Tensor]:
        """`layout.views` of key's slot (`store.ExpertLayout`), made once per slot: the pool
        is allocated once, so a slot's views stay valid whatever expert it holds."""
        slot = self.entries[key].slot
        v = self._views[slot]
        if v is None:
            v = self._views[slot] = layout.views(self.pool_CN[slot])
        return v

    # ------------------------------------------------------------ compute thread

    def claim(self, key: Key) -> str:
        """Count a demand for key; pin it if present. Returns ready, loading or absent."""
        with self._cond:
            return self.slots.claim(key, time.perf_counter())

    def wait_ready(self, keys) -> list[Key]:
        """Block until at least one of `keys` (pinned by the caller) is ready; return those."""
        t0 = time.perf_counter()
        with self._cond:
            blocked = False
            while True:
                if self._error is not None:
                    raise self._error
                now = time.perf_counter()
                ready = [k for k in keys if self.slots.ready(k, now)]
                if ready:
                    self.stats.stall_s += now - t0
                    return ready
                if not blocked:
                    blocked, self.waits = True, self.waits + 1
                self._wait(t0, f"expert loads for {sorted(keys)[:4]} did not finish")

    def release(self, key: Key) -> None:
        """The expert ran (its kernels are queued): unpin; a scratch entry frees its slot."""
        with self._cond:
            entry = self.slots.release(key)
            if self.device.type == "cuda":
                event = torch.cuda.Event()  # after the kernels reading the slot were queued
                event.record(torch.cuda.current_stream(self.device))
                self._slot_events[entry.slot] = event
            self._cond.notify_all()

    def hint(self, key: Key, when: int) -> None:
        with self._cond:
            self.resident.hint(key, when)

    def hint_many(self, hints: list[tuple[Key, int]]) -> None:
        """hint() for each (key, when) in order, under one lock round-trip."""
        with self._cond:
            self.resident.hint_many(hints)

    def set_forecast(self, forward: int, ahead_LE: list, after_first_LE: list) -> None:
        """A cross-token forecast for the policy (predicted.Reuse.set_forecast)."""
        with self._cond:
            self.resident.set_forecast(forward, ahead_LE, after_first_LE)

    def layer_counters(self) -> list[dict]:
        """Per MoE layer seen so far: demand hits, late (still loading), misses, bytes read."""
        with self._cond:
            return self.slots.layer_counters()

    def reset_counters(self) -> None:
        """Zero the counters (totals and per layer); entries and the policy stay as they are."""
        with self._cond:
            self.slots.reset_counters()

    def finalize(self) -> None:
        """End of a run: prefetched experts never used count as wasted."""
        with self._cond:
            self.slots.finalize(time.perf_counter())

    # ------------------------------------------------------------ I/O threads

    def start_load(self, key: Key, demand: bool, block: bool, when: float = INF) -> int | None:
        """Reserve a slot for key (loading); None when present already or no slot is taken.

        A prefetch (used at step `when`) never waits. Whoever creates the entry (demand or
        prefetch) hands it the pins of the claims made while it was absent, so the compute
        thread never sees an unpinned needed expert.
        """
        t0 = time.perf_counter()
        with self._cond:
            while True:
                if key in self.entries:
                    return None  # the claim's pin was handed over when it was created
                entry = self.slots.reserve(key, demand, when, time.perf_counter())
                if entry is not None:
                    return entry.slot
                if not demand or not block:
                    return None
                self._wait(t0, f"no cache slot for expert {key}")

    def slot_free_event(self, slot: int):
        """CUDA: the event after which the compute stream no longer reads `slot` (or None)."""
        with self._cond:
            return self._slot_events.get(slot)

    def finish_load(self, key: Key, nbytes: int) -> None:
        with self._cond:
            self.slots.finish(key, nbytes, at=time.perf_counter())
            self._cond.notify_all()

    def abort(self) -> None:
        """Wake every waiter with an error (the run is over, e.g. after an exception)."""
        with self._cond:
            self._error = self._error or StoreError("the offloaded run was closed")
            self._cond.notify_all()

    def fail_load(self, key: Key, error: BaseException) -> None:
        """A read failed: drop the entry and hand the error to the compute thread."""
        with self._cond:
            if key in self.entries:
                self.slots.drop(key)
            self._error = self._error or error
            self._cond.notify_all()

    def _wait(self, t0: float, what: str) -> None:
        if time.perf_counter() - t0 > self.cfg.wait_timeout_s:
            raise StoreError(
                f"{what} in {self.cfg.wait_timeout_s:.0f} s: expected loads to finish; the "
                f"store's disk is stuck or every slot stays pinned (raise --cache-frac)"
            )
        self._cond.wait(timeout=1.0)
        if self._error is not None:
            raise self._error
