"""The slot table alone (cache/slots.py), no driver: every answer is counted by hand.

Claims of an absent expert become pins of its entry when it is created, by a demand or by a
prefetch; a demand the admission rule refuses is read into a staging slot, kept apart from the
resident capacity and freed after use; prefetches evicted unused and left unused at the end
count as waste; readiness is the driver's time against `ready_at`.
"""

from __future__ import annotations

import pytest

from tensorbend.cache.policies import LRU
from tensorbend.cache.resident import ResidentSet
from tensorbend.cache.slots import SlotTable

A, B, C = (0, 1), (0, 2), (0, 3)


def table(capacity: int, scratch: int = 1) -> SlotTable:
    return SlotTable(ResidentSet(capacity, 1, LRU()), scratch=scratch, nbytes=10)


def test_claims_of_an_absent_expert_pin_its_entry_from_creation():
    t = table(capacity=1)
    assert t.claim(A, t=0.0) == "absent"
    assert t.claim(A, t=0.0) == "absent"  # two users of the same expert (a batch)
    assert t.wanted == {A: 2}
    entry = t.reserve(A, demand=False, when=0, t=0.0)  # a prefetch already under way creates it
    assert (entry.pins, entry.used, entry.prefetched) == (2, True, True)
    assert t.wanted == {} and t.stats.prefetch_used == 1 and t.stats.misses == 2
    t.finish(A, 10, at=1.0)
    assert t.reserve(B, demand=False, when=5, t=2.0) is None  # A is pinned: nothing evictable
    assert t.stats.prefetch_dropped == 1
    t.release(A)
    assert t.reserve(B, demand=False, when=5, t=2.0) is None  # still one pin
    t.release(A)
    assert t.reserve(B, demand=False, when=5, t=2.0) is not None  # now A may go
    assert list(t.entries) == [B] and t.stats.evictions == 1
    assert t.stats.prefetch_wasted == 0  # A was used


def test_a_demand_load_needs_its_claim():
    t = table(capacity=1)
    with pytest.raises(AssertionError, match="unclaimed"):
        t.reserve(A, demand=True, t=0.0)


def test_a_refused_demand_is_read_into_staging_and_freed_after_use():
    t = table(capacity=0, scratch=2)  # policy on_demand: every miss bypasses
    for key in (A, B, C):
        assert t.claim(key, t=0.0) == "absent"
    a = t.reserve(A, demand=True, t=0.0)
    b = t.reserve(B, demand=True, t=0.0)
    assert (a.slot, a.resident, b.slot, b.resident) == (0, False, 1, False)  # capacity + 0, + 1
    assert t.reserve(C, demand=True, t=0.0) is None  # both staging slots busy: the demand waits
    assert t.stats.bypassed == 2 and t.stats.prefetch_dropped == 0
    assert t.reserve((0, 4), demand=False, when=3, t=0.0) is None  # a prefetch never bypasses
    assert t.stats.prefetch_dropped == 1
    t.finish(A, 10, at=0.5)
    assert t.release(A).slot == 0 and A not in t.entries  # used once: gone, slot back
    c = t.reserve(C, demand=True, t=0.5)
    assert (c.slot, c.pins) == (0, 1)
    assert len(t.resident) == 0 and t.stats.peak_entries == 0 and t.free == []


def test_prefetches_evicted_or_left_unused_are_wasted():
    t = table(capacity=1)
    t.now = 0
    a = t.reserve(A, demand=False, when=4, t=0.0)
    a.ready_at = 1.0  # the simulator knows the arrival when it books the wire
    t.finish(A, 10)
    assert t.reserve(B, demand=False, when=2, t=0.5) is None  # A not ready at 0.5: not evictable
    b = t.reserve(B, demand=False, when=2, t=1.0)  # A evicted unused
    assert (b.slot, t.stats.evictions, t.stats.prefetch_wasted) == (0, 1, 1)
    assert t.stats.prefetch_wasted_bytes == 10
    t.finish(B, 10, at=3.0)
    t.finalize(t=2.9)  # B lands after the end: not counted
    assert t.stats.prefetch_wasted == 1
    t.finalize(t=3.0)  # B landed, never used
    assert (t.stats.prefetch_wasted, t.stats.prefetch_wasted_bytes) == (2, 20)
    t.finalize(t=4.0)  # counted once
    assert t.stats.prefetch_wasted == 2
    assert (t.stats.prefetch_loaded, t.stats.bytes_read, t.stats.demand_loads) == (2, 20, 0)


def test_readiness_is_the_drivers_time_against_ready_at():
    t = table(capacity=2)
    t.claim(A, t=0.0)
    t.reserve(A, demand=True, t=0.0).ready_at = 2.5
    assert not t.ready(A, 2.4) and t.ready(A, 2.5)
    t.release(A)
    assert t.claim(A, t=2.0) == "loading"  # late: present, not landed
    t.release(A)
    assert t.claim(A, t=2.5) == "ready"
    assert (t.stats.misses, t.stats.late, t.stats.hits) == (1, 1, 1)
    assert t.layer_counters() == [{"layer": 0, "hits": 1, "late": 1, "misses": 1, "bytes_read": 0}]
    assert t.finish(A, 10) and not t.finish(C, 10)  # a completion for an entry that is gone
    assert t.layer_counters()[0]["bytes_read"] == 10
    t.reset_counters()
    assert t.stats.demands == 0 and t.layer_counters() == [] and A in t.entries


def test_preload_fills_resident_slots_ready_from_the_start():
    t = table(capacity=2)
    t.preload([A, B], at=0.0)
    assert [t.entries[k].slot for k in (A, B)] == [0, 1] and t.free == []
    assert t.claim(B, t=0.0) == "ready" and t.stats.bytes_read == 0
    with pytest.raises(AssertionError, match="beyond capacity"):
        t.preload([C], at=0.0)
