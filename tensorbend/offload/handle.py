"""A transformers model whose routed experts live in an expert store, attached in place: the
bounded cache, the I/O threads, the prediction hooks and the counters of one offloaded run.

Usage:
    handle = OffloadHandle(model, spec, layout, Path("store/experts.safetensors"),
                           PolicyConfig("lru", cache_bytes=2 << 30))
    model.generate(input_ids, max_new_tokens=32)      # transformers' own generate, unchanged
    handle.counters()["decode"]["bytes_read_per_token"], handle.counters()["per_layer"]
    handle.reset()                                    # zero the counters (the cache stays warm)
    handle.close()                                    # I/O threads joined, store closed

`tensorbend.load_offloaded` builds the model (experts never materialised) and this handle;
`OffloadSession` attaches one per measured run to a model it ran resident first. The experts
modules keep their signature; their forward becomes `layer.OffloadedExperts` over this
handle's cache, so outputs equal the resident `eager` experts bit for bit whatever the policy
or predictor. With `drive_clock` (the default) forward hooks on the model advance the logical
clock and routing history per forward, start a new request when a forward comes without a
filled KV cache, and count tokens, seconds and cache counters per phase: a forward with an
empty KV cache is prefill, one with a filled cache is decode. On CPU a decode forward runs
with torch's intra-op threads capped at the cores less one (`decode_threads`; prefill and
`close` restore the caller's count): batch-1 expert GEMVs are memory-bound and gain nothing
from a second thread, whose OpenMP spin-wait takes the core the I/O threads need to finish
their reads (2 cores, real disk: stall 60 -> 31 ms per token, same bytes). A caller that wraps every
forward itself (the session's `Recorder`) passes `drive_clock=False` and its own clock.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tensorbend.cache.config import PolicyConfig
from tensorbend.cache.slots import CacheStats
from tensorbend.cache.transfers import Link
from tensorbend.errors import TensorbendError
from tensorbend.memory import disk_read_bytes, peak_rss_bytes
from tensorbend.models import RoutingSpec, moe_block
from tensorbend.offload.build import build_cache
from tensorbend.offload.generation import Generation
from tensorbend.offload.hooks import PredictionHooks, RoutingHistory, StepClock
from tensorbend.offload.int4 import Int4
from tensorbend.offload.layer import ExpertCompute, OffloadedExperts, check_supported
from tensorbend.offload.layout import ExpertLayout
from tensorbend.offload.loader import Loader, PrefetchGuard
from tensorbend.offload.result import phase_numbers
from tensorbend.offload.store import ExpertStore, IOMode, StoreConfig


@dataclass(frozen=True)
class AttachOptions:
    io: IOMode = "buffered"
    """How expert reads treat the page cache: buffered, fadvise or direct (O_DIRECT)."""
    io_threads: int = 2
    """I/O threads reading experts."""
    link: Link = field(default_factory=Link)
    """Emulated transfer cap (default: none, real reads only)."""
    drive_clock: bool = True
    """Advance clock/history and count phases from model hooks (False: the caller does)."""
    max_tokens: int | None = None
    """Tokens (sequences x length) the memory budget's reserve holds: a forward past them is
    refused before it runs (None: not checked)."""


class OffloadHandle:
    """The offloaded experts of one model; also the run state `OffloadedExperts` reads."""

    def __init__(
        self,
        model,
        spec: RoutingSpec,
        layout: ExpertLayout,
        store_path: Path,
        pc: PolicyConfig,
        predictor=None,
        horizon=None,
        opts: AttachOptions | None = None,
        clock: StepClock | None = None,
        history: RoutingHistory | None = None,
        prefetch_extra: int = 0,
    ):
        """prefetch_extra: a decode token prefetches its top-(K + extra) predictions
        (`predictors.spec.PredictorSpec.prefetch_extra`)."""
        check_supported(spec.family)
        opts = opts or AttachOptions()
        self.model, self.spec, self.layout, self.pc, self.opts = model, spec, layout, pc, opts
        self.predictor, self.horizon = predictor, horizon
        self.memory_plan: dict | None = None  # serving.memory_plan's split of --max-memory
        L = spec.num_moe_layers
        self.clock = clock or StepClock(L)
        self.history = history or RoutingHistory(L)
        self.device = _device_of(model)
        self._threads = torch.get_num_threads()  # the caller's, restored for prefill and close
        self._decode_threads = decode_threads(self._threads) if self.device.type == "cpu" else None
        self.store = ExpertStore.open(store_path, StoreConfig(opts.io), opts.link, slots=layout)
        self.store.check({}, L, spec.num_experts, layout)
        self.cache = build_cache(pc, spec, layout, predictor, str(self.device), horizon)
        backlog_s = pc.prefetch_backlog * opts.link.seconds(self.cache.nbytes)
        self.loader = Loader(
            self.store, self.cache, opts.io_threads, max_backlog_s=backlog_s, guard=PrefetchGuard()
        )
        self.experts = [getattr(moe_block(model, spec, m), spec.experts_attr) for m in range(L)]
        for m, mod in enumerate(self.experts):
            for name, _ in layout.parts:
                setattr(mod, name, None)  # the weights live only in the store
            mod.forward = OffloadedExperts(mod, spec.family, layout, m, self._active)
        self.hooks = PredictionHooks(
            model,
            spec,
            self.clock,
            self.history,
            predictor,
            self.loader,
            self.cache,
            extra=prefetch_extra,
            on_route=lambda m, ids_TK: self.experts[m].forward.route(ids_TK),
            horizon=horizon,
            token_ahead_layers=pc.token_ahead_layers,
        ).__enter__()
        self.gen = Generation()
        self.compute = ExpertCompute()  # the experts' math seconds (layer.OffloadedExperts)
        self._phase: tuple[str, CacheStats, float] | None = None
        self._max_tokens = opts.max_tokens
        self._disk: tuple[str, int] | None = None  # (phase, disk_read_bytes) since a forward began
        self._model_hooks = []
        if opts.drive_clock:
            self._model_hooks = [
                model.register_forward_pre_hook(self._begin, with_kwargs=True),
                model.register_forward_hook(self._end, with_kwargs=True),
            ]
        self._closed = False

    # ------------------------------------------------------------ public

    def counters(self) -> dict:
        """Everything counted since the last `reset`: per phase (tokens, tok/s, bytes and hits
        per token), the cache's totals, prediction seconds, per-layer demand counts, memory."""
        self._charge_disk(None)
        gen = self.gen
        phases = {}
        for p in ("prefill", "decode"):
            phases[p] = {
                "tokens": gen.tokens[p],
                "seconds": gen.seconds[p],
                "tok_s": gen.tok_s(p),
                **phase_numbers(gen.stats[p], gen.tokens[p]),
                "disk_read_bytes_per_token": (
                    gen.disk_bytes[p] / gen.tokens[p] if gen.tokens[p] else None
                ),
            }
        decode_tokens = gen.tokens["decode"]
        pred = self.prediction_counters()
        return {
            **phases,
            "totals": dict(vars(self.cache.stats)),
            **pred,
            "predict_s_per_token": pred["predict_s"] / decode_tokens if decode_tokens else None,
            "per_layer": self.cache.layer_counters(),
            "cache_slots": self.cache.capacity,
            "expert_bytes": self.layout.nbytes,
            "expert_stored_bytes": self.layout.stored_nbytes,  # what a load reads
            "expert_dtype": stored_dtype(self.layout.block, self.layout.dtype),
            "compute_dtype": str(self.layout.dtype).removeprefix("torch."),
            "slot_dtype": "int4" if self.layout.int4_slots else _name(self.cache.pool_CN.dtype),
            "peak_rss_bytes": peak_rss_bytes(),
            "peak_device_bytes": (
                torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
            ),
        }

    def prediction_counters(self) -> dict:
        """The prediction hooks' seconds (keys ending in _s) and calls, and the experts' math,
        since the last `reset` (what `counters` and `tensorbend measure`'s result report)."""
        h = self.hooks
        return {
            "predict_s": h.predict_s,
            "decode_predict_s": h.decode_predict_s,
            "decode_predict_exposed_s": h.decode_exposed_s,
            "predict_queue_s": h.queue_s,
            "decode_predict_score_s": h.decode_score_s,
            "decode_predict_queue_s": h.decode_queue_s,
            "predict_calls": h.predict_calls,
            "decode_predict_calls": h.decode_predict_calls,
            "expert_compute": self.compute.rows(),
        }

    def reset(self) -> None:
        """Zero every counter; the cache's contents and the policy's state stay."""
        self.cache.reset_counters()
        self.hooks.reset_counters()
        self.gen = Generation()
        self.compute = ExpertCompute()
        self._disk = None

    def close(self) -> None:
        """Join the I/O threads, remove the hooks, close the store; the model stops working."""
        if self._closed:
            return
        self._closed = True
        if self._decode_threads is not None:
            torch.set_num_threads(self._threads)
        for h in self._model_hooks:
            h.remove()
        self.hooks.__exit__(None, None, None)
        self.loader.close()
        self.store.close()
        self.cache.finalize()

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ helpers

    def _active(self) -> OffloadHandle:
        if self._closed:
            raise TensorbendError(
                "this model's offload handle was closed: its experts are no longer readable; "
                "load it again with tensorbend.load_offloaded"
            )
        return self

    def _begin(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        past = kwargs.get("cache", kwargs.get("past_key_values"))
        held = past.get_seq_length() if past is not None else 0
        if self._max_tokens is not None and ids is not None:
            _check_tokens(ids.shape[0], held + ids.shape[-1], self._max_tokens)
        filled = held > 0
        # a filled cache and several tokens: a later chunk of a chunked prefill (PREFILL_CHUNK)
        decode = filled and (ids is None or ids.shape[-1] == 1)
        phase = "decode" if decode else "prefill"
        if not filled:
            self.history.begin_prompt()
            self.history.batch = ids.shape[0] if ids is not None else 1
        self.clock.begin_forward()
        self.history.begin_forward()
        mask = kwargs.get("attention_mask")
        if decode:
            real = ids.shape[0] if ids is not None else 1
        elif filled:
            real = ids.numel()
        else:
            real = int(mask.sum()) if mask is not None else (ids.numel() if ids is not None else 0)
        self.gen.tokens[phase] += real
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.hooks.phase = phase
        self._charge_disk(phase)
        if self._decode_threads is not None:
            n = self._decode_threads if decode else self._threads
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)
        self._phase = (phase, self.cache.stats.copy(), time.perf_counter())

    def _end(self, module, args, kwargs, output) -> None:
        if self._phase is None:
            return
        phase, before, t0 = self._phase
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self.gen.seconds[phase] += dt
        if phase == "decode":
            self.gen.decode_times.append(dt)
        self.gen.stats[phase].add(self.cache.stats, minus=before)
        self._phase = None

    def _charge_disk(self, phase: str | None) -> None:
        """Charge the storage bytes read since the last forward began to that forward's phase
        (the reads it caused, its prefetches finishing after it included); `phase` starts the
        next interval (None: the counters are read)."""
        now = disk_read_bytes()
        if self._disk is not None:
            self.gen.disk_bytes[self._disk[0]] += now - self._disk[1]
            phase = phase or self._disk[0]
        self._disk = None if phase is None else (phase, now)


def _check_tokens(batch: int, length: int, most: int) -> None:
    """Refuse a forward whose sequences (batch x length tokens) pass what the memory budget's
    reserve was sized for (`ServeConfig.context_tokens`), before it runs."""
    if batch * length > most:
        raise TensorbendError(
            f"{batch} sequence(s) of {length:,} tokens: expected at most {most:,} tokens, what "
            f"--reserve auto kept room for within --max-memory; load with context_tokens="
            f"{batch * length} (`tensorbend generate` sizes it from its prompts), or pass "
            "--reserve"
        )


def decode_threads(threads: int) -> int:
    """Intra-op threads for a CPU decode forward: the caller's, at most the cores less one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(threads, (cores or 1) - 1))


def _device_of(model) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def stored_dtype(block, dtype: torch.dtype | None) -> str:
    """How a store keeps the experts (its layout's `block`): their dtype, fp8 and its scale
    blocks, mxfp4, or int4 and its scale groups."""
    if block is None:
        return _name(dtype)
    if isinstance(block, Int4):
        return block.describe()
    if isinstance(block, str):  # (biases in the slots' dtype)
        return "mxfp4 (fp4 e2m1, an e8m0 scale per 32)"
    return f"float8_e4m3fn ({block[0]}x{block[1]} blocks)"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
