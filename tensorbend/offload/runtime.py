"""Offloaded generation: resident reference, expert store, and one run per policy.

Usage:
    >>> sess = OffloadSession(model, tok, prompts, SessionConfig(max_new_tokens=16))
    >>> sess.resident_result()                  # the ceiling: every expert in memory
    >>> sess.run_policy(PolicyConfig("lru", cache_frac=0.25), link=sess.link("h100-pcie5-kimi"))
    >>> sess.run_policy(PolicyConfig("prefetch", cache_frac=0.25), predictor=p)
    >>> sess.close()
or in one call (what `tensorbend run` does): `runner.run(RunConfig(model="zoo:default"))`.

The session first generates greedily with the unmodified model (experts implementation
`eager`), recording tokens, last-position logits per forward and the routing of every forward
(the oracle replays it). Then it writes the routed experts to the store, frees them from the
model and installs `OffloadedExperts` in every MoE layer. Each `run_policy` builds a fresh
cache, I/O threads and hooks, generates the same prompts, and compares tokens and logits with
the resident run. Decode and prefill are timed and counted separately; the JSON headline
numbers (stall, bytes, hit rate per token) are decode's, prefill's are under "prefill".

Policies: resident, on_demand (load when asked, keep nothing after the layer), lru, lfu (caches
without prediction), prefetch (a predictor's prefetches + cache hints, `Predicted` eviction),
oracle (the recorded routing as predictions + Belady eviction).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from tensorbend.errors import TensorbendError
from tensorbend.hf import cache_kwarg, cache_of
from tensorbend.models import describe_model, model_fingerprint, moe_block
from tensorbend.offload import POLICIES
from tensorbend.offload.cache import CacheConfig, CacheStats, ExpertCache
from tensorbend.offload.layer import OffloadedExperts, check_supported
from tensorbend.offload.policies import INF, LFU, LRU, NextUse, Predicted
from tensorbend.offload.prefetch import (
    Loader,
    PredictionHooks,
    RecordedRouting,
    RoutingHistory,
    StepClock,
)
from tensorbend.offload.resident import ResidentSet
from tensorbend.offload.store import (
    ExpertLayout,
    ExpertStore,
    Link,
    StoreConfig,
    parse_link,
    write_store,
)
from tensorbend.predictors.base import get_lookahead


@dataclass(frozen=True)
class SessionConfig:
    max_new_tokens: int = 32
    """Decode steps per prompt (greedy stops early at EOS)."""
    max_prompt_tokens: int = 128
    """Prompts are truncated to this many tokens."""
    store_dir: Path | None = None
    """Where the expert store is written (kept); None = a temporary directory, removed on close."""
    io: str = "buffered"
    """Store reads: buffered, fadvise or direct (see store.py)."""
    io_threads: int = 2
    """I/O threads per run."""
    progress: bool = False
    """tqdm progress on stderr."""
    decode: str = "greedy"
    """greedy (the model's own tokens) or teacher (feed each prompt's `continuation`)."""

    def __post_init__(self) -> None:
        StoreConfig(self.io)
        if self.decode not in ("greedy", "teacher"):
            raise TensorbendError(f"--decode {self.decode!r}: expected greedy or teacher")
        if self.max_new_tokens < 0 or self.max_prompt_tokens < 1 or self.io_threads < 1:
            raise TensorbendError(
                "expected max_new_tokens >= 0, max_prompt_tokens >= 1, io_threads >= 1"
            )


@dataclass(frozen=True)
class PolicyConfig:
    policy: str
    """One of POLICIES."""
    cache_frac: float = 0.25
    """Cache capacity as a fraction of all routed experts (L x E)."""
    cache_bytes: int | None = None
    """Cache capacity in bytes (overrides cache_frac)."""
    lookahead: str = "d1"
    """Oracle lookahead (a predictor brings its own)."""
    prefetch_extra: int = 0
    """Batch-1 decode prefetches top-(K + extra) predicted experts."""
    prefetch_backlog: float | None = 0.5
    """Start a prefetch only while the link is busy for at most this many expert transfers
    (wrong prefetches then use idle link time instead of delaying demand loads); None: always."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise TensorbendError(
                f"--policy {self.policy!r}: expected one of {', '.join(POLICIES)}"
            )
        if not 0 < self.cache_frac <= 1:
            raise TensorbendError(f"--cache-frac {self.cache_frac}: expected a fraction in (0, 1]")
        get_lookahead(self.lookahead)


@dataclass
class _Active:
    cache: ExpertCache
    loader: Loader
    clock: StepClock
    history: RoutingHistory


@dataclass
class _Gen:
    tokens: list[list[int]] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    ids: list[torch.Tensor] = field(default_factory=list)
    decode_times: list[float] = field(default_factory=list)
    n: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    s: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    stats: dict[str, CacheStats] = field(
        default_factory=lambda: {"prefill": CacheStats(), "decode": CacheStats()}
    )


class OffloadSession:
    """One model, one prompt set: a resident reference, then any number of offloaded runs."""

    def __init__(self, model, tokenizer, prompts, cfg: SessionConfig, model_name: str = "model"):
        self.model, self.cfg, self.model_name = model, cfg, model_name
        self.spec = spec = describe_model(model)
        check_supported(spec.family)
        self.inputs = [
            tokenizer(p.text, return_tensors="pt").input_ids[:, : cfg.max_prompt_tokens]
            for p in prompts
        ]
        if any(ids.shape[1] == 0 for ids in self.inputs):
            raise TensorbendError("a prompt tokenizes to nothing: remove it or give it text")
        self.eos = tokenizer.eos_token_id
        # teacher: decode feeds the prompt's continuation (natural text, still one token per
        # step with the KV cache); prompts without one are prefill only
        self.forced = [
            tokenizer(p.continuation or "", add_special_tokens=False).input_ids[
                : cfg.max_new_tokens
            ]
            if cfg.decode == "teacher"
            else None
            for p in prompts
        ]
        self.experts = [
            getattr(moe_block(model, spec, m), spec.experts_attr)
            for m in range(spec.num_moe_layers)
        ]
        self.layout = ExpertLayout.of(self.experts[0])
        model.set_experts_implementation("eager")
        self.clock = StepClock(spec.num_moe_layers)
        self.history = RoutingHistory(spec.num_moe_layers)
        self.active: _Active | None = None
        with torch.inference_mode():  # warm-up: first calls allocate and pick kernels
            model(input_ids=self.inputs[0].to(self._device()), use_cache=True)
        with PredictionHooks(model, spec, None, None, None, self.clock, self.history):
            self.reference = self._generate()
        self._tmp = None if cfg.store_dir else tempfile.mkdtemp(prefix="tensorbend-store-")
        path = Path(cfg.store_dir or self._tmp) / "experts.safetensors"
        fingerprint = model_fingerprint(model, spec)
        if not _store_matches(path, fingerprint):
            write_store(
                self.experts, self.layout, path, {"fingerprint": fingerprint, "family": spec.family}
            )
        self.store_path = path
        for m, mod in enumerate(self.experts):
            for name, _ in self.layout.parts:
                setattr(mod, name, None)  # the weights now live only in the store
            mod.forward = OffloadedExperts(mod, spec.family, self.layout, m, self._get_active)

    @property
    def num_routed_experts(self) -> int:
        return self.spec.num_moe_layers * self.spec.num_experts

    def layer_seconds(self) -> float:
        """Resident decode seconds per MoE layer (what `h100-pcie5-kimi` scales to)."""
        times = sorted(self.reference.decode_times) or [self.reference.s["prefill"]]
        return times[len(times) // 2] / self.spec.num_moe_layers  # median: robust to noise

    def link(self, text: str) -> Link:
        return parse_link(text, self.layer_seconds(), self.layout.nbytes)

    def resident_result(self) -> dict:
        return self._result(
            PolicyConfig("resident", cache_frac=1.0), None, Link(), self.reference, None
        )

    def run_policy(self, pc: PolicyConfig, predictor=None, link: Link | None = None) -> dict:
        if pc.policy == "resident":
            return self.resident_result()
        link = link or Link()
        if pc.policy == "prefetch" and predictor is None:
            raise TensorbendError("--policy prefetch needs --predictor PRED or --baseline NAME")
        if pc.policy != "prefetch":
            predictor = None
        if pc.policy == "oracle":
            predictor = RecordedRouting(
                self.reference.ids, get_lookahead(pc.lookahead), self.clock, self.spec.num_experts
            )
        cache = self._make_cache(pc, predictor)
        store = ExpertStore.open(self.store_path, StoreConfig(self.cfg.io), link)
        backlog = (
            INF if pc.prefetch_backlog is None else pc.prefetch_backlog * link.seconds(cache.nbytes)
        )
        loader = Loader(store, cache, self.cfg.io_threads, max_backlog_s=backlog)
        self.active = _Active(cache, loader, self.clock, self.history)
        for mod in self.experts:
            mod.forward._routed = None  # nothing left over from a run that raised
        try:
            with PredictionHooks(
                self.model,
                self.spec,
                predictor,
                loader,
                cache,
                self.clock,
                self.history,
                extra=0 if pc.policy == "oracle" else pc.prefetch_extra,  # exact sets
                on_route=lambda s, ids_TK: self.experts[s].forward.route(ids_TK),
            ):
                gen = self._generate()
        finally:
            loader.close()
            store.close()
            self.active = None
        cache.finalize()
        return self._result(pc, predictor, link, gen, cache)

    def close(self) -> None:
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    # ------------------------------------------------------------ helpers

    def _get_active(self) -> _Active:
        if self.active is None:
            raise TensorbendError(
                "this model's experts are offloaded: run it through OffloadSession.run_policy"
            )
        return self.active

    def _make_cache(self, pc: PolicyConfig, predictor) -> ExpertCache:
        nbytes = self.layout.nbytes
        slots = (
            pc.cache_bytes // nbytes
            if pc.cache_bytes
            else round(pc.cache_frac * self.num_routed_experts)
        )
        if slots < self.spec.top_k:
            raise TensorbendError(
                f"expert cache of {slots} slots is smaller than top_k={self.spec.top_k}: expected at "
                f"least {self.spec.top_k} x {nbytes} bytes (raise --cache-frac)"
            )
        L = self.spec.num_moe_layers
        policy = {"on_demand": LRU, "lru": LRU, "lfu": LFU}.get(pc.policy, lambda: Predicted(L))()
        if pc.policy == "oracle":
            policy = NextUse(predictor.steps_by_key(), L)
        rs = ResidentSet(0 if pc.policy == "on_demand" else slots, L, policy)
        cfg = CacheConfig(scratch=self.spec.top_k, device=self._device())
        return ExpertCache(cfg, rs, self.layout.numel, self.layout.dtype, nbytes)

    def _device(self) -> str:
        return str(next(self.model.parameters()).device)

    def _generate(self) -> _Gen:
        gen, kw = _Gen(), cache_kwarg(self.model)
        self.clock.forward = -1
        bar = tqdm(
            total=len(self.inputs),
            desc="generate",
            unit="prompt",
            disable=not self.cfg.progress,
            file=sys.stderr,
        )
        with torch.inference_mode():
            for ids, forced in zip(self.inputs, self.forced, strict=True):
                bar.update(1)
                self.history.begin_prompt()
                out = self._forward(
                    gen, "prefill", input_ids=ids.to(self._device()), use_cache=True
                )
                new = []
                steps = forced if forced is not None else range(self.cfg.max_new_tokens)
                for feed in steps:
                    nxt = int(out.logits[0, -1].argmax())  # the model's own next token
                    if forced is None and self.eos is not None and nxt == self.eos:
                        break
                    new.append(nxt)
                    out = self._forward(
                        gen,
                        "decode",
                        input_ids=torch.tensor(
                            [[nxt if forced is None else feed]], device=ids.device
                        ),
                        use_cache=True,
                        **{kw: cache_of(out)},
                    )
                gen.tokens.append(new)
        bar.close()
        return gen

    def _forward(self, gen: _Gen, phase: str, **kwargs):
        self.clock.begin_forward()
        self.history.begin_forward()
        before = self.active.cache.stats.copy() if self.active else None
        t0 = time.perf_counter()
        out = self.model(**kwargs)
        dt = time.perf_counter() - t0
        gen.s[phase] += dt
        if phase == "decode":
            gen.decode_times.append(dt)
        gen.n[phase] += kwargs["input_ids"].shape[1]
        gen.logits.append(out.logits[0, -1].float().cpu())
        if self.active is None:
            L = self.spec.num_moe_layers
            gen.ids.append(torch.stack([self.history.cur[m] for m in range(L)], dim=1))
        else:
            gen.stats[phase].add(self.active.cache.stats, minus=before)
        return out

    def _result(
        self, pc: PolicyConfig, predictor, link: Link, gen: _Gen, cache: ExpertCache | None
    ) -> dict:
        ref = self.reference
        same = gen.tokens == ref.tokens and len(gen.logits) == len(ref.logits)
        diff = (
            max(
                (float((a - b).abs().max()) for a, b in zip(gen.logits, ref.logits, strict=True)),
                default=0.0,
            )
            if same
            else None
        )
        tol = 1e-4 if self.layout.dtype == torch.float32 else 1e-2
        dec, pre = gen.stats["decode"], gen.stats["prefill"]
        total = cache.stats if cache is not None else CacheStats()
        nd, npf = max(1, gen.n["decode"]), max(1, gen.n["prefill"])
        slots = cache.capacity if cache is not None else self.num_routed_experts
        return {
            "model": self.model_name,
            "policy": pc.policy,
            "predictor": getattr(predictor, "kind", None),
            "predictor_checkpoint": getattr(predictor, "checkpoint", None),
            "lookahead": predictor.lookahead.name if predictor is not None else None,
            "cache_frac": round(slots / self.num_routed_experts, 4),
            "decode_tok_s": gen.n["decode"] / gen.s["decode"] if gen.s["decode"] else None,
            "prefill_tok_s": gen.n["prefill"] / gen.s["prefill"] if gen.s["prefill"] else None,
            "stall_s_per_token": dec.stall_s / nd,
            "bytes_read_per_token": dec.bytes_read / nd,
            "demand_hit_rate": dec.demand_hit_rate,
            "wasted_prefetch_bytes": total.prefetch_wasted_bytes,
            "output_matches_resident": bool(
                same and diff is not None and diff <= tol * (1 + _scale(ref))
            ),
            "max_logit_abs_diff": diff,
            "link": link.to_dict(),
            "io": self.cfg.io,
            "decode": self.cfg.decode,
            "prefetch_extra": pc.prefetch_extra,
            "prefetch_backlog": pc.prefetch_backlog,
            "cache_slots": slots,
            "expert_bytes": self.layout.nbytes,
            "tokens": dict(gen.n),
            "prompts": len(self.inputs),
            "prefill": {
                "stall_s_per_token": pre.stall_s / npf,
                "bytes_read_per_token": pre.bytes_read / npf,
                "demand_hit_rate": pre.demand_hit_rate,
            },
            "counters": {k: v for k, v in vars(total).items()},
        }


def _store_matches(path: Path, fingerprint: str) -> bool:
    try:
        store = ExpertStore.open(path)
    except TensorbendError:
        return False
    store.close()
    return store.meta.get("fingerprint") == fingerprint


def _scale(ref: _Gen) -> float:
    return max((float(x.abs().max()) for x in ref.logits), default=0.0)
