"""One offloaded run's ExpertCache, built from its PolicyConfig (cache/config.py).

Usage:
    cache = build_cache(pc, spec, layout, predictor, device="cpu")     # session.run_policy does this

The eviction rule comes from the policy table (`cache.config.POLICIES`): lru and on_demand LRU
(on_demand keeps nothing: a resident set of capacity 0, every miss read into a staging slot),
lfu LFU, lfru LFRU, prefetch Predicted (the predictor's hints; Reuse with a horizon), oracle
NextUse over the recorded routing within its foresight (its --oracle-beyond rule past it).
Pool and admission apply to every policy that keeps experts (`cache.config.make_resident_set`,
which the simulator builds its caches with too).
"""

from __future__ import annotations

from tensorbend.cache.config import POLICIES, PolicyConfig, make_resident_set
from tensorbend.models import RoutingSpec
from tensorbend.offload.cache import CacheConfig, ExpertCache
from tensorbend.offload.layout import ExpertLayout


def build_cache(
    pc: PolicyConfig,
    spec: RoutingSpec,
    layout: ExpertLayout,
    predictor,
    device: str,
    horizon=None,
) -> ExpertCache:
    """A fresh ExpertCache for one run of `pc` (the oracle's predictor, a RecordedRouting,
    brings the routing its eviction reads; a cross-token `horizon` predictor's forecasts drive
    `Reuse`)."""
    L, policy = spec.num_moe_layers, POLICIES[pc.policy]
    slots = pc.slots(spec, layout.nbytes) if policy.keeps_experts else 0
    steps = predictor.steps_by_key if policy.recorded_routing else None
    rs = make_resident_set(
        pc.policy,
        slots,
        L,
        pc.pool,
        pc.admission_rule,
        pc.admission_window,
        steps,
        pc.foresight,
        horizon is not None,
        pc.oracle_beyond,
    )
    cfg = CacheConfig(scratch=pc.staging(spec.top_k), device=device)
    return ExpertCache(cfg, rs, *layout.slot_shape, layout.stored_nbytes)
