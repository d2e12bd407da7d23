"""Predictors on planted structure, hand-computed metrics, checkpoints and their errors, eval."""

import json
import re

import pytest
import torch
from planted import permutation_trace, tiny_real_trace
from safetensors.torch import load_file, save_file

from tensorbend.capture.trace import Trace
from tensorbend.cli import main
from tensorbend.errors import CheckpointError, PredictorConfigError, TensorbendError
from tensorbend.predictors import build_baseline, load_predictor, sources_from_rows
from tensorbend.predictors.checkpoint import META_KEY
from tensorbend.predictors.evaluate import EvalConfig, evaluate
from tensorbend.predictors.metrics import set_metrics
from tensorbend.predictors.scoring import score_predictor
from tensorbend.predictors.train import TrainConfig, train


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    d = tmp_path_factory.mktemp("planted")
    permutation_trace(d / "t")
    return d


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory):
    return tiny_real_trace(tmp_path_factory.mktemp("real"))


def _result(report, kind, la, phase):
    return next(
        r
        for r in report.to_json()["results"]
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
    assert s.to_json()["val"]["decode"] > 0.95
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


def _rewrite(src, dst, tensors=None, meta=None):
    """Copy checkpoint src to dst with some tensors or the metadata string replaced."""
    from safetensors import safe_open

    with safe_open(str(src), "pt") as f:
        raw = f.metadata()
    save_file(
        {**load_file(str(src)), **(tensors or {})}, str(dst), {META_KEY: meta or raw[META_KEY]}
    )
    return dst


@pytest.mark.parametrize("kind", ["transition", "tensorbend"])
def test_corrupt_checkpoints_raise_one_line_errors(planted, tmp_path, kind):
    out = tmp_path / "ok.safetensors"
    epochs = 1 if kind == "tensorbend" else None
    train(
        TrainConfig(trace=planted / "t", out=out, predictor=kind, lookahead="d1", epochs=epochs),
        progress=False,
    )
    name, shape = ("P_LEE", (4, 16, 15)) if kind == "transition" else ("net.W1", (3, 7, 5))
    wrong = _rewrite(out, tmp_path / "shape.safetensors", {name: torch.zeros(shape)})
    with pytest.raises(
        CheckpointError, match=rf"{name} expected shape .*, found {re.escape(str(shape))}"
    ):
        load_predictor(wrong)
    broken = _rewrite(out, tmp_path / "json.safetensors", meta='{"format_version": 1, "kind"')
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        load_predictor(broken)
    meta = json.loads(_meta(out))
    unknown = _rewrite(out, tmp_path / "k.safetensors", meta=json.dumps({**meta, "kind": "x"}))
    with pytest.raises(CheckpointError, match="metadata kind expected one of"):
        load_predictor(unknown)
    for path, tail in ((wrong, "shape"), (broken, "JSON")):  # the CLI: exit 2, one line
        rc = main(["eval", "--trace", str(planted / "t"), "--predictor", str(path)])
        assert rc == 2, tail


def _meta(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()[META_KEY]


def test_train_options_are_checked_before_any_trace_is_read(tmp_path, capsys):
    missing = tmp_path / "no-trace"
    bad = [
        ("tensorbend", ["--loss", "nope"], "--loss: invalid choice: 'nope'"),
        ("tensorbend", ["--loss", "ranking"], "expected one of listwise, bce"),
        ("seed_mlp", ["--loss", "listwise"], "expected one of weighted_bce, ranking, bce"),
        ("frequency", ["--loss", "bce"], "frequency has no option loss"),
        ("seed_mlp", ["--width", "0"], "width: expected a positive integer"),
    ]
    for kind, extra, msg in bad:
        argv = ["train", "--trace", str(missing), "--out", str(tmp_path / "o.safetensors")]
        assert main([*argv, "--predictor", kind, *extra]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and err.count("\n") == 1, err
    with pytest.raises(PredictorConfigError, match="tensorbend has no option prev_routing"):
        TrainConfig(trace=missing, out=missing, prev_routing="layer")


def test_eval_cli_json_keys(planted, tmp_path):
    js = tmp_path / "e.json"
    argv = ["eval", "--trace", str(planted / "t"), "--baselines", "frequency,spec_gate"]
    argv += ["--lookahead", "d1", "--lookahead", "pre_attn", "--json", str(js)]
    assert main([*argv, "--plots", str(tmp_path / "plots")]) == 0
    rep = json.loads(js.read_text())
    assert rep["split"] == "test" and rep["top_k"] == 2
    keys = {"predictor", "checkpoint", "lookahead", "phase", "recall_at_k", "hit_at_k_plus_p"}
    keys |= {"exact_match", "tokens", "params", "us_per_token", "per_layer"}
    assert all(keys <= set(r) for r in rep["results"])
    assert {(r["predictor"], r["lookahead"]) for r in rep["results"]} == {
        (k, la) for k in ("frequency", "spec_gate") for la in ("d1", "pre_attn")
    }
    assert len(list((tmp_path / "plots").glob("*.png"))) == 4
    assert main(["eval", "--trace", str(planted / "t"), "--baselines", "nope"]) == 2


def test_spec_gate_same_layer_is_the_exact_router(real_trace):
    rep = evaluate(
        EvalConfig(
            trace=real_trace, baselines=("spec_gate",), lookaheads=("same_layer",), split="all"
        )
    )
    for r in rep.to_json()["results"]:
        assert r["recall_at_k"] == pytest.approx(1.0, abs=1e-3), r["phase"]


def _perturbed_ours(trace, tmp_path, la: str):
    """Ours trained briefly on `trace`, its correction made non-trivial; the trace's rows."""
    out = tmp_path / f"{la}.safetensors"
    train(
        TrainConfig(trace=trace, out=out, predictor="tensorbend", lookahead=la, epochs=2),
        progress=False,
    )
    p = load_predictor(out)
    with torch.no_grad():
        p.net.W2.normal_(0, 0.3)
        p.net.alpha.fill_(0.7)
    p._fast = {}
    return p, Trace.open(trace).load(p.lookahead.features)


def test_ours_fast_path_equals_training_computation(real_trace, tmp_path):
    for la in ("d1", "pre_attn"):
        p, rows = _perturbed_ours(real_trace, tmp_path, la)
        for m in p.lookahead.targets(p.spec.num_moe_layers):
            src = sources_from_rows(rows, p.lookahead, m)
            assert src.has_prev_T.any() and not src.has_prev_T.all()
            assert torch.allclose(p.scores(m, src), p.scores_reference(m, src), atol=1e-4)
            for i in range(0, len(src), 7):  # the one-token (decode) path
                one = src.row(i)
                assert torch.allclose(p.scores(m, one), p.scores_reference(m, one), atol=1e-4)


def test_ours_one_token_numpy_path_ranks_like_the_torch_path(real_trace, tmp_path):
    """Decode scores one token in numpy (residual_fast.score_token): the same scores as the
    torch fast path up to rounding, and the same top-(K + 2) experts in the same order, also
    as prefetch._token_list names them."""
    from tensorbend.predictors import prefetch
    from tensorbend.predictors.residual_fast import score_folded

    for la in ("d1", "pre_attn"):
        p, rows = _perturbed_ours(real_trace, tmp_path, la)
        width = p.spec.top_k + 2
        for m in p.lookahead.targets(p.spec.num_moe_layers):
            src = sources_from_rows(rows, p.lookahead, m)
            for i in range(len(src)):
                one = src.row(i)
                fast = p.scores(m, one)
                assert p._fast[m][1] is not None  # the numpy path covers this router
                torch_path = score_folded(p, p._fast[m][0], m, one)
                assert torch.allclose(fast, torch_path, atol=1e-5)
                want = torch_path.topk(width).indices[0].tolist()
                assert fast.topk(width).indices[0].tolist() == want
                assert prefetch._token_list(fast, width) == want


def test_unknown_baseline_and_untrainable_kind_are_user_errors(planted, tmp_path):
    with pytest.raises(TensorbendError, match="expected 'all' or names from spec_gate"):
        EvalConfig(trace=planted / "t", baselines=("nope",))
    with pytest.raises(
        PredictorConfigError,
        match="'spec_gate': expected one of tensorbend, horizon, seed_mlp",
    ):
        TrainConfig(trace=planted / "t", out=tmp_path / "x", predictor="spec_gate")
