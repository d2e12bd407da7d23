"""What predicts, and how wide a prefetch is: one spec for serving (`load_offloaded`,
`tensorbend generate`), `tensorbend measure` and `tensorbend simulate`, each nesting it (the flags
--predictor, --baseline, --horizon, --prefetch-extra come from its fields; `simulate` names its
within-token predictors and peers in its own --predictor list instead).

Usage:
    >>> spec = PredictorSpec(prefetch_extra=1)   # (checkpoint files are checked, kinds too)
    >>> spec.check_policy("lru"), prefetch_width(top_k=2, extra=spec.prefetch_extra)
    (None, 3)
    >>> spec.check_policy("prefetch")
    Traceback (most recent call last):
    ...
    tensorbend.errors.TensorbendError: --policy prefetch needs a predictor: --predictor PRED, --baseline NAME and/or --horizon PRED

`check_policy` is the one check of predictors against a policy (a config's, or the objects an
`OffloadSession.run_policy` caller passes); `prefetch_width` the one check of the width (the
runtime's `prefetch.Prefetcher`, the simulator).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tensorbend.errors import TensorbendError
from tensorbend.predictors.checkpoint import is_peer_name, read_metadata
from tensorbend.predictors.recency import NAME as PEER_HORIZON
from tensorbend.predictors.registry import BASELINES, KINDS, check_roles

PEERS = tuple(b for b in BASELINES if not KINDS[b].cls.needs_truth)  # oracle: --policy oracle
"""The peers --baseline builds by name (each needs the model, some a trace: `NEEDS_TRACE`)."""
NEEDS_TRACE = tuple(b for b in PEERS if KINDS[b].needs_train_data)


@dataclass(frozen=True)
class PredictorSpec:
    """The predictors of --policy prefetch and the width of a decode token's prefetch."""

    predictor: Path | None = None
    """Within-token predictor checkpoint (`tensorbend train`): prefetches ahead of the router
    (with --policy prefetch)."""
    baseline: str | None = field(default=None, metadata={"choices": PEERS})
    """Peer within-token predictor by name, instead of --predictor (with --policy prefetch):
    spec_gate (the next layer's router on the current router input; no training), random, or
    a table peer fit on a trace (`run` only, with --trace)."""
    horizon: Path | None = None
    """Cross-token predictor checkpoint (`tensorbend train --predictor horizon`), or `recency`
    (the training-free peer: the request's decayed routing): its forecasts drive eviction
    (Reuse) and next-forward prefetches (with --policy prefetch)."""
    prefetch_extra: int = 0
    """Batch-1 decode prefetches the top-(K + extra) predicted experts (negative: fewer than
    the K routed, down to 1 - K: only the likeliest one)."""

    def __post_init__(self) -> None:
        if self.predictor is not None and self.baseline is not None:
            raise TensorbendError("--predictor and --baseline both given: expected one; drop one")
        if self.baseline is not None and self.baseline not in PEERS:
            raise TensorbendError(f"--baseline {self.baseline}: expected one of {', '.join(PEERS)}")
        for flag, path in (("--predictor", self.predictor), ("--horizon", self.horizon)):
            if flag == "--horizon" and is_peer_name(path):
                continue
            if path is not None and not Path(path).is_file():
                how = " --predictor horizon" if flag == "--horizon" else ""
                raise TensorbendError(
                    f"{flag} {path}: expected a checkpoint file, found none; train one with "
                    f"`tensorbend train{how}`"
                )
        kinds = [
            None if p is None else PEER_HORIZON if is_peer_name(p) else read_metadata(p)["kind"]
            for p in (self.predictor, self.horizon)
        ]
        check_roles(*kinds, ("--predictor", "--horizon"))

    def check_policy(self, policy: str) -> None:
        """Refuse a policy that these predictors do not fit."""
        within = self.predictor is not None or self.baseline is not None
        check_policy(policy, within, self.horizon is not None)


def check_policy(policy: str, within: bool, horizon: bool) -> None:
    """--policy prefetch needs a within-token predictor and/or a horizon; no other policy takes
    one."""
    if policy == "prefetch" and not (within or horizon):
        raise TensorbendError(
            "--policy prefetch needs a predictor: --predictor PRED, --baseline NAME and/or "
            "--horizon PRED"
        )
    if policy != "prefetch" and (within or horizon):
        raise TensorbendError(
            f"--predictor/--baseline/--horizon with --policy {policy}: expected --policy "
            "prefetch (only it uses predictors); drop them or change the policy"
        )


def prefetch_width(top_k: int, extra: int) -> int:
    """A one-token call's prefetch list length, K + extra; refuses a width of no expert."""
    if top_k + extra < 1:
        raise TensorbendError(
            f"--prefetch-extra {extra}: expected at least {1 - top_k} (a one-token call "
            f"prefetches its top-(K + extra) predictions; the model routes top-{top_k})"
        )
    return top_k + extra
