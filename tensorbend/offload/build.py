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
    slot_bytes: int | None = None,
) -> ExpertCache:
    """A fresh ExpertCache for one run of `pc` (the oracle's predictor, a RecordedRouting,
    brings the routing its eviction reads; a cross-token `horizon` predictor's forecasts drive
    `Reuse`). slot_bytes: the slots live in an engine's own pool (engines/vllm_offload.py), one
    costing this many bytes; the cache then keeps the table and no tensors."""
    L, policy = spec.num_moe_layers, POLICIES[pc.policy]
    per_slot = layout.nbytes if slot_bytes is None else slot_bytes
    slots = pc.slots(spec, per_slot) if policy.keeps_experts else 0
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
    numel, dtype = layout.slot_shape if slot_bytes is None else (0, layout.dtype)
    return ExpertCache(cfg, rs, numel, dtype, layout.stored_nbytes)
