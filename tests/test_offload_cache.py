"""Expert cache mechanism: hand-counted counters, bypass, capacity under stress, no deadlock.

Policies alone (no threads) are tested in test_offload_policies.py."""

import random
import threading
import time

import pytest
import torch

from tensorbend.cache.admission import AdmitFrequent
from tensorbend.cache.policies import LFU, LRU, NextUse
from tensorbend.cache.predicted import Predicted
from tensorbend.cache.resident import ResidentSet
from tensorbend.errors import StoreError
from tensorbend.offload.cache import CacheConfig, ExpertCache


def _cache(capacity, policy, num_layers=1, scratch=1, **kw):
    rs = ResidentSet(capacity, num_layers, policy, **kw)
    return ExpertCache(CacheConfig(scratch=scratch), rs, 4, torch.float32, nbytes=16)


def _demand(cache, key):
    """What the compute thread + an I/O thread do for one needed expert (synchronously)."""
    if cache.claim(key) == "absent":
        slot = cache.start_load(key, demand=True, block=False)
        assert slot is not None
        cache.finish_load(key, 16)
    assert cache.wait_ready([key]) == [key]
    cache.release(key)


def _replay(cache, seq):
    for step, e in enumerate(seq):
        cache.now = step
        _demand(cache, (0, e))
    return cache.stats


def test_lru_counts_by_hand():
    # capacity 2: A B A C B -> miss miss hit miss(evicts B) miss(evicts A)
    s = _replay(_cache(2, LRU()), [0, 1, 0, 2, 1])
    assert (s.hits, s.misses, s.evictions, s.bytes_read) == (1, 4, 2, 64)
    assert s.demand_hit_rate == pytest.approx(0.2)


def test_lfu_keeps_the_frequent_one():
    # A A A B C A, capacity 2: LFU evicts B (count 1) for C and hits A at the end;
    # LRU evicts A (least recent) for C and misses it.
    s = _replay(_cache(2, LFU()), [0, 0, 0, 1, 2, 0])
    assert (s.hits, s.misses) == (3, 3)
    s = _replay(_cache(2, LRU()), [0, 0, 0, 1, 2, 0])
    assert (s.hits, s.misses) == (2, 4)


def test_belady_is_optimal_on_a_known_sequence():
    seq = [0, 1, 2, 0, 1, 3, 0, 1, 2, 3]
    steps = {}
    for t, e in enumerate(seq):
        steps.setdefault((0, e), []).append(t)
    s = _replay(_cache(3, NextUse(steps, num_layers=1)), seq)
    # MIN with 3 slots: misses 0 1 2 3(evicts 2) 2(evicts 0 or 1, both unused later) -> 5 misses
    assert (s.hits, s.misses) == (5, 5)


def test_on_demand_keeps_nothing_after_use():
    cache = _cache(0, LRU(), scratch=2)  # no resident slots: every miss uses a staging slot
    s = _replay(cache, [0, 0, 1, 1])
    assert (s.hits, s.misses, s.bypassed) == (0, 4, 4) and not cache.entries
    assert sorted(cache.slots.scratch_free) == [0, 1]


def test_bypassed_miss_is_computed_and_not_kept():
    # capacity 1, TinyLFU window 3 steps: A B A B C A B (hand count in test_offload_policies)
    cache = _cache(1, LRU(), admission=AdmitFrequent(3))
    s = _replay(cache, [0, 1, 0, 1, 2, 0, 1])
    assert (s.hits, s.misses, s.bypassed, s.evictions) == (2, 5, 3, 1)
    assert s.bytes_read == 5 * 16  # a bypassed expert is read (into staging) all the same
    assert list(cache.entries) == [(0, 1)] and cache.slots.scratch_free == [1]


def test_prefetch_counters_used_and_wasted():
    cache = _cache(2, Predicted(num_layers=10))
    for e in (0, 1):
        cache.hint((0, e), 5)
        assert cache.start_load((0, e), demand=False, block=False, when=5) is not None
        cache.finish_load((0, e), 16)
    # a prefetch for step 9 must not evict experts predicted for step 5 ... until step 5 passes;
    cache.now = 4
    assert cache.start_load((0, 2), demand=False, block=False, when=9) is None
    cache.now = 5
    _demand(cache, (0, 0))  # used prefetch: a hit
    # then the never-used prefetched expert 1 has the farthest estimated next use
    cache.now = 6
    assert cache.start_load((0, 2), demand=False, block=False, when=9) is not None
    cache.finish_load((0, 2), 16)
    cache.finalize()
    s = cache.stats
    assert (s.hits, s.prefetch_loaded, s.prefetch_used) == (1, 3, 1)
    assert s.prefetch_dropped == 1 and s.prefetch_wasted == 2 and s.prefetch_wasted_bytes == 32


def test_prefetch_never_blocks_when_everything_is_pinned():
    cache = _cache(1, LRU())
    assert cache.claim((0, 0)) == "absent"
    cache.start_load((0, 0), demand=True, block=True)
    assert cache.start_load((0, 1), demand=False, block=False) is None  # returns, no deadlock
    cache.finish_load((0, 0), 16)
    cache.release((0, 0))


def test_failed_read_reaches_the_compute_thread():
    cache = _cache(2, LRU())
    cache.claim((0, 0))
    cache.start_load((0, 0), demand=True, block=True)
    cache.fail_load((0, 0), StoreError("expert store /x/experts.safetensors: short read"))
    with pytest.raises(StoreError, match="/x/experts.safetensors"):
        cache.wait_ready([(0, 0)])


@pytest.mark.parametrize(
    "policy", [LRU, LFU, lambda: Predicted(3)], ids=["lru", "lfu", "predicted"]
)
def test_stress_capacity_never_exceeded_and_no_deadlock(policy):
    """Many I/O threads, random prefetches and hints, a compute thread demanding random sets."""
    cap = 6
    cache = _cache(cap, policy())
    stop = threading.Event()
    violations, errors = [], []

    def io_thread(seed):
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                key = (rng.randrange(3), rng.randrange(8))
                cache.hint(key, cache.now + rng.randrange(4))
                if cache.start_load(key, demand=False, block=False) is not None:
                    cache.finish_load(key, 16)
                time.sleep(0)  # yield the GIL: a read would release it here
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def watcher():
        while not stop.is_set():
            if len(cache.entries) > cap:
                violations.append(len(cache.entries))
            time.sleep(0)

    threads = [threading.Thread(target=io_thread, args=(i,)) for i in range(6)]
    threads.append(threading.Thread(target=watcher))
    for t in threads:
        t.start()
    rng = random.Random(99)
    demand_done = threading.Event()

    def demander():
        for step in range(300):
            cache.now = step
            keys = {(step % 3, e) for e in rng.sample(range(8), 4)}
            for k in keys:
                if cache.claim(k) == "absent":
                    # an I/O thread's role: a blocking demand load
                    if cache.start_load(k, demand=True, block=True) is not None:
                        cache.finish_load(k, 16)
            left = set(keys)
            while left:
                for k in cache.wait_ready(left):
                    cache.release(k)
                    left.discard(k)
        demand_done.set()

    d = threading.Thread(target=demander)
    d.start()
    d.join(timeout=60)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    assert demand_done.is_set(), "demand thread deadlocked"
    assert not errors and not violations
    s = cache.stats
    assert s.peak_entries <= cap and s.demands == 1200 and len(cache.resident) <= cap
    assert s.prefetch_loaded > 0 and s.evictions > 0  # the I/O threads really competed
    assert all(e.pins == 0 for e in cache.entries.values())


def test_prefetch_racing_a_demand_hands_over_the_pin():
    """Claimed while absent, then created by a prefetch: it must be pinned for the claimer."""
    cache = _cache(1, LRU())
    assert cache.claim((0, 0)) == "absent"
    assert cache.start_load((0, 0), demand=False, block=False) is not None
    cache.finish_load((0, 0), 16)
    assert cache.entries[(0, 0)].pins == 1  # cannot be evicted before the layer used it
    assert cache.start_load((0, 0), demand=True, block=True) is None  # the demand finds it
    assert cache.start_load((0, 1), demand=False, block=False) is None  # no evictable slot
    cache.release((0, 0))
    assert cache.entries[(0, 0)].pins == 0 and cache.stats.prefetch_used == 1


def test_loader_queue_order_demand_then_soonest_then_rank():
    """No I/O threads: inspect the queue the threads would serve, in order."""
    from tensorbend.offload.loader import Loader

    cache = _cache(4, LRU())
    loader = Loader(store=None, cache=cache, threads=0, prefetch_threads=0)
    loader.prefetch((1, 0), priority=0, when=10)  # the next token's layer: needed later
    loader.prefetch((0, 5), priority=3, when=5)  # this token: sooner, though ranked lower
    loader.prefetch((0, 6), priority=1, when=5)
    loader.prefetch((0, 7), priority=0, when=4)
    loader.demand((0, 3))
    loader.demand((0, 7))  # upgrades the queued prefetch
    assert loader.prefetch((0, 6), priority=0, when=5) is False  # queued already
    loader.cancel_stale(4)  # nothing stale left: (0, 7) became a demand
    order = []
    while loader.queue:
        req = loader.queue.pop()
        order.append((req.kind, req.key))
    assert order == [(0, (0, 3)), (0, (0, 7)), (1, (0, 6)), (1, (0, 5)), (1, (1, 0))]
    assert cache.stats.prefetch_issued == 4 and cache.stats.prefetch_cancelled == 0
    loader.prefetch((0, 9), priority=0, when=6)
    loader.cancel_stale(6)
    assert cache.stats.prefetch_cancelled == 1
    loader.close()


def _slow_loader(tmp_path, transfer_s: float):
    """Real I/O threads (2) over a real store of a tiny deepseek_v3 whose emulated link takes
    `transfer_s` per expert, a backlog of half a transfer; (loader, store, cache, order of the
    store's own reads)."""
    from tiny_models import build

    from tensorbend.cache.transfers import Link
    from tensorbend.models import describe_model, moe_block
    from tensorbend.offload.layout import ExpertLayout
    from tensorbend.offload.loader import Loader
    from tensorbend.offload.store import ExpertStore, write_store

    model = build("deepseek_v3")
    spec = describe_model(model)
    experts = [getattr(moe_block(model, spec, m), spec.experts_attr)
               for m in range(spec.num_moe_layers)]  # fmt: skip
    layout = ExpertLayout.of(experts[0])
    path = write_store(experts, layout, tmp_path / "experts.safetensors", {"fingerprint": "t"})
    order = []

    class Recording(ExpertStore):
        def read_into(self, m, e, out_flat, pause=None):
            n = super().read_into(m, e, out_flat, pause)
            order.append((m, e))
            return n

    link = Link(bandwidth_Bps=layout.nbytes / transfer_s)
    store = Recording.open(path, link=link)
    rs = ResidentSet(8, spec.num_moe_layers, LRU())
    cache = ExpertCache(CacheConfig(scratch=1), rs, layout.numel, layout.dtype, layout.nbytes)
    loader = Loader(store, cache, threads=2, max_backlog_s=0.5 * link.seconds(layout.nbytes))
    return loader, store, cache, order


def test_loader_threads_defer_a_prefetch_behind_a_busy_wire_and_serve_a_later_demand_first(
    tmp_path,
):
    """Real I/O threads reading a real store over an emulated link (one transfer = 0.4 s) with
    a backlog of half a transfer. Demand A takes the wire; prefetch P, taken while 0.4 s are
    booked, goes back to the queue (it used to be dropped); demand B, queued meanwhile, is read
    before it; P is read once the wire has at most 0.2 s booked ahead. Order from the store's
    own reads, which end in the wire's booked order."""
    loader, store, cache, order = _slow_loader(tmp_path, 0.4)
    try:
        assert cache.claim((0, 0)) == "absent"  # what the compute thread does at a miss
        loader.demand((0, 0))
        time.sleep(0.02)  # A is on the wire
        assert loader.prefetch((0, 1), priority=0, when=9)
        time.sleep(0.02)  # P was taken and put back
        assert cache.claim((0, 2)) == "absent"
        loader.demand((0, 2))
        deadline = time.monotonic() + 20
        while len(order) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cache.wait_ready([(0, 0), (0, 2)]) == [(0, 0), (0, 2)]
    finally:
        loader.close()
        store.close()
    assert order == [(0, 0), (0, 2), (0, 1)]
    assert cache.stats.prefetch_loaded == 1 and cache.stats.prefetch_dropped == 0


def test_a_thread_holding_a_prefetch_back_is_not_woken_by_new_prefetches(tmp_path):
    """Demand A holds the wire for 1 s (one thread reads it); prefetch P1 sends the other
    thread into its wait (one put_back). P2..P6, queued while it waits, would wait for the
    same wire: they wake no one (each wake-up is a pop, a put_back and the interpreter lock
    taken from the compute thread; the rule once woke the thread at every prefetch: six
    put_backs). A demand does wake it, and is read before every prefetch. Counts from the
    queue's own put_back calls."""
    loader, store, cache, order = _slow_loader(tmp_path, 1.0)
    backs = []
    put_back = loader.queue.put_back
    loader.queue.put_back = lambda req: (backs.append(req.key), put_back(req))[1]
    try:
        assert cache.claim((0, 0)) == "absent"
        loader.demand((0, 0))
        time.sleep(0.03)  # A is on the wire: 1 s booked, the backlog allows 0.5 s
        for e in range(1, 7):
            assert loader.prefetch((1, e), priority=0, when=9)
            time.sleep(0.03)
        held = len(backs)
        assert cache.claim((0, 7)) == "absent"
        loader.demand((0, 7))
        deadline = time.monotonic() + 20
        while len(order) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        loader.close()
        store.close()
    assert held == 1, backs
    assert order[:2] == [(0, 0), (0, 7)]


def test_a_prefetch_read_waits_while_a_demand_read_is_on_the_disk(tmp_path, monkeypatch):
    """Real I/O threads reading a real store with O_DIRECT (no emulated link): a prefetch read
    goes in parts (PAUSE_CHUNK, made one block here so a tiny expert has several) and, between
    parts, waits while a demand read is in flight. Demand A is held inside its read; prefetch
    P reads its first part, then waits (counted in prefetch_paused) and does not finish; once
    A's read ends, P finishes with its exact bytes. The store's own reads give the order."""
    from tiny_models import build

    from tensorbend.models import describe_model, moe_block
    from tensorbend.offload import blocks
    from tensorbend.offload.layout import ExpertLayout
    from tensorbend.offload.loader import Loader
    from tensorbend.offload.store import ExpertStore, StoreConfig, write_store

    monkeypatch.setattr(blocks, "PAUSE_CHUNK", 4096)
    model = build("deepseek_v3", moe_intermediate_size=128)  # experts of 48 KB: 12 blocks
    spec = describe_model(model)
    experts = [getattr(moe_block(model, spec, m), spec.experts_attr)
               for m in range(spec.num_moe_layers)]  # fmt: skip
    layout = ExpertLayout.of(experts[0])
    assert layout.nbytes > 3 * 4096, "the expert must span several parts"
    path = write_store(experts, layout, tmp_path / "experts.safetensors", {"fingerprint": "t"})
    order, started, release = [], threading.Event(), threading.Event()

    class Held(ExpertStore):
        def read_into(self, m, e, out_flat, pause=None):
            if pause is None:  # the demand: held inside its read until released
                started.set()
                assert release.wait(20)
            n = super().read_into(m, e, out_flat, pause)
            order.append((m, e))
            return n

    try:
        store = Held.open(path, StoreConfig("direct"))
    except StoreError as e:  # e.g. tmpfs: no O_DIRECT, so no parted read to test
        pytest.skip(f"this filesystem refuses O_DIRECT: {e}")
    rs = ResidentSet(8, spec.num_moe_layers, LRU())
    cache = ExpertCache(CacheConfig(scratch=1), rs, layout.numel, layout.dtype, layout.nbytes)
    loader = Loader(store, cache, threads=2)
    try:
        assert cache.claim((0, 0)) == "absent"
        loader.demand((0, 0))
        assert started.wait(20)
        assert loader.prefetch((0, 1), priority=0, when=9)
        deadline = time.monotonic() + 20
        while cache.stats.prefetch_paused == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cache.stats.prefetch_paused >= 1 and order == []  # P waits; A is held
        release.set()
        assert cache.wait_ready([(0, 0)]) == [(0, 0)]
        while len(order) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert order == [(0, 0), (0, 1)]
        slot = cache.entries[(0, 1)].slot
        for name, part in layout.views(cache.buffer(slot)).items():
            assert torch.equal(part, getattr(experts[0], name)[1]), name
    finally:
        release.set()
        loader.close()
        store.close()
