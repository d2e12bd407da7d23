"""The simulator picks the runtime's victims: same ResidentSet, same slot table, same order.

1. A recorded sequence (the routing of a tiny model's resident run) is replayed through the
   runtime's own `ExpertCache` (driven in the order its compute and I/O threads act, with
   instant loads) and through the simulator: the victims, in order, are identical for every
   policy, with predictions (prefetch + hints) and without. Both drive `cache.slots.SlotTable`;
   what this checks is that the two drivers call it in the same order.
2. The threaded runtime itself (`OffloadSession.run_policy`, one I/O thread, no link cap)
   and the simulator count the same hits, misses and evictions for lru, lfu and lfru. With
   prefetches, what the threaded runtime counts depends on when its I/O thread runs: part 1
   drives that order by hand.
(The indexed victim search both use returns ResidentSet's victims: tests/test_victim_heap.py.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_offload_runtime import _session

from tensorbend.cache.config import PolicyConfig, make_resident_set
from tensorbend.cache.resident import ResidentSet
from tensorbend.cache.transfers import Link
from tensorbend.offload.cache import CacheConfig, ExpertCache
from tensorbend.simulate.events import EventRun, ForwardWork, IOThreads, LayerWork, Times
from tensorbend.simulate.plan import steps_by_key


@pytest.fixture(scope="module")
def recorded():
    torch.set_num_threads(1)
    sess = _session("qwen3_moe", n_new=6)
    yield sess, [t.clone() for t in sess.reference.ids]
    sess.close()


def work_of(ids_per_forward, predict=None) -> list[ForwardWork]:
    """Demand per layer from recorded routing; `predict(f, m)` -> ranked ids for target m, issued
    at the router of m - 1 (d1) for step f * L + m."""
    work = []
    for f, ids_TLK in enumerate(ids_per_forward):
        L = ids_TLK.shape[1]
        layers = []
        for m in range(L):
            e, n = torch.unique(ids_TLK[:, m].long(), return_counts=True)
            layers.append(LayerWork(demand=list(zip(e.tolist(), n.tolist(), strict=True))))
        if predict is not None:
            for m in range(1, L):
                layers[m - 1].at_router.append((f * L + m, predict(f, m)))
        work.append(
            ForwardWork(phase=int(ids_TLK.shape[0] == 1), tokens=ids_TLK.shape[0], layers=layers)
        )
    return work


def victims_of(rs: ResidentSet) -> list:
    out, remove = [], rs.remove

    def record(key):
        out.append(key)
        remove(key)

    rs.remove = record
    return out


def simulate_victims(work, rs, K) -> list:
    out = victims_of(rs)
    run = EventRun(
        rs,
        IOThreads(Link(), 1, float("inf")),
        Times(lambda n: 0.0, lambda n: 0.0, lambda n: 0.0),
        scratch=K,
        unit_bytes=1,
    )
    run.run(work)
    return out


def runtime_victims(work, rs, K) -> list:
    """The runtime's ExpertCache, driven as its threads act: the compute thread claims a layer's
    experts (router hook), then predicts (hints + queued prefetches); the one I/O thread reads
    demands first, then prefetches by rank; the compute thread runs and releases each expert."""
    out = victims_of(rs)
    cache = ExpertCache(CacheConfig(scratch=K), rs, 1, torch.float32, 1)
    for f, fw in enumerate(work):
        L = len(fw.layers)
        for g, lw in enumerate(fw.layers):
            cache.now = f * L + g
            keys = [(g, e) for e, _ in lw.demand]
            absent = [k for k in keys if cache.claim(k) == "absent"]
            queued = []
            for when, ids in lw.at_router:
                for rank, e in enumerate(ids):
                    key = (when % L, e)
                    cache.hint(key, when)
                    if key not in cache.entries and key not in [q[1] for q in queued]:
                        queued.append(((when, rank), key, when))
            for k in absent:
                assert cache.start_load(k, demand=True, block=False) is not None
                cache.finish_load(k, 1)
            for _, k, when in sorted(queued, key=lambda q: q[0]):
                if cache.start_load(k, demand=False, block=False, when=when) is not None:
                    cache.finish_load(k, 1)
            for k in keys:
                cache.release(k)
    return out


def noisy_oracle(ids_per_forward, E):
    """The true experts with one wrong guess in front: prefetches that are used and wasted."""

    def predict(f, m):
        true = ids_per_forward[f][:, m].flatten().unique().tolist()
        wrong = [(e + 3) % E for e in true if (e + 3) % E not in true][:1]
        return wrong + true

    return predict


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru", "prefetch", "oracle"])
def test_simulator_and_runtime_cache_pick_the_same_victims(recorded, policy):
    sess, ids = recorded
    L, E, K = sess.spec.num_moe_layers, sess.spec.num_experts, sess.spec.top_k
    predict = noisy_oracle(ids, E) if policy in ("prefetch", "oracle") else None
    work = work_of(ids, predict)
    steps = steps_by_key(work)
    slots = round(0.5 * L * E)
    sim = simulate_victims(work, make_resident_set(policy, slots, L, steps=steps), K)
    run = runtime_victims(work, make_resident_set(policy, slots, L, steps=steps), K)
    assert len(sim) > 10  # the sequence does evict
    assert sim == run


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru"])
def test_threaded_runtime_and_simulator_count_the_same(recorded, policy):
    """Up to three threaded runs, one of which must count exactly what the simulator does. In
    the simulator the I/O thread reserves a layer's next miss the instant the previous load
    lands, while that expert is still pinned; the runtime's I/O thread does so a few us after
    `finish_load`, so the compute thread may have computed and released that expert first,
    making it a candidate victim. The one mismatch seen (lfu, a fresh clone: hits, misses,
    evictions 41, 77, 65 against 40, 78, 66) fits that order. A driver that calls the slot
    table in another order would miss every time."""
    sess, ids = recorded
    L, K = sess.spec.num_moe_layers, sess.spec.top_k
    sess.cfg = dataclasses.replace(sess.cfg, io_threads=1)
    counted, sim = [], None
    for _ in range(3):
        r = sess.run_policy(PolicyConfig(policy, cache_frac=0.5), link=Link()).to_json()
        assert r["output_matches_resident"]
        c = r["counters"]
        counted.append((c["hits"], c["misses"], c["evictions"], c["bytes_read"]))
        if sim is None:  # (deterministic: simulated once, from the first run's slots and bytes)
            run = EventRun(
                make_resident_set(policy, r["cache_slots"], L),
                IOThreads(Link(r["expert_bytes"] / 1e-3), 1, float("inf")),
                Times(lambda n: 1e-3, lambda n: 1e-4, lambda n: 0.0),
                scratch=K,
                unit_bytes=r["expert_bytes"],
            )
            run.run(work_of(ids))
            sim = (run.total.hits, run.total.misses, run.total.evictions, run.total.bytes_read)
        if counted[-1] == sim:
            break
    assert counted[-1] == sim, (counted, sim)
