"""Synthetic traces with planted routing structure, written through the real TraceWriter.

`permutation_trace`: layer 0 experts are random; layer m's experts are a fixed permutation of
layer m-1's. Hidden states are noise, so only the routing of earlier layers is informative:
a transition table (and anything that reads the source routing) can reach recall 1.0 at d1,
popularity (frequency) cannot do better than about K/E.
"""

from __future__ import annotations

import torch

from tensorbend.models import RoutingSpec
from tensorbend.trace_writer import TraceWriter


def permutation_trace(root, *, L=4, E=16, K=2, D=16, prompts=40, tokens=24, decode=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    spec = RoutingSpec(
        family="qwen3_moe",
        router_kind="softmax",
        num_experts=E,
        top_k=K,
        hidden_size=D,
        num_decoder_layers=L,
        moe_layer_ids=tuple(range(L)),
    )
    perms = [torch.randperm(E, generator=g) for _ in range(L)]
    router = {f"layers.{m}.weight": torch.randn(E, D, generator=g) for m in range(L)}
    w = TraceWriter(
        root,
        model_meta={"name": "planted", "fingerprint": f"planted{seed}"},
        spec=spec,
        features={"ids": "int16", "gate_input": "float16", "layer_input": "float16"},
        collection={"decode": "teacher"},
        router_params=router,
        shard_tokens=200,
    )
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
            "phase_T": torch.cat([torch.zeros(tokens), torch.ones(decode)]).to(torch.int8),
        }
        from tensorbend.prompts import split_of

        pid = f"q{i:03d}"
        w.add_prompt(
            {"id": pid, "split": split_of(pid), "topic": None, "prefill": tokens, "decode": decode},
            rows,
        )
    w.close()
    return spec, perms
