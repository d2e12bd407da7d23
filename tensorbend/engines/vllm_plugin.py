"""The vLLM plugin: `vllm serve` of a model larger than memory, a predictor live, counters.

Usage (tensorbend installed in vLLM's environment registers the entry point
`vllm.general_plugins: tensorbend = tensorbend.engines.vllm_plugin:register`):
    TENSORBEND_MAX_MEMORY=2GB TENSORBEND_COUNTERS=runs/counters \\
        vllm serve path/to/checkpoint --dtype float32 --enforce-eager   # experts offloaded
    TENSORBEND_PREDICTOR=ours_d1.safetensors TENSORBEND_COUNTERS=runs/counters TENSORBEND_EP=2 \\
        vllm serve path/to/checkpoint --dtype float32
    python -c "from tensorbend.engines.vllm_counters import read_counters, summary; \\
               print(summary(read_counters('runs/counters')[0]))"

Settings (environment, prefix TENSORBEND_; defaults in `PluginSettings`; the plugin does
nothing unless TENSORBEND_COUNTERS or TENSORBEND_MAX_MEMORY is set; a bad value stops vLLM
with one TensorbendError):
- TENSORBEND_MAX_MEMORY: bytes for the routed experts (8GB, 512MiB): vLLM then holds a pool
  of expert slots of that size instead of every expert, and reads misses from tensorbend's
  store (engines/vllm_offload.py); unset, vLLM holds every expert as usual
- TENSORBEND_IO: how expert reads treat the page cache (buffered, fadvise, direct)
- TENSORBEND_STORE_DIR: the root of the expert stores (as for `tensorbend generate`)
- TENSORBEND_STAGING_SLOTS: slots for misses the cache does not keep (default top_k); a
  layer needing more distinct experts than min(these, the cache's slots) runs in waves
- TENSORBEND_COUNTERS: directory the counters go to, one file per process `counters-rank{R}.json`
- TENSORBEND_PREDICTOR: a trained within-token predictor for the served model (optional:
  without it only the routing counts are kept)
- TENSORBEND_EP: expert-parallel degree the per-rank counts are sized for (default 1)
- TENSORBEND_FLUSH_S: seconds between writes of the counters file (default 1.0)
With TENSORBEND_MAX_MEMORY the cache is `tensorbend generate`'s (lfru, frequency admission);
with a predictor too, prefetch with Predicted eviction (`--policy prefetch`'s).

vLLM calls `register` in every process it starts (API server, engine core, workers). It wraps
`BaseModelLoader.load_model`, which every model loader inherits: the first model a process
loads (the served model, in the worker) gets the hooks of `tensorbend collect --engine vllm`
(engines/vllm_engine.py: every router's `select_experts`, every MoE decoder layer's input)
feeding a `ServeMeter` (engines/vllm_counters.py). A daemon thread writes the counters
atomically when they changed, at most every TENSORBEND_FLUSH_S seconds, and at exit.
"""

from __future__ import annotations

import atexit
import os
import threading
from dataclasses import dataclass, fields
from pathlib import Path

from tensorbend.errors import TensorbendError

PREFIX = "TENSORBEND_"


@dataclass(frozen=True)
class PluginSettings:
    counters: Path | None = None
    """Directory for the counters files."""
    max_memory: int | None = None
    """Bytes for the routed experts' slots; unset: vLLM holds every expert."""
    io: str = "buffered"
    """How expert reads treat the page cache: buffered, fadvise or direct."""
    store_dir: Path | None = None
    """Root of the expert stores."""
    staging_slots: int | None = None
    """Slots beside the cache for misses it does not keep (default top_k); a forward with
    more distinct experts in a layer than min(these, the cache's) runs in waves of them."""
    predictor: Path | None = None
    """A trained within-token predictor (`tensorbend train`) for the served model."""
    ep: int = 1
    """Expert-parallel degree the per-rank token counts are computed for."""
    flush_s: float = 1.0
    """Seconds between writes of the counters file."""

    @classmethod
    def from_env(cls, env=os.environ) -> PluginSettings:
        """The settings from TENSORBEND_* variables; one clear error for a bad value."""
        kw = {}
        for f in fields(cls):
            name = PREFIX + f.name.upper()
            raw = env.get(name, "").strip()
            if not raw:
                continue
            kind = {"ep": int, "flush_s": float, "io": str, "staging_slots": int}.get(f.name, Path)
            if f.name == "max_memory":
                from tensorbend.memory import parse_bytes

                kw[f.name] = parse_bytes(raw, name)
                continue
            try:
                kw[f.name] = kind(raw)
            except ValueError:
                raise TensorbendError(f"{name}={raw!r}: expected {kind.__name__}") from None
        s = cls(**kw)
        if s.ep < 1:
            raise TensorbendError(f"{PREFIX}EP={s.ep}: expected >= 1")
        if s.flush_s <= 0:
            raise TensorbendError(f"{PREFIX}FLUSH_S={s.flush_s}: expected > 0")
        if s.predictor is not None and not s.predictor.is_file():
            raise TensorbendError(f"{PREFIX}PREDICTOR={s.predictor}: no such file")
        if s.predictor is not None and s.counters is None and s.max_memory is None:
            raise TensorbendError(
                f"{PREFIX}PREDICTOR is set: set {PREFIX}COUNTERS (to measure it) or "
                f"{PREFIX}MAX_MEMORY (to prefetch with it) too"
            )
        from tensorbend.offload.store import IO_MODES

        if s.io not in IO_MODES:
            raise TensorbendError(f"{PREFIX}IO={s.io!r}: expected one of {', '.join(IO_MODES)}")
        return s


_installed = False


def register() -> None:
    """vLLM's general-plugin entry point: read the settings, wrap the model loader."""
    global _installed
    settings = PluginSettings.from_env()
    if (settings.counters is None and settings.max_memory is None) or _installed:
        return
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    if settings.max_memory is not None:
        from tensorbend.engines.vllm_offload import skip_expert_weights

        skip_expert_weights()

    load = BaseModelLoader.load_model

    def load_model(self, vllm_config, model_config, prefix: str = ""):
        model = load(self, vllm_config, model_config, prefix)
        if not getattr(BaseModelLoader, "_tensorbend_attached", False):
            BaseModelLoader._tensorbend_attached = True  # the served model, not a drafter
            attach(model, model_config.model, settings, _process_rank(vllm_config))
        return model

    BaseModelLoader.load_model = load_model
    _installed = True


def attach(model, checkpoint: str, settings: PluginSettings, rank: tuple[int, int]):
    """Hooks, meter, offload (with max_memory) and writer (with counters) on a loaded vLLM
    model; returns the ServeMeter."""
    from tensorbend.engines.vllm_counters import ServeMeter
    from tensorbend.engines.vllm_engine import VllmRouterHooks, flat_mla_rope, routers_only
    from tensorbend.models import describe_model
    from tensorbend.predictors.prefetch import Prefetcher
    from tensorbend.routers import model_fingerprint

    flat_mla_rope(model)  # vLLM 0.32 CPU's MLA rotary bug (vllm_engine's module note)
    routers = routers_only(Path(checkpoint))
    spec = describe_model(routers)
    fingerprint = model_fingerprint(routers, spec)
    pred = None
    if settings.predictor is not None:
        from tensorbend.predictors.checkpoint import load_predictor

        pred = load_predictor(settings.predictor, spec, fingerprint)
        if pred.lookahead is None:
            raise TensorbendError(
                f"{PREFIX}PREDICTOR={settings.predictor}: expected a within-token predictor"
            )
    header = {
        "model": checkpoint,
        "predictor": None if pred is None else str(settings.predictor),
        "lookahead": None if pred is None else pred.lookahead.name,
        "process": {"rank": rank[0], "world_size": rank[1]},
    }
    meter = ServeMeter(spec, Prefetcher(spec, predictor=pred), settings.ep, header)
    on_input = meter.on_layer_input if meter.pf.wants_layer_input else None
    hooks = VllmRouterHooks(model, spec, on_route=meter.on_route, on_layer_input=on_input)
    hooks.__enter__()  # for the process's life
    if settings.max_memory is not None:
        _offload(model, checkpoint, settings, meter, fingerprint, pred)
    if settings.counters is not None:
        path = settings.counters / f"counters-rank{rank[0]}.json"
        meter.write(path)
        _start_writer(meter, path, settings.flush_s)
    return meter


def _offload(model, checkpoint: str, settings: PluginSettings, meter, fingerprint: str, pred):
    from dataclasses import replace

    from tensorbend.cache.config import SERVING, PolicyConfig
    from tensorbend.engines.vllm_offload import OffloadSettings, VllmOffload

    policy = SERVING if pred is None else PolicyConfig("prefetch", admission="auto")
    policy = replace(policy, staging_slots=settings.staging_slots)
    cfg = OffloadSettings(settings.max_memory, settings.io, policy=policy)
    cfg = replace(cfg, store_dir=settings.store_dir)
    off = VllmOffload.attach(model, checkpoint, cfg, fingerprint, meter)
    meter.header["offload"] = {"max_memory": settings.max_memory, "io": settings.io}
    atexit.register(off.close)


def _start_writer(meter, path: Path, every_s: float) -> None:
    stop = threading.Event()

    def loop():
        while not stop.wait(every_s):
            if meter.dirty:
                meter.write(path)

    threading.Thread(target=loop, name="tensorbend-counters", daemon=True).start()
    atexit.register(lambda: (stop.set(), meter.write(path)))


def _process_rank(vllm_config) -> tuple[int, int]:
    """(rank, world size) of this worker among vLLM's tensor/pipeline/data-parallel workers."""
    pc = vllm_config.parallel_config
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    return getattr(pc, "rank", 0), getattr(pc, "world_size", 1)
