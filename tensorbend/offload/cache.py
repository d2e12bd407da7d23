"""A bounded pool of expert slots in fast memory, with eviction policies kept apart from it.

Usage:
    >>> cache = ExpertCache(CacheConfig(capacity=48), layout, LRU())
    >>> cache.now = step                          # logical clock: one step per (forward, MoE layer)
    >>> state = cache.claim((m, e))               # "ready" | "loading" | "absent"; pins if present
    >>> slot = cache.start_load((m, e), demand=True, block=True)   # I/O thread: reserve a slot
    >>> cache.finish_load((m, e), nbytes)         # ... after reading into cache.buffer(slot)
    >>> ready = cache.wait_ready(keys)            # compute thread: blocks (stall) until >= 1 ready
    >>> cache.release((m, e))                     # unpin after the expert ran

Keys are (MoE layer m, expert e). An entry is LOADING (a read is in flight into its slot) or
READY; `pins` counts users that must not lose it. Invariant: entries (loading or ready) never
exceed `capacity`; only READY entries with no pins are evicted. Demand loads block for a slot
(one frees as soon as the compute thread finishes an expert, so they cannot deadlock);
prefetches never block: with no evictable slot, or when the policy says the victim is worth more
than the prefetch, they are dropped.

Policies decide only *which* entry goes: `LRU`, `LFU` (all-time counts per key), `Predicted`
(farthest estimated next use: predictions first, then layer cycle and recent use rate) and
`NextUse` (farthest exact next use from a recorded trace: Belady's MIN). Counters live in
`CacheStats`.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from tensorbend.errors import StoreError

Key = tuple[int, int]  # (MoE layer m, expert e)
LOADING, READY = 0, 1
INF = float("inf")


@dataclass(frozen=True)
class CacheConfig:
    capacity: int
    """Expert slots in fast memory (all routed experts are the same size)."""
    keep: bool = True
    """Keep experts after use; False frees a slot as soon as its expert ran (policy on_demand)."""
    device: str = "cpu"
    """Where slots live: cpu, or cuda (copies then go through pinned staging + a copy stream)."""
    wait_timeout_s: float = 300.0
    """A wait longer than this means a bug or a dead disk: raise instead of hanging."""

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise StoreError(
                f"expert cache capacity: expected >= 1 slot, found {self.capacity} "
                f"(raise --cache-frac)"
            )


@dataclass
class CacheStats:
    hits: int = 0  # needed expert READY when its layer asked
    late: int = 0  # needed expert still LOADING (prefetched, not in time)
    misses: int = 0  # needed expert absent: demand load
    bytes_read: int = 0
    demand_loads: int = 0
    prefetch_issued: int = 0  # prefetch requests queued
    prefetch_loaded: int = 0  # ... that were read
    prefetch_used: int = 0  # ... read and then needed before eviction
    prefetch_wasted: int = 0  # ... read and evicted (or left at the end) unused
    prefetch_wasted_bytes: int = 0
    prefetch_cancelled: int = 0  # stale before their read started
    prefetch_dropped: int = 0  # no slot worth taking
    evictions: int = 0
    stall_s: float = 0.0  # compute thread waiting for experts
    peak_entries: int = 0

    @property
    def demands(self) -> int:
        return self.hits + self.late + self.misses

    @property
    def demand_hit_rate(self) -> float:
        return self.hits / self.demands if self.demands else 1.0

    def copy(self) -> CacheStats:
        return CacheStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def minus(self, other: CacheStats) -> CacheStats:
        out = self.copy()
        for f in fields(self):
            if f.name != "peak_entries":
                setattr(out, f.name, getattr(self, f.name) - getattr(other, f.name))
        return out


@dataclass
class _Entry:
    slot: int
    state: int = LOADING
    pins: int = 0
    prefetched: bool = False
    used: bool = False
    last: tuple[int, int] = (0, 0)  # (clock, sequence) of the last access


class LRU:
    name = "lru"

    def touch(self, key: Key, now: int) -> None:
        pass

    def rank(self, key: Key, entry: _Entry, now: int):  # the highest rank is evicted
        return (0, _neg(entry.last))

    def hint(self, key: Key, when: int) -> None:
        pass


class LFU(LRU):
    name = "lfu"

    def __init__(self) -> None:
        self.counts: dict[Key, int] = {}

    def touch(self, key: Key, now: int) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def rank(self, key: Key, entry: _Entry, now: int):
        return (-self.counts.get(key, 0), _neg(entry.last))


class NextUse(LRU):
    """Belady's MIN: evict the entry whose exact next use (from a recorded trace) is farthest."""

    name = "belady"

    def __init__(self, next_use: Callable[[Key, int], float]):
        self.next_use = next_use

    def when(self, key: Key, now: int) -> float:
        return self.next_use(key, now)

    def rank(self, key: Key, entry: _Entry, now: int):
        return (self.when(key, now), _neg(entry.last))


class Predicted(NextUse):
    """Evict the farthest *estimated* next use; keep what is predicted soon.

    A predicted expert (`hint(key, step)`, step not passed yet) is next used at that step. Any
    other expert of MoE layer m can next be used when layer m comes round again, which is
    one forward later if a prediction for that visit left it out; we stretch that visit by the
    odds against use, (1 - p) / p visits, where p is the expert's recent use rate per visit
    (decayed count, `decay` per forward). Without predictions this is a layer-cycle-aware LFU.
    """

    name = "predicted"

    def __init__(self, num_layers: int, decay: float = 0.9):
        self.L, self.decay = num_layers, decay
        self.hints: dict[Key, int] = {}
        self.layer_hint: dict[int, int] = {}  # m -> latest predicted step of layer m
        self.use: dict[Key, tuple[float, int]] = {}  # key -> (decayed count, step of last use)

    def touch(self, key: Key, now: int) -> None:
        self.use[key] = (self._count(key, now) + 1.0, now)

    def hint(self, key: Key, when: int) -> None:
        self.hints[key] = when
        self.layer_hint[key[0]] = max(when, self.layer_hint.get(key[0], -1))

    def when(self, key: Key, now: int) -> float:
        h = self.hints.get(key)
        if h is not None and h >= now:
            return h
        m, L = key[0], self.L
        visit = now - now % L + m
        if visit <= now:
            visit += L
        if self.layer_hint.get(m, -1) >= visit:
            visit += L  # predicted set for that visit excludes this expert
        p = min(1.0, self._count(key, now) * (1 - self.decay))
        return visit + L * (1 - p) / max(p, 1e-3)

    def _count(self, key: Key, now: int) -> float:
        c, t = self.use.get(key, (0.0, now))
        return c * self.decay ** ((now - t) / self.L)


class ExpertCache:
    """Slots + entries + counters; every method is thread-safe."""

    def __init__(self, cfg: CacheConfig, numel: int, dtype: torch.dtype, policy: LRU, nbytes: int):
        self.cfg, self.policy, self.nbytes = cfg, policy, nbytes
        self.device = torch.device(cfg.device)
        self.pool_CN = torch.empty(cfg.capacity, numel, dtype=dtype, device=self.device)
        self.entries: dict[Key, _Entry] = {}
        self.free = list(range(cfg.capacity - 1, -1, -1))
        self.stats = CacheStats()
        self.now = 0
        self._seq = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._wanted: dict[Key, int] = {}  # claims of absent experts: pins for their entry

    def buffer(self, slot: int) -> torch.Tensor:
        return self.pool_CN[slot]

    def weights(self, key: Key) -> torch.Tensor:
        return self.pool_CN[self.entries[key].slot]

    # ------------------------------------------------------------ compute thread

    def claim(self, key: Key) -> str:
        """Count a demand for key; pin it if present. Returns ready, loading or absent."""
        with self._cond:
            self.policy.touch(key, self.now)
            entry = self.entries.get(key)
            if entry is None:
                self.stats.misses += 1
                self._wanted[key] = self._wanted.get(key, 0) + 1  # pinned once it is created
                return "absent"
            entry.pins += 1
            self._touch(entry)
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
                if time.perf_counter() - t0 > self.cfg.wait_timeout_s:
                    raise StoreError(
                        f"expert loads for {sorted(keys)[:4]} did not finish in "
                        f"{self.cfg.wait_timeout_s:.0f} s: the store's disk is stuck"
                    )
                self._cond.wait(timeout=1.0)

    def release(self, key: Key) -> None:
        with self._cond:
            entry = self.entries[key]
            assert entry.pins > 0, f"release of unpinned expert {key}"
            entry.pins -= 1
            if entry.pins == 0 and not self.cfg.keep:
                self._evict(key)
            self._cond.notify_all()

    def hint(self, key: Key, when: int) -> None:
        with self._cond:
            self.policy.hint(key, when)

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
        """Reserve a slot for key (LOADING). None when present already or (prefetch) no slot.

        Whoever creates the entry (demand or prefetch) hands it the pins of the claims made
        while it was absent, so the compute thread never sees an unpinned needed expert.
        """
        t0 = time.perf_counter()
        with self._cond:
            while True:
                entry = self.entries.get(key)
                if entry is not None:
                    return None  # the claim's pin was handed over when it was created
                if self.free:
                    break
                victim = self._victim()
                if victim is not None and (demand or self._worth(victim, when)):
                    self._evict(victim)
                    break
                if not block:
                    self.stats.prefetch_dropped += 1
                    return None
                if time.perf_counter() - t0 > self.cfg.wait_timeout_s:
                    raise StoreError(
                        f"no cache slot for expert {key} in {self.cfg.wait_timeout_s:.0f} s: "
                        f"all {self.cfg.capacity} slots stay pinned (raise --cache-frac)"
                    )
                self._cond.wait(timeout=1.0)
                if self._error is not None:
                    raise self._error
            slot = self.free.pop()
            pins = self._wanted.pop(key, 0)  # claims made while it was absent
            assert pins > 0 or not demand, f"demand load of unclaimed expert {key}"
            entry = _Entry(slot, LOADING, pins=pins, prefetched=not demand, used=pins > 0)
            if pins and not demand:
                self.stats.prefetch_used += 1
            self._touch(entry)
            self.entries[key] = entry
            self.stats.peak_entries = max(self.stats.peak_entries, len(self.entries))
            assert len(self.entries) <= self.cfg.capacity
            return slot

    def finish_load(self, key: Key, nbytes: int) -> None:
        with self._cond:
            entry = self.entries[key]
            entry.state = READY
            self.stats.bytes_read += nbytes
            if entry.prefetched:
                self.stats.prefetch_loaded += 1
            else:
                self.stats.demand_loads += 1
            if entry.pins == 0 and not self.cfg.keep and not entry.prefetched:
                self._evict(key)
            self._cond.notify_all()

    def abort(self) -> None:
        """Wake every waiter with an error (the run is over, e.g. after an exception)."""
        with self._cond:
            self._error = self._error or StoreError("the offloaded run was closed")
            self._cond.notify_all()

    def fail_load(self, key: Key, error: BaseException) -> None:
        """A read failed: drop the entry and hand the error to the compute thread."""
        with self._cond:
            entry = self.entries.pop(key, None)
            if entry is not None:
                self.free.append(entry.slot)
            self._error = self._error or error
            self._cond.notify_all()

    # ------------------------------------------------------------ helpers (lock held)

    def _touch(self, entry: _Entry) -> None:
        self._seq += 1
        entry.last = (self.now, self._seq)

    def _victim(self) -> Key | None:
        cands = [(k, e) for k, e in self.entries.items() if e.state == READY and e.pins == 0]
        if not cands:
            return None
        return max(cands, key=lambda ke: self.policy.rank(ke[0], ke[1], self.now))[0]

    def _worth(self, victim: Key, when: float) -> bool:
        """Evict victim for a prefetch needed at `when` only if victim is needed later."""
        if not isinstance(self.policy, NextUse):
            return True  # LRU / LFU: no notion of when
        return self.policy.when(victim, self.now) > when

    def _evict(self, key: Key) -> None:
        entry = self.entries.pop(key)
        self.free.append(entry.slot)
        self.stats.evictions += 1
        if entry.prefetched and not entry.used:
            self.stats.prefetch_wasted += 1
            self.stats.prefetch_wasted_bytes += self.nbytes


def trace_next_use(steps_by_key: dict[Key, list[int]]) -> Callable[[Key, int], float]:
    """Exact next use after `now` from sorted access steps per key (Belady's MIN)."""

    def next_use(key: Key, now: int) -> float:
        steps = steps_by_key.get(key)
        if not steps:
            return INF
        i = bisect.bisect_right(steps, now)
        return steps[i] if i < len(steps) else INF

    return next_use


def _neg(last: tuple[int, int]) -> tuple[int, int]:
    return (-last[0], -last[1])
