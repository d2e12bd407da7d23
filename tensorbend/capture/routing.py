"""Record exact routing (and the hidden states predictors learn from) per MoE layer.

Usage:
    >>> from tensorbend.capture.hf import load_model
    >>> from tensorbend.models import describe_model
    >>> model, tok = load_model("zoo:default")
    >>> spec = describe_model(model)
    >>> with RoutingCapture(model, spec, features=("ids", "gate_input")) as cap:
    ...     _ = model(tok("In the beginning", return_tensors="pt").input_ids)
    ...     rows = cap.pop()
    >>> sorted(rows), rows["expert_ids_TLK"].shape[1:]
    (['expert_ids_TLK', 'gate_input_TLD'], torch.Size([6, 4]))

Ids and weights come from the router's own output (the tensors the experts consume), never
recomputed from logits. Hooks go through `models.RouterHooks`, so they are removed on exit,
also after an exception. Rows are in the order the model saw the tokens (batch 1: sequence
order). Feature names and their tensor names are the trace format's (`trace.FEATURE_TENSORS`).
"""

from __future__ import annotations

import torch

from tensorbend.capture.trace import FEATURE_TENSORS, FEATURES
from tensorbend.errors import TensorbendError
from tensorbend.models import RouterCall, RouterHooks, RoutingSpec


class RoutingCapture:
    """Context manager buffering per-layer rows of the chosen features until `pop()`."""

    def __init__(
        self,
        model: torch.nn.Module,
        spec: RoutingSpec,
        features=("ids",),
        store_dtype=torch.float16,
        hooks=RouterHooks,
    ):
        """hooks: the router-hook context manager, called as hooks(model, spec, on_route=...,
        on_layer_input=...); another engine's (engines/vllm_engine.py) gives the same RouterCalls."""
        unknown = set(features) - set(FEATURES)
        if unknown:
            raise TensorbendError(
                f"unknown capture features {sorted(unknown)}: expected some of {list(FEATURES)}"
            )
        self.spec = spec
        self.features = tuple(dict.fromkeys(("ids", *features)))  # ids always
        self.store_dtype = store_dtype
        self._hooks = hooks(
            model,
            spec,
            on_route=self._on_route,
            on_layer_input=self._on_layer_input if "layer_input" in self.features else None,
        )
        self._reset()

    def __enter__(self) -> RoutingCapture:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

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

    def _keep(self, x: torch.Tensor, last_dim: int) -> torch.Tensor:
        return x.detach().reshape(-1, last_dim).to("cpu", self.store_dtype, copy=True)

    def _on_route(self, call: RouterCall) -> None:
        buf, m = self._buf, call.m
        buf["ids"][m].append(
            call.ids_TK.detach().reshape(-1, call.ids_TK.shape[-1]).to("cpu", torch.int16)
        )
        if "weights" in buf:
            buf["weights"][m].append(self._keep(call.weights_TK, call.weights_TK.shape[-1]))
        if "logits" in buf:
            buf["logits"][m].append(self._keep(call.logits_TE, call.logits_TE.shape[-1]))
        if "gate_input" in buf:
            buf["gate_input"][m].append(self._keep(call.gate_input, self.spec.hidden_size))

    def _on_layer_input(self, m: int, hidden: torch.Tensor) -> None:
        self._buf["layer_input"][m].append(self._keep(hidden, self.spec.hidden_size))
