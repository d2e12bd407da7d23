"""The table of predictor kinds: train, checkpoint, evaluate, plots and the CLI read it.

Usage:
    >>> from tensorbend.predictors.registry import KINDS, TRAINABLE, BASELINES
    >>> TRAINABLE
    ('tensorbend', 'horizon', 'seed_mlp', 'transition', 'frequency')
    >>> BASELINES
    ('spec_gate', 'transition', 'prev_token', 'frequency', 'random', 'oracle')
    >>> KINDS["spec_gate"].needs_train_data, KINDS["oracle"].cls.needs_truth
    (False, True)

A new predictor kind is one module (a class following predictors/base.py's Predictor protocol:
`fit`, `scores`, `state_tensors`, `from_state`, ...) plus one row here. Row order is the
order of plots and legends. Columns:
  trainable         `tensorbend train` fits it and saves a checkpoint
  baseline          `tensorbend eval --baselines` builds it by name in the same run
  needs_train_data  fitting reads the train split (eval fits these on the trace's train split)
  cross_token       it predicts the next forwards' experts (foresight), not layer m's
A kind's config class (or None) is what its checkpoint stores; `from_train(train_cfg)` on the
config class maps `tensorbend train`'s generic options onto it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Literal

import torch

from tensorbend.errors import PredictorConfigError
from tensorbend.models import RoutingSpec
from tensorbend.predictors.base import Lookahead, TrainData, get_lookahead
from tensorbend.predictors.baselines import (
    FrequencyPredictor,
    OraclePredictor,
    PrevTokenPredictor,
    RandomConfig,
    RandomPredictor,
    SpecGatePredictor,
    TransitionPredictor,
)
from tensorbend.predictors.horizon import HorizonConfig, HorizonPredictor
from tensorbend.predictors.recency import RecencyForecaster
from tensorbend.predictors.residual_gate import ResidualGateConfig, ResidualGatePredictor
from tensorbend.predictors.seed_mlp import SeedMLPConfig, SeedMLPPredictor


@dataclass(frozen=True)
class PredictorKind:
    name: str
    cls: type
    config_cls: type | None
    trainable: bool
    baseline: bool
    needs_train_data: bool
    help: str
    cross_token: bool = False  # predicts the next forwards' experts (foresight), not layer m's
    needs_hidden: bool = True  # reads the source hidden state (else routing only: imported traces)

    def features(self, la: Lookahead) -> tuple[str, ...]:
        """Trace features it reads at lookahead la."""
        return la.features if self.needs_hidden else ("ids",)


_ROWS = (
    PredictorKind(
        name="tensorbend",
        cls=ResidualGatePredictor,
        config_cls=ResidualGateConfig,
        trainable=True,
        baseline=False,
        needs_train_data=True,
        help="ours: the target router on the source hidden state plus a small learned correction",
    ),
    PredictorKind(
        name="horizon",
        cls=HorizonPredictor,
        config_cls=HorizonConfig,
        trainable=True,
        baseline=False,
        needs_train_data=True,
        help="ours across tokens: P(expert used within the next h forwards), for eviction",
        cross_token=True,
    ),
    PredictorKind(
        name="recency",
        cls=RecencyForecaster,
        config_cls=None,
        trainable=False,
        baseline=False,
        needs_train_data=False,
        help="the peer across tokens: the request's decayed routing as the next forwards' (no "
        "training; `--horizon recency`)",
        cross_token=True,
        needs_hidden=False,
    ),
    PredictorKind(
        name="seed_mlp",
        cls=SeedMLPPredictor,
        config_cls=SeedMLPConfig,
        trainable=True,
        baseline=False,
        needs_train_data=True,
        help="the seed's per-layer MLP and training recipe, at any lookahead",
    ),
    PredictorKind(
        name="spec_gate",
        cls=SpecGatePredictor,
        config_cls=None,
        trainable=False,
        baseline=True,
        needs_train_data=False,
        help="the target layer's own router on the earlier hidden state (speculative gating)",
    ),
    PredictorKind(
        name="transition",
        cls=TransitionPredictor,
        config_cls=None,
        trainable=True,
        baseline=True,
        needs_train_data=True,
        help="P(target expert | source-layer expert) tables from the train split",
        needs_hidden=False,
    ),
    PredictorKind(
        name="prev_token",
        cls=PrevTokenPredictor,
        config_cls=None,
        trainable=False,
        baseline=True,
        needs_train_data=True,
        help="the previous token's experts at the target layer where they exist, else frequency",
        needs_hidden=False,
    ),
    PredictorKind(
        name="frequency",
        cls=FrequencyPredictor,
        config_cls=None,
        trainable=True,
        baseline=True,
        needs_train_data=True,
        help="per-layer expert popularity on the train split",
        needs_hidden=False,
    ),
    PredictorKind(
        name="random",
        cls=RandomPredictor,
        config_cls=RandomConfig,
        trainable=False,
        baseline=True,
        needs_train_data=False,
        help="uniform random scores (the floor)",
        needs_hidden=False,
    ),
    PredictorKind(
        name="oracle",
        cls=OraclePredictor,
        config_cls=None,
        trainable=False,
        baseline=True,
        needs_train_data=False,
        help="the true experts (the ceiling)",
        needs_hidden=False,
    ),
)
KINDS: dict[str, PredictorKind] = {k.name: k for k in _ROWS}
TRAINABLE = tuple(k.name for k in _ROWS if k.trainable)
BASELINES = tuple(k.name for k in _ROWS if k.baseline)
KindName = Literal[tuple(KINDS)]  # type: ignore[valid-type]
TrainableKind = Literal[TRAINABLE]  # type: ignore[valid-type]
BaselineName = Literal[BASELINES]  # type: ignore[valid-type]
BaselineChoice = Literal[(*BASELINES, "all")]  # type: ignore[valid-type]
_TRAIN_OPTIONS = (
    "loss",
    "width",
    "epochs",
    "prev_routing",
    "src_scores",
    "foresight",
    "inputs",
    "fit_layers",
)
CROSS_TOKEN_OPTIONS = ("foresight", "inputs")


def get_kind(name: str) -> PredictorKind:
    if name not in KINDS:
        raise PredictorConfigError(
            f"predictor kind {name!r}: expected one of {', '.join(KINDS)}, found {name!r}"
        )
    return KINDS[name]


def check_roles(
    predictor_kind: str | None,
    horizon_kind: str | None,
    names: tuple[str, str] = ("predictor=", "horizon="),
) -> None:
    """Refuse a cross-token kind as the within-token `predictor`, or a within-token kind as the
    `horizon` (None: not given; a kind outside this table, e.g. the runtime's empty predictor,
    counts as within-token). `names`: how the caller spells the two (flags or keywords)."""
    p_name, h_name = names
    if predictor_kind in KINDS and KINDS[predictor_kind].cross_token:
        raise PredictorConfigError(
            f"{p_name} expected a within-token predictor, found a cross-token one (kind "
            f"{predictor_kind}): pass it as {h_name}"
        )
    if horizon_kind is not None and not (horizon_kind in KINDS and KINDS[horizon_kind].cross_token):
        raise PredictorConfigError(
            f"{h_name} expected a cross-token (horizon) predictor, found kind {horizon_kind} "
            f"(within-token): pass it as {p_name}, or train a horizon with `tensorbend train "
            "--predictor horizon`"
        )


def build(
    name: str,
    spec: RoutingSpec,
    la: Lookahead,
    data: TrainData,
    cfg=None,
    *,
    seed: int = 0,
    progress: bool = False,
):
    """Fit (or just construct) a predictor of kind `name`; cfg None: the kind's default at `seed`."""
    kind = get_kind(name)
    if cfg is None and kind.config_cls is not None:
        cfg = default_config(kind, seed)
    return kind.cls.fit(spec, la, data, cfg, progress=progress)


def build_baseline(
    name: str,
    spec: RoutingSpec,
    lookahead: str | Lookahead,
    router_params: dict[str, torch.Tensor] | None = None,
    train_rows: dict[str, torch.Tensor] | None = None,
    seed: int = 0,
):
    """A ready-to-score peer by name: `build` with the train rows and router parameters it reads."""
    la = get_lookahead(lookahead) if isinstance(lookahead, str) else lookahead
    data = TrainData(train_rows=train_rows, router_params=router_params)
    return build(name, spec, la, data, seed=seed)


def default_config(kind: PredictorKind, seed: int):
    """The kind's default config with its seed (a `seed` field, or its fit config's)."""
    cfg = kind.config_cls()
    names = {f.name for f in dataclasses.fields(cfg)}
    if "seed" in names:
        return dataclasses.replace(cfg, seed=seed)
    if "fit" in names:
        return dataclasses.replace(cfg, fit=dataclasses.replace(cfg.fit, seed=seed))
    return cfg


def config_from_train(kind: PredictorKind, train_cfg):
    """The config of a trainable kind from `tensorbend train`'s options (train.TrainConfig):
    its config class's `from_train`, or None for a kind without options; raises
    PredictorConfigError for an option the kind does not have."""
    assert kind.trainable, kind.name
    if not kind.cross_token:
        for o in CROSS_TOKEN_OPTIONS:
            if getattr(train_cfg, o) is not None:
                raise PredictorConfigError(
                    f"{kind.name} has no option {o}: expected it unset, found "
                    f"{getattr(train_cfg, o)!r}; it is an option of --predictor horizon"
                )
    if kind.config_cls is not None:
        return kind.config_cls.from_train(train_cfg)
    given = [o for o in _TRAIN_OPTIONS if getattr(train_cfg, o) is not None]
    given += [] if train_cfg.use_prev else ["use_prev"]
    if given:
        raise PredictorConfigError(
            f"{kind.name} has no option {given[0]}: expected it unset, found "
            f"{getattr(train_cfg, given[0])!r}; drop it"
        )
    return None


def option_choices(option: str) -> tuple[str, ...]:
    """Every value the kinds' configs accept for a Literal-typed option (e.g. "loss")."""
    out: dict[str, None] = {}
    for k in _ROWS:
        if k.config_cls is not None:
            hint = typing.get_type_hints(k.config_cls).get(option)
            out.update(dict.fromkeys(typing.get_args(hint) if hint is not None else ()))
    return tuple(out)


LOSSES = option_choices("loss")
PREV_ROUTINGS = option_choices("prev_routing")
LossName = Literal[LOSSES]  # type: ignore[valid-type]
PrevRoutingName = Literal[PREV_ROUTINGS]  # type: ignore[valid-type]
