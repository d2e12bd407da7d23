"""Experts larger than memory inside vLLM: a bounded pool of slots under vLLM's own CPU kernel.

Usage (the plugin does this when TENSORBEND_MAX_MEMORY is set; engines/vllm_plugin.py):
    skip_expert_weights()                    # before vLLM loads: its loader reads no expert
    off = VllmOffload.attach(model, checkpoint, cfg, meter, rank)    # after: store, slots, I/O
    off.counters()                           # hits, misses, bytes, stall per layer; slots

What changes in vLLM, each through a point it offers:
- Loading: the expert-parallel weight filter (`DefaultModelLoader.local_expert_ids`, which
  skips experts a rank does not hold before reading them) is set to "no expert here", and
  every fused-MoE layer's `w13_weight` / `w2_weight` is cut to one expert before vLLM's
  `process_weights_after_loading`: the full [E, ...] tensors are never written, so never
  resident. The routed experts stay in tensorbend's store (offload/store.py), built once from
  the checkpoint's shards: the store `tensorbend generate` uses.
- Slots: one pool of C slots per model, shared by every MoE layer: `w13_weight` [C, 2I', D]
  and `w2_weight` [C, D, I'] as vLLM's CPU experts keep them (the intermediate size padded to
  the kernel's alignment, then `cpu_prepack_moe_weight`, the experts' own
  `process_weights_after_loading` run on one expert). Prepacking is per expert, so a slot
  packed alone equals that expert's row of the whole tensor's prepack (tested).
- Compute: each layer's `RoutedExperts.forward_modular` gets the router's global ids. The
  layer's distinct experts are claimed in the cache (offload/cache.py: the policy, pins,
  waiting), misses read by the I/O threads (offload/loader.py) and packed into their slot
  there, then vLLM's kernel runs once with the ids remapped to slots (vLLM's `expert_map`
  convention: global id -> slot). A forward needing more distinct experts than
  `wave` = min(resident slots, staging slots) runs in waves of `wave` experts: each wave's
  kernel call takes the tokens routed to one of its experts and only those pairs (`_wave`),
  the outputs added in float32. One wave is bit for bit vLLM's resident output; waves sum in
  another order (measured in tests/test_vllm_offload.py).
- Prediction: the plugin's Prefetcher (TENSORBEND_PREDICTOR) hands its predictions to the
  cache (hints) and the loader (prefetches), as `offload.hooks.PredictionHooks` does in the
  transformers runtime.

Tensor parallel: each rank reads the whole expert from the store and packs its own shard
(rows of gate and up, columns of down), as vLLM's weight loader slices them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tensorbend.cache.config import SERVING, PolicyConfig
from tensorbend.errors import TensorbendError
from tensorbend.models import RoutingSpec
from tensorbend.offload.blocks import ALIGN, aligned_empty
from tensorbend.offload.build import build_cache
from tensorbend.offload.layout import ExpertLayout
from tensorbend.offload.loader import Loader, PrefetchGuard
from tensorbend.offload.store import ExpertStore, StoreConfig


@dataclass(frozen=True)
class OffloadSettings:
    max_memory: int
    """Bytes for the expert slots (resident and staging), in vLLM's packed layout."""
    io: str = "buffered"
    """How expert reads treat the page cache: buffered, fadvise or direct."""
    io_threads: int = 2
    """I/O threads reading experts."""
    policy: PolicyConfig = SERVING
    """The cache (the serving default: lfru with frequency admission)."""
    store_dir: Path | None = None
    """Root of the expert stores (else $TENSORBEND_STORE_DIR, else ~/.cache/tensorbend/stores)."""


def skip_expert_weights() -> None:
    """Patch vLLM's default loader: no routed expert is read, none is kept (module note)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    if getattr(DefaultModelLoader, "_tensorbend_skips_experts", False):
        return
    init_filter, load_weights = (
        DefaultModelLoader._init_ep_weight_filter,
        DefaultModelLoader.load_weights,
    )

    def _init_ep_weight_filter(self, model_config):
        init_filter(self, model_config)
        self.local_expert_ids = set()  # (expert-parallel's filter: none of them is local)

    def _load_weights(self, model, model_config):
        load_weights(self, model, model_config)
        for layer in routed_layers(model):  # before process_weights_after_loading packs them
            for name in ("w13_weight", "w2_weight"):
                full = getattr(layer, name)
                one = torch.zeros((1, *full.shape[1:]), dtype=full.dtype)
                setattr(layer, name, torch.nn.Parameter(one, requires_grad=False))

    DefaultModelLoader._init_ep_weight_filter = _init_ep_weight_filter
    DefaultModelLoader.load_weights = _load_weights
    DefaultModelLoader._tensorbend_skips_experts = True


def routed_layers(model) -> list:
    """vLLM's `RoutedExperts` modules, in model order (one per MoE layer)."""
    return [m for m in model.modules() if type(m).__name__ == "RoutedExperts"]


class VllmOffload:
    """The slot pool, cache, store and I/O threads of one vLLM model; see the module note."""

    def __init__(
        self, layers, spec: RoutingSpec, layout: ExpertLayout, store: Path, settings, fingerprint
    ):
        self.spec, self.layout, self.settings = spec, layout, settings
        self.layers = layers
        first = layers[0]
        self.kernel = first.quant_method.moe_kernel.fused_experts
        if type(self.kernel).__name__ not in _KERNELS:
            raise TensorbendError(
                f"vLLM runs these experts with {type(self.kernel).__name__}: expected one of "
                f"{', '.join(_KERNELS)} (vLLM's CPU kernels for unquantized experts); offload "
                "with TENSORBEND_MAX_MEMORY needs them"
            )
        pc = first.moe_config.moe_parallel_config
        self.tp = (pc.tp_rank, pc.tp_size)
        w13, w2 = self.pack(torch.zeros(layout.numel, dtype=layout.dtype))
        self.slot_bytes = w13.nbytes + w2.nbytes
        packed = ExpertLayout((("w13", tuple(w13.shape)), ("w2", tuple(w2.shape))), w13.dtype)
        self.packed = w13.nbytes % ALIGN == 0  # (else the second part's reads would straddle)
        if self.packed:  # (a miss: one read straight into its slot; else read, then pack)
            store = self._packed_store(store, packed, fingerprint)
        scratch = settings.policy.staging(spec.top_k)
        budget = settings.max_memory - scratch * self.slot_bytes
        policy = replace(settings.policy, cache_bytes=max(budget, 0))
        stored = packed if self.packed else layout
        self.cache = build_cache(policy, spec, stored, None, "cpu", slot_bytes=self.slot_bytes)
        rows = self.cache.capacity + scratch
        self.w13_C = _aligned((rows, *w13.shape), w13.dtype)
        self.w2_C = _aligned((rows, *w2.shape), w2.dtype)
        self.wave = max(1, min(self.cache.capacity, scratch))
        w13_C = torch.nn.Parameter(self.w13_C, requires_grad=False)
        w2_C = torch.nn.Parameter(self.w2_C, requires_grad=False)
        for layer in layers:  # one pool for every layer (the ids are remapped to its slots)
            layer.w13_weight, layer.w2_weight = w13_C, w2_C
        self.store = ExpertStore.open(store, StoreConfig(settings.io))
        self.store.check({}, spec.num_moe_layers, spec.num_experts, stored)
        self._staging = threading.local()  # (unpacked store: each I/O thread's read buffer)
        self.loader = _PackingLoader(self, settings.io_threads)
        self.clock = None  # the Prefetcher's StepClock, when the plugin has one (`attach`)
        self._step = 0
        self.waves = 0  # layer calls that ran in more than one wave
        for m, layer in enumerate(layers):
            layer.forward_modular = self._forward(m, layer.forward_modular)

    @classmethod
    def attach(
        cls, model, checkpoint: str, settings: OffloadSettings, fingerprint: str, meter=None
    ):
        """Build (or reuse) the store, allocate the slots, wrap every MoE layer; with a meter
        (engines/vllm_counters.ServeMeter), its Prefetcher's predictions become prefetches.
        fingerprint: the model's (`routers.model_fingerprint`), which the store records."""
        from tensorbend.serving.offloaded import ServeConfig, plan_store
        from tensorbend.serving.stores import ensure_store

        layers = routed_layers(model)
        dtype = layers[0].w13_weight.dtype
        serve = ServeConfig(dtype=dtype, store_dir=settings.store_dir)
        _, spec, layout, plan, store = plan_store(Path(checkpoint), serve)
        if len(layers) != spec.num_moe_layers:
            raise TensorbendError(
                f"vLLM built {len(layers)} fused-MoE layers, the checkpoint has "
                f"{spec.num_moe_layers}: this model is not supported"
            )
        if layout.block is not None or [n for n, _ in layout.parts] != [
            "gate_up_proj",
            "down_proj",
        ]:
            raise TensorbendError(
                f"offload in vLLM: expected unquantized experts of gate_up_proj and down_proj "
                f"(SwiGLU, no biases), found {[n for n, _ in layout.parts]}"
                + (f" stored as {layout.block}" if layout.block is not None else "")
            )
        ensure_store(plan, store, fingerprint, layout, progress=False)
        off = cls(layers, spec, layout, store, settings, fingerprint)
        model.tensorbend_offload = off  # (what `llm.apply_model` hands back carries it)
        if meter is not None:
            off.clock = meter.pf.clock
            meter.on_predictions = off.queue
            meter.offload = off
        return off

    # ------------------------------------------------------------ public

    def queue(self, preds) -> None:
        """A Prefetcher's predictions: hints to the cache, then prefetches in rank order."""
        hints = [((p.layer, p.expert), p.step) for p in preds if p.hint]
        if hints:
            self.cache.hint_many(hints)
        self.loader.prefetch_many([((p.layer, p.expert), p.rank, p.step) for p in preds])

    def counters(self) -> dict:
        """The cache's totals and per-layer counts, the slots and what one costs."""
        return {
            "totals": dict(vars(self.cache.stats)),
            "per_layer": self.cache.layer_counters(),
            "cache_slots": self.cache.capacity,
            "staging_slots": self.w13_C.shape[0] - self.cache.capacity,
            "slot_bytes": self.slot_bytes,
            "expert_stored_bytes": self.cache.nbytes,
            "packed_store": self.packed,
            "isa": getattr(self.kernel, "isa", None),
            "wave": self.wave,
            "multi_wave_calls": self.waves,
            "store": str(self.store.path),
            "policy": self.settings.policy.policy,
            "admission": self.settings.policy.admission_rule,
        }

    def close(self) -> None:
        self.loader.close()
        self.store.close()

    # ------------------------------------------------------------ the I/O threads' side

    def read(self, key, slot: int, pause=None) -> int:
        """Expert `key` from the store into `slot` (an I/O thread's work); returns bytes read."""
        m, e = key
        if self.packed:
            outs = [self.w13_C[slot].view(-1), self.w2_C[slot].view(-1)]
            return self.store.read_parts_into(m, e, outs, pause)
        raw = getattr(self._staging, "raw", None)
        if raw is None:
            raw = self._staging.raw = aligned_empty(1, self.layout.numel, self.layout.dtype)[0]
        nbytes = self.store.read_into(m, e, raw, pause)
        w13, w2 = self.pack(raw)
        self.w13_C[slot].copy_(w13)
        self.w2_C[slot].copy_(w2)
        return nbytes

    def pack(self, raw_flat: torch.Tensor):
        """A store expert (flat, transformers' layout) as the kernel keeps it: (w13, w2)."""
        return self._pack(*_unpacked(raw_flat, self.layout))

    def _pack(self, gate_up: torch.Tensor, down: torch.Tensor):
        """(w13 [2I, D], w2 [D, I]) of one expert -> this rank's shard, padded and prepacked by
        the kernel's own code (its `process_weights_after_loading` on a one-expert layer)."""
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        rank, size = self.tp
        if size > 1:
            inter = down.shape[1]
            n = inter // size
            rows = torch.cat(
                [
                    gate_up[rank * n : (rank + 1) * n],
                    gate_up[inter + rank * n : inter + (rank + 1) * n],
                ]
            )
            gate_up, down = rows, down[:, rank * n : (rank + 1) * n]
        one = torch.nn.Module()
        one.w13_weight = torch.nn.Parameter(gate_up[None].clone(), requires_grad=False)
        one.w2_weight = torch.nn.Parameter(down[None].contiguous(), requires_grad=False)
        CPUUnquantizedExperts.process_weights_after_loading(self.kernel, one)
        return one.w13_weight.data[0], one.w2_weight.data[0]

    def _packed_store(self, plain: Path, packed: ExpertLayout, fingerprint: str) -> Path:
        from tensorbend.engines.vllm_store import ensure_packed, probe

        rank, size = self.tp
        isa = getattr(self.kernel, "isa", "cpu")
        ident = {
            "fingerprint": fingerprint,
            "vllm_packing": f"{isa}:{probe(self.pack, self.layout)}",
        }
        shape = (self.spec.num_moe_layers, self.spec.num_experts)
        tag = f"vllm-{isa}-tp{rank}of{size}"
        return ensure_packed(plain, self.layout, packed, self.pack, ident, tag, shape)

    # ------------------------------------------------------------ the compute side

    def _forward(self, m: int, run):
        E = self.spec.num_experts

        def forward_modular(
            x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None
        ):
            now = self.clock.step(m) if self.clock is not None else self._tick(m)
            self.cache.now = now
            ids = torch.unique(topk_ids).tolist()
            waves = [ids[i : i + self.wave] for i in range(0, len(ids), self.wave)]
            if len(waves) > 1:
                self.waves += 1
            out = None
            for i, wave in enumerate(waves):
                keys = self._ready([(m, e) for e in wave], now)
                try:
                    slot_E = torch.zeros(E, dtype=topk_ids.dtype)
                    slot_E[wave] = torch.tensor(
                        [self.cache.entries[k].slot for k in keys], dtype=topk_ids.dtype
                    )
                    if len(waves) == 1:  # (vLLM's own call, on slots)
                        ids_TK = slot_E[topk_ids.long()]
                        return run(x, topk_weights, ids_TK, shared_experts, shared_experts_input)
                    rows, w_RK, ids_RK = _wave(topk_weights, topk_ids, wave, all_rows=i == 0)
                    part = run(
                        x[rows],
                        w_RK,
                        slot_E[ids_RK.long()],
                        shared_experts if i == 0 else None,  # (every row, in the first wave)
                        shared_experts_input if i == 0 else None,
                    )
                finally:
                    for k in keys:
                        self.cache.release(k)
                if not isinstance(part, torch.Tensor):
                    raise TensorbendError(
                        f"vLLM's experts returned {type(part).__name__}: waves need a tensor"
                    )
                if out is None:
                    out = part.float()
                else:
                    out.index_add_(0, rows, part.float())
            return out.to(x.dtype)

        return forward_modular

    def _ready(self, keys: list, now: int) -> list:
        """Claim keys (pinning them), demand the absent ones, wait until every one is ready."""
        for k in keys:
            if self.cache.claim(k) == "absent":
                self.loader.demand(k)
        self.loader.cancel_stale(now)
        pending = set(keys)
        while pending:
            pending.difference_update(self.cache.wait_ready(pending))
        return keys

    def _tick(self, m: int) -> int:
        """Without a Prefetcher: step = forward * L + m, a forward starting at layer 0."""
        if m == 0:
            self._step += 1
        return (self._step - 1) * self.spec.num_moe_layers + m


_KERNELS = (
    "CPUUnquantizedExperts",
    "X86CPUUnquantizedExperts",
    "ArmCPUUnquantizedExperts",
    "PowerCPUUnquantizedExperts",
)


class _PackingLoader(Loader):
    """Loader whose I/O threads fill the kernel's two pools (`VllmOffload.read`): the slot is
    ready when its packed expert is in both."""

    def __init__(self, off: VllmOffload, threads: int):
        self.off = off
        super().__init__(off.store, off.cache, threads, guard=PrefetchGuard())

    def _read(self, key, slot: int, pause=None) -> int:
        return self.off.read(key, slot, pause)


def _aligned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous zeroed tensor starting on a 4096-byte boundary (direct reads land in its
    rows with no copy when a row's bytes are whole blocks)."""
    numel = 1
    for n in shape:
        numel *= n
    return aligned_empty(1, numel, dtype)[0].zero_().view(shape)


def _wave(weights_TK, ids_TK, wave: list[int], all_rows: bool):
    """One wave's kernel call: the rows (tokens) with an expert in `wave` (every row when
    `all_rows`), each row's in-wave (weight, id) pairs first, as many columns as a row has at
    most; the other columns point at the wave's first expert with weight 0.

    >>> w = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    >>> ids = torch.tensor([[1, 2], [3, 1], [3, 4]], dtype=torch.int32)
    >>> rows, w_RK, ids_RK = _wave(w, ids, [1, 4], all_rows=False)
    >>> rows.tolist(), w_RK.tolist(), ids_RK.tolist()
    ([0, 1, 2], [[0.6000000238418579], [0.30000001192092896], [0.5]], [[1], [1], [4]])
    >>> _wave(w, ids, [2], all_rows=True)[1:]
    (tensor([[0.4000],
            [0.0000],
            [0.0000]]), tensor([[2],
            [2],
            [2]], dtype=torch.int32))
    """
    inside_TK = torch.isin(ids_TK, torch.tensor(wave, dtype=ids_TK.dtype))
    rows = torch.arange(ids_TK.shape[0]) if all_rows else inside_TK.any(1).nonzero().flatten()
    inside = inside_TK[rows]
    width = max(1, int(inside.sum(1).max()))
    order = torch.argsort((~inside).to(torch.int8), dim=1, stable=True)[:, :width]
    keep = inside.gather(1, order)
    w_RK = weights_TK[rows].gather(1, order) * keep
    ids_RK = torch.where(keep, ids_TK[rows].gather(1, order), wave[0]).to(ids_TK.dtype)
    return rows, w_RK, ids_RK


def _unpacked(flat: torch.Tensor, layout: ExpertLayout) -> tuple[torch.Tensor, torch.Tensor]:
    W = layout.views(flat)
    return W["gate_up_proj"], W["down_proj"]
