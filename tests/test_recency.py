"""The training-free cross-token peer (kind `recency`, predictors/recency.py): its forecast by
hand, its recall on planted routing (a request that keeps its experts: exact; a cycle that
alternates them: never right), the runtime's numpy twin, its label as a peer's row, and an
offloaded run driven by it that generates the resident model's tokens."""

import numpy as np
import pytest
import torch
from planted import cycle_trace
from tiny_models import save_checkpoint
from transformers import AutoModelForCausalLM

import tensorbend
from tensorbend.cache.report import best_peer, is_ours, run_label
from tensorbend.capture.trace import Trace
from tensorbend.models import RoutingSpec
from tensorbend.predictors.foresight import evaluate_foresight
from tensorbend.predictors.horizon import request_forwards
from tensorbend.predictors.recency import DECAY, FastRecency, RecencyConfig, RecencyForecaster
from tensorbend.predictors.spec import PredictorSpec


def _spec(L=1, E=3, K=1):
    return RoutingSpec(family="qwen3_moe", router_kind="softmax", num_experts=E, top_k=K,
                       hidden_size=4, num_decoder_layers=L, moe_layer_ids=tuple(range(L)))  # fmt: skip


def test_forecast_by_hand():
    """Expert 0 used at forward 1, expert 1 at forward 2: decayed counts (0.7, 1, 0), bias
    correction (1 - 0.7) / (1 - 0.7^2) = 0.3 / 0.51, so p = (0.41176, 0.58824, 0); the first
    use is geometric in p, and 'later' holds the rest."""
    assert DECAY == 0.7
    p = RecencyForecaster(_spec(), RecencyConfig(foresight=2))
    st = p.new_state()
    st.observe(torch.tensor([[1.0, 0, 0]]))
    assert p.forecast(st).first_use_LEJ[0].tolist() == [[1, 0, 0], [0, 0, 1], [0, 0, 1]]
    st.observe(torch.tensor([[0.0, 1, 0]]))
    got = p.forecast(st).first_use_LEJ[0]
    r = torch.tensor([0.7 * 0.3 / 0.51, 0.3 / 0.51, 0.0])
    want = torch.stack([r, r * (1 - r), (1 - r) ** 2], -1)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got.sum(-1), torch.ones(3))


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("recency")
    cycle_trace(root / "cycle")
    cycle_trace(root / "sticky", sticky=True)
    return {name: Trace.open(root / name) for name in ("cycle", "sticky")}


def test_recall_is_exact_on_sticky_routing_and_zero_on_a_cycle(traces):
    """A request that keeps its experts: the present routing is the next (recall 1.0). Routing
    that alternates two sets across tokens: the just-used set always ranks first and is never
    the next one (recall 0.0), where the trained horizon reaches 1.0 (test_horizon.py)."""
    for name, want in (("sticky", 1.0), ("cycle", 0.0)):
        tr = traces[name]
        rep = evaluate_foresight(RecencyForecaster(tr.spec), tr.load(("ids",), split="test"),
                                 replay=False)  # fmt: skip
        assert rep["next_forward_recall"] == [want, want], name


def test_fast_numpy_path_equals_the_torch_computation(traces):
    tr = traces["cycle"]
    p = RecencyForecaster(tr.spec, RecencyConfig(foresight=3))
    fast = p.fast()
    request = request_forwards(tr.load(("ids",), split="val"), tr.spec)[0]
    st, fst = p.new_state(), fast.new_state()
    for f, (_, used_LE, _) in enumerate(request):
        st.observe(used_LE)
        want = p.forecast(st)
        got = fast.step(fst, used_LE.numpy(), None, forward=f)
        for a, b in zip(want.next_use_steps(f, tr.spec.num_moe_layers), got, strict=True):
            np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-5)
        np.testing.assert_allclose(fast.next_forward_probs, want.first_use_LEJ[..., 0], atol=1e-6)


def test_its_rows_are_a_peers_labelled_recency():
    row = {"policy": "prefetch", "predictor": "spec_gate", "lookahead": "d1", "horizon": "recency",
           "token_ahead_layers": 1, "pool": "global", "admission": "predicted",
           "decode_tok_s": 9.0}  # fmt: skip
    ours = {**row, "predictor": "tensorbend", "horizon": "h.safetensors", "decode_tok_s": 8.0}
    assert run_label(row) == "recency+d1:spec_gate/adm=predicted"
    assert run_label({**row, "token_ahead_layers": 0}).startswith("recency(evict only)+")
    assert not is_ours(row) and is_ours(ours)
    assert best_peer([row, ours]) is row


def test_offloaded_generation_with_recency_equals_the_resident_model(tmp_path):
    """`--horizon recency` (no checkpoint) with spec_gate's prefetches, 25% cache: greedy tokens
    and logits equal transformers' eager model, and its forecasts issued prefetches."""
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    assert PredictorSpec(horizon="recency").horizon == "recency"  # a name, not a file
    ref = AutoModelForCausalLM.from_pretrained(ckpt, experts_implementation="eager").eval()
    served = tensorbend.load_offloaded(ckpt, cache_frac=0.25, policy="prefetch",
                                       horizon="recency", baseline="spec_gate",
                                       store_dir=tmp_path / "store", progress=False)  # fmt: skip
    ids = torch.tensor([[5, 17, 33, 2, 40, 8]])
    try:
        with torch.inference_mode():
            kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 1}
            want = ref.generate(ids, **kw)
            assert torch.equal(served.generate(ids, **kw), want)
            assert torch.equal(served(want).logits, ref(want).logits)
        c = served.tensorbend.counters()["totals"]
        assert isinstance(served.tensorbend.hooks.prefetcher.horizon, FastRecency)
    finally:
        served.tensorbend.close()
    assert c["prefetch_issued"] > 0, c
