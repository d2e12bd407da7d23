"""The runtime feeds a predictor exactly what it was trained and scored on: the SourceBatch
built in the hooks equals `predictors.base.sources_from_rows` on a trace of the same prompts,
and what the cross-token horizon observes after each forward equals `request_forwards`."""

import pytest
import torch
from tiny_models import save_checkpoint, write_prompts

from tensorbend.cache.config import PolicyConfig
from tensorbend.capture.collect import CollectConfig, collect
from tensorbend.capture.hf import DecodeConfig, load_model
from tensorbend.capture.prompts import load_prompts
from tensorbend.capture.trace import Trace
from tensorbend.offload.session import OffloadSession, SessionConfig
from tensorbend.predictors.base import LOOKAHEADS, sources_from_rows


class RecordingPredictor:
    """Scores nothing useful; keeps every SourceBatch the runtime hands it, per target layer."""

    kind = "recording"
    needs_truth = recorded_routing = predicts_nothing = False
    checkpoint = None

    def __init__(self, num_experts, lookahead):
        self.num_experts, self.lookahead = num_experts, LOOKAHEADS[lookahead]
        self.calls = []

    def scores(self, m, src):
        self.calls.append((m, src))
        return torch.zeros(len(src), self.num_experts)

    def num_params(self):
        return 0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sources")
    ckpt = save_checkpoint("deepseek_v3", tmp / "model")  # 3 MoE layers after a dense one
    prompts = write_prompts(tmp / "p.jsonl", 3)  # t000 and t002 have continuations
    dc = DecodeConfig(decode="teacher", max_new_tokens=4)
    feats = ("ids", "gate_input", "layer_input")
    collect(
        CollectConfig(
            model=str(ckpt), out=tmp / "trace", prompts=prompts, features=feats,
            dtype="float32", decode=dc,
        ),
        progress=False,
    )  # fmt: skip
    rows = Trace.open(tmp / "trace").load(feats)
    model, tok = load_model(str(ckpt))
    sess = OffloadSession(model, tok, load_prompts(prompts, "all"), SessionConfig(dc))
    yield sess, rows
    sess.close()


@pytest.mark.parametrize("la", ["pre_attn", "d1", "d2", "same_layer"])
def test_online_sources_equal_offline_rows(setup, la):
    sess, rows = setup
    rec = RecordingPredictor(sess.spec.num_experts, la)
    r = sess.run_policy(PolicyConfig("prefetch", cache_frac=0.5), rec)
    assert r.output_matches_resident is True
    assert rows["phase_T"].sum() == r.tokens["decode"] > 0  # decode rows are compared too
    lookahead = LOOKAHEADS[la]
    targets = list(lookahead.targets(sess.spec.num_moe_layers))
    assert sorted({m for m, _ in rec.calls}) == targets
    for m in targets:
        online = [src for mm, src in rec.calls if mm == m]
        offline = sources_from_rows(rows, lookahead, m)
        hidden_TD = torch.cat([s.hidden_TD for s in online])
        assert torch.equal(hidden_TD, offline.hidden_TD), (la, m)
        has_prev_T = torch.cat([s.has_prev_T for s in online])
        assert torch.equal(has_prev_T, offline.has_prev_T), (la, m)
        prev_TK = torch.cat([s.prev_ids_TK for s in online])
        assert torch.equal(prev_TK[has_prev_T], offline.prev_ids_TK[has_prev_T]), (la, m)
        assert {s.src_layer for s in online} == {offline.src_layer}
        if offline.src_ids_TK is None:
            assert all(s.src_ids_TK is None for s in online)
        else:
            src_TK = torch.cat([s.src_ids_TK for s in online])
            assert torch.equal(src_TK, offline.src_ids_TK), (la, m)


def test_online_horizon_inputs_equal_offline_request_forwards(setup, monkeypatch):
    """What the horizon observes at run time, after each forward (the experts every layer used,
    the last token's gate input of the last MoE layer, one history per request), equals
    `horizon.request_forwards` on the trace, and so do its forecasts (the replay's)."""
    import numpy as np

    from tensorbend.predictors.foresight import forecasts
    from tensorbend.predictors.horizon import HorizonConfig, HorizonPredictor, request_forwards
    from tensorbend.predictors.horizon_fast import FastHorizon

    sess, rows = setup
    spec = sess.spec
    torch.manual_seed(0)
    hz = HorizonPredictor(spec, HorizonConfig(foresight=3))
    for p in hz.net.parameters():  # arbitrary but fixed, non-trivial forecasts
        torch.nn.init.normal_(p, std=0.3)
    seen = []  # (state, used_LE, hidden_D, forward, forecast) per horizon step
    step = FastHorizon.step

    def recording(self, st, used_LE, hidden_D, forward):
        out = step(self, st, used_LE, hidden_D, forward)
        seen.append((st, used_LE.copy(), hidden_D.copy(), forward, out))
        return out

    monkeypatch.setattr(FastHorizon, "step", recording)
    r = sess.run_policy(PolicyConfig("prefetch", cache_frac=0.5), None, horizon=hz)
    assert r.output_matches_resident is True
    offline = request_forwards(rows, spec)
    want = [fw for request in offline for fw in request]
    assert len(offline) == 3 and len(want) == len(seen) == 3 + r.tokens["decode"]
    assert [fw for _, _, _, fw, _ in seen] == list(range(len(want)))  # the run's forwards
    bounds = np.cumsum([0, *map(len, offline)]).tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):  # one history per request
        assert len({id(s[0]) for s in seen[a:b]}) == 1
    assert len({id(s[0]) for s in seen}) == len(offline)
    offline_fc = forecasts(hz, rows)
    for (_, used_LE, hidden_D, f, (ahead, after)), (_, used, hidden) in zip(
        seen, want, strict=True
    ):
        assert np.array_equal(used_LE, used.numpy()), f
        assert np.array_equal(hidden_D, hidden.numpy()), f
        want_ahead, want_after = offline_fc[f].next_use_steps(f, spec.num_moe_layers)
        np.testing.assert_allclose(ahead, want_ahead, rtol=1e-5)
        np.testing.assert_allclose(after, want_after, rtol=1e-5)
