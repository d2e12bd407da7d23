"""No-leak guarantees: what a prediction may read at its source point, row selection, held-out
eval; across tokens, a whole request whose future is scrambled through the foresight replay,
the engine-neutral Prefetcher and the threaded runtime."""

import copy
from dataclasses import replace

import pytest
import torch
from planted import router_trace, tiny_real_trace

from tensorbend.capture.rows import RowSelection, select_rows
from tensorbend.capture.trace import Trace
from tensorbend.errors import TensorbendError
from tensorbend.models import RoutingSpec
from tensorbend.predictors.base import HEADLINE_LOOKAHEADS, LOOKAHEADS, TrainData, sources_from_rows
from tensorbend.predictors.evaluate import EvalConfig, evaluate
from tensorbend.predictors.fit import FitConfig
from tensorbend.predictors.horizon import HorizonConfig, HorizonPredictor
from tensorbend.predictors.registry import KINDS, build
from tensorbend.predictors.residual_gate import ResidualGateConfig
from tensorbend.predictors.seed_mlp import SEED_FIT, SeedMLPConfig
from tensorbend.predictors.train import TrainConfig, train


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
    "kind",
    [k for k, v in KINDS.items() if not v.cls.needs_truth and not v.cross_token],
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


# ------------------------------------------------ across tokens: a whole request, future scrambled

L_H, E_H, K_H, D_H = 3, 8, 2, 16
PREFILL, DECODE, CUT = 5, 10, 5  # forwards 0 (the prefill) .. 10; the future: forwards > CUT


def _horizon(spec):
    torch.manual_seed(0)
    h = HorizonPredictor(spec, HorizonConfig(foresight=3))
    for p in h.net.parameters():  # arbitrary but fixed forecasts that read every input
        torch.nn.init.normal_(p, std=0.3)
    return h


def _request(g):
    """One request's rows: a 5-token prefill, then 10 decode tokens; random routing [T, L, K]
    (distinct experts per token) and gate inputs."""
    T = PREFILL + DECODE
    ids_TLK = torch.stack(
        [
            torch.stack([torch.randperm(E_H, generator=g)[:K_H] for _ in range(L_H)])
            for _ in range(T)
        ]
    )
    return {
        "expert_ids_TLK": ids_TLK.to(torch.int16),
        "gate_input_TLD": torch.randn(T, L_H, D_H, generator=g),
        "prompt_index_T": torch.zeros(T, dtype=torch.long),
        "phase_T": (torch.arange(T) >= PREFILL).to(torch.int8),
        "positions_T": torch.arange(T),
    }


def _with_future_scrambled(rows, g):
    """The same request with the routing and gate inputs of every forward after CUT redrawn
    (decode forward f >= 1 is row PREFILL - 1 + f)."""
    out, fresh, first = dict(rows), _request(g), PREFILL + CUT
    for k in ("expert_ids_TLK", "gate_input_TLD"):
        out[k] = torch.cat([rows[k][:first], fresh[k][first:]])
    assert not torch.equal(out["expert_ids_TLK"][first], rows["expert_ids_TLK"][first])
    return out


@pytest.fixture(scope="module")
def request_pair():
    g = torch.Generator().manual_seed(0)
    spec = RoutingSpec("qwen3_moe", "softmax", E_H, K_H, D_H, L_H, tuple(range(L_H)))
    rows = _request(g)
    return spec, _horizon(spec), rows, _with_future_scrambled(rows, g)


def test_the_foresight_replay_decides_nothing_before_a_forward_from_its_future(
    request_pair, monkeypatch
):
    """Whole requests through `evaluate_foresight` (which gets every forward at once): the
    forecasts after forwards 0..CUT, and every placement and eviction of the caches that use
    no oracle before forward CUT + 1 starts, are the same with the future scrambled; from
    forward CUT + 1 on they differ (the replay does read what it is given)."""
    from tensorbend.cache import replay as demand
    from tensorbend.predictors import foresight

    spec, pred, rows, scrambled = request_pair
    L, log, replay = spec.num_moe_layers, [], demand.replay

    def logged(ids_FLK, cfg, *args, forecasts=None, **kw):
        out = replay(ids_FLK, cfg, *args, forecasts=forecasts, **kw | {"record": True})
        if cfg.eviction != "next_use":  # Belady reads the future by definition
            log.append((cfg, forecasts, out.victims()))
        return out

    monkeypatch.setattr(demand, "replay", logged)
    runs = []
    for r in (rows, scrambled):
        log.clear()
        foresight.evaluate_foresight(pred, r, cache_frac=0.25)
        runs.append((list(log), foresight.forecasts(pred, r)))
    ((log_a, fc_a), (log_b, fc_b)), first = runs, (CUT + 1) * L

    def before_cut(entries):
        return [(cfg, None if fc is None else [a[: CUT + 1].tolist() for a in fc],
                 [v for v in victims if v[0] < first])  # fmt: skip
                for cfg, fc, victims in entries]  # fmt: skip

    past = before_cut(log_a)
    assert past == before_cut(log_b)
    assert {cfg.eviction for cfg, _, _ in past} >= {"lru", "lfu", "lfru", "reuse"}
    assert sum(fc is not None for _, fc, _ in past) == 2  # reuse x 2 admissions
    assert all(victims for _, _, victims in past)
    assert [v for _, _, v in log_a] != [v for _, _, v in log_b]
    for f in range(CUT + 1):
        assert torch.equal(fc_a[f].first_use_LEJ, fc_b[f].first_use_LEJ), f
        assert torch.equal(fc_a[f].tail_LE, fc_b[f].tail_LE), f
    assert not torch.equal(fc_a[CUT + 1].first_use_LEJ, fc_b[CUT + 1].first_use_LEJ)


def test_the_prefetcher_predicts_nothing_before_a_forward_from_its_future(request_pair):
    """An engine loop asking the `Prefetcher` (spec_gate at d1 within the token, the horizon
    across tokens) over the whole request: every prediction and forecast of forwards 0..CUT is
    the same with the future scrambled, the forecast after CUT + 1 is not; each forecast is
    the replay's (`foresight.forecasts`) for the same forward."""
    import numpy as np

    from tensorbend.capture.rows import forwards
    from tensorbend.predictors.foresight import forecasts
    from tensorbend.predictors.prefetch import Prefetcher
    from tensorbend.predictors.registry import build_baseline

    spec, horizon, rows, scrambled = request_pair
    g = torch.Generator().manual_seed(1)
    router = {f"layers.{m}.weight": torch.randn(E_H, D_H, generator=g) for m in range(L_H)}
    gate = build_baseline("spec_gate", spec, "d1", router_params=router)
    runs = []
    for r in (rows, scrambled):
        pf = Prefetcher(spec, gate, horizon, token_ahead_layers=1)
        pf.begin_request()
        per_forward = []
        for fw in forwards(r):
            got = []
            for m in range(L_H):
                got += pf.observe(m, hidden_TD=r["gate_input_TLD"][fw.rows, m],
                                  routed_ids_TK=r["expert_ids_TLK"][fw.rows, m].long())  # fmt: skip
            pf.on_token_end()
            per_forward.append((got, pf.forecast))
        runs.append(per_forward)
        offline = forecasts(horizon, r)
        for f, (_, (forward, ahead, after)) in enumerate(per_forward):
            want_ahead, want_after = offline[f].next_use_steps(f, L_H)
            assert forward == f
            np.testing.assert_allclose(ahead, want_ahead, rtol=1e-5)
            np.testing.assert_allclose(after, want_after, rtol=1e-5)
    a, b = runs
    assert len(a) == len(b) == 1 + DECODE
    assert all(got for got, _ in a[1:])  # within-token and next-forward predictions each time
    assert a[: CUT + 1] == b[: CUT + 1]
    assert a[CUT + 1][1] != b[CUT + 1][1]


def test_the_runtime_predicts_nothing_before_a_forward_from_its_future(monkeypatch):
    """The threaded runtime, teacher-forced on two continuations that share their first CUT
    tokens (the decode forward f feeds continuation token f - 1): the predictor inputs, the
    predictions (spec_gate at d1, the horizon's next-forward experts) and the forecasts of
    forwards 0..CUT are identical; forward CUT + 1 sees another token and forecasts otherwise."""
    from tiny_models import build, char_tokenizer

    from tensorbend.cache.config import PolicyConfig
    from tensorbend.capture.hf import DecodeConfig
    from tensorbend.capture.prompts import Prompt
    from tensorbend.models import describe_model
    from tensorbend.offload import hooks as hooks_mod
    from tensorbend.offload.session import OffloadSession, SessionConfig
    from tensorbend.predictors.registry import build_baseline
    from tensorbend.routers import router_params

    recorded, init = [], hooks_mod.PredictionHooks.__init__

    def recording(self, *a, **kw):
        init(self, *a, **kw)
        self.observed = []  # (inputs, predictions, (forward, first, forecast)) per call
        recorded.append(self)

    monkeypatch.setattr(hooks_mod.PredictionHooks, "__init__", recording)
    continuations = (" jumps over", " jumpZ~q#kx!")  # the char tokenizer: one token a char
    ca, cb = continuations
    assert ca[:CUT] == cb[:CUT] and ca[CUT] != cb[CUT]
    runs = []
    for cont in continuations:
        model = build("deepseek_v3", 0)
        spec = describe_model(model)
        gate = build_baseline("spec_gate", spec, "d1", router_params=router_params(model, spec))
        cfg = SessionConfig(DecodeConfig(decode="teacher", max_new_tokens=8))
        sess = OffloadSession(model, char_tokenizer(), [Prompt("a", "the quick brown fox",
                              continuation=cont)], cfg, model_name="tiny")  # fmt: skip
        try:
            pc = PolicyConfig("prefetch", cache_frac=0.5)
            r = sess.run_policy(pc, gate, horizon=_horizon(spec))
        finally:
            sess.close()
        assert r.output_matches_resident and r.tokens["decode"] == 8
        by_forward = {}
        for (m, hidden, ids), preds, (forward, _, forecast) in recorded[-1].observed:
            by_forward.setdefault(forward, []).append((m, hidden, ids, preds, forecast))
        assert sorted(by_forward) == list(range(9))
        runs.append(by_forward)
    a, b = runs

    def same(x, y):
        return len(x) == len(y) and all(
            p[0] == q[0] and torch.equal(p[1], q[1]) and torch.equal(p[2], q[2])
            and p[3] == q[3] and p[4] == q[4]
            for p, q in zip(x, y, strict=True)
        )  # fmt: skip

    assert any(preds for f in range(CUT + 1) for _, _, _, preds, _ in a[f])
    for f in range(CUT + 1):
        assert same(a[f], b[f]), f
    assert not torch.equal(a[CUT + 1][0][1], b[CUT + 1][0][1])  # another token's hidden state
    assert a[CUT + 1][-1][4] != b[CUT + 1][-1][4]  # and another forecast
