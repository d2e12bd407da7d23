"""No-leak guarantees: what a prediction may read at its source point, row selection, held-out eval."""

import copy
from dataclasses import replace

import pytest
import torch
from planted import router_trace, tiny_real_trace

from tensorbend.errors import TensorbendError
from tensorbend.evaluate import EvalConfig, evaluate
from tensorbend.predictors.base import HEADLINE_LOOKAHEADS, LOOKAHEADS, TrainData, sources_from_rows
from tensorbend.predictors.fit import FitConfig
from tensorbend.predictors.registry import KINDS, build
from tensorbend.predictors.residual_gate import ResidualGateConfig
from tensorbend.predictors.seed_mlp import SEED_FIT, SeedMLPConfig
from tensorbend.rows import RowSelection, select_rows
from tensorbend.trace import Trace
from tensorbend.train import TrainConfig, train


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    d = tmp_path_factory.mktemp("routed")
    router_trace(d / "t")
    return d / "t"


def test_prefill_rows_never_see_the_previous_tokens_routing_at_a_real_lookahead(tmp_path):
    rows = Trace.open(tiny_real_trace(tmp_path)).load(("ids", "gate_input", "layer_input"))
    prev = rows["prev_row_T"]
    phase = rows["phase_T"]
    pair = (prev >= 0) & (phase == 0) & (phase[prev.clamp(min=0)] == 0)  # prefill after prefill
    decode = (prev >= 0) & (phase == 1)
    assert pair.sum() > 20 and decode.sum() > 20
    for name, la in LOOKAHEADS.items():
        for m in la.targets(rows["expert_ids_TLK"].shape[1]):
            has = sources_from_rows(rows, la, m).has_prev_T
            assert has[decode].all(), (name, m)
            assert not has[prev < 0].any(), (name, m)
            # same_layer: the router input of layer m exists for the whole pass (the seed's setup)
            assert bool(has[pair].all() if la.prev_in_pass else not has[pair].any()), (name, m)
    assert [n for n, la in LOOKAHEADS.items() if la.prev_in_pass] == ["same_layer"]


def _scramble(rows, la, m, g):
    """Rows with everything the source point of target m may not see replaced by noise."""
    out = dict(rows)
    last = m - la.distance if la.distance else m - 1  # latest layer routed before the source
    hid_from = {"gate_input": last + 1, "layer_input": m + 1 if la.distance == 0 else last + 1}
    ids = rows["expert_ids_TLK"].clone()
    E, L = int(ids.max()) + 1, ids.shape[1]
    ids[:, last + 1 :] = torch.randint(0, E, ids[:, last + 1 :].shape, generator=g).to(ids.dtype)
    out["expert_ids_TLK"] = ids
    for f, start in hid_from.items():
        h = rows[f"{f}_TLD"].clone()
        h[:, start:] = torch.randn(h[:, start:].shape, generator=g).to(h.dtype)
        out[f"{f}_TLD"] = h
    assert start <= L
    return out


def _fitted(kind, la, spec, data):
    cfg = None
    if kind == "tensorbend":
        cfg = ResidualGateConfig(fit=FitConfig(epochs=2, min_steps=0, batch_rows=256))
    elif kind == "seed_mlp":
        cfg = SeedMLPConfig(width=32, fit=replace(SEED_FIT, epochs=3))
    p = build(kind, spec, LOOKAHEADS[la], data, cfg)
    if kind == "tensorbend":
        with torch.no_grad():  # a correction that reads every input
            p.net.W2.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    return p


@pytest.mark.parametrize(
    "kind", [k for k, v in KINDS.items() if not v.cls.needs_truth and not v.cross_token]
)
def test_scrambling_what_the_source_point_cannot_see_changes_no_prediction(routed, kind):
    tr = Trace.open(routed)
    feats = ("ids", "gate_input", "layer_input")
    data = TrainData(tr.load(feats, split="train"), tr.load(feats, split="val"), tr.router_params())
    rows = select_rows(tr.load(feats, split="test"), RowSelection())  # previous tokens kept aside
    g = torch.Generator().manual_seed(0)
    for name in HEADLINE_LOOKAHEADS:
        la, p = LOOKAHEADS[name], _fitted(kind, name, tr.spec, data)
        for m in la.targets(tr.spec.num_moe_layers):
            a = copy.deepcopy(p).scores(m, sources_from_rows(rows, la, m))
            b = copy.deepcopy(p).scores(m, sources_from_rows(_scramble(rows, la, m, g), la, m))
            assert torch.equal(a, b), (kind, name, m)


def test_row_subsets_keep_each_rows_previous_token(routed):
    """After sampling rows, every kept row's SourceBatch equals its row's in the full rows."""
    rows = Trace.open(routed).load(("ids", "gate_input"), split="train")
    key = {
        (int(p), int(q)): i
        for i, (p, q) in enumerate(zip(rows["prompt_index_T"], rows["positions_T"], strict=True))
    }
    for sel in (
        RowSelection(max_prompts=5),
        RowSelection(max_rows=300),
        RowSelection(tokens_per_forward=4),
    ):
        sub = select_rows(rows, sel)
        n = sub["prompt_index_T"].shape[0]
        assert 0 < n < rows["prompt_index_T"].shape[0]
        idx = torch.tensor(
            [
                key[(int(p), int(q))]
                for p, q in zip(sub["prompt_index_T"], sub["positions_T"], strict=True)
            ]
        )
        for name in ("same_layer", "d1"):
            la = LOOKAHEADS[name]
            for m in la.targets(rows["expert_ids_TLK"].shape[1]):
                full, part = sources_from_rows(rows, la, m), sources_from_rows(sub, la, m)
                assert torch.equal(part.has_prev_T, full.has_prev_T[idx])
                have = part.has_prev_T
                assert have[sub["phase_T"] == 1].all()  # every decode row keeps its own
                assert torch.equal(part.prev_ids_TK[have], full.prev_ids_TK[idx][have])
        if sel.tokens_per_forward:
            assert (sub["positions_T"][sub["phase_T"] == 0] < 4).all()
            assert (sub["phase_T"] == 1).sum() == (rows["phase_T"] == 1).sum()


def test_eval_refuses_a_checkpoints_own_training_prompts_without_the_flag(routed, tmp_path):
    out = tmp_path / "f.safetensors"
    train(TrainConfig(trace=routed, out=out, predictor="frequency", lookahead="d1"), progress=False)
    for split in ("train", "val", "all"):
        with pytest.raises(TensorbendError, match=f"prompts of split '{split}': expected held-out"):
            evaluate(EvalConfig(trace=routed, predictors=(out,), baselines=(), split=split))
        ok = EvalConfig(
            trace=routed, predictors=(out,), baselines=(), split=split, allow_seen_split=True
        )
        assert evaluate(replace(ok, timing_rows=0)).to_json()["results"]
    assert evaluate(
        EvalConfig(trace=routed, predictors=(out,), baselines=(), timing_rows=0)
    ).results
