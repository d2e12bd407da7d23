"""`tensorbend run`: load a model, build the predictor, run one policy against the resident model.

Usage:
    >>> from tensorbend.cache.config import PolicyConfig
    >>> cfg = RunConfig(model="zoo:default", offload=PolicyConfig("prefetch"), baseline="spec_gate")
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
from tensorbend.predictors.checkpoint import check_held_out, read_metadata
from tensorbend.predictors.registry import BASELINES, KINDS, check_roles
from tensorbend.routers import model_fingerprint

RUN_BASELINES = tuple(b for b in BASELINES if not KINDS[b].cls.needs_truth)  # oracle: --policy
NEEDS_TRAIN = tuple(b for b in BASELINES if KINDS[b].needs_train_data)


@dataclass(frozen=True)
class RunConfig:
    """What `tensorbend run` asks for: one model, one prompt set, one policy."""

    model: str
    """Local HF checkpoint directory or zoo:NAME."""
    prompts: Path | None = None
    """Prompts JSONL (default: the shipped prompts)."""
    split: Literal["train", "val", "test", "all"] = "test"
    """Which prompts of the file to run."""
    max_prompts: int | None = 8
    """Run at most this many prompts (file order)."""
    predictor: Path | None = None
    """Trained predictor checkpoint (for --policy prefetch)."""
    predictor_group: tuple[Path, ...] = ()
    """Within-token checkpoints of lookaheads d1, d2, ..., dn, in that order (instead of
    --predictor): they fire together from every n-th MoE layer's router, each target layer
    predicted once, so a decode token makes one prediction call site per n layers."""
    baseline: str | None = field(default=None, metadata={"choices": RUN_BASELINES})
    """Peer predictor by name (for --policy prefetch)."""
    horizon: Path | None = None
    """Cross-token predictor checkpoint (`tensorbend train --predictor horizon`) for --policy
    prefetch: its forecasts drive eviction (Reuse) and next-forward prefetches; combinable
    with --predictor/--baseline (within-token prefetches). With --policy evictor: the horizon
    an eviction model trained with `--horizon` reads (forecasts only, no prefetches)."""
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
    offload: PolicyConfig = field(default_factory=PolicyConfig)
    """Policy and cache options."""
    session: SessionConfig = field(default_factory=SessionConfig)
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
    from tensorbend.hf import load_model
    from tensorbend.prompts import load_prompts

    prompts = load_prompts(cfg.prompts, cfg.split)[: cfg.max_prompts]
    if not prompts:
        raise TensorbendError(
            f"no prompts in split {cfg.split!r} of {cfg.prompts or 'the shipped prompts'}: "
            f"expected at least one; pick another --split"
        )
    cfg.session.check_prompts(prompts)
    checkpoints = (cfg.predictor, *cfg.predictor_group, cfg.horizon, cfg.offload.evictor)
    for path in () if cfg.allow_seen_split else checkpoints:
        if path is not None:
            check_held_out(path, [p.id for p in prompts], cfg.split)
    model, tok = load_model(cfg.model, cfg.dtype, cfg.device)
    spec = describe_model(model)
    if cfg.predictor_group:
        predictor = build_group(model, cfg.predictor_group)
    else:
        predictor = build_predictor(
            model, cfg.predictor, cfg.baseline, cfg.offload.lookahead, cfg.trace, spec
        )
    horizon = build_predictor(model, cfg.horizon, None, cfg.offload.lookahead, None, spec)
    cfg.offload.slots(spec, expert_layout(model, spec).nbytes)  # too small: fail before the run
    sess = OffloadSession(model, tok, prompts, cfg.session, model_name=cfg.model, spec=spec)
    try:
        link = sess.link(cfg.link, cfg.link_speedup)
        return sess.run_policy(cfg.offload, predictor, link, horizon)
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
        from tensorbend.trace import Trace

        rows = Trace.open(trace).load(("ids",), split="train")
    return build_baseline(
        baseline, spec, lookahead, router_params=router_params(model, spec), train_rows=rows
    )


def build_group(model, paths):
    """A `predictors.group.PredictorGroup` of the checkpoints at `paths` (d1, d2, ... in order)."""
    from tensorbend.predictors.group import PredictorGroup

    return PredictorGroup(build_predictor(model, Path(p), None, "d1", None) for p in paths)


def _check_predictor(cfg: RunConfig) -> None:
    policy = cfg.offload.policy
    given = [f for f, v in (("--predictor", cfg.predictor), ("--predictor-group",
             cfg.predictor_group), ("--baseline", cfg.baseline)) if v]  # fmt: skip
    if len(given) > 1:
        raise TensorbendError(f"{' and '.join(given)} both given: expected one; drop one")
    within = bool(given)
    if policy == "prefetch" and not within and cfg.horizon is None:
        raise TensorbendError(
            "--policy prefetch needs --predictor PRED, --baseline NAME or --horizon PRED"
        )
    if policy != "prefetch" and (within or (cfg.horizon is not None and policy != "evictor")):
        # (--policy evictor --horizon: a learner reading forecasts; run_policy checks the model)
        raise TensorbendError(
            f"--predictor/--baseline with --policy {policy}: expected --policy prefetch "
            f"(only it uses a predictor); drop the predictor or change the policy"
        )
    for flag, path, kind in (
        ("--predictor", cfg.predictor, ""),
        *(("--predictor-group", p, " --lookahead dN") for p in cfg.predictor_group),
        ("--horizon", cfg.horizon, " --predictor horizon"),
    ):
        if path is not None and not Path(path).is_file():
            raise TensorbendError(
                f"{flag} {path}: expected a checkpoint file, found none; "
                f"train one with `tensorbend train{kind}`"
            )
    kinds = [None if p is None else read_metadata(p)["kind"] for p in (cfg.predictor, cfg.horizon)]
    check_roles(*kinds, ("--predictor", "--horizon"))
    for p in cfg.predictor_group:
        check_roles(read_metadata(p)["kind"], None, ("--predictor-group", "--horizon"))
    if cfg.baseline in NEEDS_TRAIN and cfg.trace is None:
        raise TensorbendError(
            f"--baseline {cfg.baseline} learns tables from data: expected --trace DIR "
            f"(a trace of this model, from `tensorbend collect`)"
        )
    if cfg.trace is not None and not (Path(cfg.trace) / "manifest.json").is_file():
        raise TensorbendError(
            f"--trace {cfg.trace}: expected a trace directory with manifest.json, found none"
        )
