"""The cross-token predictor (kind `horizon`) and its measurement (foresight.py)."""

import pytest
import torch
from planted import cycle_trace, permutation_trace, router_trace

from tensorbend.capture.trace import Trace
from tensorbend.cli import main
from tensorbend.errors import TensorbendError
from tensorbend.predictors.base import TrainData
from tensorbend.predictors.checkpoint import load_predictor
from tensorbend.predictors.foresight import evaluate_foresight
from tensorbend.predictors.horizon import HorizonConfig, HorizonPredictor, first_use_class


def test_first_use_class_by_hand():
    # next 3 forwards of 1 layer x 3 experts: e0 used at +2, e1 at +1 and +3, e2 never
    next_FLE = torch.tensor([[[0, 1, 0]], [[1, 0, 0]], [[0, 1, 0]]])
    assert first_use_class(next_FLE, h=3).tolist() == [[1, 0, 3]]
    assert first_use_class(next_FLE[:0], h=3).tolist() == [[3, 3, 3]]  # request over: later


@pytest.fixture(scope="module")
def cycle(tmp_path_factory):
    root = tmp_path_factory.mktemp("cycle") / "t"
    cycle_trace(root)
    return Trace.open(root)


def test_a_cycle_across_tokens_is_learned_exactly_and_reaches_belady(cycle):
    """Routing that alternates A, B, A, ... across tokens: the next use of every expert is a
    function of the present, so next-forward recall is 1.0 and a cache evicting by the
    forecast reads exactly what Belady (full future) reads, while LRU thrashes."""
    rows = {s: cycle.load(("ids",), split=s) for s in ("train", "val", "test")}
    cfg = HorizonConfig(foresight=2, inputs="routing")
    p = HorizonPredictor.fit(cycle.spec, None, TrainData(rows["train"], rows["val"]), cfg)
    rep = evaluate_foresight(p, rows["test"], cache_frac=6 / 8)  # 6 slots, 8 experts in use
    assert rep["next_forward_recall"] == [1.0, 1.0]
    assert rep["within_h_recall"] == [1.0, 1.0]
    replay = {k: v["experts_per_token"] for k, v in rep["replay"].items()}
    ours = "horizon(evict only)"
    assert replay[ours] == pytest.approx(replay["oracle@h=all"])
    assert replay[f"{ours}/adm=predicted"] == pytest.approx(replay["oracle@h=all/adm=predicted"])
    assert replay["lru"] == pytest.approx(4.0)  # every use misses
    assert replay["oracle@h=all"] < 2.5 and replay["oracle@h=all/adm=predicted"] < 1.2


@pytest.mark.parametrize("planted", ["cycle", "router"])
def test_the_bounded_oracle_is_a_ceiling_over_the_best_cache(planted, tmp_path):
    """Beyond its sight the oracle ranks and admits like the best no-prediction cache (with h = 0
    it IS that cache, to the expert), so for every h >= 1 it reads no more than that cache;
    Belady within a sight of 1 forward plus that rule beyond is not enough by itself on the
    router trace, which is why the ceiling may ignore what it knows (`oracle_at`)."""
    (cycle_trace if planted == "cycle" else router_trace)(tmp_path / "t")
    tr = Trace.open(tmp_path / "t")
    rows = {s: tr.load(("ids",), split=s) for s in ("train", "val", "test")}
    cfg = HorizonConfig(foresight=2, inputs="routing")
    p = HorizonPredictor.fit(tr.spec, None, TrainData(rows["train"], rows["val"]), cfg)
    for frac in (0.25, 0.5):
        rep = evaluate_foresight(p, rows["test"], cache_frac=frac)
        rp = rep["replay"]
        best = rp[rep["best_no_prediction"]]
        same = [r for r in rp.values() if r["policy"] == "oracle" and r["foresight"] == 0
                and (r["pool"], r["admission"]) == (best["pool"], best["admission"])]  # fmt: skip
        assert len(same) == 1 and same[0]["experts_per_token"] == best["experts_per_token"]
        ceiling = [rp[rep["oracle_ceiling"][h]]["experts_per_token"]
                   for h in ("1", "2", "4", "8", "all")]  # fmt: skip
        assert all(c <= best["experts_per_token"] for c in ceiling), (frac, ceiling, best)
        assert ceiling == sorted(ceiling, reverse=True)  # more sight never costs
        assert planted == "cycle" or ceiling[-1] < best["experts_per_token"]  # the future helps
    if planted == "router":  # at 25%: Belady for 1 forward + LFU beyond reads more than LFU
        raw = [r["experts_per_token"] for r in rep["replay"].values()
               if r["policy"] == "oracle" and r["foresight"] == 1]  # fmt: skip
        assert rep["cache_frac"] == 0.5 or min(raw) >= best["experts_per_token"]


def test_train_eval_cli_round_trip_and_refusals(tmp_path, capsys):
    permutation_trace(tmp_path / "t", prompts=16)
    out = tmp_path / "h.safetensors"
    argv = ["train", "--trace", str(tmp_path / "t"), "--out", str(out), "--quiet"]
    assert main([*argv, "--predictor", "horizon", "--foresight", "3"]) == 0
    p = load_predictor(out)
    assert (p.kind, p.cfg.foresight, p.lookahead.name) == ("horizon", 3, "next_forwards")
    capsys.readouterr()
    assert main(["eval", "--trace", str(tmp_path / "t"), "--predictor", str(out),
                 "--baselines", "none", "--lookahead", "d1"]) == 0  # fmt: skip
    assert "gap to full Belady closed by" in capsys.readouterr().out
    bad = [
        (["--predictor", "horizon", "--lookahead", "d2"], "expected no lookahead"),
        (["--predictor", "horizon", "--loss", "bce"], "horizon has no option loss"),
        (["--predictor", "tensorbend", "--foresight", "3"], "tensorbend has no option foresight"),
        (["--predictor", "horizon", "--tokens-per-forward", "4"], "horizon has no option tokens_"),
        (["--predictor", "horizon", "--no-use-prev"], "horizon has no option use_prev"),
    ]
    for extra, msg in bad:
        assert main([*argv, *extra]) == 2
        assert msg in capsys.readouterr().err


def test_routing_only_horizon_trains_on_a_trace_without_hidden_states(tmp_path):
    """An imported (routing-only) trace: inputs=routing trains; routing+hidden says why not."""
    from tensorbend.engines.importers import ImportConfig, import_trace

    csv = tmp_path / "r.csv"
    lines = ["prompt_id,layer,position,expert_ids,phase"]
    for p in range(40):
        for t in range(8):
            for m in range(2):
                ids = f"{(t + m) % 4} {(t + m + 1) % 4}"
                lines.append(f"p{p},{m},{t},{ids},{'prefill' if t == 0 else 'decode'}")
    csv.write_text("\n".join(lines) + "\n")
    import_trace(ImportConfig("csv", csv, tmp_path / "t", progress=False))
    base = ["train", "--trace", str(tmp_path / "t"), "--predictor", "horizon", "--quiet",
            "--out", str(tmp_path / "h.safetensors")]  # fmt: skip
    assert main([*base, "--inputs", "routing"]) == 0
    t = str(tmp_path / "t")
    ev = ["eval", "--trace", t, "--json", str(tmp_path / "e.json")]
    assert main([*ev, "--baselines", "all"]) == 0  # routing-only peers, at d1..d3
    import json

    kinds = {r["predictor"] for r in json.loads((tmp_path / "e.json").read_text())["results"]}
    assert kinds == {"transition", "prev_token", "frequency", "random", "oracle"}
    assert main([*ev, "--baselines", "spec_gate"]) == 2  # needs hidden states: says so
    assert main(["train", "--trace", t, "--predictor", "transition", "--quiet",
                 "--out", str(tmp_path / "tr.safetensors")]) == 0  # fmt: skip
    with pytest.raises(TensorbendError, match="--inputs routing"):
        from tensorbend.predictors.train import TrainConfig, train

        train(TrainConfig(tmp_path / "t", tmp_path / "x.safetensors", "horizon"), progress=False)


def test_fast_numpy_path_equals_the_torch_computation(cycle):
    """The runtime's numpy path (state, forecast, next-use steps) equals HorizonPredictor's."""
    import numpy as np

    from tensorbend.predictors.horizon import request_forwards
    from tensorbend.predictors.horizon_fast import FastHorizon

    for inputs in ("routing", "routing+hidden"):
        rows = {s: cycle.load(("ids", "gate_input"), split=s) for s in ("train", "val")}
        cfg = HorizonConfig(foresight=3, inputs=inputs)
        p = HorizonPredictor.fit(cycle.spec, None, TrainData(rows["train"], rows["val"]), cfg)
        torch.nn.init.normal_(p.net.w_LJX)  # non-trivial weights everywhere
        if p.net.mlp is not None:
            torch.nn.init.normal_(p.net.mlp[2].weight, std=0.1)
        fast = FastHorizon(p)
        request = request_forwards(rows["val"], cycle.spec)[0]
        st, fst = p.new_state(), fast.new_state()
        for f, (_, used_LE, _) in enumerate(request):
            h = torch.randn(8)  # the cycle trace stores zeros: exercise the MLP
            st.observe(used_LE, h)
            want = p.forecast(st).next_use_steps(f, cycle.spec.num_moe_layers)
            got = fast.step(fst, used_LE.numpy(), h.numpy(), forward=f)
            for a, b in zip(want, got, strict=True):
                np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-4)
            np.testing.assert_allclose(
                fast.next_forward_probs, p.forecast(st).first_use_LEJ[..., 0].numpy(), atol=1e-5
            )


def test_horizon_training_streams_at_most_its_row_limits(tmp_path, monkeypatch):
    """Rows (forwards) come out of the shards one shard at a time, at most --max-train-rows /
    --max-val-rows of them; without limits the streamed fit is the in-memory fit, byte for byte,
    and its val recalls are foresight.evaluate_foresight's on the whole val requests."""
    from tensorbend.predictors.foresight import dataset_recalls
    from tensorbend.predictors.train import TrainConfig, train

    permutation_trace(tmp_path / "t", prompts=16)  # 32 rows a prompt, shards of 200 rows
    tr = Trace.open(tmp_path / "t")
    loaded = []
    load = Trace.load

    def counting(self, *a, **k):
        rows = load(self, *a, **k)
        loaded.append(rows["phase_T"].numel())
        return rows

    monkeypatch.setattr(Trace, "load", counting)
    cfg = TrainConfig(tmp_path / "t", tmp_path / "h.safetensors", "horizon", max_train_rows=7,
                      max_val_rows=3, epochs=2)  # fmt: skip
    got = train(cfg, progress=False).to_json()
    assert (got["train_rows"], got["val_rows"]) == (7, 3)
    assert max(loaded) <= 200  # one shard at a time, never a whole split
    assert load_predictor(cfg.out).metadata["val_metrics"]["decode_rows"] <= 3

    full = TrainConfig(tmp_path / "t", tmp_path / "f.safetensors", "horizon", epochs=2)
    streamed = train(full, progress=False).to_json()
    feats = full.kind_config.features
    rows = {s: tr.load(feats, split=s) for s in ("train", "val")}
    n_val = sum(q["decode"] for q in tr.prompts if q["split"] == "val")  # prefill + decode - 1
    assert (streamed["train_rows"], streamed["val_rows"]) == (
        sum(q["decode"] for q in tr.prompts if q["split"] == "train"),
        n_val,
    )
    ref = HorizonPredictor.fit(
        tr.spec, None, TrainData(rows["train"], rows["val"]), full.kind_config
    )
    p = load_predictor(full.out)
    for k, v in ref.state_tensors().items():
        assert torch.equal(p.state_tensors()[k], v), k
    want = evaluate_foresight(p, rows["val"], replay=False)
    have = dataset_recalls(p, p.dataset(rows["val"]))
    for key in ("next_forward_recall", "within_h_recall"):
        assert have[key] == pytest.approx(want[key], abs=1e-6)
        assert p.metadata["val_metrics"][key] == pytest.approx(want[key], abs=1e-6)
