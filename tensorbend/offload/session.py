"""Offloaded generation sessions: a resident reference, the expert store, then one run per policy.

Usage:
    sess = OffloadSession(model, tok, prompts, SessionConfig())
    sess.resident_result()                                    # the ceiling: all in memory
    sess.run_policy(PolicyConfig("lru"), link=sess.link("h100-pcie5-kimi"))
    sess.run_policy(PolicyConfig("prefetch"), predictor=p)
    sess.run_policy(PolicyConfig("oracle", foresight=2, admission="predicted"))
    sess.close()

or in one call (what `tensorbend measure` does): `runner.run(RunConfig(model="zoo:default"))`.

The session first runs the prompts through the unmodified model (experts implementation
`eager`) with `hf.decode_prompt`, recording tokens, last-position logits and the routing of
every forward (the oracle replays it). Then it writes the routed experts to the store, frees
them from the model and installs `OffloadedExperts` in every MoE layer. Each `run_policy`
builds a fresh cache (policy, pool, admission), I/O threads and hooks, runs the same prompts
and compares tokens and logits with the resident run (`result.compare`). Decode and prefill
are timed and counted separately; the headline numbers are decode's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tensorbend.cache.config import POLICIES, PolicyConfig
from tensorbend.cache.transfers import Link, parse_link
from tensorbend.capture.hf import DecodeConfig, encode_prompt
from tensorbend.errors import TensorbendError
from tensorbend.models import RoutingSpec, describe_model, moe_block
from tensorbend.offload.generation import Generation, Recorder, generate
from tensorbend.offload.handle import AttachOptions, OffloadHandle
from tensorbend.offload.hooks import PredictionHooks, RoutingHistory, StepClock
from tensorbend.offload.layer import check_supported
from tensorbend.offload.layout import ExpertLayout
from tensorbend.offload.recorded import RecordedRouting
from tensorbend.offload.result import RunResult, compare, phase_numbers
from tensorbend.offload.store import ExpertStore, IOMode, StoreConfig, write_store
from tensorbend.predictors.base import get_lookahead
from tensorbend.predictors.spec import check_policy
from tensorbend.routers import model_fingerprint
from tensorbend.timing.time_model import PredictorCost, declare


@dataclass(frozen=True)
class SessionConfig:
    decode: DecodeConfig = field(default_factory=DecodeConfig, metadata={"group": "decoding"})
    """How prompts are run (decode mode, lengths, sampling): the same for every policy."""
    store_dir: Path | None = None
    """Where the expert store is written (kept and reused); default: a temporary directory."""
    io: IOMode = "buffered"
    """How expert reads treat the page cache (see store.py)."""
    io_threads: int = 2
    """I/O threads reading experts per run."""
    batch: int = 1
    """Sequences decoded together in lockstep (static batch, left-padded prefill): each MoE
    layer loads the union of their experts. The resident reference runs the same batches."""
    logit_tolerance: float = 0.0
    """Largest |logit difference| still counted as matching the resident run: 0 (bit-identical)
    unless the device's kernels are not deterministic; reported in every result."""
    progress: bool = field(default=False, metadata={"cli": False})
    """tqdm progress on stderr."""
    layer_time: str = field(default="median", metadata={"cli": False})
    """What `layer_seconds` takes of the resident decode forwards: median, or best (the
    fastest: other processes only add time, so on a busy machine it is the undisturbed one)."""

    def __post_init__(self) -> None:
        if self.io_threads < 1:
            raise TensorbendError(f"--io-threads {self.io_threads}: expected a count >= 1")
        if self.batch < 1:
            raise TensorbendError(f"--batch {self.batch}: expected a count >= 1")
        if not self.logit_tolerance >= 0:
            raise TensorbendError(
                f"--logit-tolerance {self.logit_tolerance}: expected >= 0 (0: bit-identical)"
            )
        StoreConfig(self.io)
        assert self.layer_time in ("median", "best"), self.layer_time

    def check_prompts(self, prompts) -> None:
        """Refuse prompts this config would run wrongly (cheap: no model, no tokenizer).

        Teacher forcing decodes a batch for as many steps as its shortest continuation, so a
        prompt without one would silently give its whole batch zero decode steps."""
        if self.decode.decode != "teacher" or self.batch == 1:
            return
        bare = [p.id for p in prompts if not p.continuation]
        if bare:
            more = f" and {len(bare) - 5} more" if len(bare) > 5 else ""
            raise TensorbendError(
                f"--decode teacher --batch {self.batch}: prompts {bare[:5]}{more} have no "
                "continuation, which would give their whole batch zero decode steps; expected a "
                "continuation for every prompt: drop those prompts or run --batch 1"
            )


class OffloadSession:
    """One model, one prompt set: a resident reference, then any number of offloaded runs."""

    def __init__(
        self,
        model,
        tokenizer,
        prompts,
        cfg: SessionConfig,
        model_name: str = "model",
        spec: RoutingSpec | None = None,
    ):
        self.model, self.cfg, self.model_name = model, cfg, model_name
        self.spec = spec = spec or describe_model(model)  # (the caller's, when it has it)
        check_supported(spec.family)
        cfg.check_prompts(prompts)
        self.inputs = [encode_prompt(tokenizer, p, cfg.decode) for p in prompts]
        self.eos = tokenizer.eos_token_id
        self.pad = next((t for t in (tokenizer.pad_token_id, self.eos) if t is not None), 0)
        self.experts = [
            getattr(moe_block(model, spec, m), spec.experts_attr)
            for m in range(spec.num_moe_layers)
        ]
        self.layout = expert_layout(model, spec)
        model.set_experts_implementation("eager")
        self.clock = StepClock(spec.num_moe_layers)
        self.history = RoutingHistory(spec.num_moe_layers)
        with torch.inference_mode():  # warm-up: first calls allocate and pick kernels
            model(input_ids=self.inputs[0].ids_1S.to(self.device), use_cache=True)
        self.reference = self._generate(PredictionHooks(model, spec, self.clock, self.history))
        self._tmp = None if cfg.store_dir else tempfile.mkdtemp(prefix="tensorbend-store-")
        self.store_path = self._write_store(Path(cfg.store_dir or self._tmp))
        for mod in self.experts:
            for name, _ in self.layout.parts:
                setattr(mod, name, None)  # the weights now live only in the store
            mod.forward = _not_attached

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def layer_seconds(self) -> float:
        """Resident decode seconds per MoE layer (what `h100-pcie5-kimi` scales to): of the
        reference's decode forwards the median (robust to noise) or, with
        `layer_time="best"`, the fastest."""
        times = sorted(self.reference.decode_times) or [self.reference.seconds["prefill"]]
        pick = times[0] if self.cfg.layer_time == "best" else times[len(times) // 2]
        return pick / self.spec.num_moe_layers

    def link(self, text: str, speedup: float = 1.0) -> Link:
        return parse_link(text, self.layer_seconds(), self.layout.nbytes, speedup)

    def resident_result(self) -> RunResult:
        pc = PolicyConfig("resident", cache_frac=1.0)
        return self._declare(self._result(pc, None, Link(), self.reference, None, 0), Link())

    def run_policy(
        self,
        pc: PolicyConfig,
        predictor=None,
        link: Link | None = None,
        horizon=None,
        prefetch_extra: int = 0,
    ) -> RunResult:
        """One offloaded run. predictor: within-token (prefetch + hints); horizon: cross-token
        (forecasts for eviction + the next forward's first layers), both for policy prefetch;
        prefetch_extra: a decode token prefetches its top-(K + extra) predictions."""
        if pc.policy == "resident":
            return self.resident_result()
        link = link or Link()
        check_policy(pc.policy, predictor is not None, horizon is not None)
        if pc.policy != "prefetch":
            horizon = None
        if POLICIES[pc.policy].recorded_routing:
            la = get_lookahead(pc.lookahead)
            predictor = RecordedRouting(self.reference.ids, la, pc.foresight)
        elif pc.policy != "prefetch":
            predictor = None
        opts = AttachOptions(self.cfg.io, self.cfg.io_threads, link, drive_clock=False)
        handle = OffloadHandle(
            self.model,
            self.spec,
            self.layout,
            self.store_path,
            pc,
            predictor,
            horizon,
            opts,
            self.clock,
            self.history,
            prefetch_extra=prefetch_extra,
        )
        cache = handle.cache
        try:
            gen = self._generate(handle.hooks, cache)
        finally:
            handle.close()
            for mod in self.experts:
                mod.forward = _not_attached
        result = self._result(pc, predictor, link, gen, cache, prefetch_extra)
        decode, c = gen.tokens["decode"], handle.prediction_counters()
        per_token = {
            f"{k}_per_token": v / decode if decode else None
            for k, v in c.items()
            if k.endswith("_s")
        }
        result = dataclasses.replace(
            result,
            **per_token,
            predict_calls=c["predict_calls"],
            expert_compute=c["expert_compute"],
        )
        if horizon is not None:
            result = dataclasses.replace(
                result,
                horizon=horizon.checkpoint or horizon.kind,
                token_ahead_layers=pc.token_ahead_layers,
            )
        return self._declare(result, link, predictor if pc.policy == "prefetch" else None, horizon)

    def close(self) -> None:
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    # ------------------------------------------------------------ helpers

    def _generate(self, hooks: PredictionHooks, cache=None) -> Generation:
        self.clock.forward = -1
        rec = Recorder(
            self.model, self.clock, self.history, cache, record_routing=cache is None, hooks=hooks
        )
        with contextlib.nullcontext() if cache is not None else hooks:  # a handle's: entered
            return generate(
                self.model,
                self.inputs,
                self.cfg.decode,
                self.eos,
                rec,
                self.cfg.progress,
                self.cfg.batch,
                self.pad,
            )

    def _declare(self, result: RunResult, link: Link, predictor=None, horizon=None) -> RunResult:
        """`result` with its time model (timing/time_model.py): each predictor's modelled cost
        per call, and its calls per decode forward (one per target layer; the horizon one; a
        predictor that predicts nothing is never asked, so none)."""
        costs = []
        if predictor is not None and not getattr(predictor, "predicts_nothing", False):
            n = len(predictor.lookahead.targets(self.spec.num_moe_layers))
            costs.append((PredictorCost.of(predictor, n), n))
        if horizon is not None:
            costs.append((PredictorCost.of(horizon, 1), 1))
        tm = declare(result.to_json(), link, self.layer_seconds(), costs, self.spec.num_moe_layers)
        return dataclasses.replace(result, time_model=tm)

    def _write_store(self, directory: Path) -> Path:
        path = directory / "experts.safetensors"
        fingerprint = model_fingerprint(self.model, self.spec)
        if not _store_matches(path, fingerprint, self.spec, self.layout):
            meta = {"fingerprint": fingerprint, "family": self.spec.family}
            write_store(self.experts, self.layout, path, meta)
        return path

    def _result(self, pc, predictor, link: Link, gen: Generation, cache, extra: int) -> RunResult:
        matches, diff = compare(gen, self.reference, self.cfg.logit_tolerance)
        n_routed = self.spec.num_moe_layers * self.spec.num_experts
        slots = cache.capacity if cache is not None else n_routed
        dec = phase_numbers(gen.stats["decode"], gen.tokens["decode"])
        total = cache.stats if cache is not None else gen.stats["decode"]
        la = None if predictor is None else predictor.lookahead
        ref_load = self.reference.host_load
        return RunResult(
            model=self.model_name,
            policy=pc.policy,
            predictor=None if predictor is None else predictor.kind,
            cache_frac=round(slots / n_routed, 4),
            decode_tok_s=gen.tok_s("decode"),
            prefill_tok_s=gen.tok_s("prefill"),
            stall_s_per_token=dec["stall_s_per_token"],
            bytes_read_per_token=dec["bytes_read_per_token"],
            demand_hit_rate=dec["demand_hit_rate"],
            io_cpu_s_per_token=None if cache is None else dec["io_cpu_s_per_token"],
            wasted_prefetch_bytes=total.prefetch_wasted_bytes,
            output_matches_resident=None if cache is None else matches,
            max_logit_abs_diff=None if cache is None else diff,
            logit_tolerance=self.cfg.logit_tolerance,
            predictor_checkpoint=None if predictor is None else predictor.checkpoint,
            lookahead=la and la.name,
            pool=pc.pool,
            admission=pc.admission_rule,
            foresight=pc.foresight if POLICIES[pc.policy].recorded_routing else None,
            oracle_beyond=pc.oracle_beyond if POLICIES[pc.policy].recorded_routing else None,
            link=link.to_dict(),
            io=self.cfg.io,
            decode=self.cfg.decode.decode,
            device=str(self.device),
            prefetch_extra=extra,
            prefetch_backlog=pc.prefetch_backlog,
            cache_slots=slots,
            expert_bytes=self.layout.nbytes,
            tokens=dict(gen.tokens),
            prompts=len(self.inputs),
            prefill=phase_numbers(gen.stats["prefill"], gen.tokens["prefill"]),
            counters=dict(vars(total)),
            batch=self.cfg.batch,
            host_load={"run": _load_json(gen.host_load), "reference": _load_json(ref_load)},
            host_busy=any(x is not None and x.busy for x in (gen.host_load, ref_load)),
        )


def expert_layout(model, spec: RoutingSpec) -> ExpertLayout:
    """The packed layout of one routed expert (the same in every MoE layer)."""
    check_supported(spec.family)
    return ExpertLayout.of(getattr(moe_block(model, spec, 0), spec.experts_attr))


def _load_json(load) -> dict | None:
    return None if load is None else load.to_json()


def _store_matches(path: Path, fingerprint: str, spec: RoutingSpec, layout: ExpertLayout) -> bool:
    try:
        store = ExpertStore.open(path)
        store.check({"fingerprint": fingerprint}, spec.num_moe_layers, spec.num_experts, layout)
    except TensorbendError:  # none there, or another model's: (re)written
        return False
    store.close()
    return True


def _not_attached(*args, **kwargs):
    raise TensorbendError(
        "this model's experts are offloaded: run it through OffloadSession.run_policy "
        "(or tensorbend.load_offloaded)"
    )
