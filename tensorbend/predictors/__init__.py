"""Predictors: peers (baselines), the seed's MLP, and ours, behind one interface (base.py).

>>> from tensorbend.predictors import KINDS, TRAINABLE, build_baseline, load_predictor, LOOKAHEADS
>>> list(KINDS)[:2]
['tensorbend', 'horizon']

Modules: base (lookaheads, SourceBatch, the Predictor protocol), ops (shared tensor ops),
registry (the table of kinds), baselines (peers), residual_gate + residual_fast (ours),
horizon + horizon_fast (ours across tokens: when each expert is next used; numpy at decode),
seed_mlp + seed_net (the seed's predictor), seed_api (the seed's ExpertPredictorSet),
fit (the training loop), checkpoint (save/load), spec (PredictorSpec: what serving, `run` and
`simulate` predict with, and how wide a prefetch is).
"""

from tensorbend.predictors.base import (
    LOOKAHEADS,
    Lookahead,
    SourceBatch,
    TrainData,
    get_lookahead,
    sources_from_rows,
)
from tensorbend.predictors.checkpoint import load_predictor, save_predictor
from tensorbend.predictors.registry import (
    BASELINES,
    KINDS,
    TRAINABLE,
    build,
    build_baseline,
    get_kind,
)

__all__ = [
    "BASELINES",
    "KINDS",
    "LOOKAHEADS",
    "TRAINABLE",
    "Lookahead",
    "SourceBatch",
    "TrainData",
    "build",
    "build_baseline",
    "get_kind",
    "get_lookahead",
    "load_predictor",
    "save_predictor",
    "sources_from_rows",
]
