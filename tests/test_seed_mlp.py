"""The seed's predictor and recipe: its loss by hand, per-layer clipping, last epoch, inputs, learning."""

import math
from dataclasses import replace

import pytest
import torch
from planted import router_trace

from tensorbend.capture.trace import Trace
from tensorbend.models import RoutingSpec
from tensorbend.predictors.base import LOOKAHEADS, SourceBatch, sources_from_rows
from tensorbend.predictors.evaluate import EvalConfig, evaluate
from tensorbend.predictors.fit import fit
from tensorbend.predictors.residual_gate import (
    ResidualGateConfig,
    ResidualGatePredictor,
    width_for_budget,
)
from tensorbend.predictors.seed_mlp import (
    SEED_FIT,
    SeedMLPConfig,
    SeedMLPPredictor,
    expert_importance,
    seed_loss,
)
from tensorbend.predictors.seed_net import SeedMLPNet
from tensorbend.predictors.train import TrainConfig, train

LOGITS = [[2.0, -1.0, 0.0, 1.0], [0.5, 0.0, -2.0, 3.0]]
TARGET = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]]


def _bce(x, t):  # binary cross-entropy of one logit, written out
    return math.log1p(math.exp(-x)) if t else math.log1p(math.exp(x))


def test_weighted_bce_is_three_on_picked_half_on_the_rest_by_hand():
    want = (
        sum(
            (3.0 if t else 0.5) * _bce(x, t)
            for row_x, row_t in zip(LOGITS, TARGET, strict=True)
            for x, t in zip(row_x, row_t, strict=True)
        )
        / 8
    )
    got = seed_loss(torch.tensor([LOGITS]), torch.tensor([TARGET]), "weighted_bce")
    assert got.shape == (1,) and float(got[0]) == pytest.approx(want, rel=1e-6)
    plain = (
        sum(
            _bce(x, t)
            for rx, rt in zip(LOGITS, TARGET, strict=True)
            for x, t in zip(rx, rt, strict=True)
        )
        / 8
    )
    assert float(seed_loss(torch.tensor([LOGITS]), torch.tensor([TARGET]), "bce")[0]) == (
        pytest.approx(plain, rel=1e-6)
    )


def test_ranking_variant_by_hand():
    imp = [1.0, 0.0, 0.5, 0.25]
    bce = (
        sum(
            ((3.0 + 2.0 * imp[e]) if t else 0.5 * (1 - 0.3 * imp[e])) * _bce(x, t)
            for rx, rt in zip(LOGITS, TARGET, strict=True)
            for e, (x, t) in enumerate(zip(rx, rt, strict=True))
        )
        / 8
    )
    sig = [[1 / (1 + math.exp(-x)) for x in r] for r in LOGITS]
    rank = 0.0
    for s, t in zip(sig, TARGET, strict=True):
        top = sum(a for a, b in zip(s, t, strict=True) if b) / sum(t)
        rest = sum(a for a, b in zip(s, t, strict=True) if not b) / (4 - sum(t))
        rank += max(0.0, 0.1 - (top - rest)) / 2
    got = seed_loss(torch.tensor([LOGITS]), torch.tensor([TARGET]), "ranking", torch.tensor([imp]))
    assert float(got[0]) == pytest.approx(bce + 0.3 * rank, rel=1e-6)
    # importance: frequencies 1/2, 1/2, 0, 1/2 -> boundary 1, 1, 0, 1; rarity 0, 0, 1, 0
    freq_imp = expert_importance(torch.tensor([TARGET]))
    assert freq_imp[0].tolist() == pytest.approx([1.0, 1.0, 0.4 / 0.6, 1.0])


def _two_layer_data(N=32, D=5, E=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, N, D, generator=g)
    truth = torch.randint(0, E, (2, N, 1), generator=g)
    return {"x": x, "truth": truth}


def _fit_layers(data, L, clip):
    torch.manual_seed(0)
    net = SeedMLPNet(2, 5, 8, 4, dropout=0.0)
    if L == 1:  # the same initial layer 0, trained alone
        one = SeedMLPNet(1, 5, 8, 4, dropout=0.0)
        one.load_state_dict({k: v[:1] for k, v in net.state_dict().items()})
        net, data = one, {k: v[:1] for k, v in data.items()}

    def loss_fn(n, b, layers):
        s = n(b["x"])
        t = torch.zeros_like(s).scatter_(2, b["truth"], 1.0)
        # layer 1's loss (and gradient) is huge: clipping jointly would shrink layer 0's steps
        return (seed_loss(s, t, "weighted_bce") * torch.tensor([1.0, 1e4])[:L]).sum()

    cfg = replace(SEED_FIT, epochs=10, clip=clip)
    fit(net, data, loss_fn, lambda n, layers: 0.0, cfg)
    return net.fc1_w[0].detach()


def test_per_layer_clipping_trains_each_layer_as_if_alone():
    data = _two_layer_data()
    alone = _fit_layers(data, 1, "per_layer")
    assert torch.allclose(_fit_layers(data, 2, "per_layer"), alone, atol=1e-7)
    assert (_fit_layers(data, 2, "global") - alone).abs().max() > 1e-5


def test_separate_layers_fit_each_layer_alone_with_its_own_best_epoch():
    """layers="separate" gives layer 1 exactly what fitting layer 1 alone gives (same seed),
    and each layer keeps its own best val epoch: here layer 0 peaks at epoch 0, layer 1 at
    its last epoch, so a joint fit could not keep both."""
    data = _two_layer_data()
    torch.manual_seed(0)
    init = SeedMLPNet(2, 5, 8, 4, dropout=0.0).state_dict()

    def run(L, layers, first):
        net = SeedMLPNet(L, 5, 8, 4, dropout=0.0)
        net.load_state_dict({k: v[first : first + L] for k, v in init.items()})
        d = {k: v[first : first + L] for k, v in data.items()}
        calls = {}

        def val_fn(n, sl):  # layer index (of the full stack) -> val by epoch
            li = first + (sl.start or 0)
            calls[li] = calls.get(li, -1) + 1
            return -calls[li] if li == 0 else calls[li]

        loss = lambda n, b, sl: n(b["x"]).pow(2).mean()  # noqa: E731
        fit(net, d, loss, val_fn, replace(SEED_FIT, epochs=4, keep="best_val", layers=layers))
        return net

    both = run(2, "separate", 0)
    assert torch.equal(both.fc1_w[1], run(1, "joint", 1).fc1_w[0])  # layer 1 alone
    torch.manual_seed(0)
    untouched = SeedMLPNet(2, 5, 8, 4, dropout=0.0)
    epoch0 = run(1, "joint", 0)  # layer 0 alone keeps epoch 0
    assert torch.equal(both.fc1_w[0], epoch0.fc1_w[0])
    assert not torch.equal(both.fc1_w[0], untouched.fc1_w[0])  # it did train


def test_keep_last_returns_the_final_epoch_not_the_best_val():
    data = _two_layer_data()
    states = {}
    for keep in ("best_val", "last"):
        torch.manual_seed(0)
        net = SeedMLPNet(2, 5, 8, 4, dropout=0.0)
        vals = iter([1.0, 0.0, -1.0])  # epoch 0 is the best on val
        cfg = replace(SEED_FIT, epochs=3, keep=keep)
        fit(net, data, lambda n, b, sl: n(b["x"]).pow(2).mean(), lambda n, sl, v=vals: next(v), cfg)
        states[keep] = net.fc1_w.detach().clone()
    assert not torch.equal(states["best_val"], states["last"])
    torch.manual_seed(0)
    first = SeedMLPNet(2, 5, 8, 4, dropout=0.0)  # best_val must be epoch 0's state
    fit(
        first,
        data,
        lambda n, b, sl: n(b["x"]).pow(2).mean(),
        lambda n, sl: 0.0,
        replace(SEED_FIT, epochs=1),
    )
    assert torch.equal(states["best_val"], first.fc1_w.detach())


def _spec(D, E, L=1, K=2):
    ids = tuple(range(L))
    return RoutingSpec("qwen3_moe", "softmax", E, K, D, L, ids)


def test_prev_routing_inputs_token_layer_none():
    spec, E, D = _spec(3, 4), 4, 3
    src = SourceBatch(
        hidden_TD=torch.ones(2, D),
        src_ids_TK=torch.tensor([[0, 1], [2, 3]]),
        prev_ids_TK=torch.tensor([[1, 2], [0, 3]]),
        has_prev_T=torch.tensor([True, False]),
        src_layer=0,
    )
    la = LOOKAHEADS["d1"]
    x = {
        how: SeedMLPPredictor(_spec(D, E, L=2), la, SeedMLPConfig(prev_routing=how))._x(src)
        for how in ("token", "layer", "none")
    }
    assert x["token"][:, D:].tolist() == [[0, 1, 1, 0], [0, 0, 0, 0]]
    assert x["layer"][:, D:].tolist() == [[1, 1, 0, 0], [0, 0, 1, 1]]
    assert x["none"].shape == (2, D)
    none = SeedMLPPredictor(spec, LOOKAHEADS["same_layer"], SeedMLPConfig(prev_routing="none"))
    assert none.net.fc1_w.shape == (1, 256, D)  # the seed's use_prev_routing=False: D inputs


@pytest.mark.parametrize("D,E,H", [(128, 32, 55), (7168, 384, 61), (7168, 72, 63), (2048, 128, 60)])
def test_ours_counts_at_most_a_quarter_of_a_built_seed_mlp(D, E, H):
    """Real parameter counts of built predictors; H at (128, 32) and (7168, 384) as the docs say."""
    spec, la = _spec(D, E), LOOKAHEADS["same_layer"]
    seed = SeedMLPPredictor(spec, la, SeedMLPConfig()).num_params()
    assert width_for_budget(D, E, 64, 0.25) == H
    ours = ResidualGatePredictor(spec, la, {}, ResidualGateConfig(), H).num_params()
    assert ours <= 0.25 * seed
    if H < 64:  # the cap binds: one more unit would break the budget
        assert ResidualGatePredictor(spec, la, {}, ResidualGateConfig(), H + 1).num_params() > (
            0.25 * seed
        )


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    d = tmp_path_factory.mktemp("routed")
    router_trace(d / "t")
    return d / "t"


def test_seed_mlp_learns_a_planted_router_on_held_out_rows(routed, tmp_path):
    """Experts = top-2 of 16 by a linear router of the hidden state: learnable, chance is 1/8."""
    out = tmp_path / "seed.safetensors"
    s = train(
        TrainConfig(trace=routed, out=out, predictor="seed_mlp", lookahead="same_layer"),
        progress=False,
    )
    assert 0.0 < s.to_json()["train_rows_recall"] <= 1.0
    rep = evaluate(EvalConfig(trace=routed, predictors=(out,), baselines=(), timing_rows=0))
    for r in rep.to_json()["results"]:
        assert r["recall_at_k"] > 0.6, (r["phase"], r["recall_at_k"])


def test_token_routing_is_the_previous_prompt_token_at_same_layer_only(routed):
    rows = Trace.open(routed).load(("ids", "gate_input"), split="train")
    prefill_pair = (rows["phase_T"] == 0) & (rows["prev_row_T"] >= 0)
    i = int(prefill_pair.nonzero()[0])
    prev = int(rows["prev_row_T"][i])
    for la, fed in (("same_layer", True), ("d1", False)):
        src = sources_from_rows(rows, LOOKAHEADS[la], 2)
        p = SeedMLPPredictor(_spec(16, 16, L=4), LOOKAHEADS[la], SeedMLPConfig())
        routing = p._x(src)[i, 16:]
        want = torch.zeros(16).index_fill_(0, rows["expert_ids_TLK"][prev, 2].long(), 1.0)
        assert torch.equal(routing, want if fed else torch.zeros(16)), la
