"""The engine-neutral prefetch API: a synthetic engine loop (no HF model, no runtime) asking a
Prefetcher gets exactly the predictions and forecasts the runtime got on the same inputs."""

import numpy as np
import pytest
import torch
from tiny_models import build, char_tokenizer

from tensorbend.cache.config import PolicyConfig
from tensorbend.capture.hf import DecodeConfig
from tensorbend.capture.prompts import Prompt
from tensorbend.models import describe_model
from tensorbend.offload import hooks as hooks_mod
from tensorbend.offload.session import OffloadSession, SessionConfig
from tensorbend.predictors.horizon import HorizonConfig, HorizonPredictor
from tensorbend.predictors.prefetch import Prediction, Prefetcher
from tensorbend.predictors.registry import build_baseline
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


def test_a_negative_extra_prefetches_the_likeliest_only_and_changes_no_output():
    """--prefetch-extra 1 - K: each one-token call names only the first of the list the same
    call names with extra 0 (the likeliest); -K is refused before anything runs; offloaded with
    it, the model generates what the resident model does."""
    from tensorbend.errors import TensorbendError

    torch.set_num_threads(1)
    model = build("deepseek_v3", 0)
    spec = describe_model(model)
    K = spec.top_k
    pred = build_baseline("spec_gate", spec, "d1", router_params=router_params(model, spec))
    full, one = Prefetcher(spec, pred), Prefetcher(spec, pred, extra=1 - K)
    g = torch.Generator().manual_seed(0)
    named = 0
    for pf in (full, one):
        pf.begin_request()
    for _ in range(3):  # decode tokens
        for m in range(spec.num_moe_layers):
            hidden = torch.randn(1, spec.hidden_size, generator=g)
            ids = torch.randperm(spec.num_experts, generator=g)[:K].view(1, K)
            want = full.observe(m, hidden_TD=hidden, routed_ids_TK=ids)
            assert one.observe(m, hidden_TD=hidden, routed_ids_TK=ids) == want[:1]
            named += len(want) == K
        for pf in (full, one):
            pf.on_token_end()
    assert named > 0
    with pytest.raises(TensorbendError, match=rf"--prefetch-extra {-K}: expected at least "
                       rf"{1 - K} .* routes top-{K}"):  # fmt: skip
        Prefetcher(spec, pred, extra=-K)
    cfg = SessionConfig(DecodeConfig(max_new_tokens=5))
    sess = OffloadSession(model, char_tokenizer(), PROMPTS, cfg, model_name="tiny")
    try:
        pc = PolicyConfig("prefetch", cache_frac=0.5)
        assert sess.run_policy(pc, pred, prefetch_extra=1 - K).output_matches_resident
    finally:
        sess.close()


def test_a_predictor_in_the_others_place_is_refused():
    from tensorbend.errors import PredictorConfigError

    model = build("deepseek_v3", 0)
    spec = describe_model(model)
    within = build_baseline("spec_gate", spec, "d1", router_params=router_params(model, spec))
    with pytest.raises(PredictorConfigError, match=r"horizon= expected a cross-token .* found "
                       r"kind spec_gate \(within-token\): pass it as predictor="):  # fmt: skip
        Prefetcher(spec, horizon=within)
    with pytest.raises(PredictorConfigError, match=r"predictor= expected a within-token "
                       r"predictor, found a cross-token one \(kind horizon\): pass it as horizon="):  # fmt: skip
        Prefetcher(spec, predictor=_horizon(spec))
    assert Prefetcher(spec, within, _horizon(spec)).horizon is not None  # the right places


def test_serving_run_and_simulate_check_one_predictor_spec_alike(tmp_path, capsys):
    """`generate`, `run` and `simulate` read --predictor/--horizon into one PredictorSpec: a
    within-token checkpoint passed as --horizon, or --policy prefetch without a predictor
    (generate, run), is refused before any model or trace is read, with one message each;
    load_offloaded's keywords reach the spec too."""
    from tensorbend.cli import main
    from tensorbend.predictors.checkpoint import save_predictor
    from tensorbend.serving.offloaded import ServeConfig, _with_overrides

    spec = describe_model(build("deepseek_v3", 0))
    rows = {"expert_ids_TLK": torch.randint(0, spec.num_experts, (8, spec.num_moe_layers,
            spec.top_k)), "prompt_T": torch.zeros(8, dtype=torch.long),
            "position_T": torch.arange(8), "phase_T": torch.ones(8, dtype=torch.long)}  # fmt: skip
    within = save_predictor(build_baseline("frequency", spec, "d1", train_rows=rows),
                            tmp_path / "d1.safetensors", fingerprint="0" * 16)  # fmt: skip
    verbs = {
        "generate": ["generate", "--model", "nowhere", "--prompt", "a", "--policy", "prefetch"],
        "run": ["run", "--model", "nowhere", "--policy", "prefetch"],
        "simulate": ["simulate", "--trace", "nowhere", "--hardware", "h100-pcie5",
                     "--geometry", "kimi-k2.5"],
    }  # fmt: skip
    errors = {}
    for verb, argv in verbs.items():
        assert main([*argv, "--quiet", "--horizon", str(within)]) == 2
        errors[verb] = capsys.readouterr().err
        assert "--horizon expected a cross-token (horizon) predictor" in errors[verb]
    assert errors["generate"] == errors["run"] == errors["simulate"]
    for verb in ("generate", "run"):
        assert main([*verbs[verb], "--quiet"]) == 2
        assert capsys.readouterr().err == (
            "error: --policy prefetch needs a predictor: --predictor PRED, --baseline NAME "
            "and/or --horizon PRED\n"
        )
    cfg = _with_overrides(ServeConfig(), dict(policy="prefetch", predictor=within,
                                              prefetch_extra=-1, io_threads=3))  # fmt: skip
    assert (cfg.offload.policy, cfg.prediction.predictor, cfg.prediction.prefetch_extra,
            cfg.io_threads) == ("prefetch", within, -1, 3)  # fmt: skip


def test_a_batch_of_two_keeps_two_histories_and_merges_their_forecasts_by_hand():
    """B = 2 sequences in lockstep: each keeps its own history; the published forecast is the
    soonest expected use of either, the next forward's prefetches rank experts by the chance
    that either uses them, 1 - (1 - p_a)(1 - p_b). A horizon whose only weights are
    logit(next forward) = ln 3 * used-in-this-forward + beta_e (foresight h = 1, routing
    inputs) makes every number computable by hand from the documented formulas:
        p     = sigmoid(ln 3 * used + beta_e)
        rate  = clip(0.03 * sum_(g <= f) 0.97^(f - g) used_g, 1e-3, 1), tail = (1 - rate) / rate
        next  = (f + 1) * L + m,   later = next + L * tail
        ahead = p * next + (1 - p) * later,   after_first = later   (h = 1)"""
    import math

    from tensorbend.models import RoutingSpec
    from tensorbend.predictors.prefetch import RoutingHistory

    L, E, K, D, B = 2, 4, 2, 4, 2
    spec = RoutingSpec("qwen3_moe", "softmax", E, K, D, L, (0, 1))
    h = HorizonPredictor(spec, HorizonConfig(foresight=1, inputs="routing"))
    beta_E = [0.0, 0.1, 0.2, 0.3]
    with torch.no_grad():
        h.net.w_LJX.zero_()
        h.net.w_LJX[:, 0, 0] = math.log(3)  # class "next forward", feature "used in f"
        h.net.b_LEJ.zero_()
        h.net.b_LEJ[:, :, 0] = torch.tensor(beta_E)
    pf = Prefetcher(spec, horizon=h, token_ahead_layers=2, history=RoutingHistory(L, batch=B))
    # ids [B * T, K] per layer, sequences in order (rows 0..T-1: a, T..2T-1: b)
    prefill = {0: [[0, 1], [0, 1], [1, 2], [1, 2]], 1: [[2, 3], [2, 3], [2, 3], [3, 2]]}
    decode = {0: [[3, 0], [1, 2]], 1: [[0, 1], [2, 3]]}
    forwards = [prefill, decode]
    # used[f][b][m]: the experts sequence b used at layer m in forward f
    used = [[[{0, 1}, {2, 3}], [{1, 2}, {2, 3}]], [[{0, 3}, {0, 1}], [{1, 2}, {2, 3}]]]

    def sigmoid(x):
        return 1 / (1 + math.exp(-x))

    pf.begin_request()
    ranked_by_forward = []
    for f, ids in enumerate(forwards):
        T = len(ids[0])
        for m in range(L):
            got = pf.observe(m, hidden_TD=torch.zeros(T, D), routed_ids_TK=torch.tensor(ids[m]))
        pf.on_token_end()
        p_BLE = [[[sigmoid(math.log(3) * (e in used[f][b][m]) + beta_E[e]) for e in range(E)]
                  for m in range(L)] for b in range(B)]  # fmt: skip
        want_ahead, want_after, either = [], [], []
        for m in range(L):
            row_ahead, row_after, row_either = [], [], []
            for e in range(E):
                nxt, aheads, afters = (f + 1) * L + m, [], []
                for b in range(B):
                    count = sum(0.97 ** (f - g) * (e in used[g][b][m]) for g in range(f + 1))
                    rate = min(max(0.03 * count, 1e-3), 1.0)
                    later = nxt + L * (1 - rate) / rate
                    p = p_BLE[b][m][e]
                    aheads.append(p * nxt + (1 - p) * later)
                    afters.append(later)
                row_ahead.append(min(aheads))
                row_after.append(min(afters))
                row_either.append(1 - (1 - p_BLE[0][m][e]) * (1 - p_BLE[1][m][e]))
            want_ahead.append(row_ahead)
            want_after.append(row_after)
            either.append(row_either)
        forward, ahead, after = pf.forecast
        assert forward == f
        np.testing.assert_allclose(ahead, want_ahead, rtol=1e-5)
        np.testing.assert_allclose(after, want_after, rtol=1e-5)
        ranked = [(m, e) for m in range(L)
                  for e in sorted(range(E), key=lambda e: -either[m][e])[:K]]  # fmt: skip
        assert [(p.layer, p.expert) for p in got] == ranked
        assert [(p.step, p.rank, p.hint) for p in got] == [
            ((f + 1) * L + m, r, False) for r, (m, _) in enumerate(ranked)
        ]
        ranked_by_forward.append(ranked)
    # written out: after the prefill, layer 0 ranks e1 (both used it: 0.946) and e2 (0.904)
    # above e0 (0.875) and e3 (0.819), where the larger of the two chances (e2 0.786 > e1
    # 0.768) would order them the other way; layer 1: e3 (0.961), e2 (0.954). After the
    # decode forward, both layers: e3 (0.916), e2 (0.903), e1 (0.890), e0 (0.875).
    assert ranked_by_forward == [[(0, 1), (0, 2), (1, 3), (1, 2)], [(0, 3), (0, 2), (1, 3), (1, 2)]]


def test_the_one_token_list_is_the_ranked_rows_list():
    """Decode's list (prefetch._token_list, one topk and two lists) equals the general rule
    (ranked_ids then prefetch_list) on fixed scores, -inf (no guess) included."""
    from tensorbend.predictors.prefetch import _token_list, prefetch_list, ranked_ids

    g = torch.Generator().manual_seed(3)
    for extra in (0, 2):
        for n_inf in (0, 3, 7, 8):
            scores_1E = torch.randn(1, 8, generator=g)
            scores_1E[0, torch.randperm(8, generator=g)[:n_inf]] = -float("inf")
            want = prefetch_list(ranked_ids(scores_1E, 4 + extra), 4, extra)
            assert _token_list(scores_1E, 4 + extra) == want
            assert len(want) == min(4 + extra, 8 - n_inf)


@pytest.mark.parametrize("lookahead", ["d1", "pre_attn"])
def test_a_predictor_of_only_minus_inf_is_not_asked_and_that_changes_nothing(lookahead):
    """The runtime's empty predictor (prefetch:none, the horizon's runs) declares that it
    predicts nothing: the Prefetcher skips it. Asked anyway (the same class, not declaring it)
    it yields no prediction either, so both give the same (empty) lists and forecasts."""
    from tensorbend.offload.hooks import NoPredictor
    from tensorbend.predictors import get_lookahead

    spec = describe_model(build("deepseek_v3", 0))
    asked = []

    class Counting(NoPredictor):
        def scores(self, m, src):
            asked.append(m)
            return super().scores(m, src)

    class Declaring(Counting):
        predicts_nothing = True

    class Silent(Counting):
        predicts_nothing = False  # asked at every source point

    la = get_lookahead(lookahead)
    runs = {}
    for cls in (Declaring, Silent):
        asked.clear()
        pf = Prefetcher(spec, cls(spec.num_experts, la), _horizon(spec), token_ahead_layers=1)
        g = torch.Generator().manual_seed(0)
        got = []
        for _ in range(2):
            pf.begin_request()
            for T in (3, 1, 1):  # a prefill, then two decode tokens
                for m in range(spec.num_moe_layers):
                    hidden = torch.randn(T, spec.hidden_size, generator=g)
                    got.append(pf.observe(m, hidden_TD=hidden))  # before attention
                    ids = torch.randperm(spec.num_experts, generator=g)[: spec.top_k]
                    got.append(pf.observe(m, hidden_TD=hidden, routed_ids_TK=ids.expand(T, -1)))
                pf.on_token_end()
                got.append(pf.forecast)
        runs[cls] = (got, len(asked))
    (declared, n_declared), (silent, n_silent) = runs[Declaring], runs[Silent]
    assert n_declared == 0 and n_silent > 0
    assert declared == silent
    assert any(p for p in declared if isinstance(p, list))  # the horizon's prefetches remain


@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16", "needs_grad", "strided"])
def test_a_hidden_state_of_any_dtype_reaches_numpy_as_its_float32_values(kind):
    """prefetch._host_f32 (the one step from a hidden state to the numpy paths' float32
    input) tries the tensor's own numpy view first: whatever the tensor, the values it
    hands over are the tensor's as float32, and a float32 CPU tensor is not copied."""
    from tensorbend.predictors.prefetch import _host_f32

    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 8, generator=g)
    t = {
        "float32": base,
        "float16": base.half(),
        "bfloat16": base.bfloat16(),
        "needs_grad": base.clone().requires_grad_(True),
        "strided": base.t(),
    }[kind]
    got = _host_f32(t)
    assert got.dtype == np.float32 and got.shape == tuple(t.shape)
    np.testing.assert_array_equal(got, t.detach().float().numpy())
    if kind == "float32":
        assert np.shares_memory(got, base.numpy())
