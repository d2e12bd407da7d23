"""Predictors on planted structure, hand-computed metrics, checkpoints, the seed's API."""

import json

import pytest
import torch
from planted import permutation_trace

from tensorbend.cli import main
from tensorbend.errors import CheckpointError
from tensorbend.evaluate import EvalConfig, evaluate, score_predictor
from tensorbend.metrics import set_metrics
from tensorbend.predictors import build_baseline, load_predictor
from tensorbend.predictors.residual_gate import seed_params_per_layer, width_for_budget
from tensorbend.trace import Trace
from tensorbend.train import TrainConfig, train


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    d = tmp_path_factory.mktemp("planted")
    permutation_trace(d / "t")
    return d


def _result(report, kind, la, phase):
    return next(
        r
        for r in report["results"]
        if r["predictor"] == kind and r["lookahead"] == la and r["phase"] == phase
    )


def test_metrics_by_hand():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.0], [0.1, 0.2, 0.9, 0.3]])
    truth = torch.tensor([[0, 2], [2, 3]])
    m = set_metrics(scores, truth, overprovision=(0, 1, 2))
    # row 0: top-2 {0,1} hits {0} -> 1/2; top-3 {0,1,2} -> 2/2. row 1: top-2 {2,3} -> 2/2.
    assert m["recall_at_k"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["hit_at_k_plus_p"] == {
        "0": pytest.approx(0.75),
        "1": pytest.approx(1.0),
        "2": pytest.approx(1.0),
    }
    assert m["exact_match"] == pytest.approx(0.5)
    assert m["miss_rate"] == pytest.approx(0.25)


def test_planted_permutation_transition_and_ours_perfect_frequency_not(planted, tmp_path):
    out = tmp_path / "ours.safetensors"
    s = train(
        TrainConfig(trace=planted / "t", out=out, predictor="tensorbend", lookahead="d1"),
        progress=False,
    )
    assert s["val"]["decode"] > 0.95
    rep = evaluate(EvalConfig(trace=planted / "t", predictors=(out,), lookaheads=("d1",)))
    for phase in ("prefill", "decode"):
        assert _result(rep, "transition", "d1", phase)["recall_at_k"] == pytest.approx(1.0)
        assert _result(rep, "tensorbend", "d1", phase)["recall_at_k"] > 0.97
        assert _result(rep, "oracle", "d1", phase)["recall_at_k"] == 1.0
        assert _result(rep, "frequency", "d1", phase)["recall_at_k"] < 0.35
        assert _result(rep, "random", "d1", phase)["recall_at_k"] < 0.35
    r = _result(rep, "tensorbend", "d1", "decode")
    assert r["checkpoint"] == str(out) and r["target_layers"] == [1, 2, 3] and r["params"] > 0
    assert set(r["hit_at_k_plus_p"]) == {"0", "2", "4", "K"}


def test_training_is_deterministic_same_bytes(planted, tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    for out in (a, b):
        train(
            TrainConfig(
                trace=planted / "t", out=out, predictor="tensorbend", lookahead="d2", epochs=3
            ),
            progress=False,
        )
    assert a.read_bytes() == b.read_bytes()


def test_checkpoint_round_trip_and_mismatch_errors(planted, tmp_path):
    out = tmp_path / "t.safetensors"
    train(
        TrainConfig(trace=planted / "t", out=out, predictor="transition", lookahead="d1"),
        progress=False,
    )
    tr = Trace.open(planted / "t")
    p = load_predictor(out, spec=tr.spec, fingerprint=tr.manifest["model"]["fingerprint"])
    ref = build_baseline("transition", tr.spec, "d1", train_rows=tr.load(("ids",), split="train"))
    rows = tr.load(("ids", "gate_input"), split="test")
    assert score_predictor(p, rows) == score_predictor(ref, rows)
    with pytest.raises(
        CheckpointError, match="trained for model fingerprint planted0, found other"
    ):
        load_predictor(out, spec=tr.spec, fingerprint="other")
    other = permutation_trace(tmp_path / "t2", E=8, seed=1)[0]
    with pytest.raises(CheckpointError, match="num_experts expected 8, found 16"):
        load_predictor(out, spec=other)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_predictor(bad)


def test_ours_stays_within_a_quarter_of_the_seed_mlp():
    for D, E in ((128, 32), (7168, 384), (7168, 72), (2048, 128)):
        H = width_for_budget(D, E, 64, 0.25)
        ours = (D + 2 * E + 1) * H + H + H * E + E + 1
        assert ours <= 0.25 * seed_params_per_layer(D, E)


def test_seed_mlp_trains_and_reports_training_rows(planted, tmp_path):
    out = tmp_path / "seed.safetensors"
    s = train(
        TrainConfig(trace=planted / "t", out=out, predictor="seed_mlp", lookahead="d1", epochs=40),
        progress=False,
    )
    assert "train_rows_recall" in s and s["params"] == 3 * seed_params_per_layer(16, 16)
    p = load_predictor(out)
    assert p.kind == "seed_mlp" and p.lookahead.name == "d1"


def test_eval_cli_json_keys(planted, tmp_path, capsys):
    js = tmp_path / "e.json"
    rc = main(
        [
            "eval",
            "--trace",
            str(planted / "t"),
            "--baselines",
            "frequency,spec_gate",
            "--lookahead",
            "d1",
            "--lookahead",
            "pre_attn",
            "--json",
            str(js),
            "--plots",
            str(tmp_path / "plots"),
        ]
    )
    assert rc == 0
    rep = json.loads(js.read_text())
    assert rep["split"] == "test" and rep["top_k"] == 2
    keys = {
        "predictor",
        "checkpoint",
        "lookahead",
        "phase",
        "recall_at_k",
        "hit_at_k_plus_p",
        "exact_match",
        "tokens",
        "params",
        "us_per_token",
        "per_layer",
    }
    assert all(keys <= set(r) for r in rep["results"])
    assert {(r["predictor"], r["lookahead"]) for r in rep["results"]} == {
        (k, la) for k in ("frequency", "spec_gate") for la in ("d1", "pre_attn")
    }
    assert len(list((tmp_path / "plots").glob("*.png"))) == 4
    assert main(["eval", "--trace", str(planted / "t"), "--baselines", "nope"]) == 2


def test_seed_checkpoint_format_loads_safely(tmp_path):
    """A checkpoint in the seed's own torch.save format loads with weights_only and predicts alike."""
    from tensorbend import ExpertPredictorSet

    L, D, E, p = 3, 12, 10, 16

    class Seed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.bn, self.fc2 = (
                torch.nn.Linear(D + E, p),
                torch.nn.BatchNorm1d(p),
                torch.nn.Linear(p, E),
            )

        def forward(self, x):
            return self.fc2(torch.nn.functional.gelu(self.bn(self.fc1(x))))

    torch.manual_seed(0)
    ml = torch.nn.ModuleList([Seed() for _ in range(L)])
    for m in ml:  # non-trivial running stats
        m.train()
        m(torch.randn(64, D + E) * 3 + 1)
    ml.eval()
    path = tmp_path / "predictor.pt"
    torch.save({"state_dict": ml.state_dict(), "num_layers": L, "trained": True}, path)

    pset = ExpertPredictorSet(num_layers=L, hidden_dim=D, num_experts=E, predictor_dim=p)
    pset.load(path)
    h = torch.randn(D)
    prev = [1, 4, 7]
    pset.update_routing(prev)
    got = pset.predict(layer_idx=2, hidden_states=h, top_k=3, overprovision=2)
    x = torch.cat([h, torch.zeros(E).index_fill_(0, torch.tensor(prev), 1.0)])[None]
    want = ml[2](x)[0].topk(5).indices.tolist()
    assert got == want
    pset.reset_routing()
    got0 = pset.predict(layer_idx=0, hidden_states=h, top_k=3, overprovision=2)
    assert got0 == ml[0](torch.cat([h, torch.zeros(E)])[None])[0].topk(5).indices.tolist()
    assert pset.total_params == sum(q.numel() for q in ml.parameters())
    pset.save(tmp_path / "p.safetensors")
    again = ExpertPredictorSet(num_layers=L, hidden_dim=D, num_experts=E, predictor_dim=p)
    again.load(tmp_path / "p.safetensors")
    again.update_routing(prev)
    assert again.predict(layer_idx=2, hidden_states=h, top_k=3, overprovision=2) == want
    wrong = ExpertPredictorSet(num_layers=L, hidden_dim=D + 1, num_experts=E, predictor_dim=p)
    with pytest.raises(CheckpointError, match=r"fc1.weight expected shape \(16, 23\)"):
        wrong.load(path)


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory):
    """A trace of a real (tiny, random-init) DeepSeek-V3 with group-limited routing, stored in fp32."""
    from tiny_models import save_checkpoint, write_prompts

    from tensorbend.collect import CollectConfig, collect
    from tensorbend.hf import DecodeConfig

    d = tmp_path_factory.mktemp("real")
    save_checkpoint("deepseek_v3", d / "model")
    write_prompts(d / "p.jsonl", n=16)
    collect(
        CollectConfig(
            model=str(d / "model"),
            out=d / "t",
            prompts=d / "p.jsonl",
            decode=DecodeConfig(max_new_tokens=6),
            dtype="float32",
            features=("ids", "gate_input", "layer_input"),
        ),
        progress=False,
    )
    return d / "t"


def test_spec_gate_same_layer_is_the_exact_router(real_trace):
    rep = evaluate(
        EvalConfig(
            trace=real_trace, baselines=("spec_gate",), lookaheads=("same_layer",), split="all"
        )
    )
    for r in rep["results"]:
        assert r["recall_at_k"] == pytest.approx(1.0, abs=1e-3), r["phase"]


def test_ours_fast_path_equals_training_computation(real_trace, tmp_path):
    for la in ("d1", "pre_attn"):
        out = tmp_path / f"{la}.safetensors"
        train(
            TrainConfig(trace=real_trace, out=out, predictor="tensorbend", lookahead=la, epochs=2),
            progress=False,
        )
        p = load_predictor(out)
        with torch.no_grad():  # make the correction non-trivial
            p.net.W2.normal_(0, 0.3)
            p.net.alpha.fill_(0.7)
        p._fast = {}
        rows = Trace.open(real_trace).load(p.lookahead.features)
        from tensorbend.predictors import sources_from_rows

        for m in p.lookahead.targets(p.spec.num_moe_layers):
            src = sources_from_rows(rows, p.lookahead, m)
            assert torch.allclose(p.scores(m, src), p.scores_reference(m, src), atol=1e-4)
            from tensorbend.evaluate import _row

            for i in range(0, len(src), 7):  # the one-token (decode) path
                one = _row(src, i)
                assert torch.allclose(p.scores(m, one), p.scores_reference(m, one), atol=1e-4)


def test_row_subsets_keep_previous_token_links(planted):
    """Sampling train rows (the seed's row cap) or prompts keeps prev_row pointing at the same token."""
    from tensorbend.train import _rows

    tr = Trace.open(planted / "t")
    full = tr.load(("ids",), split="train")
    for kw in ({"max_prompts": 5, "max_rows": None}, {"max_prompts": None, "max_rows": 300}):
        sub = _rows(tr, ("ids",), "train", seed=0, **kw)
        n = sub["prompt_index_T"].shape[0]
        assert n == (300 if kw["max_rows"] else n) and n < full["prompt_index_T"].shape[0]
        ok = sub["prev_row_T"] >= 0
        assert ok.any()
        prev = sub["prev_row_T"][ok]
        assert torch.equal(sub["prompt_index_T"][prev], sub["prompt_index_T"][ok])
        assert torch.equal(sub["positions_T"][prev] + 1, sub["positions_T"][ok])
