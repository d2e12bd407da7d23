"""The simulator's analytic cases, profiles, mapping and an imported trace end to end.

Known answers: perfect prediction with lead time and bandwidth to spare stalls 0 s; with no
cache and no prefetch every demand is a miss and the stall is misses x bytes / bandwidth; the
geometry profiles reproduce the models' published parameter counts; the transition table
predicts a planted permutation routing exactly.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_import import csv_rows, planted_routing

from tensorbend.cache.config import PolicyConfig
from tensorbend.capture.trace import Trace
from tensorbend.engines.importers import ImportConfig, import_trace
from tensorbend.engines.importers.csv import write_csv
from tensorbend.errors import TensorbendError, TraceError
from tensorbend.predictors.spec import PredictorSpec
from tensorbend.simulate import (
    GEOMETRY_NAMES,
    HARDWARE_NAMES,
    SimulateConfig,
    format_table,
    simulate,
)
from tensorbend.simulate.costs import Calibration
from tensorbend.simulate.geometry import GEOMETRIES
from tensorbend.simulate.mapping import make_mapping
from tensorbend.simulate.predictions import build_predictor, ranked_predictions, routing_rows
from tensorbend.timing.hardware import HARDWARE


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A routing-only trace: 3 MoE layers, 8 experts, top-2; layer m = permutation of m-1."""
    d = tmp_path_factory.mktemp("planted")
    routing = planted_routing(prompts=40, L=3, E=8, K=2, prefill=4, decode=6, seed=3)
    src = write_csv(d / "r.csv", csv_rows(routing))
    import_trace(ImportConfig(source="csv", path=src, out=d / "t", progress=False))
    return d / "t"


def calibration(path, *, wire_s=0.1, latency_s=0.0, attn_s=1.0, expert_s=0.0, forward_s=0.0):
    return Calibration(
        expert_bytes=1000,
        link_bandwidth_Bps=1000 / wire_s,
        link_latency_s=latency_s,
        attn_s=attn_s,
        expert_s=expert_s,
        forward_s=forward_s,
        source="test",
    ).save(path)


def sim(trace, cal, **kw):
    base = dict(
        trace=trace,
        hardware="h100-pcie5",
        geometry="from-trace",
        calibration=cal,
        progress=False,
        split="all",
        max_prompts=8,
    )
    return simulate(sim_config(**{**base, **kw}))


def sim_config(**kw) -> SimulateConfig:
    """SimulateConfig of `kw`, the cache options among them (PolicyConfig's) nested in its
    `offload`."""
    own = set(SimulateConfig.__dataclass_fields__)
    pol = {
        k: kw.pop(k) for k in list(kw) if k not in own and k in PolicyConfig.__dataclass_fields__
    }
    return SimulateConfig(**kw, offload=PolicyConfig("oracle", **pol))


def test_perfect_prediction_with_lead_time_and_bandwidth_stalls_zero(planted, tmp_path):
    # the oracle prefetches each layer's exact experts before its attention (pre_attn);
    # 2 transfers of 0.1 s fit in the 1 s of attention
    cal = calibration(tmp_path / "c.json", wire_s=0.1, attn_s=1.0)
    res = sim(
        planted,
        cal,
        policies=("oracle",),
        lookahead="pre_attn",
        cache_fracs=(0.5,),
        prefetch_backlog=float("inf"),
    )
    (r,) = res.results
    assert r["stall_s_per_token"] == 0.0
    assert r["demand_hit_rate"] == 1.0
    assert r["decode_tok_s"] == pytest.approx(1 / 3.0)  # 3 layers x 1 s of attention


def test_no_cache_no_prefetch_stall_is_misses_times_bytes_over_bandwidth(planted, tmp_path):
    cal = calibration(tmp_path / "c.json", wire_s=0.25, latency_s=0.0, attn_s=0.5)
    res = sim(planted, cal, policies=("on_demand",), cache_fracs=(0.25,))
    (r,) = res.results
    c, n = r["counters"], r["tokens"]["decode"]
    decode_misses = round(r["stall_s_per_token"] * n / 0.25)
    assert r["demand_hit_rate"] == 0.0
    assert r["bytes_read_per_token"] * n == decode_misses * 1000
    assert r["stall_s_per_token"] * n == pytest.approx(decode_misses * 1000 / (1000 / 0.25))
    # every decode demand is a miss: K=2 distinct experts x 3 layers per token
    assert decode_misses == n * 2 * 3
    assert c["misses"] == c["demand_loads"]


def test_latency_adds_per_miss_and_bandwidth_scales_the_stall(planted, tmp_path):
    a = sim(planted, calibration(tmp_path / "a.json", wire_s=0.1), policies=("on_demand",)).results[
        0
    ]
    b = sim(planted, calibration(tmp_path / "b.json", wire_s=0.2), policies=("on_demand",)).results[
        0
    ]
    assert b["stall_s_per_token"] == pytest.approx(2 * a["stall_s_per_token"])
    c = sim(
        planted,
        calibration(tmp_path / "c.json", wire_s=0.1, latency_s=0.05),
        policies=("on_demand",),
    ).results[0]
    assert c["stall_s_per_token"] > a["stall_s_per_token"]


def test_prediction_beats_the_caches_on_planted_routing(planted, tmp_path):
    cal = calibration(tmp_path / "c.json", wire_s=0.3, attn_s=0.5, expert_s=0.05)
    res = sim(
        planted,
        cal,
        policies=("lru", "lfu", "prefetch", "oracle"),
        predictors=("transition", "none"),
        cache_fracs=(0.5,),
        split="test",
        max_prompts=None,
    )
    by = {(r["policy"], r["predictor"]): r for r in res.results}
    best_cache = max(by[("lru", None)]["decode_tok_s"], by[("lfu", None)]["decode_tok_s"])
    assert by[("prefetch", "transition")]["decode_tok_s"] > best_cache
    assert by[("prefetch", "transition")]["vs_best_cache"] > 1.0
    assert (
        by[("oracle", "oracle")]["stall_s_per_token"]
        <= by[("prefetch", "transition")]["stall_s_per_token"]
    )
    keys = {
        "policy",
        "predictor",
        "cache_frac",
        "decode_tok_s",
        "stall_s_per_token",
        "bytes_read_per_token",
        "demand_hit_rate",
        "wasted_prefetch_bytes",
    }
    assert all(keys <= set(r) for r in res.results)
    json.dumps(res.to_json())  # serialisable


def test_geometry_profiles_reproduce_published_parameter_counts():
    published_total = {  # billions, from the model cards
        "kimi-k2.5": 1040,
        "deepseek-v3": 671,
        "qwen3-235b-a22b": 235,
        "qwen3-30b-a3b": 30.5,
        "mixtral-8x22b": 141,
        "gpt-oss-120b": 117,
    }
    for name, g in GEOMETRIES.items():
        moe = g.num_moe_layers * (g.num_experts * g.expert_params() + g.layer_static_params())
        dense = g.num_dense_layers * (g.attn_params + 3 * g.hidden_size * g.dense_intermediate_size)
        total = (moe + dense + 2 * g.vocab_size * g.hidden_size) / 1e9
        assert total == pytest.approx(published_total[name], rel=0.02), name
    assert GEOMETRIES["kimi-k2.5"].expert_bytes() == int(3 * 7168 * 2048 * 0.5625)
    assert set(GEOMETRIES) | {"from-trace"} == set(GEOMETRY_NAMES)


def test_every_hardware_number_has_a_source():
    assert set(HARDWARE) == set(HARDWARE_NAMES)
    for hw in HARDWARE.values():
        for f in (
            "mem_bandwidth",
            "mem_capacity",
            "peak_flops",
            "link_bandwidth",
            "link_latency",
            "mem_efficiency",
        ):
            n = getattr(hw, f)
            assert n.value > 0 and len(n.source) > 20, (hw.name, f)


def test_every_hardware_geometry_pair_simulates(planted):
    for hw in HARDWARE_NAMES:
        for geo in GEOMETRIES:
            res = simulate(
                SimulateConfig(
                    trace=planted,
                    hardware=hw,
                    geometry=geo,
                    policies=("lru", "prefetch"),
                    predictors=("transition",),
                    max_prompts=1,
                    progress=False,
                )
            )
            labels = [r["label"].split(" [")[0] for r in res.results]  # may load 0 prefetches
            assert labels == ["lru", "prefetch:none", "d1:transition"]
            assert all(r["decode_tok_s"] > 0 for r in res.results)
            assert res.mapping["geometry_layers"] == GEOMETRIES[geo].num_moe_layers


def test_mapping_rules_and_the_printed_table(planted, tmp_path):
    m = make_mapping(6, 32, 4, 60, 384, 8)
    assert m.layer_of[:7] == (0, 1, 2, 3, 4, 5, 0) and m.unit_scale == 2.0
    s = make_mapping(10, 8, 2, 4, 8, 2)
    assert (
        s.layer_rule == "subsample" and s.layer_of == (0, 2, 5, 7) and s.expert_rule == "identity"
    )
    res = simulate(
        SimulateConfig(
            trace=planted,
            hardware="dgx-spark",
            geometry="qwen3-30b-a3b",
            policies=("lru",),
            max_prompts=1,
            progress=False,
        )
    )
    text = format_table(res)
    assert "geometry layer g replays trace layer g mod 3" in text
    assert "each trace expert stands for 4 geometry experts" in text


def test_config_errors_say_how_to_fix():
    with pytest.raises(TensorbendError, match="from-trace .* --calibration"):
        SimulateConfig(trace="t", hardware="h100-pcie5", geometry="from-trace")
    with pytest.raises(TensorbendError, match="--hardware"):
        SimulateConfig(trace="t", hardware="tpu", geometry="kimi-k2.5")
    with pytest.raises(TensorbendError, match="admission predicted"):
        sim_config(trace="t", hardware="h100-pcie5", geometry="kimi-k2.5", admission="predicted")


def test_imported_csv_of_another_shape_evaluates_and_simulates(tmp_path):
    """26 MoE layers, 64 experts, top-6: import, evaluate routing-only peers, simulate."""
    from tensorbend.predictors.scoring import score_predictor

    routing = planted_routing(prompts=30, L=26, E=64, K=6, prefill=5, decode=6, seed=7)
    src = write_csv(tmp_path / "r.csv", csv_rows(routing))
    import_trace(ImportConfig(source="csv", path=src, out=tmp_path / "t", progress=False))
    tr = Trace.open(tmp_path / "t")
    assert (tr.spec.num_moe_layers, tr.spec.num_experts, tr.spec.top_k) == (26, 64, 6)
    rows = routing_rows(tr, "test")
    recall = {}
    for name in ("frequency", "transition", "prev_token"):
        scored = score_predictor(build_predictor(name, tr, "d1"), rows)
        recall[name] = scored["decode"]["recall_at_k"]
    # a planted permutation: the transition table recovers it (a few co-occurrence ties on
    # 21 training prompts); popularity is near chance (6 of 64)
    assert recall["transition"] > 0.99
    assert recall["frequency"] < 0.3
    with pytest.raises(TraceError, match="needs hidden states"):
        build_predictor("spec_gate", tr, "d1")
    res = simulate(
        SimulateConfig(
            trace=tmp_path / "t",
            hardware="nvme-gen5",
            geometry="from-trace",
            calibration=calibration(tmp_path / "c.json", wire_s=0.2, attn_s=0.3),
            policies=("lru", "prefetch"),
            predictors=("transition",),
            cache_fracs=(0.25,),
            progress=False,
        )
    )
    by = {r["policy"]: r for r in res.results}
    assert by["prefetch"]["demand_hit_rate"] > by["lru"]["demand_hit_rate"]
    ranked = ranked_predictions(build_predictor("transition", tr, "d1"), rows, 6)
    assert not bool(ranked.valid_L[0]) and bool(ranked.valid_L[1:].all())  # d1: no source for 0
    assert bool((ranked.ids_TLJ[:, 0] == -1).all())


def test_ep_statistics_are_in_the_json(planted, tmp_path):
    cal = calibration(tmp_path / "c.json")
    res = sim(
        planted,
        cal,
        policies=("prefetch",),
        predictors=("transition", "frequency"),
        ep_degree=2,
        batch=4,
        split="test",
        max_prompts=None,
    )
    dec = {e["predictor"]: e for e in res.to_json()["ep"] if e["phase"] == "decode"}
    assert dec["transition"]["all_ranks_predicted_share"] == 1.0  # exact at layers 1, 2
    assert dec["transition"]["mae_tokens"] == 0.0
    assert dec["frequency"]["mae_tokens"] > 0
    assert dec["transition"]["buffer_p99_predicted_mean"] <= dec["transition"]["buffer_p99_static"]


def test_batch_decodes_prompts_together(planted, tmp_path):
    cal = calibration(tmp_path / "c.json")
    one = sim(planted, cal, policies=("resident",), batch=1).results[0]
    four = sim(planted, cal, policies=("resident",), batch=4).results[0]
    # resident: 3 layers x 1 s per forward; a batch of 4 decodes 4 tokens per forward
    assert one["decode_tok_s"] == pytest.approx(1 / 3)
    assert four["decode_tok_s"] == pytest.approx(4 / 3)
    assert np.isclose(one["tokens"]["decode"], four["tokens"]["decode"])


def test_plots_are_written(planted, tmp_path):
    cal = calibration(tmp_path / "c.json")
    sim(planted, cal, policies=("lru", "prefetch"), cache_fracs=(0.25, 0.5), plots=tmp_path / "p")
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "simulate_by_cache.png",
        "simulate_runs.png",
    ]


def test_oracle_sees_across_the_forward_boundary_within_its_foresight(planted, tmp_path):
    # d1: layer 0 of the next token is predicted at this token's last router, as the runtime's
    # RecordedRouting.ahead does; with foresight 1 the next forward is out of sight
    cal = calibration(tmp_path / "c.json", wire_s=0.1, attn_s=1.0)
    kw = dict(policies=("oracle",), cache_fracs=(0.5,), prefetch_backlog=float("inf"))
    full = sim(planted, cal, **kw).results[0]
    one = sim(planted, cal, foresight=1, **kw).results[0]
    assert full["stall_s_per_token"] == 0.0 and full["demand_hit_rate"] == 1.0
    assert one["stall_s_per_token"] > 0.0 and one["demand_hit_rate"] < 1.0


def test_horizon_forecasts_steer_the_simulated_cache(tmp_path, monkeypatch):
    """On a trace whose routing cycles across tokens (policy prefetch, no within-token
    predictor, no prefetch ahead: demand loads only): learned forecasts read fewer bytes than
    the eviction without them (Predicted) and than LRU; exact forecasts (one-hot, from the
    trace's future) read no more than the learned ones."""
    from planted import cycle_trace

    import tensorbend.simulate.simulator as simulator
    from tensorbend.cli import main
    from tensorbend.predictors.horizon import Forecast, first_use_class, request_forwards

    cycle_trace(tmp_path / "t", prompts=40)
    ckpt = tmp_path / "h.safetensors"
    assert main(["train", "--trace", str(tmp_path / "t"), "--out", str(ckpt), "--quiet",
                 "--predictor", "horizon", "--inputs", "routing", "--foresight", "2"]) == 0  # fmt: skip
    cal = calibration(tmp_path / "c.json", wire_s=0.1, attn_s=1.0)
    kw = dict(policies=("lru", "prefetch"), predictors=("none",), prediction=PredictorSpec(horizon=ckpt),
              token_ahead_layers=0, cache_fracs=(0.75,), split="test", max_prompts=None)  # fmt: skip
    learned = sim(tmp_path / "t", cal, **kw).results

    def exact(cfg, tr, rows):
        out = []
        for request in request_forwards(rows, tr.spec):
            used_FLE = torch.stack([u for _, u, _ in request])
            for f in range(len(request)):
                cls_LE = first_use_class(used_FLE[f + 1 : f + 3], 2)
                probs_LEJ = torch.nn.functional.one_hot(cls_LE, 3).float()
                out.append(Forecast(probs_LEJ, torch.zeros(cls_LE.shape)))
        return out, None  # (no cost model: the run is calibrated)

    monkeypatch.setattr(simulator, "_forecasts", exact)
    true = sim(tmp_path / "t", cal, **kw).results
    by = {r["label"]: r["bytes_read_per_token"] for r in learned}
    by_true = {r["label"]: r["bytes_read_per_token"] for r in true}
    hz = "horizon(evict only)"  # the label says what ran: no within-token predictor
    assert by_true[hz] <= by[hz] < by["prefetch:none"] < by["lru"]
    assert by["prefetch:none"] == by_true["prefetch:none"]  # runs without forecasts untouched


def test_simulate_flags_fill_the_nested_policy_config(monkeypatch):
    """The cache options `simulate` shares with `run` keep their flags and defaults, nested in
    one PolicyConfig; --oracle-beyond best and --prefetch-extra stay simulate's own."""
    import tensorbend.simulate.simulator as simulator
    from tensorbend.cli import main

    got = []

    class Stop(Exception):
        pass

    def capture(cfg):
        got.append(cfg)
        raise Stop  # (the config is what is tested: no trace to replay)

    monkeypatch.setattr(simulator, "simulate", capture)
    base = ["simulate", "--trace", "t", "--hardware", "h100-pcie5", "--geometry", "kimi-k2.5"]
    flags = ["--pool", "per_layer", "--foresight", "2", "--lookahead", "d2", "--quiet"]
    with pytest.raises(Stop):
        main([*base, *flags])
    (cfg,) = got
    assert cfg.offload == PolicyConfig("oracle", pool="per_layer", foresight=2, lookahead="d2")
    assert (cfg.oracle_beyond, cfg.prediction.prefetch_extra) == ("best", 0)
