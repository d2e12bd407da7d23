"""The eviction learner from the command line: `train --predictor evictor`, `eval` (its cache
replay), `run` / `simulate --policy evictor --evictor E`, and the refusals."""

import json

import pytest
from planted import cycle_trace
from test_simulate_runtime import random_evictor
from tiny_models import save_checkpoint, write_prompts

from tensorbend.cache.evictor import Evictor, EvictorModel
from tensorbend.cache.imitation import load_requests, replay
from tensorbend.cli import main


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("ev")
    cycle_trace(d / "t", L=2, K=2, prompts=30)
    out = d / "e.safetensors"
    assert main(["train", "--trace", str(d / "t"), "--out", str(out), "--predictor", "evictor",
                 "--quiet"]) == 0  # fmt: skip
    return d, out


def test_train_writes_an_evictor_that_eval_replays(trained, capsys):
    d, ck = trained
    model = EvictorModel.load(str(ck))
    assert model.num_layers == 2 and model.meta["prior_K"].shape == (2 * 4,)
    capsys.readouterr()
    assert main(["eval", "--trace", str(d / "t"), "--predictor", str(ck), "--baselines",
                 "frequency", "--json", str(d / "eval.json")]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "eviction replay of" in printed and "full Belady" in printed
    (ev,) = json.loads((d / "eval.json").read_text())["eviction"]
    rows = ev["replay"]
    # the number eval reports is the replay of the checkpoint on the test requests, by hand
    test = load_requests(str(d / "t"), "test")
    want = replay(test, Evictor(2, 4, model, model.meta["prior_K"]), ev["cache_slots"],
                  admission="policy")  # fmt: skip
    assert rows["evictor"]["experts_per_token"] == want["experts_per_token"]
    best, full = rows[ev["best_no_prediction"]], rows[ev["full_oracle"]]
    assert full["experts_per_token"] <= best["experts_per_token"]
    assert {"evictor", "evictor+shadow", "belady/all", "lfru/global/all"} <= set(rows)


def test_an_evictor_is_refused_where_a_routing_predictor_goes(trained, capsys):
    d, ck = trained
    capsys.readouterr()
    assert main(["simulate", "--trace", str(d / "t"), "--hardware", "h100-pcie5", "--geometry",
                 "deepseek-v3", "--policy", "prefetch", "--predictor", str(ck), "--split",
                 "test"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "is an eviction model" in err and "--evictor" in err
    assert main(["train", "--trace", str(d / "t"), "--out", str(d / "x.safetensors"),
                 "--predictor", "evictor", "--lookahead", "d1"]) == 2  # fmt: skip
    assert "expected no lookahead" in capsys.readouterr().err


def test_simulate_policy_evictor_refuses_seen_prompts_and_runs_held_out(trained, capsys):
    from tensorbend.simulate.costs import Calibration

    d, ck = trained
    cal = Calibration(expert_bytes=1000, link_bandwidth_Bps=1e6, link_latency_s=1e-5,
                      attn_s=1e-4, expert_s=1e-5, forward_s=0.0).save(d / "cal.json")  # fmt: skip
    base = ["simulate", "--trace", str(d / "t"), "--hardware", "h100-pcie5", "--geometry",
            "deepseek-v3", "--policy", "lru", "--policy", "evictor", "--evictor", str(ck)]  # fmt: skip
    capsys.readouterr()
    assert main([*base, "--split", "test"]) == 2  # 58 MoE layers: not the trace's 2
    assert "use --geometry from-trace" in capsys.readouterr().err
    base[6:7] = ["from-trace", "--calibration", str(cal)]
    assert main([*base, "--split", "train"]) == 2
    assert "was trained or early-stopped on" in capsys.readouterr().err
    assert main([*base, "--split", "test", "--json", str(d / "s.json")]) == 0
    rows = json.loads((d / "s.json").read_text())["results"]
    (ev,) = [r for r in rows if r["policy"] == "evictor"]
    assert ev["label"] == "evictor" and ev["evictor"] == str(ck) and ev["guard_window"] == 48
    assert main([*base[:-2], "--split", "test"]) == 2  # no --evictor
    assert "--policy evictor needs --evictor CHECKPOINT" in capsys.readouterr().err


def test_run_policy_evictor_generates_what_the_resident_model_does(tmp_path, capsys):
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    prompts = write_prompts(tmp_path / "p.jsonl", n=4, continuation_every=1)
    from tensorbend.hf import load_model
    from tensorbend.models import describe_model

    spec = describe_model(load_model(str(ckpt))[0])
    ev = random_evictor(tmp_path / "e.safetensors", spec.num_moe_layers, spec.num_experts)
    out = tmp_path / "r.json"
    rc = main(["run", "--model", str(ckpt), "--prompts", str(prompts), "--split", "all",
               "--max-new-tokens", "4", "--policy", "evictor", "--evictor", str(ev),
               "--guard-window", "2", "--cache-frac", "0.3", "--json", str(out), "--quiet"])  # fmt: skip
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["output_matches_resident"] is True
    assert (r["policy"], r["evictor"], r["guard_window"]) == ("evictor", str(ev), 2)
    assert r["counters"]["evictions"] > 0
    capsys.readouterr()


def test_a_learner_trained_on_forecasts_is_evaluated_and_simulated_with_its_horizon(trained,
                                                                                   capsys):  # fmt: skip
    """train --predictor evictor --horizon H records H; eval replays it with H's forecasts;
    simulate runs it as evictor+forecast only when given --horizon (refused otherwise)."""
    from tensorbend.simulate.costs import Calibration

    d, plain = trained
    hz, ck = d / "h.safetensors", d / "ef.safetensors"
    assert main(["train", "--trace", str(d / "t"), "--out", str(hz), "--predictor", "horizon",
                 "--inputs", "routing", "--quiet"]) == 0  # fmt: skip
    assert main(["train", "--trace", str(d / "t"), "--out", str(ck), "--predictor", "evictor",
                 "--horizon", str(hz), "--quiet"]) == 0  # fmt: skip
    model = EvictorModel.load(str(ck))
    assert "forecast" in model.groups and model.meta["horizon"] == str(hz)
    assert main(["eval", "--trace", str(d / "t"), "--predictor", str(ck), "--baselines",
                 "frequency", "--json", str(d / "ef.json")]) == 0  # fmt: skip
    (ev,) = json.loads((d / "ef.json").read_text())["eviction"]
    test = load_requests(str(d / "t"), "test", str(hz))
    want = replay(test, Evictor(2, 4, model, model.meta["prior_K"]), ev["cache_slots"],
                  admission="policy")  # fmt: skip
    assert ev["horizon"] == str(hz)
    assert ev["replay"]["evictor"]["experts_per_token"] == want["experts_per_token"]
    cal = Calibration(expert_bytes=1000, link_bandwidth_Bps=1e6, link_latency_s=1e-5,
                      attn_s=1e-4, expert_s=1e-5, forward_s=0.0).save(d / "cal2.json")  # fmt: skip
    base = ["simulate", "--trace", str(d / "t"), "--hardware", "h100-pcie5", "--geometry",
            "from-trace", "--calibration", str(cal), "--policy", "evictor", "--evictor", str(ck),
            "--split", "test"]  # fmt: skip
    capsys.readouterr()
    assert main(base) == 2
    assert "reads a horizon's forecasts" in capsys.readouterr().err
    assert main([*base, "--horizon", str(hz), "--json", str(d / "sf.json")]) == 0
    (row,) = json.loads((d / "sf.json").read_text())["results"]
    assert row["label"] == "evictor+forecast" and row["token_ahead_layers"] == 0
    base[base.index(str(ck))] = str(plain)
    assert main([*base, "--horizon", str(hz)]) == 2
    assert "reads no forecasts" in capsys.readouterr().err
