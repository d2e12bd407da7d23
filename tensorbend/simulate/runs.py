"""One simulated run: its resident set, its work through the event loop, its result row.

Usage:
    row = run_one(cfg, "lru", None, 0.25, fwds, demand, rows, mapping, costs, hw, geo)
    row["decode_tok_s"], row["stall_s_per_token"]     # the keys of `run --json`

`cache.config.make_resident_set` builds the policy table's eviction rule in a resident set
with the asked pool and admission, as the runtime does (`cache.victim_heap.IndexedResidentSet`:
the runtime's victims, found through an index). Cache size: `cache_frac` of each layer's (trace) experts,
at least top-k slots; its bytes are reported for the geometry's own experts. Rows carry
`cache.report.ROW_KEYS`.
"""

from __future__ import annotations

import math

from tensorbend.cache.config import (
    POLICIES,
    admission_rule,
    check_slots,
    make_resident_set,
)
from tensorbend.cache.report import compare, run_label
from tensorbend.cache.transfers import Link
from tensorbend.predictors import get_lookahead
from tensorbend.simulate import plan
from tensorbend.simulate.events import EventRun, IOThreads, Times
from tensorbend.simulate.geometry import Geometry
from tensorbend.simulate.predictions import Ranked


def run_one(
    cfg, policy, ranked, frac, fwds, demand, mapping, costs, hw, geo, forecasts=None, beyond="lru"
) -> dict:
    """One policy (x predictor, x cross-token forecasts) at one cache fraction; its result row."""
    L, K = mapping.geometry_layers, mapping.trace_top_k
    bounded = POLICIES[policy].bounded
    units = cache_units(cfg, frac, mapping) if bounded else L * mapping.trace_experts
    extra = cfg.prediction.prefetch_extra
    preds = None if ranked is None else plan.prediction_lists(ranked, fwds, K, extra)
    work = plan.build_work(fwds, demand, mapping, ranked, preds)
    if forecasts is not None:
        plan.add_horizon(work, mapping, forecasts, cfg.offload.token_ahead_layers, K)
    steps = None
    if POLICIES[policy].recorded_routing:
        la = get_lookahead(cfg.offload.lookahead)
        plan.add_oracle(work, la.distance, la.hidden == "gate_input", cfg.offload.foresight)
        steps = plan.steps_by_key(work)
        ranked = Ranked("oracle", la.name, la.distance, None, None)
    o = cfg.offload
    adm = admission_rule(o.admission, policy)
    rs = make_resident_set(
        policy,
        units,
        L,
        o.pool,
        adm,
        o.admission_window,
        steps,
        o.foresight,
        forecasts is not None,
        beyond,
    )
    backlog = cfg.offload.prefetch_backlog * costs.transfer_s()
    predict_s = predict_call_s(costs, ranked, hw) if policy == "prefetch" else 0.0
    forecast_s = costs.forecast_s if policy == "prefetch" or forecasts is not None else 0.0
    times = Times(
        costs.attn_s, costs.expert_s, costs.forward_s, predict_s, costs.miss_s, forecast_s
    )
    link = IOThreads(Link(costs.link_bandwidth, costs.link_latency), costs.io_slots, backlog)
    run = EventRun(rs, link, times, scratch=o.staging(K), unit_bytes=costs.unit_bytes)
    if not bounded:
        run.preload([(g, e) for g in range(L) for e in range(mapping.trace_experts)])
    run.run(work)
    row = _result(policy, ranked, frac, units, run, costs, hw, geo, cfg)
    row["horizon"] = str(cfg.prediction.horizon) if forecasts is not None else None
    row["token_ahead_layers"] = cfg.offload.token_ahead_layers if forecasts is not None else None
    row["oracle_beyond"] = beyond if POLICIES[policy].recorded_routing else None
    return row


def predict_call_s(costs, ranked, hw) -> float:
    """Seconds of one within-token prediction call on the compute path: a calibration's measured
    `predict_s`; on a hardware profile, the predictor's modelled cost there
    (`offload.time_model.PredictorCost.call_s`: launches + its weights read once)."""
    if costs.calibrated or ranked is None or ranked.cost is None:
        return costs.predict_s
    return ranked.cost.call_s(hw)


def cache_units(cfg, frac: float, mapping) -> int:
    """Slots for `frac` of the simulated experts; at least what the runtime asks for (top-k, and
    one per layer with a per-layer pool)."""
    L, E, K = mapping.geometry_layers, mapping.trace_experts, mapping.trace_top_k
    units = round(frac * L * E)
    return check_slots(units, f"--cache-frac {frac} of {L * E} experts", K, L, cfg.offload.pool)


def _result(policy, ranked, frac, units, run: EventRun, costs, hw, geo, cfg) -> dict:
    dec, pre = run.stats[1], run.stats[0]
    nd, npf = max(1, run.tokens[1]), max(1, run.tokens[0])
    expert_total = geo.num_moe_layers * geo.num_experts * geo.expert_bytes(cfg.dtype)
    bounded = POLICIES[policy].bounded
    cache_bytes = frac * expert_total if bounded else expert_total
    return {
        "policy": policy,
        "predictor": None if ranked is None else ranked.kind,
        "lookahead": None if ranked is None else ranked.lookahead,
        "cache_frac": frac if bounded else 1.0,
        "decode_tok_s": run.tokens[1] / run.seconds[1] if run.seconds[1] else None,
        "prefill_tok_s": run.tokens[0] / run.seconds[0] if run.seconds[0] else None,
        "stall_s_per_token": dec.stall_s / nd,
        "bytes_read_per_token": dec.bytes_read / nd,
        "demand_hit_rate": dec.demand_hit_rate,
        "wasted_prefetch_bytes": run.total.prefetch_wasted_bytes,
        "cache_slots": units,
        "cache_bytes": int(cache_bytes),
        "fits_fast_memory": cfg.calibration is not None
        or cache_bytes + resident_bytes(geo) <= hw.mem_capacity.value,
        "pool": cfg.offload.pool,
        "admission": admission_rule(cfg.offload.admission, policy),
        "foresight": cfg.offload.foresight if POLICIES[policy].recorded_routing else None,
        "tokens": {"prefill": run.tokens[0], "decode": run.tokens[1]},
        "prefill": {
            "stall_s_per_token": pre.stall_s / npf,
            "bytes_read_per_token": pre.bytes_read / npf,
            "demand_hit_rate": pre.demand_hit_rate,
        },
        "counters": dict(vars(run.total)),
        "predict_s_per_call": run.times.predict_s,
        "time_model": {
            "regime": "simulated",
            "target": hw.name if cfg.calibration is None else "calibration",
            "prediction": _charge(costs, ranked, run),
        },
    }


def _charge(costs, ranked, run: EventRun) -> str:
    if ranked is None or run.times.predict_s == 0:
        return "none (no predictor call)" if ranked is None else "0 s per call"
    how = "calibrated" if costs.calibrated else "modelled (timing/time_model.py)"
    return f"{run.times.predict_s * 1e6:.2f} us per call, {how}"


def relative(results: list[dict]) -> None:
    """Each row's label and `vs_best_cache` (decode tok/s over the best no-prediction cache at
    the same size, `cache.report.compare`)."""
    by_frac = compare(results)
    for r in results:
        r["label"] = run_label(r)
        c = by_frac.get(r["cache_frac"])
        r["vs_best_cache"] = c and c["runs"][r["label"]]["vs_best_cache"]


def resident_bytes(geo: Geometry) -> float:
    """Weights that stay in fast memory: every MoE layer's non-expert weights, dense layers,
    the LM head and the embedding."""
    return (
        geo.num_moe_layers * geo.layer_static_bytes()
        + geo.forward_static_bytes()
        + geo.vocab_size * geo.hidden_size * 2
    )


def fitting_frac(hw, geo: Geometry, dtype: str, spec) -> float:
    """The largest cache fraction (4 decimals, rounded down) whose bytes fit fast memory beside
    the resident weights; at least top-k slots."""
    total = geo.num_moe_layers * geo.num_experts * geo.expert_bytes(dtype)
    frac = math.floor((hw.mem_capacity.value - resident_bytes(geo)) / total * 1e4) / 1e4
    floor = spec.top_k / (geo.num_moe_layers * spec.num_experts)
    return min(1.0, max(frac, floor))
