"""Hooks that record exact routing (and the hidden states predictors learn from) per MoE layer.

Usage:
    >>> spec = describe_model(model)
    >>> with RoutingCapture(model, spec, features=("ids", "gate_input")) as cap:
    ...     model(input_ids)
    ...     rows = cap.pop()        # {"expert_ids_TLK": [T, L, K] int16, "gate_input_TLD": ...}

Ids and weights come from the router's own output (the tensors the experts consume), never
recomputed from logits. Hooks are removed on exit, also after an exception.
Rows are in the order the model saw the tokens (batch 1: sequence order).
"""

from __future__ import annotations

import torch

from tensorbend.errors import TensorbendError
from tensorbend.models import RoutingSpec, decoder_layers, router_module, router_outputs

# feature name -> tensor name in a trace shard
FEATURE_TENSORS = {
    "ids": "expert_ids_TLK",
    "weights": "weights_TLK",
    "logits": "logits_TLE",
    "gate_input": "gate_input_TLD",
    "layer_input": "layer_input_TLD",
}
FEATURES = tuple(FEATURE_TENSORS)


class RoutingCapture:
    """Context manager installing forward hooks on every router (and decoder layer if needed)."""

    def __init__(
        self,
        model: torch.nn.Module,
        spec: RoutingSpec,
        features=("ids",),
        store_dtype=torch.float16,
    ):
        unknown = set(features) - set(FEATURES)
        if unknown:
            raise TensorbendError(
                f"unknown capture features {sorted(unknown)}: expected some of {list(FEATURES)}"
            )
        self.model, self.spec = model, spec
        self.features = tuple(dict.fromkeys(("ids", *features)))  # ids always
        self.store_dtype = store_dtype
        self._handles: list = []
        self._buf: dict[str, list[list[torch.Tensor]]] = {}
        self._reset()

    def __enter__(self) -> RoutingCapture:
        layers = decoder_layers(self.model)
        for m, lid in enumerate(self.spec.moe_layer_ids):
            self._handles.append(
                router_module(self.model, self.spec, m).register_forward_hook(self._router_hook(m))
            )
            if "layer_input" in self.features:
                self._handles.append(
                    layers[lid].register_forward_pre_hook(self._layer_hook(m), with_kwargs=True)
                )
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def pop(self) -> dict[str, torch.Tensor]:
        """Rows captured since the last pop, stacked over MoE layers: {tensor_name: [T, L, ...]}."""
        out = {}
        for feat, per_layer in self._buf.items():
            if not per_layer[0]:
                continue
            counts = {sum(t.shape[0] for t in chunks) for chunks in per_layer}
            assert len(counts) == 1, f"{feat}: MoE layers saw different token counts {counts}"
            out[FEATURE_TENSORS[feat]] = torch.stack(
                [torch.cat(chunks) for chunks in per_layer], dim=1
            )
        self._reset()
        return out

    # ------------------------------------------------------------ hooks

    def _reset(self) -> None:
        L = self.spec.num_moe_layers
        self._buf = {f: [[] for _ in range(L)] for f in self.features}

    def _router_hook(self, m: int):
        D = self.spec.hidden_size

        def hook(module, args, output):
            logits_TE, weights_TK, ids_TK = router_outputs(self.spec, output)
            buf = self._buf
            buf["ids"][m].append(ids_TK.detach().to("cpu", torch.int16))
            if "weights" in buf:
                buf["weights"][m].append(weights_TK.detach().to("cpu", self.store_dtype, copy=True))
            if "logits" in buf:
                buf["logits"][m].append(
                    logits_TE.detach()
                    .reshape(-1, logits_TE.shape[-1])
                    .to("cpu", self.store_dtype, copy=True)
                )
            if "gate_input" in buf:
                buf["gate_input"][m].append(
                    args[0].detach().reshape(-1, D).to("cpu", self.store_dtype, copy=True)
                )

        return hook

    def _layer_hook(self, m: int):
        D = self.spec.hidden_size

        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            self._buf["layer_input"][m].append(
                h.detach().reshape(-1, D).to("cpu", self.store_dtype, copy=True)
            )

        return hook
