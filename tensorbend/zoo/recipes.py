"""Model recipes for the zoo: size presets -> a transformers config of each MoE architecture.

Usage:
    >>> import transformers
    >>> cfg = build_config("deepseek_v3", SIZES["small"], vocab_size=8192, eos_token_id=0)
    >>> model = transformers.AutoModelForCausalLM.from_config(cfg)
    >>> model.config.model_type, cfg.n_routed_experts, cfg.num_experts_per_tok
    ('deepseek_v3', 32, 4)

Each architecture keeps its own routing and balancing style:
    deepseek_v3  sigmoid scores + e_score_correction_bias (aux-loss-free balancing, updated by
                 the trainer), one shared expert, the first layer dense, fine-grained experts.
    qwen3_moe    softmax top-k with normalised weights, every layer MoE, aux loss.
    mixtral      softmax top-k, every layer MoE, aux loss.

`register_sorted_experts()` adds a sort-by-expert experts forward to transformers'
ExpertsInterface. On CPU it trains ~1.3x faster than `eager` and far faster than `grouped_mm`;
the trainer switches to it for training and back to the default before saving.

Shapes: T tokens, K top-k, D hidden size, E experts, I expert intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, MixtralConfig, PretrainedConfig, Qwen3MoeConfig

from tensorbend.errors import ZooError

ARCHS = ("deepseek_v3", "qwen3_moe", "mixtral")
SORTED_EXPERTS = "tensorbend_sorted"


@dataclass(frozen=True)
class ZooSize:
    """One size preset; the same numbers apply to every architecture."""

    hidden_size: int
    """D, the residual stream width."""
    moe_layers: int
    """Number of MoE layers. DeepSeek-V3 style adds `dense_layers_deepseek` dense layers first."""
    num_heads: int
    """Attention heads (query heads)."""
    head_dim: int
    """Per-head width (DeepSeek MLA: the no-RoPE part and the value width)."""
    num_experts: int
    """E, routed experts per MoE layer."""
    top_k: int
    """K, routed experts per token."""
    moe_intermediate_size: int
    """I, the hidden width of one routed expert (and of the DeepSeek shared expert)."""
    dense_intermediate_size: int
    """Hidden width of the dense MLP in DeepSeek-V3's leading dense layer(s)."""
    vocab_size: int
    """Byte-level BPE vocabulary size, special tokens included."""
    seq_len: int
    """Training sequence length in tokens."""
    batch_size: int
    """Sequences per optimizer step."""
    lr: float
    """Peak AdamW learning rate (cosine decay to 10% after a linear warmup)."""
    dense_layers_deepseek: int = 1
    """`first_k_dense_replace` for DeepSeek-V3 style models."""
    kv_lora_rank: int | None = None
    """DeepSeek MLA latent width (default hidden_size // 2). vLLM's CPU MLA backend needs
    kv_lora_rank + qk_rope_head_dim = 576 (DeepSeek-V3's 512 + 64)."""
    qk_rope_head_dim: int | None = None
    """DeepSeek MLA rotary part of each query/key head (default head_dim // 2)."""
    q_lora_rank: int | None = None
    """DeepSeek MLA query compression width (None: no compression; llama.cpp's converter
    refuses None)."""
    n_group: int = 1
    """DeepSeek expert groups; a token picks its experts from its `topk_group` best groups."""
    topk_group: int = 1
    """DeepSeek groups each token may route to."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ZooError(
                f"size preset: expected 1 <= top_k <= num_experts, found top_k={self.top_k}, "
                f"num_experts={self.num_experts} (lower top_k)"
            )
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ZooError(
                f"size preset: expected n_group dividing num_experts and 1 <= topk_group <= "
                f"n_group, found num_experts={self.num_experts}, n_group={self.n_group}, "
                f"topk_group={self.topk_group}"
            )
        if self.vocab_size > 65535:
            raise ZooError(
                f"size preset: expected vocab_size <= 65535 (token ids are cached as uint16), "
                f"found {self.vocab_size}"
            )


_SMALL = ZooSize(  # (the bundled models, and zoo:dsv3-vllm with its MLA widths)
    hidden_size=128,
    moe_layers=6,
    num_heads=4,
    head_dim=32,
    num_experts=32,
    top_k=4,
    moe_intermediate_size=64,
    dense_intermediate_size=384,
    vocab_size=8192,
    seq_len=256,
    batch_size=8,
    lr=2e-3,
)

SIZES = {
    # for tests: trains in seconds, not a language model worth reading
    "tiny": ZooSize(
        hidden_size=32,
        moe_layers=2,
        num_heads=2,
        head_dim=16,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=16,
        dense_intermediate_size=64,
        vocab_size=512,
        seq_len=64,
        batch_size=4,
        lr=3e-3,
    ),
    # the bundled models: ~6.5M parameters, ~26 MB in fp32, several million tokens in an hour on 2 cores
    "small": _SMALL,
    # the realistic-routing benchmark model: DeepSeek-V2-Lite's routing shape (64 experts, top-6)
    # over twice the MoE depth of `small`, narrow experts so it stays ~45 MB and trains on 2 cores
    "deep": ZooSize(
        hidden_size=128,
        moe_layers=12,
        num_heads=4,
        head_dim=32,
        num_experts=64,
        top_k=6,
        moe_intermediate_size=32,
        dense_intermediate_size=384,
        vocab_size=8192,
        seq_len=256,
        batch_size=8,
        lr=2e-3,
    ),
    # zoo:dsv3-vllm: `small` with DeepSeek-V3's MLA widths (kv_lora_rank 512 + rope 64 = 576,
    # what vLLM's CPU MLA kernel supports), query compression, and group-limited routing
    "vllm": replace(
        _SMALL, kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=64, n_group=4, topk_group=2
    ),
    # for a GPU or a long CPU run
    "medium": ZooSize(
        hidden_size=256,
        moe_layers=8,
        num_heads=8,
        head_dim=32,
        num_experts=64,
        top_k=6,
        moe_intermediate_size=128,
        dense_intermediate_size=1024,
        vocab_size=8192,
        seq_len=512,
        batch_size=16,
        lr=1e-3,
    ),
}


def build_config(
    arch: str, size: ZooSize, vocab_size: int, eos_token_id: int, aux_loss_coef: float = 0.01
) -> PretrainedConfig:
    """The transformers config of a small `arch` model; `vocab_size` is the trained tokenizer's."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        num_attention_heads=size.num_heads,
        moe_intermediate_size=size.moe_intermediate_size,
        num_experts_per_tok=size.top_k,
        max_position_embeddings=max(1024, 2 * size.seq_len),
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        tie_word_embeddings=True,
        use_cache=True,
    )
    if arch == "deepseek_v3":
        return DeepseekV3Config(
            **common,
            num_hidden_layers=size.dense_layers_deepseek + size.moe_layers,
            first_k_dense_replace=size.dense_layers_deepseek,
            intermediate_size=size.dense_intermediate_size,
            num_key_value_heads=size.num_heads,
            n_routed_experts=size.num_experts,
            n_shared_experts=1,
            n_group=size.n_group,
            topk_group=size.topk_group,
            # what transformers' DeepseekV3 does; the keys vLLM reads to route the same way
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
            q_lora_rank=size.q_lora_rank,
            kv_lora_rank=size.kv_lora_rank or size.hidden_size // 2,
            qk_nope_head_dim=size.head_dim,
            qk_rope_head_dim=size.qk_rope_head_dim or size.head_dim // 2,
            v_head_dim=size.head_dim,
            rope_interleave=True,
        )
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            num_hidden_layers=size.moe_layers,
            intermediate_size=size.dense_intermediate_size,
            num_key_value_heads=max(1, size.num_heads // 2),
            head_dim=size.head_dim,
            num_experts=size.num_experts,
            norm_topk_prob=True,
            output_router_logits=True,
            router_aux_loss_coef=aux_loss_coef,
        )
    if arch == "mixtral":
        return MixtralConfig(
            **common,
            num_hidden_layers=size.moe_layers,
            intermediate_size=size.moe_intermediate_size,
            num_key_value_heads=max(1, size.num_heads // 2),
            head_dim=size.head_dim,
            num_local_experts=size.num_experts,
            output_router_logits=True,
            router_aux_loss_coef=aux_loss_coef,
        )
    raise ZooError(f"unknown arch {arch!r}: expected one of {', '.join(ARCHS)}")


def register_sorted_experts() -> str:
    """Register the sort-by-expert forward with transformers; returns its implementation name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(SORTED_EXPERTS, _sorted_experts_forward)
    return SORTED_EXPERTS


def _sorted_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, D]
    top_k_index: torch.Tensor,  # [T, K]
    top_k_weights: torch.Tensor,  # [T, K]
) -> torch.Tensor:
    """Gather each expert's tokens contiguously, run one dense matmul pair per expert, scatter back."""
    T, K = top_k_index.shape
    flat_ids_TK = top_k_index.reshape(-1)
    order = torch.argsort(flat_ids_TK, stable=True)  # [T*K], grouped by expert
    token_idx = order // K
    counts_E = torch.bincount(flat_ids_TK, minlength=self.num_experts).tolist()
    x_sorted = hidden_states[token_idx]  # [T*K, D]
    outs, start = [], 0
    for e, n in enumerate(counts_E[: self.num_experts]):
        if n == 0:
            continue
        h = self._apply_gate(F.linear(x_sorted[start : start + n], self.gate_up_proj[e]))  # [n, I]
        outs.append(F.linear(h, self.down_proj[e]))  # [n, D]
        start += n
    y = torch.cat(outs) * top_k_weights.reshape(-1)[order][:start, None].to(hidden_states.dtype)
    out_TD = torch.zeros_like(hidden_states)
    return out_TD.index_add_(0, token_idx[:start], y)
