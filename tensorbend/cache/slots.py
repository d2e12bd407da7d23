"""The slot table: which expert holds which cache slot, since when, pinned by whom, at what cost.

Usage (one driver per run: the runtime's `offload.cache.ExpertCache` under its lock, or the
simulator's `simulate.events.EventRun`; times are the driver's clock):
    >>> from tensorbend.cache.policies import LRU
    >>> from tensorbend.cache.resident import Placement, ResidentSet
    >>> table = SlotTable(ResidentSet(1, 1, LRU()), scratch=1, nbytes=16)
    >>> table.now = 0                          # logical clock of the policy: step = forward * L + m
    >>> table.claim((0, 5), t=0.0)             # compute: a demand; the expert is not there
    'absent'
    >>> entry = table.reserve((0, 5), demand=True, t=0.0)   # I/O: admitted, a resident slot
    >>> (entry.slot, entry.pins)               # ... holding the claim's pin from its creation
    (0, 1)
    >>> table.finish((0, 5), 16, at=2.5)       # the read's bytes landed at t = 2.5
    True
    >>> table.ready((0, 5), t=2.0), table.ready((0, 5), t=2.5)
    (False, True)
    >>> table.release((0, 5)).pins             # the expert ran: unpinned, evictable from now on
    0
    >>> table.stats.misses, table.stats.demand_loads, table.stats.bytes_read
    (1, 1, 16)

Keys are (MoE layer m, expert e). An entry holds one of `capacity` resident slots (indices
0..capacity-1) or one of `scratch` staging slots (capacity..capacity+scratch-1): a demand miss
the admission rule refuses (bypass) is read into staging and freed once its layer ran. Which
keys are resident, which one is evicted and whether a miss is kept is `resident.ResidentSet`'s
decision (policy, pool, admission); this table never looks at the policy's type.

Readiness is the driver's: an entry's bytes are in its slot from `ready_at` on (INF while the
read is in flight and its end unknown). The simulator knows the end when it books the wire and
sets `ready_at` itself; the runtime learns it when the read returns (`finish(..., at=now)` on
the wall clock). Every readiness question takes the driver's time `t`: a claim is a hit when
`ready_at <= t`, late when the entry exists but is not ready, a miss when it is absent. An
absent expert's claims are remembered and handed to its entry as pins when the entry is
created (by the demand load or by a prefetch already under way), so a needed expert is never
evictable. Only entries that are ready and unpinned are evictable. A prefetched entry counts
as used at its first claim, as wasted when it is evicted unused or left unused and ready at
`finalize`.

Invariants: resident entries never exceed `capacity`; `free` holds exactly the resident slots
no entry holds.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from tensorbend.cache.policies import INF, Key
from tensorbend.cache.resident import Placement, ResidentSet

_LAYER_COUNTERS = ("hits", "late", "misses", "bytes_read")


@dataclass
class CacheStats:
    hits: int = 0  # needed expert ready when its layer asked
    late: int = 0  # needed expert still loading (prefetched, not in time)
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
    prefetch_paused: int = 0  # waits of a prefetch read for a demand read (real disk)
    evictions: int = 0
    stall_s: float = 0.0  # compute thread waiting for experts
    io_cpu_s: float = 0.0  # I/O threads' CPU time per load (victim search, read, bookkeeping)
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


@dataclass(slots=True)
class Slot:
    """One entry: the slot it holds and its state."""

    slot: int  # index into the driver's buffers (resident first, then staging)
    resident: bool  # holds a resident slot (False: a staging slot, freed after use)
    ready_at: float = INF  # the driver's time its bytes are in the slot (INF: not known yet)
    pins: int = 0  # users that must not lose it (claims not yet released)
    prefetched: bool = False
    used: bool = False  # claimed at least once (a prefetch that was needed)


class SlotTable:
    """Entries, free slots, claims of absent experts and counters; not thread-safe (the driver
    locks)."""

    def __init__(self, resident: ResidentSet, scratch: int, nbytes: int):
        assert scratch >= 1, scratch
        self.resident, self.nbytes = resident, nbytes
        self.capacity = resident.capacity
        self.entries: dict[Key, Slot] = {}
        self.free = list(range(self.capacity - 1, -1, -1))
        self.scratch_free = list(range(self.capacity + scratch - 1, self.capacity - 1, -1))
        self.stats = CacheStats()
        self.now = 0  # the policy's step, set by the driver before claims and reservations
        self.wanted: dict[Key, int] = {}  # claims of absent experts: pins for their entry
        self._by_layer: dict[int, list[int]] = {}  # m -> [hits, late, misses, bytes_read]

    # ------------------------------------------------------------ compute side

    def claim(self, key: Key, t: float) -> str:
        """Count a demand for key at time t; pin it if present. Returns ready, loading or absent."""
        self.resident.use(key, self.now)
        entry = self.entries.get(key)
        layer = self._by_layer.setdefault(key[0], [0, 0, 0, 0])
        if entry is None:
            layer[2] += 1
            self.stats.misses += 1
            self.wanted[key] = self.wanted.get(key, 0) + 1  # pinned once it is created
            return "absent"
        entry.pins += 1
        if entry.prefetched and not entry.used:
            self.stats.prefetch_used += 1
        entry.used = True
        if entry.ready_at <= t:
            layer[0] += 1
            self.stats.hits += 1
            return "ready"
        layer[1] += 1
        self.stats.late += 1
        return "loading"

    def ready(self, key: Key, t: float) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.ready_at <= t

    def release(self, key: Key) -> Slot:
        """The expert ran: unpin; a staging entry frees its slot. Returns the entry."""
        entry = self.entries[key]
        assert entry.pins > 0, f"release of unpinned expert {key}"
        entry.pins -= 1
        if entry.pins == 0 and not entry.resident:
            self.drop(key)
        return entry

    def finalize(self, t: float) -> None:
        """End of a run: prefetched experts ready by t and never used count as wasted."""
        for entry in self.entries.values():
            if entry.prefetched and not entry.used and entry.ready_at <= t:
                entry.used = True
                self._waste()

    # ------------------------------------------------------------ I/O side

    def reserve(self, key: Key, demand: bool, when: float = INF, t: float = INF) -> Slot | None:
        """A new entry for absent `key` (its read starts at time t), or None: no slot is taken.

        A resident slot when the resident set admits key (evicting its victim among the entries
        evictable at t), a staging slot for a refused demand (bypass), else None; a refused
        prefetch (used at step `when`) counts as dropped, a refused demand may wait and retry.
        The entry gets the pins of the claims made while key was absent."""
        assert key not in self.entries, f"{key} has an entry already"
        p = self.resident.place(
            key, self.now, None if demand else when, lambda k: self._evictable(k, t)
        )
        if p.outcome == "admitted":
            if p.victim is not None:
                self.evict(p.victim)
            slot = self.free.pop()
        elif p.outcome == "refused" and demand and self.scratch_free:
            self.stats.bypassed += 1
            slot = self.scratch_free.pop()
        else:
            if not demand:
                self.stats.prefetch_dropped += 1
            return None
        pins = self.wanted.pop(key, 0)
        assert pins > 0 or not demand, f"demand load of unclaimed expert {key}"
        entry = Slot(slot, slot < self.capacity, pins=pins, prefetched=not demand, used=pins > 0)
        if pins and not demand:
            self.stats.prefetch_used += 1
        self.entries[key] = entry
        n_resident = len(self.resident)
        self.stats.peak_entries = max(self.stats.peak_entries, n_resident)
        assert n_resident <= self.capacity and len(self.free) == self.capacity - n_resident
        return entry

    def finish(self, key: Key, nbytes: int, at: float | None = None) -> bool:
        """Key's read completed (`at`: when, for a driver that learns it only now). Counts it;
        False when the entry is gone already (the simulator may evict an entry at the instant
        its read completes, before it applies the completion: then nothing is counted)."""
        entry = self.entries.get(key)
        if entry is None:
            return False
        if at is not None:
            entry.ready_at = at
        self.stats.bytes_read += nbytes
        self._by_layer.setdefault(key[0], [0, 0, 0, 0])[3] += nbytes
        if entry.prefetched:
            self.stats.prefetch_loaded += 1
        else:
            self.stats.demand_loads += 1
        return True

    def preload(self, keys: list[Key], at: float) -> None:
        """Start with these experts resident and ready from `at` (policy resident: every expert)."""
        for key in keys:
            placed = self.resident.place(key, self.now)
            assert placed == Placement("admitted"), "preload beyond capacity"
            self.entries[key] = Slot(self.free.pop(), True, ready_at=at)

    def evict(self, key: Key) -> None:
        """`key` left the resident set (ResidentSet.place chose it): free its slot."""
        entry = self.entries.pop(key)
        self.free.append(entry.slot)
        self.stats.evictions += 1
        if entry.prefetched and not entry.used:
            self._waste()

    def drop(self, key: Key) -> None:
        """Forget an entry: a staging entry after use, or any entry whose read failed."""
        entry = self.entries.pop(key)
        if entry.resident:
            self.resident.remove(key)
            self.free.append(entry.slot)
        else:
            self.scratch_free.append(entry.slot)

    # ------------------------------------------------------------ counters

    def layer_counters(self) -> list[dict]:
        """Per MoE layer seen so far: demand hits, late (still loading), misses, bytes read."""
        return [
            {"layer": m, **dict(zip(_LAYER_COUNTERS, self._by_layer[m], strict=True))}
            for m in sorted(self._by_layer)
        ]

    def reset_counters(self) -> None:
        """Zero the counters (totals and per layer); entries and the policy stay as they are."""
        self.stats = CacheStats()
        self._by_layer.clear()

    def _evictable(self, key: Key, t: float) -> bool:
        entry = self.entries[key]
        return entry.ready_at <= t and entry.pins == 0

    def _waste(self) -> None:
        self.stats.prefetch_wasted += 1
        self.stats.prefetch_wasted_bytes += self.nbytes
