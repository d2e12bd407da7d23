"""Predictors: peers (baselines), the seed's MLP, and ours, behind one interface (base.py).

>>> from tensorbend.predictors import build_baseline, load_predictor, LOOKAHEADS
"""

from tensorbend.predictors.base import (
    LOOKAHEADS,
    Lookahead,
    SourceBatch,
    get_lookahead,
    sources_from_rows,
)
from tensorbend.predictors.baselines import BASELINES, build_baseline
from tensorbend.predictors.checkpoint import load_predictor, save_predictor

TRAINABLE = ("tensorbend", "seed_mlp", "frequency", "transition")

__all__ = [
    "BASELINES",
    "LOOKAHEADS",
    "TRAINABLE",
    "Lookahead",
    "SourceBatch",
    "build_baseline",
    "get_lookahead",
    "load_predictor",
    "save_predictor",
    "sources_from_rows",
]
