"""`tensorbend run`: load a model, build the predictor, run one policy against the resident model.

Usage:
    >>> from tensorbend.offload.runner import RunConfig, run
    >>> result = run(RunConfig(model="zoo:default", policy="prefetch", baseline="spec_gate"))
    >>> result["decode_tok_s"], result["output_matches_resident"]

The returned dict has the `run --json` keys of DESIGN.md (see runtime.OffloadSession._result).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tensorbend.errors import TensorbendError
from tensorbend.models import describe_model, model_fingerprint
from tensorbend.offload.runtime import OffloadSession, PolicyConfig, SessionConfig


@dataclass(frozen=True)
class RunConfig:
    """What `tensorbend run` asks for: one model, one prompt set, one policy."""

    model: str
    """Local HF checkpoint directory or zoo:NAME."""
    prompts: Path | None = None
    """Prompts JSONL (default: the shipped prompts)."""
    split: str = "test"
    """Which prompts of the file: train, val, test or all."""
    max_prompts: int | None = 8
    """Run at most this many prompts (file order)."""
    policy: str = "lru"
    predictor: Path | None = None
    """Trained predictor checkpoint (for --policy prefetch)."""
    baseline: str | None = None
    """Peer predictor by name (random, prev_token, spec_gate, frequency, transition)."""
    lookahead: str = "d1"
    """Lookahead of a --baseline predictor, and of the oracle."""
    trace: Path | None = None
    """Trace whose train split fits the table baselines (frequency, prev_token, transition)."""
    cache_frac: float = 0.25
    cache_bytes: int | None = None
    link: str = "h100-pcie5-kimi"
    """none, h100-pcie5-kimi (real-system ratio, scaled here), or BANDWIDTH[,LATENCY]."""
    session: SessionConfig = SessionConfig()

    def __post_init__(self) -> None:
        PolicyConfig(self.policy, self.cache_frac, self.cache_bytes, self.lookahead)
        if self.predictor is not None and self.baseline is not None:
            raise TensorbendError("pass one of --predictor and --baseline, not both")


def run(cfg: RunConfig) -> dict:
    """Resident reference + one offloaded run; returns the `run --json` dict (DESIGN.md)."""
    from tensorbend.hf import load_model
    from tensorbend.prompts import load_prompts

    model, tok = load_model(cfg.model)
    prompts = load_prompts(cfg.prompts, cfg.split)[: cfg.max_prompts]
    predictor = build_predictor(model, cfg.predictor, cfg.baseline, cfg.lookahead, cfg.trace)
    sess = OffloadSession(model, tok, prompts, cfg.session, model_name=cfg.model)
    try:
        pc = PolicyConfig(cfg.policy, cfg.cache_frac, cfg.cache_bytes, cfg.lookahead)
        return sess.run_policy(pc, predictor, sess.link(cfg.link))
    finally:
        sess.close()


def build_predictor(
    model, path: Path | None, baseline: str | None, lookahead: str, trace: Path | None
):
    """A trained checkpoint, a named baseline, or None."""
    spec = describe_model(model)
    if path is not None:
        from tensorbend.predictors.checkpoint import load_predictor

        return load_predictor(path, spec, model_fingerprint(model, spec))
    if baseline is None:
        return None
    from tensorbend.models import router_params
    from tensorbend.predictors.baselines import build_baseline

    rows = None
    if trace is not None:
        from tensorbend.trace import Trace

        rows = Trace.open(trace).load(("ids",), split="train")
    return build_baseline(
        baseline, spec, lookahead, router_params=router_params(model, spec), train_rows=rows
    )
