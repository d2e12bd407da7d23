"""`tensorbend measure`: load a model, build the predictor, run one policy against the resident model.

Usage:
    >>> from tensorbend.cache.config import PolicyConfig
    >>> from tensorbend.predictors.spec import PredictorSpec
    >>> cfg = RunConfig(model="zoo:default", offload=PolicyConfig("prefetch"),
    ...                 prediction=PredictorSpec(baseline="spec_gate"))
    >>> result = run(cfg)                                                    # doctest: +SKIP
    >>> result.to_json()["output_matches_resident"]                          # doctest: +SKIP
    True

Every check that needs no model (flags, files, checkpoint kinds, link syntax, device) happens
in `RunConfig.__post_init__`; the prompts (held out from the checkpoints unless
--allow-seen-split, a continuation each for a teacher-forced batch) right after reading them;
the cache size against the model's experts right after loading it, before the resident
reference run. Returns a `result.RunResult`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tensorbend.cache.config import PolicyConfig
from tensorbend.cache.transfers import check_link
from tensorbend.errors import TensorbendError
from tensorbend.memory import check_device
from tensorbend.models import RoutingSpec, describe_model
from tensorbend.offload.result import RunResult
from tensorbend.offload.session import OffloadSession, SessionConfig, expert_layout
from tensorbend.predictors.checkpoint import check_held_out
from tensorbend.predictors.spec import NEEDS_TRACE, PredictorSpec
from tensorbend.routers import model_fingerprint


@dataclass(frozen=True)
class RunConfig:
    """What `tensorbend measure` asks for: one model, one prompt set, one policy."""

    model: str
    """Local HF checkpoint directory or zoo:NAME."""
    prompts: Path | None = None
    """Prompts JSONL (default: the shipped prompts)."""
    split: Literal["train", "val", "test", "all"] = "test"
    """Which prompts of the file to run."""
    max_prompts: int | None = 8
    """Run at most this many prompts (file order)."""
    prediction: PredictorSpec = field(
        default_factory=PredictorSpec, metadata={"group": "prediction"}
    )
    """What predicts for --policy prefetch (--predictor or --baseline, --horizon,
    --prefetch-extra)."""
    trace: Path | None = None
    """Trace of this model whose train split fits the table baselines (frequency, prev_token,
    transition)."""
    link: str = "h100-pcie5-kimi"
    """Transfer cap: none, h100-pcie5-kimi (the real system's transfer/compute ratio, scaled
    to this machine), or BANDWIDTH[,LATENCY] like 40MB/s,20us."""
    link_speedup: float = 1.0
    """Make the link this many times faster (bandwidth x N, latency / N)."""
    device: str = "cpu"
    """Where the model and the expert cache live: cpu or cuda[:N]."""
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """Compute dtype of the model (bit-identical outputs are checked in any dtype)."""
    allow_seen_split: bool = False
    """Run a checkpoint on prompts it was trained or early-stopped on (not held out)."""
    offload: PolicyConfig = field(default_factory=PolicyConfig, metadata={"group": "cache policy"})
    """Policy and cache options."""
    session: SessionConfig = field(
        default_factory=SessionConfig, metadata={"group": "prompts, store and threads"}
    )
    """Decode mode, store and I/O options."""

    def __post_init__(self) -> None:
        if self.max_prompts is not None and self.max_prompts < 1:
            raise TensorbendError(
                f"--max-prompts {self.max_prompts}: expected a count >= 1 (or leave it out)"
            )
        _check_predictor(self)
        check_link(self.link)
        if not self.link_speedup > 0:
            raise TensorbendError(f"--link-speedup {self.link_speedup}: expected a number > 0")
        check_device(self.device)


def run(cfg: RunConfig) -> RunResult:
    """Resident reference + one offloaded run of `cfg.offload.policy`."""
    from tensorbend.capture.hf import load_model
    from tensorbend.capture.prompts import load_prompts

    prompts = load_prompts(cfg.prompts, cfg.split)[: cfg.max_prompts]
    if not prompts:
        raise TensorbendError(
            f"no prompts in split {cfg.split!r} of {cfg.prompts or 'the shipped prompts'}: "
            f"expected at least one; pick another --split"
        )
    cfg.session.check_prompts(prompts)
    pred = cfg.prediction
    checkpoints = (pred.predictor, pred.horizon)
    for path in () if cfg.allow_seen_split else checkpoints:
        if path is not None:
            check_held_out(path, [p.id for p in prompts], cfg.split)
    model, tok = load_model(cfg.model, cfg.dtype, cfg.device)
    spec = describe_model(model)
    la = cfg.offload.lookahead
    predictor = build_predictor(model, pred.predictor, pred.baseline, la, cfg.trace, spec)
    horizon = build_predictor(model, pred.horizon, None, la, None, spec)
    cfg.offload.slots(spec, expert_layout(model, spec).nbytes)  # too small: fail before the run
    sess = OffloadSession(model, tok, prompts, cfg.session, model_name=cfg.model, spec=spec)
    try:
        link = sess.link(cfg.link, cfg.link_speedup)
        return sess.run_policy(cfg.offload, predictor, link, horizon, pred.prefetch_extra)
    finally:
        sess.close()


def build_predictor(
    model,
    path: Path | None,
    baseline: str | None,
    lookahead: str,
    trace: Path | None,
    spec: RoutingSpec | None = None,
):
    """A trained checkpoint, a named baseline, or None (spec: the model's description, when the
    caller has it)."""
    spec = spec or describe_model(model)
    if path is not None:
        from tensorbend.predictors.checkpoint import load_predictor

        return load_predictor(path, spec, model_fingerprint(model, spec))
    if baseline is None:
        return None
    from tensorbend.predictors.registry import build_baseline
    from tensorbend.routers import router_params

    rows = None
    if trace is not None:
        from tensorbend.capture.trace import Trace

        rows = Trace.open(trace).load(("ids",), split="train")
    return build_baseline(
        baseline, spec, lookahead, router_params=router_params(model, spec), train_rows=rows
    )


def _check_predictor(cfg: RunConfig) -> None:
    cfg.prediction.check_policy(cfg.offload.policy)
    if cfg.prediction.baseline in NEEDS_TRACE and cfg.trace is None:
        raise TensorbendError(
            f"--baseline {cfg.prediction.baseline} learns tables from data: expected --trace DIR "
            f"(a trace of this model, from `tensorbend collect`)"
        )
    if cfg.trace is not None and not (Path(cfg.trace) / "manifest.json").is_file():
        raise TensorbendError(
            f"--trace {cfg.trace}: expected a trace directory with manifest.json, found none"
        )
