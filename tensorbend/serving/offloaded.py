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

import errno
import importlib
import sys
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch

from tensorbend.cache.config import POLICIES, SERVING, PolicyConfig, min_slots
from tensorbend.errors import StoreError, TensorbendError, TensorbendWarning
from tensorbend.memory import (
    check_device,
    kv_bytes_per_token,
    parse_bytes,
    physical_bytes,
    rss_bytes,
)
from tensorbend.models import RoutingSpec, moe_block
from tensorbend.offload.expert_plan import ExpertPlan, build_store
from tensorbend.offload.handle import AttachOptions, OffloadHandle, stored_dtype
from tensorbend.offload.int4 import Int4
from tensorbend.offload.precision import dtype_name, resolve_dtype
from tensorbend.offload.shards import Checkpoint
from tensorbend.offload.store import (
    ExpertLayout,
    ExpertStore,
    IOMode,
    StoreConfig,
    store_header,
    stride,
)
from tensorbend.predictors.spec import NEEDS_TRACE, PEERS, PredictorSpec
from tensorbend.serving.model_build import build_without_experts, load_non_experts
from tensorbend.serving.stores import check_room, stale_sources, store_lock, store_path, unwritable

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
"""--reserve auto's part beside the KV cache: activations, the allocator's retained heap and
the I/O threads' arenas (what the serving bench's runs use of the reserve: docs/results/serve_memory.md)."""

MEASURE_GRAIN = 16 * 10**6
"""The measured model part is rounded up to this: it varies by a few MB from run to run
(the serving bench's range: docs/results/serve_memory.md), which would otherwise move the cache by an
expert between runs."""


@dataclass(frozen=True)
class ServeConfig:
    """How `load_offloaded` (and `tensorbend generate`) places a model."""

    max_memory: str | None = None
    """Memory budget for the model on --device, with a unit (8GB, 512MiB; 100B for bytes):
    non-expert weights + expert cache + staging + --reserve. The natural way to size the cache;
    overrides --cache-frac. (Python: also an int of bytes, or accelerate's {device: size})"""
    reserve: str = "auto"
    """Part of --max-memory kept for the KV cache and activations: a size, or auto (the KV
    cache of 2048 tokens at batch 1 from config.json, + 64 MB)."""
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
    prediction: PredictorSpec = field(default_factory=PredictorSpec)
    """What predicts for --policy prefetch (--predictor or --baseline, --horizon,
    --prefetch-extra)."""
    progress: bool = field(default=True, metadata={"cli": False})
    """Progress bar while the store is built."""
    offload: PolicyConfig = field(default_factory=lambda: SERVING)
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
        if self.io_threads < 1:
            raise TensorbendError(f"--io-threads {self.io_threads}: expected a count >= 1")
        StoreConfig(self.io)
        pol = self.offload.policy
        if not POLICIES[pol].bounded or POLICIES[pol].recorded_routing:  # resident, oracle
            raise TensorbendError(
                f"--policy {pol}: not a serving policy (it needs a resident reference run); "
                f"use `tensorbend run` to measure it, or lru, lfu, lfru, on_demand, prefetch"
            )
        self.prediction.check_policy(pol)
        if self.prediction.baseline in NEEDS_TRACE:
            raise TensorbendError(
                f"--baseline {self.prediction.baseline}: expected a peer that needs no trace "
                f"when serving ({', '.join(b for b in PEERS if b not in NEEDS_TRACE)}); "
                f"measure table peers with `tensorbend run --trace DIR`"
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
    rss0 = _rss_after_baseline_imports() if cfg.device == "cpu" else None
    ckpt = Checkpoint.open(path)
    dtype = resolve_dtype(cfg.dtype, path, ckpt)
    lm, spec, layout = build_without_experts(path, dtype)
    layout = replace(layout, block=store_format(cfg, ckpt.block))  # (see `store_format`)
    if isinstance(layout.block, Int4):
        layout.block.check_parts(layout.parts)
    plan = ExpertPlan.of(ckpt, lm, spec, layout)
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
    pc, mem = _size_cache(cfg, lm, spec, layout, loaded)  # (the budget: before a store byte)
    store = store_path(cfg.store_dir, path, _store_tag(layout.block, dtype))
    _ensure_store(plan, store, fingerprint, layout, cfg.progress)
    opts = AttachOptions(io=cfg.io, io_threads=cfg.io_threads)
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
    return lm


def memory_plan(
    cfg: ServeConfig,
    non_expert_bytes: int,
    spec: RoutingSpec,
    expert_bytes: int,
    kv_bytes: int,
    loaded_bytes: int | None = None,
) -> dict:
    """Where --max-memory goes, in bytes: {budget, non_expert, model, staging, reserve, cache};
    `cache` (what is left) becomes slots only at the slot table (`PolicyConfig.slots`). Raises
    when the budget cannot hold the fewest slots the cache runs with (`cache.config.min_slots`).
    kv_bytes: the KV cache per token (what --reserve auto sizes). Staging: the slots a
    bypassed miss is computed from (`--staging-slots`, default top-k; `--io direct` reads
    land in the aligned slots themselves: its bounce buffers hold one 4 KB block per I/O
    thread, inside the reserve). loaded_bytes:
    on CPU, how much the process's resident set grew while the model was built without its
    experts and the predictors loaded (the model's modeling code and Python objects, the
    predictors' weights, beside its tensors): charged as the model's part when it exceeds the
    non-expert tensors' bytes."""
    budget = parse_bytes(cfg.max_memory)
    model = max(non_expert_bytes, loaded_bytes or 0)
    what = f"non-expert weights {_mb(non_expert_bytes)}"
    if model > non_expert_bytes:
        what = f"the model without its experts {_mb(model)} (measured; its tensors "
        what += f"{_mb(non_expert_bytes)})"
    auto = 2048 * kv_bytes + RESERVE_FIXED
    reserve = auto if cfg.reserve == "auto" else parse_bytes(cfg.reserve, "--reserve")
    staging = cfg.offload.staging(spec.top_k) * expert_bytes
    need = min_slots(spec.top_k, spec.num_moe_layers, cfg.offload.pool)
    minimum = model + staging + reserve + need * expert_bytes
    if budget < minimum:
        raise TensorbendError(
            f"--max-memory {cfg.max_memory}: expected at least {_mb(minimum)} = {what} + "
            f"staging {_mb(staging)} + --reserve {_mb(reserve)} + {need} cached experts "
            f"of {_mb(expert_bytes)}; raise it"
        )
    return {
        "budget": budget,
        "non_expert": non_expert_bytes,
        "model": model,
        "staging": staging,
        "reserve": reserve,
        "cache": budget - model - staging - reserve,
    }


def store_format(cfg: ServeConfig, block):
    """The store's `ExpertLayout.block` for a checkpoint whose own is `block` (None, fp8's, MXFP4
    or Int4): as it is, or Int4 for --store-dtype int4; an Int4 store in the kernel's packing
    when slots hold int4 (--slots), else in compressed-tensors'. Refuses what does not apply."""
    if cfg.store_dtype == "int4":
        if block is not None:
            raise TensorbendError(
                f"--store-dtype int4: expected an unquantized checkpoint, found experts stored in "
                f"{stored_dtype(block, None)}, which are served in their own format; drop "
                f"--store-dtype"
            )
        block = Int4(32)
    if not isinstance(block, Int4):
        if cfg.slots == "int4":
            raise TensorbendError(
                "--slots int4: expected an int4 store (a compressed-tensors int4 checkpoint, or "
                "--store-dtype int4), found none; add --store-dtype int4 or drop --slots"
            )
        return block
    cpu = torch.device(cfg.device).type == "cpu"
    if cfg.slots == "int4" and not cpu:
        raise TensorbendError(
            f"--slots int4 on {cfg.device}: expected --device cpu (torch's CPU int4 kernel); "
            f"use --slots dense on {cfg.device} (what --slots auto picks there)"
        )
    return replace(block, packing="cpu" if cpu and cfg.slots != "dense" else "ct")


# ------------------------------------------------------------ helpers


def _store_tag(block, dtype: torch.dtype) -> str:
    """What a store's file is named for: fp8, mxfp4 (its biases bf16; else -DTYPE), int4 (in
    compressed-tensors' packing) or int4-cpu (in the CPU kernel's), a dtype."""
    if isinstance(block, Int4):
        return "int4" if block.packing == "ct" else f"int4-{block.packing}"
    name = str(dtype).removeprefix("torch.")
    if block == "mxfp4":
        return "mxfp4" if dtype == torch.bfloat16 else f"mxfp4-{name}"
    return "fp8" if block else name


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


def _ensure_store(plan, store: Path, fingerprint: str, layout: ExpertLayout, progress) -> None:
    """Reuse the store when it holds this checkpoint's experts as they are now (its model
    fingerprint, the checkpoint's headers, layout, and the expert bytes: `ExpertStore.check`,
    `stores.stale_sources`); otherwise build it (again), once its folder is writable and its
    disk has room (`stores.check_room`). One process at a time (`stores.store_lock`)."""
    check_room(store, None)
    with store_lock(store, progress):  # (a second process waits here, then reuses the store)
        _check_or_build(plan, store, fingerprint, layout, progress)


def _check_or_build(plan, store: Path, fingerprint: str, layout: ExpertLayout, progress) -> None:
    spec, ident = plan.spec, {"fingerprint": fingerprint, "checkpoint": plan.ckpt.identity()}
    why = None
    if store.is_file():
        try:
            found = ExpertStore.open(store)
            found.check(ident, spec.num_moe_layers, spec.num_experts, layout)  # (closes it)
        except StoreError:
            why = "it is unfinished, of an older format or of another model or checkpoint"
        else:
            found.close()
            why = stale_sources(plan, store)
            if why is None:
                return
        if progress:
            print(f"expert store {store}: building it again ({why})", file=sys.stderr)
    meta = {**ident, "family": spec.family, "source": str(plan.ckpt.directory)}
    L, E = spec.num_moe_layers, spec.num_experts
    check_room(store, len(store_header(L, E, layout, meta)) + L * E * stride(layout.stored_nbytes))
    try:
        build_store(plan, store, meta, layout.dtype, progress)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise StoreError(f"expert store {store}: {unwritable(e)}") from e


def _size_cache(
    cfg: ServeConfig, lm, spec: RoutingSpec, layout: ExpertLayout, loaded: int | None
) -> tuple[PolicyConfig, dict | None]:
    if cfg.max_memory is None:
        return cfg.offload, None
    non_expert = sum(
        p.numel() * p.element_size() for p in lm.parameters() if p.device.type != "meta"
    )
    non_expert += sum(b.numel() * b.element_size() for b in lm.buffers())
    kv = kv_bytes_per_token(lm.config, layout.dtype)
    plan = memory_plan(cfg, non_expert, spec, layout.nbytes, kv, loaded)
    return replace(cfg.offload, cache_bytes=plan["cache"]), plan


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


def _rss_after_baseline_imports() -> int | None:
    """The resident set once BASELINE_MODULES are imported (transformers imports its modeling
    and generation code lazily: that is the baseline's, not the model's)."""
    for name in BASELINE_MODULES:
        importlib.import_module(name)
    return rss_bytes()


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
