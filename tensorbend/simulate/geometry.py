"""Model geometry profiles: how many MoE layers and experts a model has, and how many bytes they are.

Usage:
    >>> g = get_geometry("kimi-k2.5")
    >>> g.num_moe_layers, g.num_experts, g.top_k, round(g.expert_bytes() / 1e6, 1)
    (60, 384, 8, 24.8)
    >>> round(g.expert_bytes("bf16") / 1e6, 1)
    88.1

Sizes come from each model's released `config.json` (the `source` field). Per MoE layer:
  - routed expert (SwiGLU): 3 x hidden x moe_intermediate weights (+ biases for gpt-oss), stored
    in `dtype`: bf16 2 bytes/weight, fp8 1 (+ fp32 scale per 128x128 block), int4 0.5 (+ bf16
    scale per 32), mxfp4 0.5 (+ 1-byte scale per 32). `native` is the released checkpoint's.
  - resident per MoE layer: attention (parameter count from the config's head sizes, formula in
    `_attn_*`), shared experts, router, in `other_dtype`; plus per token the dense layers
    (first_k_dense_replace) and the LM head.
`from-trace` takes layers / experts / top-k from the trace; its bytes and compute come from a
calibration file (costs.py), since a routing trace does not know them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, get_args

from tensorbend.errors import TensorbendError

GeometryName = Literal[
    "kimi-k2.5",
    "deepseek-v3",
    "qwen3-235b-a22b",
    "qwen3-30b-a3b",
    "mixtral-8x22b",
    "gpt-oss-120b",
    "from-trace",
]
GEOMETRY_NAMES = get_args(GeometryName)
ExpertDtype = Literal["native", "bf16", "fp8", "int4", "mxfp4"]
BYTES_PER_WEIGHT = {
    "bf16": 2.0,
    "fp8": 1.0 + 4 / (128 * 128),
    "int4": 0.5 + 2 / 32,
    "mxfp4": 0.5 + 1 / 32,
}


@dataclass(frozen=True)
class Geometry:
    name: str
    source: str  # the config.json the sizes come from
    num_moe_layers: int
    num_dense_layers: int
    num_experts: int
    top_k: int
    num_shared_experts: int
    hidden_size: int
    moe_intermediate_size: int
    dense_intermediate_size: int
    attn_params: int  # per decoder layer
    vocab_size: int
    native_dtype: str  # routed experts as released
    other_dtype: str  # attention, shared experts, dense layers, head
    expert_biases: bool = False
    expert_bytes_override: int | None = None  # from-trace: the calibration's measured size

    def expert_params(self) -> int:
        D, inter = self.hidden_size, self.moe_intermediate_size
        return 3 * D * inter + (3 * inter if self.expert_biases else 0)

    def expert_bytes(self, dtype: str = "native") -> int:
        if self.expert_bytes_override is not None:
            return self.expert_bytes_override
        d = self.native_dtype if dtype == "native" else dtype
        return int(self.expert_params() * BYTES_PER_WEIGHT[d])

    def layer_static_params(self) -> int:
        """Weights every token reads in a MoE layer besides its routed experts."""
        shared = self.num_shared_experts * 3 * self.hidden_size * self.moe_intermediate_size
        return self.attn_params + shared + self.num_experts * self.hidden_size

    def layer_static_bytes(self) -> int:
        return int(self.layer_static_params() * BYTES_PER_WEIGHT[self.other_dtype])

    def forward_static_bytes(self) -> int:
        """Per forward, outside the MoE layers: dense decoder layers and the LM head."""
        dense = self.num_dense_layers * (
            self.attn_params + 3 * self.hidden_size * self.dense_intermediate_size
        )
        return int(
            (dense + self.vocab_size * self.hidden_size) * BYTES_PER_WEIGHT[self.other_dtype]
        )

    def to_json(self, dtype: str = "native") -> dict:
        return {
            **asdict(self),
            "expert_dtype": self.native_dtype if dtype == "native" else dtype,
            "expert_bytes": self.expert_bytes(dtype),
            "layer_static_bytes": self.layer_static_bytes(),
            "forward_static_bytes": self.forward_static_bytes(),
        }


def get_geometry(name: str) -> Geometry:
    if name == "from-trace":
        raise TensorbendError(
            "geometry from-trace is built from a trace: use Geometry sizes of the trace"
        )
    if name not in GEOMETRIES:
        raise TensorbendError(f"--geometry {name!r}: expected one of {', '.join(GEOMETRY_NAMES)}")
    return GEOMETRIES[name]


def geometry_from_trace(spec, expert_bytes: int, source: str) -> Geometry:
    """`from-trace`: the trace's layers, experts, top-k; bytes from a calibration."""
    return Geometry(
        "from-trace",
        source,
        num_moe_layers=spec.num_moe_layers,
        num_dense_layers=0,
        num_experts=spec.num_experts,
        top_k=spec.top_k,
        num_shared_experts=spec.num_shared_experts,
        hidden_size=0,
        moe_intermediate_size=0,
        dense_intermediate_size=0,
        attn_params=0,
        vocab_size=0,
        native_dtype="bf16",
        other_dtype="bf16",
        expert_bytes_override=expert_bytes,
    )


def _attn_mla(D: int, heads: int, q_lora: int, kv_lora: int, nope: int, rope: int, v: int) -> int:
    """DeepSeek-V3 multi-head latent attention: q_a, q_b, kv_a (with rope key), kv_b, o."""
    return (
        D * q_lora
        + q_lora * heads * (nope + rope)
        + D * (kv_lora + rope)
        + kv_lora * heads * (nope + v)
        + heads * v * D
    )


def _attn_gqa(D: int, heads: int, kv_heads: int, head_dim: int, bias: bool = False) -> int:
    """q, k, v, o projections (grouped-query attention)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return D * q + 2 * D * kv + q * D + ((q + 2 * kv + D + heads) if bias else 0)


_HF = "https://huggingface.co/{}/blob/main/config.json"
GEOMETRIES: dict[str, Geometry] = {
    "kimi-k2.5": Geometry(
        "kimi-k2.5",
        _HF.format("moonshotai/Kimi-K2.5")
        + " (text_config; experts INT4 group 32, attention and shared experts bf16)",
        num_moe_layers=60,
        num_dense_layers=1,
        num_experts=384,
        top_k=8,
        num_shared_experts=1,
        hidden_size=7168,
        moe_intermediate_size=2048,
        dense_intermediate_size=18432,
        attn_params=_attn_mla(7168, 64, 1536, 512, 128, 64, 128),
        vocab_size=163840,
        native_dtype="int4",
        other_dtype="bf16",
    ),
    "deepseek-v3": Geometry(
        "deepseek-v3",
        _HF.format("deepseek-ai/DeepSeek-V3") + " (FP8 weights, 128x128 block scales)",
        num_moe_layers=58,
        num_dense_layers=3,
        num_experts=256,
        top_k=8,
        num_shared_experts=1,
        hidden_size=7168,
        moe_intermediate_size=2048,
        dense_intermediate_size=18432,
        attn_params=_attn_mla(7168, 128, 1536, 512, 128, 64, 128),
        vocab_size=129280,
        native_dtype="fp8",
        other_dtype="fp8",
    ),
    "qwen3-235b-a22b": Geometry(
        "qwen3-235b-a22b",
        _HF.format("Qwen/Qwen3-235B-A22B"),
        num_moe_layers=94,
        num_dense_layers=0,
        num_experts=128,
        top_k=8,
        num_shared_experts=0,
        hidden_size=4096,
        moe_intermediate_size=1536,
        dense_intermediate_size=0,
        attn_params=_attn_gqa(4096, 64, 4, 128),
        vocab_size=151936,
        native_dtype="bf16",
        other_dtype="bf16",
    ),
    "qwen3-30b-a3b": Geometry(
        "qwen3-30b-a3b",
        _HF.format("Qwen/Qwen3-30B-A3B"),
        num_moe_layers=48,
        num_dense_layers=0,
        num_experts=128,
        top_k=8,
        num_shared_experts=0,
        hidden_size=2048,
        moe_intermediate_size=768,
        dense_intermediate_size=0,
        attn_params=_attn_gqa(2048, 32, 4, 128),
        vocab_size=151936,
        native_dtype="bf16",
        other_dtype="bf16",
    ),
    "mixtral-8x22b": Geometry(
        "mixtral-8x22b",
        _HF.format("mistralai/Mixtral-8x22B-v0.1"),
        num_moe_layers=56,
        num_dense_layers=0,
        num_experts=8,
        top_k=2,
        num_shared_experts=0,
        hidden_size=6144,
        moe_intermediate_size=16384,
        dense_intermediate_size=0,
        attn_params=_attn_gqa(6144, 48, 8, 128),
        vocab_size=32000,
        native_dtype="bf16",
        other_dtype="bf16",
    ),
    "gpt-oss-120b": Geometry(
        "gpt-oss-120b",
        _HF.format("openai/gpt-oss-120b") + " (experts MXFP4, attention bf16)",
        num_moe_layers=36,
        num_dense_layers=0,
        num_experts=128,
        top_k=4,
        num_shared_experts=0,
        hidden_size=2880,
        moe_intermediate_size=2880,
        dense_intermediate_size=0,
        attn_params=_attn_gqa(2880, 64, 8, 64, bias=True),
        vocab_size=201088,
        native_dtype="mxfp4",
        other_dtype="bf16",
        expert_biases=True,
    ),
}
