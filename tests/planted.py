"""Synthetic traces with planted routing structure, written through the real TraceWriter.

`permutation_trace`: layer 0 experts are random; layer m's experts are a fixed permutation of
layer m-1's. Hidden states are noise, so only the routing of earlier layers is informative:
a transition table (and anything that reads the source routing) can reach recall 1.0 at d1,
popularity (frequency) cannot do better than about K/E.

`cycle_trace`: every request starts at the same point of a cycle of two expert sets per layer
(A, B, A, B, ... across tokens: 1 prefill token, then decode) and has an even length, so the
whole run's routing is a function of the present one: a cross-token predictor can place every
next use exactly, and Belady is reached. With `sticky`, a request keeps one set at every token:
its present routing is its next.

`router_trace`: each layer routes like a real linear router, top-K of W_m @ gate_input[m], and
the trace's router weights are those W_m (spec_gate at same_layer is exact). Only the hidden
state is informative: a model that learns the linear map from train rows reaches recall well
above chance (K/E) on held-out rows.
"""

from __future__ import annotations

import torch

from tensorbend.capture.writer import TraceWriter
from tensorbend.models import RoutingSpec


def _spec(L: int, E: int, K: int, D: int) -> RoutingSpec:
    return RoutingSpec(
        family="qwen3_moe",
        router_kind="softmax",
        num_experts=E,
        top_k=K,
        hidden_size=D,
        num_decoder_layers=L,
        moe_layer_ids=tuple(range(L)),
    )


def _writer(root, spec, router, fingerprint: str):
    return TraceWriter(
        root,
        model_meta={"name": "planted", "fingerprint": fingerprint},
        spec=spec,
        features={"ids": "int16", "gate_input": "float16", "layer_input": "float16"},
        collection={"decode": "teacher"},
        router_params=router,
        shard_tokens=200,
    )


def _record(i: int, tokens: int, decode: int) -> dict:
    from tensorbend.capture.prompts import split_of

    pid = f"q{i:03d}"
    return {"id": pid, "split": split_of(pid), "topic": None, "prefill": tokens, "decode": decode}


def _phase(tokens: int, decode: int) -> torch.Tensor:
    return torch.cat([torch.zeros(tokens), torch.ones(decode)]).to(torch.int8)


def cycle_trace(root, *, L=2, K=2, prompts=40, decode=11, D=8, sticky=False):
    """E = 2K experts per layer: set A = experts 0..K-1, set B = K..2K-1; token t uses A at
    even t, B at odd t (t counts from 0 at the prompt's single prefill token). sticky: request
    i uses one set at every token instead (A for even i, B for odd)."""
    E, T = 2 * K, 1 + decode
    assert T % 2 == 0, "an even request length keeps the cycle going across requests"
    spec = _spec(L, E, K, D)
    w = _writer(root, spec, {}, "planted-sticky" if sticky else "planted-cycle")
    sets_K = [torch.arange(K), torch.arange(K, 2 * K)]
    for i in range(prompts):
        ids_TK = torch.stack([sets_K[i % 2 if sticky else t % 2] for t in range(T)])
        rows = {
            "expert_ids_TLK": ids_TK[:, None, :].expand(T, L, K).to(torch.int16).contiguous(),
            "gate_input_TLD": torch.zeros(T, L, D).half(),
            "layer_input_TLD": torch.zeros(T, L, D).half(),
            "token_ids_T": torch.zeros(T, dtype=torch.int32),
            "positions_T": torch.arange(T, dtype=torch.int32),
            "phase_T": _phase(1, decode),
        }
        w.add_prompt(_record(i, 1, decode), rows)
    w.close()
    return spec


def permutation_trace(root, *, L=4, E=16, K=2, D=16, prompts=40, tokens=24, decode=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    spec = _spec(L, E, K, D)
    perms = [torch.randperm(E, generator=g) for _ in range(L)]
    router = {f"layers.{m}.weight": torch.randn(E, D, generator=g) for m in range(L)}
    w = _writer(root, spec, router, f"planted{seed}")
    for i in range(prompts):
        T = tokens + decode
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # [T, K] distinct
        layers = [ids]
        for m in range(1, L):
            layers.append(perms[m][layers[-1]])
        rows = {
            "expert_ids_TLK": torch.stack(layers, 1).to(torch.int16),
            "gate_input_TLD": torch.randn(T, L, D, generator=g).half(),
            "layer_input_TLD": torch.randn(T, L, D, generator=g).half(),
            "token_ids_T": torch.zeros(T, dtype=torch.int32),
            "positions_T": torch.arange(T, dtype=torch.int32),
            "phase_T": _phase(tokens, decode),
        }
        w.add_prompt(_record(i, tokens, decode), rows)
    w.close()
    return spec, perms


def router_trace(root, *, L=4, E=16, K=2, D=16, prompts=40, tokens=24, decode=8, seed=0):
    """Routing = top-K of a fixed linear router on the (planted) gate input of each layer."""
    g = torch.Generator().manual_seed(seed)
    spec = _spec(L, E, K, D)
    W_LED = torch.randn(L, E, D, generator=g)
    router = {f"layers.{m}.weight": W_LED[m] for m in range(L)}
    w = _writer(root, spec, router, f"router{seed}")
    for i in range(prompts):
        T = tokens + decode
        x_TLD = torch.randn(T, L, D, generator=g)
        for m in range(1, L):  # a residual stream: each layer's input carries the previous one
            x_TLD[:, m] = 0.8 * x_TLD[:, m - 1] + 0.6 * x_TLD[:, m]
        gate_TLD = x_TLD.half().float()  # what the trace stores is what the router saw
        ids_TLK = torch.einsum("tld,led->tle", gate_TLD, W_LED).topk(K, dim=-1).indices
        rows = {
            "expert_ids_TLK": ids_TLK.to(torch.int16),
            "gate_input_TLD": gate_TLD.half(),
            "layer_input_TLD": (x_TLD + 0.1 * torch.randn(T, L, D, generator=g)).half(),
            "token_ids_T": torch.zeros(T, dtype=torch.int32),
            "positions_T": torch.arange(T, dtype=torch.int32),
            "phase_T": _phase(tokens, decode),
        }
        w.add_prompt(_record(i, tokens, decode), rows)
    w.close()
    return spec, W_LED


def tiny_real_trace(d):
    """A trace of a real (tiny, random-init) DeepSeek-V3 with group-limited routing, in fp32."""
    from tiny_models import save_checkpoint, write_prompts

    from tensorbend.capture.collect import CollectConfig, collect
    from tensorbend.capture.hf import DecodeConfig

    save_checkpoint("deepseek_v3", d / "model")
    write_prompts(d / "p.jsonl", n=16)
    collect(
        CollectConfig(
            model=str(d / "model"),
            out=d / "t",
            prompts=d / "p.jsonl",
            decode=DecodeConfig(max_new_tokens=6),
            dtype="float32",
            features=("ids", "gate_input", "layer_input"),
        ),
        progress=False,
    )
    return d / "t"
