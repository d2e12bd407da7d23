"""The engine-neutral prefetch API: a synthetic engine loop (no HF model, no runtime) asking a
Prefetcher gets exactly the predictions and forecasts the runtime got on the same inputs."""

import pytest
import torch
from tiny_models import build, char_tokenizer

from tensorbend.cache.config import PolicyConfig
from tensorbend.engines.prefetcher import Prediction, Prefetcher
from tensorbend.hf import DecodeConfig
from tensorbend.models import describe_model
from tensorbend.offload import hooks as hooks_mod
from tensorbend.offload.session import OffloadSession, SessionConfig
from tensorbend.predictors.baselines import build_baseline
from tensorbend.predictors.horizon import HorizonConfig, HorizonPredictor
from tensorbend.prompts import Prompt
from tensorbend.routers import router_params

PROMPTS = [Prompt("a", "the quick brown fox"), Prompt("b", "kernel module river")]


def _horizon(spec):
    torch.manual_seed(0)
    h = HorizonPredictor(spec, HorizonConfig(foresight=3))
    for p in h.net.parameters():  # arbitrary but fixed forecasts
        torch.nn.init.normal_(p, std=0.3)
    return h


@pytest.mark.parametrize("lookahead", ["d1", "pre_attn"])
def test_a_synthetic_engine_loop_gets_the_runtimes_predictions(lookahead, monkeypatch):
    torch.set_num_threads(1)
    model = build("deepseek_v3", 0)
    spec = describe_model(model)
    pred = build_baseline("spec_gate", spec, lookahead, router_params=router_params(model, spec))
    horizon = _horizon(spec)
    recorded = []
    init = hooks_mod.PredictionHooks.__init__

    def recording(self, *a, **kw):
        init(self, *a, **kw)
        self.observed = []
        recorded.append(self)

    monkeypatch.setattr(hooks_mod.PredictionHooks, "__init__", recording)
    cfg = SessionConfig(DecodeConfig(max_new_tokens=5))
    sess = OffloadSession(model, char_tokenizer(), PROMPTS, cfg, model_name="tiny")
    try:
        r = sess.run_policy(PolicyConfig("prefetch", cache_frac=0.5), pred, horizon=horizon)
    finally:
        sess.close()
    assert r.output_matches_resident
    calls = recorded[-1].observed  # the policy run's (inputs, predictions, clock state)
    assert any(p for _, p, _ in calls) and any(not q.hint for _, p, _ in calls for q in p)
    engine = Prefetcher(spec, pred, horizon, token_ahead_layers=1)  # its own clock
    last = None
    for (m, hidden, ids), want, (forward, first_of_request, forecast) in calls:
        if forward != last:  # the engine's loop: a new forward (and maybe a new request)
            if last is not None:
                engine.on_token_end()
            if first_of_request:
                engine.begin_request()
            last = forward
        got = engine.observe(m, hidden_TD=hidden, routed_ids_TK=ids)
        assert got == want and all(isinstance(p, Prediction) for p in got)
        assert engine.forecast == forecast


def test_a_hidden_state_of_another_width_is_refused():
    from tensorbend.errors import PredictorInputError

    spec = describe_model(build("deepseek_v3", 0))
    pf = Prefetcher(spec, horizon=_horizon(spec))
    with pytest.raises(PredictorInputError, match=r"expected hidden_TD \[\.\.\., 32\]"):
        pf.observe(0, hidden_TD=torch.zeros(1, 33), routed_ids_TK=torch.zeros(1, 4).long())
