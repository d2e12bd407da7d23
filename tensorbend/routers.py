"""A model's routers away from the model: their parameters, their exact scores and selection, and
the model fingerprint built from them.

Usage:
    >>> from tensorbend.capture.hf import load_model
    >>> from tensorbend.models import describe_model
    >>> model, tok = load_model("zoo:default")
    >>> spec = describe_model(model)
    >>> params = router_params(model, spec)      # {"layers.3.weight": [E, D], ...}
    >>> sorted(k for k in params if k.startswith("layers.0."))
    ['layers.0.correction_bias', 'layers.0.gate_norm', 'layers.0.input_norm', 'layers.0.weight']
    >>> x_TD = torch.randn(3, spec.hidden_size)
    >>> select_experts(spec, params, 0, x_TD).shape            # the router's own top-k: [T, K]
    torch.Size([3, 4])
    >>> len(model_fingerprint(model, spec))
    16

Router kinds (models.ROUTER_KINDS) decide how logits become a selection; `router_scores` gives
scores whose top-k is exactly the selection (spec_gate and ours rerun routers this way on
earlier hidden states), and beyond the top-k their order is still meaningful.

Shapes: T tokens, E routed experts, K top-k, D hidden size.
"""

from __future__ import annotations

import hashlib
import json

import torch

from tensorbend.models import RoutingSpec, decoder_layers, router_module


def router_params(model: torch.nn.Module, spec: RoutingSpec) -> dict[str, torch.Tensor]:
    """Everything needed to rerun each router away from the model (fp32, CPU).

    Keys per MoE layer m: `layers.{m}.weight` [E, D], optional `layers.{m}.bias` [E],
    `layers.{m}.correction_bias` [E], and the RMSNorm weights that produce the router input
    from the residual stream: `layers.{m}.gate_norm` (post-attention norm) and
    `layers.{m}.input_norm` (pre-attention norm) [D], when the layer has them.
    """
    out: dict[str, torch.Tensor] = {}
    layers = decoder_layers(model)
    for m, lid in enumerate(spec.moe_layer_ids):
        router = router_module(model, spec, m)
        out[f"layers.{m}.weight"] = _read(router, "weight")
        for key, attr in (("bias", "bias"), ("correction_bias", "e_score_correction_bias")):
            if getattr(router, attr, None) is not None:
                out[f"layers.{m}.{key}"] = _read(router, attr)
        for name, attr in (
            ("gate_norm", "post_attention_layernorm"),
            ("input_norm", "input_layernorm"),
        ):
            norm = getattr(layers[lid], attr, None)
            if norm is not None and getattr(norm, "weight", None) is not None:
                out[f"layers.{m}.{name}"] = _read(norm, "weight")
    return out


def _read(module: torch.nn.Module, name: str) -> torch.Tensor:
    """module.<name> as an fp32 CPU copy, read back from accelerate's offload when the model
    was placed with --max-memory and the tensor lies on disk or in host memory (meta here)."""
    if getattr(module, name).device.type == "meta":
        from accelerate.utils import align_module_device

        with align_module_device(module, torch.device("cpu")):
            return getattr(module, name).detach().float().cpu().clone()
    return getattr(module, name).detach().float().cpu().clone()


def router_scores(
    spec: RoutingSpec, params: dict[str, torch.Tensor], m: int, x_TD: torch.Tensor
) -> torch.Tensor:
    """Scores whose top-k is exactly the router's selection for router input x_TD; [T, E].

    Beyond the top-k the order is still meaningful (used for over-provisioning): experts of
    groups excluded by group-limited routing rank after every allowed expert.
    """
    return scores_from_logits(spec, params, m, x_TD.float() @ params[f"layers.{m}.weight"].T)


def scores_from_logits(
    spec: RoutingSpec, params: dict[str, torch.Tensor], m: int, logits_TE: torch.Tensor
) -> torch.Tensor:
    """router_scores given the bias-free logits x @ W.T (see router_scores)."""
    if f"layers.{m}.bias" in params:
        logits_TE = logits_TE + params[f"layers.{m}.bias"]
    if spec.router_kind not in ("sigmoid_bias", "group_limited"):
        return logits_TE  # softmax and sigmoid are monotone: logits rank like probabilities
    scores_TE = logits_TE.sigmoid()
    bias = params.get(f"layers.{m}.correction_bias")
    if bias is not None:
        scores_TE = scores_TE + bias
    if spec.router_kind == "group_limited":
        T, E, G = scores_TE.shape[0], spec.num_experts, spec.n_group
        group_scores_TG = scores_TE.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)
        keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
        keep_TG.scatter_(1, group_scores_TG.topk(spec.topk_group, dim=-1).indices, True)
        keep_TE = keep_TG.repeat_interleave(E // G, dim=1)
        scores_TE = torch.where(keep_TE, scores_TE, scores_TE - 1e4)
    return scores_TE


def select_experts(
    spec: RoutingSpec, params: dict[str, torch.Tensor], m: int, x_TD: torch.Tensor
) -> torch.Tensor:
    """The router's top-k expert ids for router input x_TD; [T, K] (as a set per row)."""
    return router_scores(spec, params, m, x_TD).topk(spec.top_k, dim=-1).indices


def model_fingerprint(model: torch.nn.Module, spec: RoutingSpec) -> str:
    """sha256 (16 hex) of the config's routing-relevant fields and the router + embedding
    weights, rounded to bf16 first: the same checkpoint served in float32, bf16 or with int4
    experts has one fingerprint, so a predictor trained on one precision loads on the others."""
    h = hashlib.sha256()
    h.update(json.dumps(spec.to_dict(), sort_keys=True).encode())
    params = router_params(model, spec)
    for k in sorted(params):
        h.update(k.encode())
        h.update(_bf16_bytes(params[k]))
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None:
        h.update(_bf16_bytes(_read(emb, "weight")[:64]))
    return h.hexdigest()[:16]


def _bf16_bytes(t: torch.Tensor) -> bytes:
    return t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
