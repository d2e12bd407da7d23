"""Model support: MoE layers found per family, and captured ids equal the ids the experts consumed."""

import pytest
import torch
import transformers
from tiny_models import CONFIGS, EXPECTED_MOE_LAYERS, build

from tensorbend.capture.routing import RoutingCapture
from tensorbend.errors import UnsupportedModelError
from tensorbend.models import describe_model, moe_block
from tensorbend.routers import router_params, select_experts


def _consumed_ids(model, spec):
    """Hook each experts module and return, per MoE layer, the expert sets it computed [T] of sets."""
    seen, handles = {}, []
    for m in range(spec.num_moe_layers):
        experts = getattr(moe_block(model, spec, m), spec.experts_attr)

        def pre(mod, args, kwargs, m=m):
            if spec.family == "llama4_text":
                # Llama-4 experts take the input pre-scaled by router scores [E*T, D]: nonzero = used.
                routed_ET = (
                    args[0].reshape(spec.num_experts, -1, spec.hidden_size).abs().sum(-1) > 0
                )
                seen[m] = [
                    set(routed_ET[:, t].nonzero().flatten().tolist())
                    for t in range(routed_ET.shape[1])
                ]
            else:
                ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
                seen[m] = [set(r) for r in ids.tolist()]

        handles.append(experts.register_forward_pre_hook(pre, with_kwargs=True))
    return seen, handles


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_capture_equals_consumed_ids(family):
    model = build(family)
    spec = describe_model(model)
    assert spec.moe_layer_ids == EXPECTED_MOE_LAYERS[family]
    if family == "deepseek_v3":
        assert spec.router_kind == "group_limited" and spec.n_group == 4 and spec.topk_group == 2
        with torch.no_grad():  # a non-zero correction bias must change the selection we read
            for m in range(spec.num_moe_layers):
                moe_block(model, spec, m).gate.e_score_correction_bias.normal_(0, 0.3)
    torch.manual_seed(1)
    input_ids = torch.randint(0, 97, (2, 9))
    seen, handles = _consumed_ids(model, spec)
    try:
        with RoutingCapture(
            model, spec, features=("ids", "weights", "gate_input", "layer_input")
        ) as cap:
            with torch.no_grad():
                model(input_ids)
            rows = cap.pop()
    finally:
        for h in handles:
            h.remove()
    ids_TLK = rows["expert_ids_TLK"]
    T, L, K = ids_TLK.shape
    assert (T, L, K) == (18, spec.num_moe_layers, spec.top_k)
    assert rows["gate_input_TLD"].shape == (18, L, spec.hidden_size)
    assert rows["layer_input_TLD"].shape == (18, L, spec.hidden_size)
    for m in range(L):
        captured = [set(r) for r in ids_TLK[:, m].tolist()]
        assert captured == seen[m], f"{family} MoE layer {m}"
    # The router rerun away from the model (spec_gate's exact router) selects the same sets.
    params = router_params(model, spec)
    for m in range(L):
        again = select_experts(spec, params, m, rows["gate_input_TLD"][:, m].float())
        same = [
            set(a) == set(b) for a, b in zip(again.tolist(), ids_TLK[:, m].tolist(), strict=True)
        ]
        assert sum(same) >= T - 1, f"{family} layer {m}: {sum(same)}/{T} rows agree"  # fp16 storage


def test_group_limited_selection_stays_in_top_groups():
    model = build("deepseek_v3")
    spec = describe_model(model)
    with RoutingCapture(model, spec) as cap, torch.no_grad():
        model(torch.randint(0, 97, (1, 20)))
        ids_TLK = cap.pop()["expert_ids_TLK"].long()
    groups = ids_TLK // (spec.num_experts // spec.n_group)
    for row in groups.reshape(-1, spec.top_k).tolist():
        assert len(set(row)) <= spec.topk_group


def test_hooks_removed_after_exception():
    model = build("mixtral")
    spec = describe_model(model)
    with pytest.raises(RuntimeError, match="boom"):
        with RoutingCapture(model, spec, features=("layer_input",)):
            raise RuntimeError("boom")
    for mod in model.modules():
        assert not mod._forward_hooks and not mod._forward_pre_hooks


def test_unknown_family_is_a_clear_error():
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        UnsupportedModelError, match=r"'llama' is not supported: expected one of .*deepseek_v3"
    ):
        describe_model(model)


def test_model_without_moe_layers_is_a_clear_error():
    config = CONFIGS["qwen3_moe"]()
    config.mlp_only_layers = list(range(config.num_hidden_layers))
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError, match="has no MoE layers"):
        describe_model(model)
