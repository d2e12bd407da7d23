"""Find the MoE layers and routers of a loaded HF transformers model, and describe its routing.

Usage:
    >>> from tensorbend.capture.hf import load_model
    >>> model, tok = load_model("zoo:default")
    >>> spec = describe_model(model)            # RoutingSpec: layers, experts, top-k, router kind
    >>> spec.family, spec.num_moe_layers, spec.num_experts, spec.top_k
    ('deepseek_v3', 6, 32, 4)
    >>> calls = []
    >>> with RouterHooks(model, spec, on_route=calls.append):   # the one router-hook helper
    ...     _ = model(tok("In the beginning", return_tensors="pt").input_ids)
    >>> [c.m for c in calls] == list(range(spec.num_moe_layers))
    True
    >>> from tensorbend.routers import router_params, select_experts      # routers, rerun
    >>> ids_TK = select_experts(spec, router_params(model, spec), 2, calls[2].gate_input_TD())
    >>> bool((ids_TK.sort(-1).values == calls[2].ids_TK.sort(-1).values).all())
    True

Shape legend: T tokens, L MoE layers, E routed experts, K top-k, D hidden size.

The MoE layer index `m = 0..L-1` counts MoE layers only; `spec.moe_layer_ids[m]` is the
decoder-layer id. Dense layers (first_k_dense_replace, mlp_only_layers, decoder_sparse_step,
moe_layers) are skipped because we detect MoE blocks structurally (a router module inside the
layer's feed-forward block), and the tests check that against those config fields.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tensorbend.errors import UnsupportedModelError

# Router kinds (how the router turns logits into a selection):
#   softmax       top-k of softmax(logits)              Qwen2/3-MoE, Mixtral, OLMoE
#   topk_softmax  top-k of logits (+bias), softmax over the k   GPT-OSS, Granite-MoE
#   sparsemixer   top-k of logits in eval mode           Phi-MoE
#   sigmoid_topk  top-k of logits, sigmoid weights       Llama-4
#   sigmoid_bias  top-k of sigmoid(logits) + correction bias            DeepSeek-V3 / Kimi-K2
#   group_limited sigmoid_bias restricted to the best topk_group of n_group groups  DeepSeek-V3
ROUTER_KINDS = (
    "softmax",
    "topk_softmax",
    "sparsemixer",
    "sigmoid_topk",
    "sigmoid_bias",
    "group_limited",
)


@dataclass(frozen=True)
class _Family:
    moe_attr: str  # feed-forward block attribute on the decoder layer
    router_attr: str  # router attribute on the MoE block
    experts_attr: str  # routed experts attribute on the MoE block
    router_kind: str
    returns: str = "logits_weights_ids"  # or "scores_logits" (Llama-4)


_FAMILIES: dict[str, _Family] = {
    "deepseek_v3": _Family("mlp", "gate", "experts", "sigmoid_bias"),
    "qwen3_moe": _Family("mlp", "gate", "experts", "softmax"),
    "qwen2_moe": _Family("mlp", "gate", "experts", "softmax"),
    "mixtral": _Family("mlp", "gate", "experts", "softmax"),
    "olmoe": _Family("mlp", "gate", "experts", "softmax"),
    "gpt_oss": _Family("mlp", "router", "experts", "topk_softmax"),
    "phimoe": _Family("mlp", "router", "experts", "sparsemixer"),
    "granitemoe": _Family("block_sparse_moe", "router", "experts", "topk_softmax"),
    "llama4_text": _Family("feed_forward", "router", "experts", "sigmoid_topk", "scores_logits"),
}
SUPPORTED_FAMILIES = tuple(_FAMILIES)
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
"""config.json model_types that transformers does not know but whose weights and config fields
are another family's (Kimi-K2's config is DeepSeek-V3's, served without its remote code)."""


@dataclass(frozen=True)
class RoutingSpec:
    """What a predictor and the runtime need to know about a model's routing."""

    family: str  # HF model_type
    router_kind: str  # one of ROUTER_KINDS
    num_experts: int  # routed experts per MoE layer (E)
    top_k: int  # experts selected per token (K)
    hidden_size: int  # D
    num_decoder_layers: int
    moe_layer_ids: tuple[int, ...]  # decoder-layer id of each MoE layer m
    num_shared_experts: int = 0  # always-on experts (stay resident; not predicted)
    n_group: int = 1  # group-limited routing: groups of experts
    topk_group: int = 1  # ... of which this many may be selected
    norm_topk_prob: bool = False
    moe_attr: str = "mlp"
    router_attr: str = "gate"
    experts_attr: str = "experts"

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RoutingSpec:
        d = dict(d)
        d["moe_layer_ids"] = tuple(d["moe_layer_ids"])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a CausalLM or base model."""
    for path in (
        "model.layers",
        "layers",
        "model.language_model.layers",
        "language_model.model.layers",
    ):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return obj
    raise UnsupportedModelError(
        f"cannot find decoder layers in {type(model).__name__}: expected `model.layers` "
        f"(a transformers CausalLM of one of: {', '.join(SUPPORTED_FAMILIES)})"
    )


def check_model_type(path) -> None:
    """One-line UnsupportedModelError when config.json is not JSON or its model_type is unknown
    to transformers (instead of transformers' paragraph, or a complaint about the tokenizer); a
    known non-MoE type is describe_model's to refuse."""
    import transformers
    from transformers import CONFIG_MAPPING

    file = Path(path) / "config.json"
    try:
        text = file.read_text()
    except OSError:
        return  # (missing or unreadable: AutoConfig's own error names it)
    try:
        mt = json.loads(text).get("model_type")
    except ValueError as e:
        raise UnsupportedModelError(
            f"{file}: expected a JSON object (transformers' config), found invalid JSON ({e}); "
            "fix it, or save the model's config again with config.save_pretrained(DIR)"
        ) from None
    except AttributeError:
        return
    if isinstance(mt, str) and mt not in CONFIG_MAPPING and mt not in MODEL_TYPE_ALIASES:
        raise UnsupportedModelError(
            f"{file}: model_type {mt!r} is unknown to transformers {transformers.__version__}: "
            f"expected one of the supported MoE families {', '.join(SUPPORTED_FAMILIES)}; fix "
            f"model_type or upgrade transformers"
        )


def read_config(path):
    """config.json as transformers' config object; a `MODEL_TYPE_ALIASES` type read as its
    family's (no remote code runs). OSError / ValueError as AutoConfig raises them."""
    from transformers import CONFIG_MAPPING, AutoConfig

    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError):
        raw = {}
    alias = MODEL_TYPE_ALIASES.get(raw.get("model_type")) if isinstance(raw, dict) else None
    if alias is None:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
    return CONFIG_MAPPING[alias](**fields)


def max_positions(path) -> int | None:
    """config.json's max_position_embeddings (None where it has none): the longest prompt +
    new tokens the model takes, which `generate` and `collect --engine vllm` check first."""
    return getattr(read_config(path), "max_position_embeddings", None) or None


def describe_model(model: torch.nn.Module) -> RoutingSpec:
    """Find MoE layers and routers; raise UnsupportedModelError naming the family otherwise."""
    config = getattr(model, "config", None)
    family = _family_name(config)
    if family not in _FAMILIES:
        raise UnsupportedModelError(
            f"model family {family!r} is not supported: expected one of "
            f"{', '.join(SUPPORTED_FAMILIES)} (open an issue with the model's config.json)"
        )
    fam = _FAMILIES[family]
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = decoder_layers(model)
    moe_ids, routers = [], []
    for i, layer in enumerate(layers):
        block = getattr(layer, fam.moe_attr, None)
        router = getattr(block, fam.router_attr, None) if block is not None else None
        if router is not None and getattr(router, "weight", None) is not None:
            moe_ids.append(i)
            routers.append(router)
    if not moe_ids:
        raise UnsupportedModelError(
            f"{family} model has no MoE layers: expected `{fam.moe_attr}.{fam.router_attr}` in at "
            f"least one of its {len(layers)} decoder layers (is this a dense checkpoint?)"
        )
    router = routers[0]
    num_experts = int(router.weight.shape[0])
    top_k = int(getattr(router, "top_k", None) or text_config.num_experts_per_tok)
    kind = fam.router_kind
    n_group = int(getattr(router, "num_group", None) or 1)
    topk_group = int(getattr(router, "topk_group", None) or 1)
    if kind == "sigmoid_bias" and n_group > 1 and topk_group < n_group:
        kind = "group_limited"
    shared = 0
    if family == "deepseek_v3":
        shared = int(getattr(text_config, "n_shared_experts", 0) or 0)
    elif family in ("qwen2_moe", "llama4_text"):
        shared = 1
    return RoutingSpec(
        family=family,
        router_kind=kind,
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=int(text_config.hidden_size),
        num_decoder_layers=len(layers),
        moe_layer_ids=tuple(moe_ids),
        num_shared_experts=shared,
        n_group=n_group if kind == "group_limited" else 1,
        topk_group=topk_group if kind == "group_limited" else 1,
        norm_topk_prob=bool(getattr(router, "norm_topk_prob", False)),
        moe_attr=fam.moe_attr,
        router_attr=fam.router_attr,
        experts_attr=fam.experts_attr,
    )


def moe_block(model: torch.nn.Module, spec: RoutingSpec, m: int) -> torch.nn.Module:
    return getattr(decoder_layers(model)[spec.moe_layer_ids[m]], spec.moe_attr)


def router_module(model: torch.nn.Module, spec: RoutingSpec, m: int) -> torch.nn.Module:
    return getattr(moe_block(model, spec, m), spec.router_attr)


def router_outputs(spec: RoutingSpec, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalise a router's forward output to (logits_TE, weights_TK, ids_TK)."""
    if _FAMILIES[spec.family].returns == "scores_logits":
        scores_TE, logits_TE = output
        # Same op the router ran on the same logits, so the same ids.
        ids_TK = torch.topk(logits_TE, spec.top_k, dim=1).indices
        return logits_TE, scores_TE.gather(1, ids_TK), ids_TK
    logits_TE, weights_TK, ids_TK = output[0], output[1], output[2]
    return logits_TE, weights_TK, ids_TK


@dataclass(frozen=True)
class RouterCall:
    """One forward of MoE layer m's router, as the experts module will consume it.

    `gate_input` is the router's input exactly as received ([B, S, D] for DeepSeek-V3, [T, D]
    for the others); `logits_TE`, `weights_TK`, `ids_TK` are its outputs (not detached: the zoo
    trainer takes gradients through the logits). Consumers detach/copy what they keep.
    """

    m: int
    gate_input: torch.Tensor
    logits_TE: torch.Tensor
    weights_TK: torch.Tensor
    ids_TK: torch.Tensor

    def gate_input_TD(self) -> torch.Tensor:
        return self.gate_input.reshape(-1, self.gate_input.shape[-1])


class RouterHooks:
    """The one place that hooks routers: a context manager calling back on every MoE layer.

    on_route(call: RouterCall) runs after each router forward (before its experts run);
    on_layer_input(m, hidden) runs before MoE layer m's decoder layer (the residual stream
    entering attention, the `pre_attn` source point). Hooks are removed on exit, also after an
    exception. Used by capture, the offload runtime's prefetch hooks, the zoo trainer and card.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        spec: RoutingSpec,
        on_route: Callable[[RouterCall], None] | None = None,
        on_layer_input: Callable[[int, torch.Tensor], None] | None = None,
    ):
        self.model, self.spec = model, spec
        self.on_route, self.on_layer_input = on_route, on_layer_input
        self._handles: list = []

    def __enter__(self) -> RouterHooks:
        layers = decoder_layers(self.model)
        try:
            for m, lid in enumerate(self.spec.moe_layer_ids):
                if self.on_route is not None:
                    router = router_module(self.model, self.spec, m)
                    self._handles.append(router.register_forward_hook(self._route_hook(m)))
                if self.on_layer_input is not None:
                    self._handles.append(
                        layers[lid].register_forward_pre_hook(self._layer_hook(m), with_kwargs=True)
                    )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _route_hook(self, m: int):
        def hook(module, args, output):
            logits_TE, weights_TK, ids_TK = router_outputs(self.spec, output)
            self.on_route(RouterCall(m, args[0], logits_TE, weights_TK, ids_TK))

        return hook

    def _layer_hook(self, m: int):
        def hook(module, args, kwargs):
            self.on_layer_input(m, args[0] if args else kwargs["hidden_states"])

        return hook


def _family_name(config) -> str:
    if config is None:
        return "unknown (no .config)"
    mt = getattr(config, "model_type", None) or "unknown"
    if mt == "llama4":
        return "llama4_text"
    if mt in ("kimi_k2", "deepseek_v3"):  # Kimi-K2 configs are DeepSeek-V3 models
        return "deepseek_v3"
    return mt
