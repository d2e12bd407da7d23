"""This machine's costs for the simulator, measured from the runtime's own counters.

Usage:
    sess = OffloadSession(model, tok, val_prompts, SessionConfig(...))
    cal = calibrate(sess, sess.link("h100-pcie5-kimi"), predictor, horizon)
    cal.save(Path("calibration.json"))   # tensorbend simulate --geometry from-trace --calibration

Nothing is patched; every number comes from `OffloadSession.run_policy` results:
- cache holding everything, no link cap (lru, cache_frac 1): `RunResult.expert_compute` gives
  seconds per expert computed at decode (`expert_s`) and per extra (token, expert) pair in a
  prefill call; the rest of a decode token's time, spread over the MoE layers, is `attn_s`
  (attention, router, dense layers and head: no separate `forward_s`).
- on_demand with no link cap (every decode demand misses, reads come from the page cache):
  the compute thread's own time per miss (`miss_s`), what is left after the all-cached time.
- a within-token prefetch run: prediction seconds per hook call (`predict_s`), measured inside
  the hooks (`RunResult.predict_s_per_token`, `predict_calls`); a horizon-only run: seconds per
  cross-token forecast (`forecast_s`, one per forward, its next-forward prefetches included).
`bench/sim_validation.py` calibrates on one prompt split and judges the simulator on another.
"""

from __future__ import annotations

import torch

from tensorbend.cache.config import PolicyConfig
from tensorbend.cache.transfers import Link
from tensorbend.offload.hooks import NoPredictor
from tensorbend.offload.session import OffloadSession
from tensorbend.predictors import get_lookahead
from tensorbend.simulate.costs import Calibration


def calibrate(sess: OffloadSession, link: Link, predictor=None, horizon=None, cache_frac: float = 0.25,
              lookahead: str = "d1", say=None) -> Calibration:  # fmt: skip
    """This machine's costs from the session's own runs (module docstring); `predictor` /
    `horizon`: the within-token and cross-token predictors whose cost is measured."""
    say = say or (lambda msg: None)
    L, K = sess.spec.num_moe_layers, sess.spec.top_k
    everything = PolicyConfig("lru", cache_frac=1.0)
    sess.run_policy(everything, link=Link())  # warm: every expert loaded, kernels picked
    r = sess.run_policy(everything, link=Link()).to_json()
    calls = {row[0]: row[1:] for row in r["expert_compute"]}  # T -> [calls, experts, pairs, s]
    dec_calls, dec_experts, _, dec_s = calls.pop(1, [0, 0, 0, 0.0])
    assert dec_calls, "no decode step ran: raise --max-new-tokens"
    n_dec = r["tokens"]["decode"]
    expert_s = dec_s / max(1, dec_experts)
    per_tok = 1 / r["decode_tok_s"] - r["stall_s_per_token"]
    attn_s = max(0.0, per_tok - dec_s / n_dec) / L
    # prefill: x(T) = x_decode + x_per_token * (T - 1), per call of T tokens
    pre_calls = sum(c[0] for c in calls.values())
    pre_experts = sum(c[1] for c in calls.values())
    pre_pairs = sum(c[2] for c in calls.values())
    pre_expert_s = sum(c[3] for c in calls.values())
    pre_tokens = sum(T * c[0] for T, c in calls.items()) // max(1, L)
    prompts = pre_calls // max(1, L)
    pre_time = r["tokens"]["prefill"] / r["prefill_tok_s"] if r["prefill_tok_s"] else 0.0
    extra_tokens = max(1, pre_tokens - prompts)
    attn_per_token = max(0.0, (pre_time - pre_expert_s) / L - prompts * attn_s) / extra_tokens
    expert_per_token = max(0.0, pre_expert_s - pre_experts * expert_s) / max(
        1, pre_pairs - pre_experts
    )
    od = sess.run_policy(PolicyConfig("on_demand", cache_frac=cache_frac), link=Link())
    od = od.to_json()
    misses_per_tok = (1 - od["demand_hit_rate"]) * L * K  # batch-1 decode: every demand
    base = 1 / r["decode_tok_s"] - r["stall_s_per_token"]
    miss_s = max(0.0, 1 / od["decode_tok_s"] - od["stall_s_per_token"] - base) / max(
        misses_per_tok, 1e-9
    )
    pc = PolicyConfig("prefetch", cache_frac=cache_frac, lookahead=lookahead)
    predict_s = forecast_s = 0.0
    if predictor is not None:
        p = sess.run_policy(pc, predictor, link).to_json()
        predict_s = _seconds_per_call(p)
        say(f"calibration: {predict_s * 1e6:.0f} us per within-token prediction")
    if horizon is not None:
        none = NoPredictor(sess.spec.num_experts, get_lookahead(lookahead))
        h = sess.run_policy(pc, none, link, horizon).to_json()
        forwards = h["tokens"]["decode"] + h["prompts"]  # batch 1: one forward per token + prompt
        forecast_s = h["predict_s_per_token"] * h["tokens"]["decode"] / max(1, forwards)
        say(f"calibration: {forecast_s * 1e6:.0f} us per cross-token forecast")
    return Calibration(
        expert_bytes=sess.layout.nbytes,
        link_bandwidth_Bps=link.bandwidth_Bps or 1e15,
        link_latency_s=link.latency_s,
        attn_s=attn_s,
        expert_s=expert_s,
        forward_s=0.0,
        attn_s_per_token=attn_per_token,
        expert_s_per_token=expert_per_token,
        predict_s=predict_s,
        forecast_s=forecast_s,
        miss_s=miss_s,
        io_slots=sess.cfg.io_threads,
        source=f"bench.sim_calibration on {sess.model_name}, "
        f"{torch.get_num_threads()} compute thread(s), {len(sess.inputs)} prompts",
    )


def _seconds_per_call(row: dict) -> float:
    """Seconds per prediction hook call of a run (`predict_s_per_token` counts both phases'
    seconds per decode token)."""
    return row["predict_s_per_token"] * row["tokens"]["decode"] / max(1, row["predict_calls"])
