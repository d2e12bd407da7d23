"""The time model: a predictor's modelled cost on a target, the emulated link's slowdown and the
prediction charged as the target would pay it, by hand; a real run declares its regime."""

import torch
from tiny_models import build, char_tokenizer

from tensorbend.cache.config import PolicyConfig
from tensorbend.cache.transfers import Link, parse_link
from tensorbend.capture.hf import DecodeConfig
from tensorbend.capture.prompts import Prompt
from tensorbend.offload.session import OffloadSession, SessionConfig
from tensorbend.predictors.registry import build_baseline
from tensorbend.routers import router_params
from tensorbend.timing.hardware import get_hardware
from tensorbend.timing.time_model import PredictorCost, declare, label


class Weights:
    def __init__(self):
        self.w = [torch.zeros(100, 50), torch.zeros(100, 50)]  # fp32: 2 x 20000 bytes
        self.shared = self.w[0]  # counted once


def test_predictor_cost_by_hand():
    cost = PredictorCost.of(Weights(), calls_per_forward=2)
    assert cost.bytes_per_call == 20_000 and cost.flops_per_call == 10_000
    hw = get_hardware("h100-pcie5")  # 3.35e12 x 0.7 = 2.345e12 B/s; 989e12 FLOP/s
    # 4 launches x 5 us + 20000 / 2.345e12 s (bytes dominate FLOPs: 1e4 / 989e12)
    assert abs(cost.call_s(hw) - (20e-6 + 20_000 / 2.345e12)) < 1e-15


def test_emulated_link_charges_prediction_at_s_times_the_target_cost():
    # target layer 490 MB / 2.35 TB/s (transfers.real_link), host layer 10x that: s = 10. One predictor, 3 calls/forward of
    # 10 us each at batch 1: 30 us of scoring on the target. Measured on the host: 500 us per
    # token, 200 us of it scoring, so 300 us of glue. Charged: 10 x (30 + 300) us = 3.3 ms.
    # As run a token took 1 / 100 = 10 ms; charged it takes 10 - 0.5 + 3.3 = 12.8 ms.
    target_s = 490e6 / 2.35e12
    link = parse_link("h100-pcie5-kimi", 10 * target_s, 1000)
    assert link.target == "h100-pcie5" and abs(link.target_layer_s - target_s) < 1e-15
    cost = PredictorCost(bytes_per_call=0.0, flops_per_call=0.0, kernels_per_call=2)  # 10 us
    run = {"io": "pread", "batch": 1, "decode_tok_s": 100.0,
           "decode_predict_s_per_token": 500e-6, "decode_predict_score_s_per_token": 200e-6}  # fmt: skip
    tm = declare(run, link, 10 * target_s, [(cost, 3)])
    assert tm["regime"] == "emulated link" and tm["slowdown"] == 10.0
    assert abs(tm["target_predict_score_s_per_token"] - 30e-6) < 1e-12
    assert abs(tm["predict_charged_s_per_token"] - 3.3e-3) < 1e-12
    assert abs(1 / tm["decode_tok_s_charged"] - 12.8e-3) < 1e-12
    assert label(tm).startswith("emulated link (target h100-pcie5, s=10.0")
    # the link x4 keeps its target; a bandwidth link and no link have none
    assert parse_link("h100-pcie5-kimi", 1e-3, 1000, speedup=4).target == "h100-pcie5"
    assert declare(run, Link(1e6, 0, "1MB/s"), 1e-3, [])["regime"] == "host"
    assert declare(dict(run, io="direct"), Link(), 1e-3, [])["regime"] == "real disk"
    assert label(None) == "time model not recorded (run before 2026-12-05)"


def test_a_run_declares_its_time_model():
    torch.set_num_threads(1)
    model = build("deepseek_v3", 0)
    cfg = SessionConfig(DecodeConfig(max_new_tokens=3))
    sess = OffloadSession(model, char_tokenizer(), [Prompt("a", "the quick fox")], cfg, "ds")
    try:
        spec = sess.spec
        pred = build_baseline(
            "spec_gate", spec, "d1", router_params=router_params(sess.model, spec)
        )
        link = sess.link("h100-pcie5-kimi")
        r = sess.run_policy(PolicyConfig("prefetch", cache_frac=0.5), pred, link).to_json()
        tm = r["time_model"]
        assert tm["regime"] == "emulated link" and tm["target"] == "h100-pcie5"
        s = sess.layer_seconds() / link.target_layer_s
        assert abs(tm["slowdown"] - round(s, 4)) < 1e-9
        assert tm["predictor_costs"][0]["calls_per_forward"] == spec.num_moe_layers - 1
        assert tm["predict_charged_s_per_token"] > 0
        assert sess.resident_result().to_json()["time_model"]["regime"] == "host"
    finally:
        sess.close()


def test_simulated_prediction_time_delays_a_prefetch():
    # 2 MoE layers, expert (0, 0) resident; layer 0's router predicts (1, 5) for step 1. attn
    # 0.2 s, expert 0.5 s, a 10-byte expert over 10 B/s (1 s). With prediction cost p: the
    # prefetch is queued at 0.2 + p, lands at 1.2 + p; layer 0 ends at 0.7 + p, layer 1's router
    # at 0.9 + p waits 0.3 s for it, its expert ends at 1.7 + p.
    from tensorbend.cache.policies import LRU
    from tensorbend.cache.resident import ResidentSet
    from tensorbend.simulate.events import EventRun, ForwardWork, IOThreads, LayerWork, Times

    def run(p):
        work = [ForwardWork(1, 1, [LayerWork([(0, 1)], at_router=[(1, [5])]),
                                   LayerWork([(5, 1)])])]  # fmt: skip
        times = Times(lambda n: 0.2, lambda n: 0.5, lambda n: 0.0, predict_s=p)
        ev = EventRun(ResidentSet(4, 2, LRU()), IOThreads(Link(10.0), 1, float("inf")),
                      times, scratch=2, unit_bytes=10)  # fmt: skip
        ev.preload([(0, 0)])
        ev.run(work)
        return ev.seconds[1], ev.stats[1].stall_s

    for p in (0.0, 0.1):
        seconds, stall = run(p)
        assert abs(seconds - (1.7 + p)) < 1e-12 and abs(stall - 0.3) < 1e-12


def test_simulated_runs_charge_the_modelled_cost_on_a_profile():
    from types import SimpleNamespace

    from tensorbend.simulate.runs import predict_call_s

    hw = get_hardware("h100-pcie5")
    ranked = SimpleNamespace(cost=PredictorCost(0.0, 0.0, kernels_per_call=3))
    profile, calibrated = (SimpleNamespace(calibrated=c, predict_s=7e-6) for c in (False, True))
    assert abs(predict_call_s(profile, ranked, hw) - 15e-6) < 1e-15  # 3 launches x 5 us
    assert predict_call_s(calibrated, ranked, hw) == 7e-6  # a calibration's measured cost
