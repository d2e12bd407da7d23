"""The offloaded experts forward: the family's eager math on weights fetched from the cache.

Usage (session.py installs it; nothing else should need to):
    fwd = OffloadedExperts(mod, spec.family, layout, m, get_active)
    mod.forward = fwd          # the module keeps its signature (hidden, ids, weights)

Outputs equal the resident model's `eager` experts implementation bit for bit: the same
expert mask, the same per-expert ops, and contributions added to the output in ascending
expert order (experts are computed in the order they arrive, then summed in eager's order).
Supported: every family whose experts module takes (hidden_TD, top_k_index_TK,
top_k_weights_TK) with fused `gate_up_proj`/`down_proj`: deepseek_v3, qwen3_moe, qwen2_moe,
mixtral, olmoe, phimoe, granitemoe (SwiGLU on [2I, D] / [D, I]) and gpt_oss (biases,
transposed weights, clamped gate). Llama-4 is not: its experts receive every expert's
pre-scaled copy of the tokens, so there is nothing to skip loading. Int4 slots
(`ExpertLayout.int4_slots`, SwiGLU families) run the same math with each matmul on torch's int4
kernel (`int4.int4_linear`): equal to the same int4 experts computed resident by that kernel,
not to a dense model (docs/guide/serving.md measures the difference).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tensorbend.errors import UnsupportedModelError
from tensorbend.offload.int4 import int4_linear
from tensorbend.offload.layout import ExpertLayout

SWIGLU_FAMILIES = (
    "deepseek_v3",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "phimoe",
    "granitemoe",
)
OFFLOAD_FAMILIES = (*SWIGLU_FAMILIES, "gpt_oss")


def check_supported(family: str) -> None:
    if family not in OFFLOAD_FAMILIES:
        why = (
            (
                "its experts take every expert's pre-scaled copy of the tokens, so there is no "
                "per-token expert set to load"
            )
            if family == "llama4_text"
            else "no offload kernel for it"
        )
        raise UnsupportedModelError(
            f"offload of {family} models is not supported ({why}): expected one of "
            f"{', '.join(OFFLOAD_FAMILIES)}; run it resident with transformers (or `tensorbend "
            f"measure --policy resident`), where it fits in memory"
        )


class OffloadedExperts:
    """Callable replacing `experts.forward` for MoE layer m; `get_active()` gives the run state."""

    def __init__(
        self, mod: torch.nn.Module, family: str, layout: ExpertLayout, m: int, get_active: Callable
    ):
        check_supported(family)
        self.mod, self.layout, self.m, self.get_active = mod, layout, m, get_active
        self.num_experts = int(mod.num_experts)
        self.expert = _gpt_oss_expert if family == "gpt_oss" else _swiglu_expert
        if layout.int4_slots:
            if family not in SWIGLU_FAMILIES:
                raise UnsupportedModelError(
                    f"int4 slots for {family} experts: expected one of {', '.join(SWIGLU_FAMILIES)}"
                    f" (SwiGLU experts without biases); serve it with --slots dense"
                )
            self.expert = _Int4SwiGLU(layout.block.group)
        self._routed: tuple | None = None  # (ids, expert mask, claimed keys) from `route`

    def route(self, top_k_index: torch.Tensor) -> None:
        """Claim this layer's experts and queue demand loads as soon as the router has run.

        Called from the router's forward hook (before any prefetch for later layers is
        queued, so demand loads go first); `__call__` does it itself when no hook did.
        """
        act = self.get_active()
        m, E = self.m, self.num_experts
        now = act.clock.step(m)
        act.cache.now = now
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=E + 1).permute(2, 1, 0)
            hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
        pending = set()
        for e in hit:
            if e == E:
                continue
            key = (m, e)
            pending.add(key)
            if act.cache.claim(key) == "absent":
                act.loader.demand(key)
        act.loader.cancel_stale(now)
        self._routed = (top_k_index, expert_mask, pending)

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        if self._routed is None:
            self.route(top_k_index)
        ids, expert_mask, pending = self._routed
        self._routed = None
        assert ids is top_k_index or torch.equal(ids, top_k_index), "router hook saw other ids"
        act = self.get_active()
        cache = act.cache
        outs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        math_s, pairs = 0.0, 0
        waits = cache.waits  # (only this thread adds to it)
        while pending:
            for key in cache.wait_ready(pending):
                e = key[1]
                t0 = time.perf_counter()
                try:
                    W = cache.views(key, self.layout)
                    top_k_pos, token_idx = torch.where(expert_mask[e])
                    out = self.expert(self.mod, hidden_states[token_idx], W)
                    outs[e] = (token_idx, out * top_k_weights[token_idx, top_k_pos, None])
                    pairs += len(token_idx)
                finally:
                    cache.release(key)
                    math_s += time.perf_counter() - t0
                pending.discard(key)
        act.hooks.settle(waited=cache.waits > waits)
        final = torch.zeros_like(hidden_states)
        for e in sorted(outs):
            token_idx, out = outs[e]
            final.index_add_(0, token_idx, out.to(final.dtype))
        act.compute.add(hidden_states.shape[0], len(outs), pairs, math_s)
        return final


class ExpertCompute:
    """Seconds inside the expert math (weights ready; waiting excluded), per token count T of
    an experts call: `rows()` gives [T, calls, experts computed, (token, expert) pairs,
    seconds] (`RunResult.expert_compute`; bench/sim_calibration.py turns it into per-expert
    costs). Keyed by T so serving a long stream keeps a bounded table.

        >>> c = ExpertCompute(); c.add(1, 4, 4, 0.002); c.add(1, 3, 3, 0.001); c.add(7, 9, 28, 0.01)
        >>> c.rows()
        [[1, 2, 7, 7, 0.003], [7, 1, 9, 28, 0.01]]
    """

    def __init__(self):
        self._by_tokens: dict[int, list] = {}

    def add(self, tokens: int, experts: int, pairs: int, seconds: float) -> None:
        row = self._by_tokens.setdefault(tokens, [0, 0, 0, 0.0])
        row[0] += 1
        row[1] += experts
        row[2] += pairs
        row[3] += seconds

    def rows(self) -> list[list]:
        return [[t, *r[:3], round(r[3], 9)] for t, r in sorted(self._by_tokens.items())]


def _swiglu_expert(mod, x: torch.Tensor, W: dict[str, torch.Tensor]) -> torch.Tensor:
    gate, up = F.linear(x, W["gate_up_proj"]).chunk(2, dim=-1)
    return F.linear(mod.act_fn(gate) * up, W["down_proj"])


class _Int4SwiGLU:
    """`_swiglu_expert` on an int4 slot's weights: each matmul torch's int4 kernel."""

    def __init__(self, group: int):
        self.group = group

    def __call__(self, mod, x: torch.Tensor, W: dict) -> torch.Tensor:
        gate, up = int4_linear(x, W["gate_up_proj"], self.group).chunk(2, dim=-1)
        return int4_linear(mod.act_fn(gate) * up, W["down_proj"], self.group)


def _gpt_oss_expert(mod, x: torch.Tensor, W: dict[str, torch.Tensor]) -> torch.Tensor:
    gate_up = x @ W["gate_up_proj"] + W["gate_up_proj_bias"]
    return mod._apply_gate(gate_up) @ W["down_proj"] + W["down_proj_bias"]
