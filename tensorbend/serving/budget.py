"""Where a memory budget goes: the model without its experts, staging, the reserve, and the
cache (what is left), in bytes; and the import baseline every budget comes on top of.

Usage:
    plan = memory_plan(cfg, non_expert_bytes, spec, expert_bytes, kv_bytes)   # ServeConfig cfg
    plan["cache"]                    # bytes left for cached experts (slots: PolicyConfig.slots)
    pc, plan = size_cache(cfg, lm, spec, layout, loaded)                      # load_offloaded's
"""

from __future__ import annotations

import importlib
from dataclasses import replace

import torch

from tensorbend.cache.config import PolicyConfig, min_slots
from tensorbend.errors import TensorbendError
from tensorbend.memory import kv_bytes_per_token, parse_bytes, rss_bytes
from tensorbend.models import RoutingSpec
from tensorbend.offload.layout import ExpertLayout

BASELINE_MODULES = (
    "torch",
    "transformers.modeling_utils",
    "transformers.generation.utils",
    "tensorbend.serving.generate",
    "tensorbend.offload.handle",
)
IMPORT_BASELINE = (
    f"import {', '.join(BASELINE_MODULES)}; "
    "from tensorbend.memory import peak_rss_bytes; print(peak_rss_bytes())"
)
"""Python code printing the peak RSS of a process that imports what any transformers
inference needs (torch, transformers' modeling and generation code) and tensorbend: the
baseline that a memory budget comes on top of (about 400 MB on CPU)."""

RESERVE_FIXED = 64 * 10**6
"""--reserve auto's part beside the KV cache and the attention scores: activations, the
allocator's retained heap and the I/O threads' arenas (what the serving bench's runs use of
the reserve: docs/results/serve_memory.md)."""

ONEDNN_RESERVE = 64 * 10**6
"""--reserve auto's part for oneDNN where experts compute in bf16 or fp16 on CPU: torch runs
those matmuls through oneDNN, which keeps a primitive (kernel and scratch memory) per shape
for the life of the process, none of it in the import baseline. Decoding zoo:qwen3moe-tiny x184
at 1 GB it held 52-54 MB (`python -m bench.onednn_memory`, docs/results/bench/onednn_memory.json).
Not bounded yet: a long prefill on wide experts creates a primitive per token count and holds
far more (about 183 MB for a 552-token prompt on zoo:default x184:
docs/results/bench/onednn_memory_prefill.json)."""

CONTEXT_TOKENS = 2048
"""Tokens per sequence (prompt + new) --reserve auto keeps room for unless told
(`ServeConfig.context_tokens`; `tensorbend generate` sets it from its prompts)."""

PREFILL_CHUNK = 512
"""Prompt tokens per prefill forward (transformers' `prefill_chunk_size`): a long prompt
prefills in chunks, so its activations grow with the chunk, not the prompt. On CPU the
attention of a chunk holds up to chunk x context x heads fp32 scores: what `reserve_auto`
counts (tests/test_long_prompt.py holds the bound at 2k, 6k and 12k-token prompts)."""

MEASURE_GRAIN = 16 * 10**6
"""The measured model part is rounded up to this: it varies by a few MB from run to run
(the serving bench's range: docs/results/serve_memory.md), which would otherwise move the cache by an
expert between runs."""


def memory_plan(
    cfg,
    non_expert_bytes: int,
    spec: RoutingSpec,
    expert_bytes: int,
    kv_bytes: int,
    loaded_bytes: int | None = None,
    attn_heads: int = 0,
    onednn: bool = False,
) -> dict:
    """Where --max-memory goes (`cfg`: a ServeConfig), in bytes: {budget, non_expert, model, staging, reserve, cache};
    `cache` (what is left) becomes slots only at the slot table (`PolicyConfig.slots`). Raises
    when the budget cannot hold the fewest slots the cache runs with (`cache.config.min_slots`).
    kv_bytes: the KV cache per token and attn_heads the attention heads (what --reserve auto
    sizes for `cfg.context_tokens`: `reserve_auto`). Staging: the slots a
    bypassed miss is computed from (`--staging-slots`, default top-k; `--io direct` reads
    land in the aligned slots themselves: its bounce buffers hold one 4 KB block per I/O
    thread, inside the reserve). loaded_bytes:
    on CPU, how much the process's resident set grew while the model was built without its
    experts and the predictors loaded (the model's modeling code and Python objects, the
    predictors' weights, beside its tensors): charged as the model's part when it exceeds the
    non-expert tensors' bytes. onednn: the experts' matmuls run through oneDNN (`uses_onednn`),
    whose memory --reserve auto adds (ONEDNN_RESERVE)."""
    budget = parse_bytes(cfg.max_memory)
    model = max(non_expert_bytes, loaded_bytes or 0)
    what = f"non-expert weights {_mb(non_expert_bytes)}"
    if model > non_expert_bytes:
        what = f"the model without its experts {_mb(model)} (measured; its tensors "
        what += f"{_mb(non_expert_bytes)})"
    auto = reserve_auto(kv_bytes, cfg.context_tokens, attn_heads)
    auto += ONEDNN_RESERVE if onednn else 0
    reserve = auto if cfg.reserve == "auto" else parse_bytes(cfg.reserve, "--reserve")
    staging = cfg.offload.staging(spec.top_k) * expert_bytes
    need = min_slots(spec.top_k, spec.num_moe_layers, cfg.offload.pool)
    minimum = model + staging + reserve + need * expert_bytes
    if budget < minimum:
        whose = "--reserve"
        if cfg.reserve == "auto":
            parts = "KV cache, attention" + (", oneDNN" if onednn else "")
            whose = f"the reserve for {cfg.context_tokens:,} tokens ({parts})"
        raise TensorbendError(
            f"--max-memory {cfg.max_memory}: expected at least {_mb(minimum)} = {what} + "
            f"staging {_mb(staging)} + {whose} {_mb(reserve)} + {need} cached experts "
            f"of {_mb(expert_bytes)}; raise it"
            + ("" if cfg.reserve != "auto" else " or shorten the prompt")
        )
    return {
        "budget": budget,
        "non_expert": non_expert_bytes,
        "model": model,
        "staging": staging,
        "reserve": reserve,
        "cache": budget - model - staging - reserve,
        "context_tokens": cfg.context_tokens if cfg.reserve == "auto" else None,
        "onednn": ONEDNN_RESERVE if onednn and cfg.reserve == "auto" else 0,
    }


def reserve_auto(kv_bytes: int, context: int, attn_heads: int) -> int:
    """--reserve auto for sequences of `context` tokens: their KV cache, the fp32 attention
    scores of one prefill chunk against them (PREFILL_CHUNK) and RESERVE_FIXED."""
    scores = min(PREFILL_CHUNK, context) * context * attn_heads * 4
    return context * kv_bytes + scores + RESERVE_FIXED


def uses_onednn(device: str, layout: ExpertLayout) -> bool:
    """Whether the experts' matmuls run through oneDNN: dense bf16 or fp16 slots on CPU with
    torch's oneDNN path available and enabled (float32 matmuls and the int4 kernel do not)."""
    dense_half = not layout.int4_slots and layout.dtype in (torch.bfloat16, torch.float16)
    mkldnn = torch.backends.mkldnn
    return device == "cpu" and dense_half and mkldnn.is_available() and mkldnn.enabled


def prefill_chunk(prompt_tokens: int) -> int:
    """transformers' `prefill_chunk_size` for a prompt: PREFILL_CHUNK, or one less where the
    last chunk would be one token (a one-token forward on a filled cache reads as decode)."""
    chunk = PREFILL_CHUNK
    while prompt_tokens > chunk and prompt_tokens % chunk == 1:
        chunk -= 1
    return chunk


def size_cache(
    cfg, lm, spec: RoutingSpec, layout: ExpertLayout, loaded: int | None
) -> tuple[PolicyConfig, dict | None]:
    if cfg.max_memory is None:
        return cfg.offload, None
    non_expert = sum(
        p.numel() * p.element_size() for p in lm.parameters() if p.device.type != "meta"
    )
    non_expert += sum(b.numel() * b.element_size() for b in lm.buffers())
    kv = kv_bytes_per_token(lm.config, layout.dtype)
    heads = getattr(lm.config.get_text_config(), "num_attention_heads", 0) or 0
    onednn = uses_onednn(cfg.device, layout)
    plan = memory_plan(cfg, non_expert, spec, layout.nbytes, kv, loaded, heads, onednn)
    return replace(cfg.offload, cache_bytes=plan["cache"]), plan


def rss_after_baseline_imports() -> int | None:
    """The resident set once BASELINE_MODULES are imported (transformers imports its modeling
    and generation code lazily: that is the baseline's, not the model's)."""
    for name in BASELINE_MODULES:
        importlib.import_module(name)
    return rss_bytes()


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
