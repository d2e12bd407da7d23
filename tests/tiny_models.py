"""Tiny HF MoE models of every supported family, built from configs (no downloads).

Each config is small enough to build and run in well under a second on CPU, but keeps the
family's routing features: dense layers mixed in, shared experts, group-limited routing.
"""

from __future__ import annotations

import torch
import transformers

COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    head_dim=8,
)


def _deepseek_v3(**kw):
    return transformers.DeepseekV3Config(
        **{k: v for k, v in COMMON.items() if k not in ("head_dim", "num_key_value_heads")},
        num_key_value_heads=4,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        norm_topk_prob=True,
        **kw,
    )


CONFIGS = {
    "deepseek_v3": _deepseek_v3,
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **{k: v for k, v in COMMON.items() if k != "head_dim"},
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON,
        intermediate_size=32,
        num_hidden_layers=3,
        num_local_experts=6,
        num_experts_per_tok=2,
    ),
    "olmoe": lambda: transformers.OlmoeConfig(
        **{k: v for k, v in COMMON.items() if k != "head_dim"},
        intermediate_size=16,
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "gpt_oss": lambda: transformers.GptOssConfig(
        **COMMON,
        intermediate_size=16,
        num_hidden_layers=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "phimoe": lambda: transformers.PhimoeConfig(
        **{k: v for k, v in COMMON.items() if k != "head_dim"},
        intermediate_size=16,
        num_hidden_layers=3,
        num_local_experts=6,
        num_experts_per_tok=2,
    ),
    "granitemoe": lambda: transformers.GraniteMoeConfig(
        **{k: v for k, v in COMMON.items() if k != "head_dim"},
        intermediate_size=16,
        num_hidden_layers=3,
        num_local_experts=6,
        num_experts_per_tok=2,
    ),
    "llama4_text": lambda: transformers.Llama4TextConfig(
        **COMMON,
        intermediate_size=16,
        intermediate_size_mlp=48,
        num_hidden_layers=4,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        attention_chunk_size=64,
        no_rope_layers=[1, 1, 1, 1],
    ),
}

# Decoder-layer ids that must be MoE, from each config's own dense-layer fields.
EXPECTED_MOE_LAYERS = {
    "deepseek_v3": (1, 2, 3),  # first_k_dense_replace=1
    "qwen3_moe": (0, 2, 3),  # mlp_only_layers=[1]
    "qwen2_moe": (1, 3),  # decoder_sparse_step=2
    "mixtral": (0, 1, 2),
    "olmoe": (0, 1, 2),
    "gpt_oss": (0, 1),
    "phimoe": (0, 1, 2),
    "granitemoe": (0, 1, 2),
    "llama4_text": (1, 3),  # interleave_moe_layer_step=2
}


def build(family: str, seed: int = 0, **config_overrides):
    """A randomly initialised CausalLM of `family` in eval mode, fp32 (its config's fields
    `config_overrides`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = CONFIGS[family]()
    for k, v in config_overrides.items():
        setattr(config, k, v)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random-init routers are near-uniform; scale them so selections are decisive and varied.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")):
                p.normal_(0, 0.5)
    return model.eval()


def char_tokenizer():
    """A 97-symbol character tokenizer (printable ASCII + <unk> + </s>) matching COMMON's vocab."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{chr(c): c - 30 for c in range(32, 127)}}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>")


def save_checkpoint(
    family: str, path, seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides
):
    """Write an HF checkpoint directory (model + tokenizer) for a tiny model of `family`, its
    weights (and config.json's `dtype`) in `dtype`."""
    model = build(family, seed, **config_overrides).to(dtype)
    model.config.eos_token_id = 1
    model.config.bos_token_id = None
    model.config.pad_token_id = None
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def write_prompts(path, n: int = 12, continuation_every: int = 2):
    """A small prompts JSONL: ids t000.., every `continuation_every`-th prompt has a continuation."""
    import json

    words = "alpha beta gamma delta kernel module python class river stone light dark".split()
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(words[(i + j) % len(words)] for j in range(3 + i % 5))
            rec = {"id": f"t{i:03d}", "text": text, "topic": ["code", "prose"][i % 2]}
            if i % continuation_every == 0:
                rec["continuation"] = " ".join(reversed(text.split())) + " and so on"
            f.write(json.dumps(rec) + "\n")
    return path


def save_fp8_checkpoint(family: str, path, block: int = 16, seed: int = 0):
    """`save_checkpoint` in bf16, then quantized in place as DeepSeek-V3's FP8 checkpoints are
    (`bench.precision_store.quantize_fp8_blocks`: routed experts, attention and dense MLPs of
    whole blocks; not the routers, embeddings or lm_head)."""
    from pathlib import Path

    from bench.precision_store import quantize_fp8_blocks

    return quantize_fp8_blocks(
        Path(save_checkpoint(family, path, seed, dtype=torch.bfloat16)), block
    )


def save_mxfp4_checkpoint(path, seed: int = 0, quantize: bool = True):
    """A tiny gpt_oss checkpoint in bf16 whose expert dims are whole 32-value blocks (hidden 64,
    intermediate 32), its experts then quantized in place as gpt-oss's MXFP4 checkpoints are
    (`bench.precision_store.quantize_mxfp4_experts`; `quantize=False`: left bf16)."""
    from pathlib import Path

    from bench.precision_store import quantize_mxfp4_experts

    path = Path(save_checkpoint("gpt_oss", path, seed, dtype=torch.bfloat16, hidden_size=64,
                                intermediate_size=32))  # fmt: skip
    return quantize_mxfp4_experts(path) if quantize else path


def save_int4_checkpoint(family: str, path, seed: int = 0, ignore=None, **config_overrides):
    """`save_checkpoint` in bf16 with expert dims the int4 kernel takes (moe_intermediate 32),
    its routed experts then written by the compressed-tensors library as Kimi-K2-Thinking's
    INT4 checkpoints are (`bench.precision_store.quantize_int4_experts`: pack-quantized W4A16,
    group 32, Kimi's ignore list unless `ignore` is given)."""
    from pathlib import Path

    from bench.precision_store import KIMI_IGNORE, quantize_int4_experts

    config_overrides.setdefault("moe_intermediate_size", 32)
    path = Path(save_checkpoint(family, path, seed, dtype=torch.bfloat16, **config_overrides))
    return quantize_int4_experts(path, KIMI_IGNORE if ignore is None else ignore)
