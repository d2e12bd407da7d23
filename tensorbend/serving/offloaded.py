"""Serve an MoE model that does not fit in memory: its routed experts stay on disk in an expert
store, a bounded cache holds the ones in use, and `model.generate()` works unchanged.

Usage:
    >>> import tensorbend                                                  # doctest: +SKIP
    >>> model = tensorbend.load_offloaded("path/to/checkpoint", max_memory="8GB")   # doctest: +SKIP
    >>> out = model.generate(input_ids, max_new_tokens=32)                 # doctest: +SKIP
    >>> model.tensorbend.counters()["decode"]["bytes_read_per_token"]      # doctest: +SKIP
    >>> model.tensorbend.close()                                           # doctest: +SKIP

What happens, in order, and what lives in memory at each step:
1. The model is built from its config with the routed experts' parameters on the `meta`
   device (never allocated); every other weight is read from the checkpoint's shards (keys
   mapped by transformers' own conversion table). Peak: the non-expert weights.
2. The expert store is built from the checkpoint by streaming one expert at a time
   (`offload/expert_plan.py`: resumable, fsync'd per layer) unless a finished store for this
   checkpoint exists, as its experts are now (`stores.py`: one builder at a time; a store of
   other bytes, fingerprint or headers is built again).
3. The cache gets what the budget leaves: `max_memory` - the model without its experts (its
   tensors, or on CPU what loading it and the predictors added to the resident set, if more:
   modeling code, Python objects, the predictors' weights) - the staging slots (top-k) -
   `reserve` (KV cache and activations), in whole experts; or `cache_frac` of all routed
   experts. `offload/handle.py` attaches it, with the I/O threads, the policy and
   the predictors, to the model in place; counters are on `model.tensorbend`.
Greedy outputs equal the resident model's exactly (tests per family); prediction changes
only what is read when.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch

from tensorbend.cache.config import POLICIES, SERVING, PolicyConfig
from tensorbend.errors import TensorbendError, TensorbendWarning
from tensorbend.memory import (
    check_device,
    parse_bytes,
    physical_bytes,
    rss_bytes,
)
from tensorbend.models import RoutingSpec, moe_block
from tensorbend.offload.expert_plan import ExpertPlan
from tensorbend.offload.handle import AttachOptions, OffloadHandle
from tensorbend.offload.int4 import Int4
from tensorbend.offload.precision import dtype_name, resolve_dtype
from tensorbend.offload.shards import Checkpoint
from tensorbend.offload.store import (
    IOMode,
    StoreConfig,
)
from tensorbend.predictors.spec import NEEDS_TRACE, PEERS, PredictorSpec
from tensorbend.serving.budget import (  # noqa: F401  (IMPORT_BASELINE, memory_plan: public)
    CONTEXT_TOKENS,
    IMPORT_BASELINE,
    MEASURE_GRAIN,
    PREFILL_CHUNK,
    memory_plan,
    rss_after_baseline_imports,
    size_cache,
)
from tensorbend.serving.model_build import build_without_experts, load_non_experts
from tensorbend.serving.stores import ensure_store, store_format, store_path, store_tag

SERVED_POLICIES = tuple(
    p for p in POLICIES if POLICIES[p].bounded and not POLICIES[p].recorded_routing
)
"""The policies serving runs (resident and oracle need a resident reference: `measure`)."""
SERVED_PEERS = tuple(b for b in PEERS if b not in NEEDS_TRACE)
"""The peers --baseline builds when serving (the table peers need a trace: `measure`)."""


@dataclass(frozen=True)
class ServeConfig:
    """How `load_offloaded` (and `tensorbend generate`) places a model."""

    max_memory: str | None = None
    """Memory budget for the model on --device, with a unit (8GB, 512MiB; 100B for bytes):
    non-expert weights + expert cache + staging + --reserve. The natural way to size the cache;
    overrides --cache-frac. (Python: also an int of bytes, or accelerate's {device: size})"""
    reserve: str = "auto"
    """Part of --max-memory kept for the KV cache and activations: a size, or auto (for
    --context-tokens at batch 1: their KV cache from config.json, the attention scores of one
    512-token prefill chunk against them, + 64 MB; + 64 MB more for oneDNN where experts
    compute in bf16 or fp16 on CPU)."""
    context_tokens: int = CONTEXT_TOKENS
    """Tokens per sequence (prompt + new) that --reserve auto keeps room for; a longer
    sequence is refused. `generate` sets it from its longest prompt + --max-new-tokens."""
    device: str = "cpu"
    """Where the model and the expert cache live: cpu or cuda[:N] (experts are read into pinned
    host staging and copied on their own stream)."""
    dtype: str = "auto"
    """Precision the model is served in, the store keeping the experts in it: auto (the
    checkpoint's own: config.json's dtype, else its tensors'), float32 (fp32), float16 (fp16)
    or bfloat16 (bf16); the Python API takes torch dtypes too."""
    store_dtype: Literal["auto", "int4"] = "auto"
    """What the store keeps of each expert: auto (the checkpoint's own: its dtype, fp8 blocks,
    mxfp4 or compressed-tensors int4) or int4 (an unquantized checkpoint quantized
    round-to-nearest, symmetric, a bf16 scale per 32 inputs, in compressed-tensors' format:
    0.28x a bf16 expert; it changes the output a little, as any 4-bit quant does)."""
    slots: Literal["auto", "int4", "dense"] = "auto"
    """What a cache slot holds of an int4 store's expert: int4 (0.31x a bf16 slot, computed by
    torch's int4 kernel; cpu), dense (dequantized into --dtype as it loads) or auto (int4 on
    cpu, dense on cuda)."""
    store_dir: Path | None = None
    """Root folder of the expert stores (each built once, reused), one folder per checkpoint
    inside; default: $TENSORBEND_STORE_DIR or ~/.cache/tensorbend/stores."""
    io: IOMode = "buffered"
    """How expert reads treat the page cache: buffered, fadvise (drop pages after each read)
    or direct (O_DIRECT: every read comes from the disk)."""
    io_threads: int = 2
    """I/O threads reading experts."""
    prediction: PredictorSpec = field(
        default_factory=PredictorSpec, metadata={"group": "prediction"}
    )
    """What predicts for --policy prefetch (--predictor or --baseline, --horizon,
    --prefetch-extra)."""
    progress: bool = field(default=True, metadata={"cli": False})
    """Progress bar while the store is built."""
    offload: PolicyConfig = field(
        default_factory=lambda: SERVING, metadata={"group": "cache policy"}
    )
    """Policy and cache options (--policy, --cache-frac, --pool, --admission, ...); default
    `cache.config.SERVING`: lfru with frequency admission (auto)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))  # (torch.bfloat16 -> name)
        if isinstance(self.device, torch.device):  # (the Python API's own device type)
            object.__setattr__(self, "device", str(self.device))
        check_device(self.device)
        if isinstance(self.max_memory, dict):  # accelerate's {device: size}: this device's
            object.__setattr__(self, "max_memory", _budget_of(self.max_memory, self.device))
        if self.max_memory is not None:
            parse_bytes(self.max_memory)
        if self.reserve != "auto":
            parse_bytes(self.reserve, "--reserve")
        if self.context_tokens < 1:
            raise TensorbendError(
                f"--context-tokens {self.context_tokens}: expected a count of tokens >= 1"
            )
        if self.io_threads < 1:
            raise TensorbendError(f"--io-threads {self.io_threads}: expected a count >= 1")
        StoreConfig(self.io)
        pol = self.offload.policy
        if pol not in SERVED_POLICIES:  # resident, oracle
            raise TensorbendError(
                f"--policy {pol}: not a serving policy (it needs a resident reference run); "
                f"use `tensorbend measure` to measure it, or {', '.join(SERVED_POLICIES)}"
            )
        self.prediction.check_policy(pol)
        if self.prediction.baseline in NEEDS_TRACE:
            raise TensorbendError(
                f"--baseline {self.prediction.baseline}: expected a peer that needs no trace "
                f"when serving ({', '.join(SERVED_PEERS)}); "
                f"measure table peers with `tensorbend measure --trace DIR`"
            )


def load_offloaded(model: str | Path, cfg: ServeConfig | None = None, **overrides):
    """Load `model` (a local checkpoint directory or zoo:NAME) with its routed experts offloaded.

    Returns the transformers CausalLM; `model.tensorbend` is its `OffloadHandle` (counters,
    reset, close). Keyword overrides set ServeConfig fields, and the fields of its nested
    PolicyConfig (`policy`, `cache_frac`, `pool`, `admission`, ...) and PredictorSpec
    (`predictor`, `baseline`, `horizon`, `prefetch_extra`) directly:
    `load_offloaded(path, max_memory="8GB", policy="prefetch", predictor="d1.safetensors")`,
    or `baseline="spec_gate"` (the next layer's router on the current router input). Without
    them the cache is `cache.config.SERVING`: lfru with frequency admission.
    """
    cfg = _with_overrides(cfg or ServeConfig(), overrides)
    _warn_above_physical(cfg)
    from tensorbend.zoo import resolve_model

    path = resolve_model(str(model))
    rss0 = rss_after_baseline_imports() if cfg.device == "cpu" else None
    lm, spec, layout, plan, store = plan_store(path, cfg)
    load_non_experts(lm, plan)
    for m in range(spec.num_moe_layers):  # the meta parameters go: weights live in the store
        for name, _ in layout.parts:
            setattr(getattr(moe_block(lm, spec, m), spec.experts_attr), name, None)
    from tensorbend.routers import model_fingerprint

    fingerprint = model_fingerprint(lm, spec)
    lm.to(cfg.device).eval()
    predictor, horizon = _predictors(cfg, lm, spec, fingerprint)  # (refused before a store build)
    grown = None if rss0 is None else rss_bytes() - rss0  # (rss0 is None off Linux too)
    loaded = None if grown is None else -(-grown // MEASURE_GRAIN) * MEASURE_GRAIN
    pc, mem = size_cache(cfg, lm, spec, layout, loaded)  # (the budget: before a store byte)
    ensure_store(plan, store, fingerprint, layout, cfg.progress)
    guard = mem is not None and cfg.reserve == "auto"  # (the reserve holds this many tokens)
    opts = AttachOptions(
        io=cfg.io, io_threads=cfg.io_threads, max_tokens=cfg.context_tokens if guard else None
    )
    lm.tensorbend = OffloadHandle(
        lm,
        spec,
        layout,
        store,
        pc,
        predictor,
        horizon,
        opts,
        prefetch_extra=cfg.prediction.prefetch_extra,
    )
    if mem is not None:  # what the slots hold (the rest of the budget: less than one expert)
        mem["cache"] = lm.tensorbend.cache.capacity * layout.nbytes
        if grown is not None:
            mem["measured"] = grown  # the growth itself, before rounding up
    lm.tensorbend.memory_plan = mem  # where --max-memory went (bytes), or None
    lm.generation_config.prefill_chunk_size = PREFILL_CHUNK  # activations bounded by a chunk
    return lm


def plan_store(path: Path, cfg: ServeConfig):
    """(model built without its experts, spec, expert layout, ExpertPlan, store path) of the
    checkpoint directory `path` as `cfg` serves it: its dtype and store dtype (`store_format`),
    the store under `cfg.store_dir`. Nothing is read but headers and config; nothing is built."""
    ckpt = Checkpoint.open(path)
    dtype = resolve_dtype(cfg.dtype, path, ckpt)
    lm, spec, layout = build_without_experts(path, dtype)
    layout = replace(layout, block=store_format(cfg, ckpt.block))  # (see `store_format`)
    if isinstance(layout.block, Int4):
        layout.block.check_parts(layout.parts)
    plan = ExpertPlan.of(ckpt, lm, spec, layout)
    return lm, spec, layout, plan, store_path(cfg.store_dir, path, store_tag(layout.block, dtype))


# ------------------------------------------------------------ helpers


def _with_overrides(cfg: ServeConfig, overrides: dict) -> ServeConfig:
    """cfg with `overrides` set: ServeConfig's own fields, or those of its nested configs."""
    top, nested, unknown = {}, {"offload": {}, "prediction": {}}, []
    for k, v in overrides.items():
        home = [n for n in nested if k in type(getattr(cfg, n)).__dataclass_fields__]
        if k in ServeConfig.__dataclass_fields__:
            top[k] = v
        elif home:
            nested[home[0]][k] = v
        else:
            unknown.append(k)
    if unknown:
        raise TensorbendError(
            f"load_offloaded: unknown option(s) {sorted(unknown)}; expected fields of "
            f"ServeConfig, PolicyConfig or PredictorSpec"
        )
    for name, fields in nested.items():
        if fields:
            top[name] = replace(top.get(name, getattr(cfg, name)), **fields)
    return replace(cfg, **top)


def _budget_of(max_memory: dict, device: str):
    """The entry of an accelerate-style max_memory dict for `device` (cpu: "cpu"; cuda:N: N,
    "cuda:N", or "cuda" for N = 0)."""
    index = torch.device(device).index or 0
    keys = ("cpu",) if device == "cpu" else (index, f"cuda:{index}") + ("cuda",) * (index == 0)
    for k in keys:
        if k in max_memory:
            return max_memory[k]
    raise TensorbendError(
        f"max_memory {max_memory!r}: expected a size, or a dict with an entry for the serving "
        f"device {device} (key {' or '.join(map(repr, keys))}); found keys "
        f'{list(max_memory)}; pass max_memory="8GB" or add the device\'s entry'
    )


def _warn_above_physical(cfg: ServeConfig) -> None:
    """A warning (not an error: the machine may swap, or report less than it has) when
    --max-memory is more than the device's physical memory."""
    have = None if cfg.max_memory is None else physical_bytes(cfg.device)
    if have is not None and parse_bytes(cfg.max_memory) > have:
        warnings.warn(
            f"--max-memory {cfg.max_memory}: expected at most the {have / 1e9:.1f} GB of "
            f"physical memory on {cfg.device}, found more; the cache is sized for memory that "
            f"is not there (expect swapping or an out-of-memory kill): lower it",
            TensorbendWarning,
            stacklevel=3,
        )


def _predictors(cfg: ServeConfig, lm, spec: RoutingSpec, fingerprint: str):
    """The --predictor (or --baseline, built from the model's routers at --lookahead) and
    --horizon checkpoints, each for this model (PredictorSpec checked their places)."""
    from tensorbend.predictors.checkpoint import load_predictor

    pc = cfg.prediction
    within, horizon = (
        None if p is None else load_predictor(p, spec, fingerprint)
        for p in (pc.predictor, pc.horizon)
    )
    if pc.baseline is not None:
        from tensorbend.predictors.registry import build_baseline
        from tensorbend.routers import router_params

        params = router_params(lm, spec)
        within = build_baseline(pc.baseline, spec, cfg.offload.lookahead, router_params=params)
    return within, horizon
