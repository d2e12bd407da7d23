"""A bounded pool of expert slots in fast memory: states, pins, locks and counters.

Usage:
    >>> import torch
    >>> from tensorbend.offload.policies import LRU
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

Keys are (MoE layer m, expert e). An entry is LOADING (a read is in flight into its slot) or
READY; `pins` counts users that must not lose it. Which keys hold the `capacity` resident slots,
which one is evicted and whether a miss is kept is decided by `resident.ResidentSet` (policy,
pool, admission: see policies.py); this module never looks at the policy's type. Only READY
entries with no pins are evictable. A demand miss the admission rule refuses (bypass) is read
into one of `scratch` staging slots and freed as soon as its layer ran.

Invariants: resident entries never exceed `capacity`; demand loads block for a slot (one frees
as soon as the compute thread finishes an expert, so they cannot deadlock); prefetches never
block: refused or blocked, they are dropped. On CUDA a slot is overwritten only after the
compute stream has finished the kernels that read its previous expert (`slot_free_event`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, fields

import torch

from tensorbend.errors import StoreError
from tensorbend.offload.policies import INF, Key
from tensorbend.offload.resident import ResidentSet

LOADING, READY = 0, 1


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


@dataclass
class CacheStats:
    hits: int = 0  # needed expert READY when its layer asked
    late: int = 0  # needed expert still LOADING (prefetched, not in time)
    misses: int = 0  # needed expert absent: demand load
    bypassed: int = 0  # ... of which computed from a staging slot and not kept (admission)
    bytes_read: int = 0
    demand_loads: int = 0
    prefetch_issued: int = 0  # prefetch requests queued
    prefetch_loaded: int = 0  # ... that were read
    prefetch_used: int = 0  # ... read and then needed before eviction
    prefetch_wasted: int = 0  # ... read and evicted (or left at the end) unused
    prefetch_wasted_bytes: int = 0
    prefetch_cancelled: int = 0  # stale before their read started
    prefetch_dropped: int = 0  # no slot worth taking, or the link was busy
    evictions: int = 0
    stall_s: float = 0.0  # compute thread waiting for experts
    peak_entries: int = 0  # resident entries (<= capacity)

    @property
    def demands(self) -> int:
        return self.hits + self.late + self.misses

    @property
    def demand_hit_rate(self) -> float:
        return self.hits / self.demands if self.demands else 1.0

    def copy(self) -> CacheStats:
        return CacheStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def add(self, other: CacheStats, minus: CacheStats | None = None) -> None:
        """self += other - minus (peak_entries: the max)."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "peak_entries":
                setattr(self, f.name, max(a, b))
            else:
                setattr(self, f.name, a + b - (getattr(minus, f.name) if minus else 0))


@dataclass
class _Entry:
    slot: int
    resident: bool  # holds a resident slot (False: a scratch slot, freed after use)
    state: int = LOADING
    pins: int = 0
    prefetched: bool = False
    used: bool = False


class ExpertCache:
    """Slots + entries + counters; every method is thread-safe."""

    def __init__(
        self,
        cfg: CacheConfig,
        resident: ResidentSet,
        numel: int,
        dtype: torch.dtype,
        nbytes: int,
    ):
        self.cfg, self.resident, self.nbytes = cfg, resident, nbytes
        self.capacity = resident.capacity
        self.device = torch.device(cfg.device)
        self.pool_CN = torch.empty(
            self.capacity + cfg.scratch, numel, dtype=dtype, device=self.device
        )
        self.entries: dict[Key, _Entry] = {}
        self.free = list(range(self.capacity - 1, -1, -1))
        self.scratch_free = list(range(self.capacity + cfg.scratch - 1, self.capacity - 1, -1))
        self.stats = CacheStats()
        self.now = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._wanted: dict[Key, int] = {}  # claims of absent experts: pins for their entry
        self._slot_events: dict[int, torch.cuda.Event] = {}
        self._by_layer: dict[int, list[int]] = {}  # m -> [hits, late, misses, bytes_read]

    def buffer(self, slot: int) -> torch.Tensor:
        return self.pool_CN[slot]

    def weights(self, key: Key) -> torch.Tensor:
        return self.pool_CN[self.entries[key].slot]

    # ------------------------------------------------------------ compute thread

    def claim(self, key: Key) -> str:
        """Count a demand for key; pin it if present. Returns ready, loading or absent."""
        with self._cond:
            self.resident.use(key, self.now)
            entry = self.entries.get(key)
            layer = self._by_layer.setdefault(key[0], [0, 0, 0, 0])
            layer[0 if entry is not None and entry.state == READY else 1 if entry else 2] += 1
            if entry is None:
                self.stats.misses += 1
                self._wanted[key] = self._wanted.get(key, 0) + 1  # pinned once it is created
                return "absent"
            entry.pins += 1
            if entry.prefetched and not entry.used:
                self.stats.prefetch_used += 1
            entry.used = True
            if entry.state == READY:
                self.stats.hits += 1
                return "ready"
            self.stats.late += 1
            return "loading"

    def wait_ready(self, keys) -> list[Key]:
        """Block until at least one of `keys` (pinned by the caller) is READY; return those."""
        t0 = time.perf_counter()
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                ready = [k for k in keys if k in self.entries and self.entries[k].state == READY]
                if ready:
                    self.stats.stall_s += time.perf_counter() - t0
                    return ready
                self._wait(t0, f"expert loads for {sorted(keys)[:4]} did not finish")

    def release(self, key: Key) -> None:
        """The expert ran (its kernels are queued): unpin; a scratch entry frees its slot."""
        with self._cond:
            entry = self.entries[key]
            assert entry.pins > 0, f"release of unpinned expert {key}"
            entry.pins -= 1
            if self.device.type == "cuda":
                event = torch.cuda.Event()  # after the kernels reading the slot were queued
                event.record(torch.cuda.current_stream(self.device))
                self._slot_events[entry.slot] = event
            if entry.pins == 0 and not entry.resident:
                self._free(key)
            self._cond.notify_all()

    def hint(self, key: Key, when: int) -> None:
        with self._cond:
            self.resident.hint(key, when)

    def set_forecast(self, forward: int, ahead_LE: list, after_first_LE: list) -> None:
        """A cross-token forecast for the policy (policies.Reuse.set_forecast)."""
        with self._cond:
            self.resident.set_forecast(forward, ahead_LE, after_first_LE)

    def layer_counters(self) -> list[dict]:
        """Per MoE layer seen so far: demand hits, late (still loading), misses, bytes read."""
        with self._cond:
            names = ("hits", "late", "misses", "bytes_read")
            return [
                {"layer": m, **dict(zip(names, self._by_layer[m], strict=True))}
                for m in sorted(self._by_layer)
            ]

    def reset_counters(self) -> None:
        """Zero the counters (totals and per layer); entries and the policy stay as they are."""
        with self._cond:
            self.stats = CacheStats()
            self._by_layer.clear()

    def finalize(self) -> None:
        """End of a run: prefetched experts never used count as wasted."""
        with self._cond:
            for entry in self.entries.values():
                if entry.prefetched and not entry.used and entry.state == READY:
                    entry.used = True
                    self.stats.prefetch_wasted += 1
                    self.stats.prefetch_wasted_bytes += self.nbytes

    # ------------------------------------------------------------ I/O threads

    def start_load(self, key: Key, demand: bool, block: bool, when: float = INF) -> int | None:
        """Reserve a slot for key (LOADING); None when present already or no slot is taken.

        A prefetch (used at step `when`) never waits. Whoever creates the entry (demand or
        prefetch) hands it the pins of the claims made while it was absent, so the compute
        thread never sees an unpinned needed expert.
        """
        t0 = time.perf_counter()
        with self._cond:
            while True:
                if key in self.entries:
                    return None  # the claim's pin was handed over when it was created
                slot = self._reserve(key, demand, when)
                if slot is not None:
                    break
                if not demand:
                    self.stats.prefetch_dropped += 1
                    return None
                if not block:
                    return None
                self._wait(t0, f"no cache slot for expert {key}")
            pins = self._wanted.pop(key, 0)  # claims made while it was absent
            assert pins > 0 or not demand, f"demand load of unclaimed expert {key}"
            resident = slot < self.capacity
            entry = _Entry(slot, resident, pins=pins, prefetched=not demand, used=pins > 0)
            if pins and not demand:
                self.stats.prefetch_used += 1
            self.entries[key] = entry
            n_resident = len(self.resident)
            self.stats.peak_entries = max(self.stats.peak_entries, n_resident)
            assert n_resident <= self.capacity and len(self.free) == self.capacity - n_resident
            return slot

    def slot_free_event(self, slot: int):
        """CUDA: the event after which the compute stream no longer reads `slot` (or None)."""
        with self._cond:
            return self._slot_events.get(slot)

    def finish_load(self, key: Key, nbytes: int) -> None:
        with self._cond:
            entry = self.entries[key]
            entry.state = READY
            self.stats.bytes_read += nbytes
            self._by_layer.setdefault(key[0], [0, 0, 0, 0])[3] += nbytes
            if entry.prefetched:
                self.stats.prefetch_loaded += 1
            else:
                self.stats.demand_loads += 1
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
                self._free(key)
            self._error = self._error or error
            self._cond.notify_all()

    # ------------------------------------------------------------ helpers (lock held)

    def _reserve(self, key: Key, demand: bool, when: float) -> int | None:
        """A slot for key: resident (admitted, maybe evicting), scratch (bypass), or None."""
        p = self.resident.place(key, self.now, None if demand else when, self._evictable)
        if p.outcome == "admitted":
            if p.victim is not None:
                self._evict(p.victim)
            return self.free.pop()
        if p.outcome == "refused" and demand and self.scratch_free:
            self.stats.bypassed += 1
            return self.scratch_free.pop()
        return None

    def _evictable(self, key: Key) -> bool:
        entry = self.entries[key]
        return entry.state == READY and entry.pins == 0

    def _evict(self, key: Key) -> None:
        """`key` left the resident set (ResidentSet.place chose it): free its slot."""
        entry = self.entries.pop(key)
        self.free.append(entry.slot)
        self.stats.evictions += 1
        if entry.prefetched and not entry.used:
            self.stats.prefetch_wasted += 1
            self.stats.prefetch_wasted_bytes += self.nbytes

    def _free(self, key: Key) -> None:
        """Drop a scratch entry after use, or any entry whose read failed."""
        entry = self.entries.pop(key)
        if entry.resident:
            self.resident.remove(key)
            self.free.append(entry.slot)
        else:
            self.scratch_free.append(entry.slot)

    def _wait(self, t0: float, what: str) -> None:
        if time.perf_counter() - t0 > self.cfg.wait_timeout_s:
            raise StoreError(
                f"{what} in {self.cfg.wait_timeout_s:.0f} s: expected loads to finish; the "
                f"store's disk is stuck or every slot stays pinned (raise --cache-frac)"
            )
        self._cond.wait(timeout=1.0)
        if self._error is not None:
            raise self._error
