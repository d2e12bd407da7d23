"""Train a predictor on a trace's train split (val split for early stopping) and save it.

Usage:
    >>> from tensorbend.train import TrainConfig, train
    >>> train(TrainConfig(trace=Path("runs/trace"), out=Path("runs/pred_d1.safetensors"),
    ...                   predictor="tensorbend", lookahead="d1"))

The test split is never read here. The saved checkpoint carries the val metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tensorbend.errors import TensorbendError
from tensorbend.predictors import TRAINABLE, get_lookahead, save_predictor
from tensorbend.trace import Trace


@dataclass(frozen=True)
class TrainConfig:
    trace: Path  # trace directory with train and val prompts
    out: Path  # predictor checkpoint (.safetensors)
    predictor: str = "tensorbend"  # tensorbend | seed_mlp | frequency | transition
    lookahead: str = "d1"  # pre_attn | d1 | d2 | d3 | same_layer
    seed: int = 0
    loss: str | None = (
        None  # override the kind's default loss (tensorbend: listwise|bce; seed_mlp: bce|ranking)
    )
    width: int | None = None  # tensorbend: correction width H; seed_mlp: p
    use_prev: bool = True  # feed previous-token (tensorbend) / previous-layer (seed_mlp) routing
    epochs: int | None = None  # override the kind's default epoch budget
    max_train_prompts: int | None = None  # use only the first N train prompts (ablations)
    max_train_rows: int | None = (
        None  # uniform random sample of train rows (the seed kept <= 10,000 per layer)
    )
    threads: int | None = None  # torch threads (None: leave as is)
    src_scores: bool | None = (
        None  # tensorbend: feed the source layer's router scores (None: default)
    )

    def __post_init__(self):
        if self.predictor not in TRAINABLE:
            raise TensorbendError(
                f"--predictor {self.predictor!r}: expected one of {', '.join(TRAINABLE)}"
            )
        get_lookahead(self.lookahead)


def train(cfg: TrainConfig, progress: bool = True) -> dict:
    """Fit, evaluate on val, save; returns a summary (kind, lookahead, val metrics, params, seconds)."""
    from tensorbend.evaluate import score_predictor
    from tensorbend.predictors.baselines import FrequencyPredictor, TransitionPredictor
    from tensorbend.predictors.fit import FitConfig
    from tensorbend.predictors.residual_gate import ResidualGateConfig, ResidualGatePredictor
    from tensorbend.predictors.seed_mlp import SEED_FIT, SeedMLPConfig, SeedMLPPredictor

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    tr = Trace.open(cfg.trace)
    la = get_lookahead(cfg.lookahead)
    feats = la.features
    train_rows = _rows(tr, feats, "train", cfg.max_train_prompts, cfg.max_train_rows, cfg.seed)
    val_rows = _rows(tr, feats, "val", None, None, cfg.seed)
    for name, rows in (("train", train_rows), ("val", val_rows)):
        if rows["expert_ids_TLK"].shape[0] == 0:
            raise TensorbendError(
                f"trace {cfg.trace} has no {name} prompts: collect with --split all (the default) "
                "so train and val prompts are present"
            )
    spec = tr.spec
    if cfg.predictor == "tensorbend":
        fit = replace(
            ResidualGateConfig().fit, seed=cfg.seed, epochs=cfg.epochs or FitConfig.epochs
        )
        rc = ResidualGateConfig(
            fit=fit,
            use_prev=cfg.use_prev,
            loss=cfg.loss or "listwise",
            hidden=cfg.width or ResidualGateConfig.hidden,
            use_src_scores=(
                ResidualGateConfig.use_src_scores if cfg.src_scores is None else cfg.src_scores
            ),
        )
        p = ResidualGatePredictor.fit(
            spec, la, tr.router_params(), train_rows, val_rows, rc, progress
        )
    elif cfg.predictor == "seed_mlp":
        fit = replace(SEED_FIT, seed=cfg.seed, epochs=cfg.epochs or SEED_FIT.epochs)
        sc = SeedMLPConfig(
            fit=fit,
            use_prev_routing=cfg.use_prev,
            loss=cfg.loss or "bce",
            width=cfg.width or SeedMLPConfig.width,
        )
        p = SeedMLPPredictor.fit(spec, la, train_rows, val_rows, sc, progress)
    else:
        freq = FrequencyPredictor.from_rows(spec, la, train_rows)
        p = (
            freq
            if cfg.predictor == "frequency"
            else TransitionPredictor.from_rows(spec, la, train_rows, freq)
        )
    val = {
        ph: {k: v for k, v in r.items() if k != "per_layer"}
        for ph, r in score_predictor(p, val_rows).items()
    }
    seconds = time.perf_counter() - t0
    # No timings in the checkpoint: the same seed gives the same bytes.
    extra = {
        "train_prompts": int(train_rows["prompt_index_T"].unique().numel()),
        "trace": str(cfg.trace),
    }
    if hasattr(p, "train_rows_recall"):
        extra["train_rows_recall"] = p.train_rows_recall
    save_predictor(
        p, cfg.out, fingerprint=tr.manifest["model"]["fingerprint"], val_metrics=val, extra=extra
    )
    return {
        "predictor": p.kind,
        "lookahead": la.name,
        "out": str(cfg.out),
        "params": p.num_params(),
        "val": {
            ph: round(v["recall_at_k"], 4) if v["recall_at_k"] is not None else None
            for ph, v in val.items()
        },
        "seconds": round(seconds, 1),
        **{k: v for k, v in extra.items() if k != "trace"},
    }


def _rows(
    tr: Trace, feats, split: str, max_prompts: int | None, max_rows: int | None, seed: int
) -> dict:
    rows = tr.load(feats, split=split)
    T = rows["prompt_index_T"].shape[0]
    keep = torch.ones(T, dtype=torch.bool)
    if max_prompts is not None:
        first = sorted(set(rows["prompt_index_T"].tolist()))[:max_prompts]
        keep &= torch.isin(
            rows["prompt_index_T"], torch.tensor(first, dtype=rows["prompt_index_T"].dtype)
        )
    if max_rows is not None and int(keep.sum()) > max_rows:
        idx = keep.nonzero().flatten()
        chosen = idx[
            torch.randperm(idx.numel(), generator=torch.Generator().manual_seed(seed))[:max_rows]
        ]
        keep = torch.zeros(T, dtype=torch.bool)
        keep[chosen] = True
    if bool(keep.all()):
        return rows
    new_index = torch.cumsum(keep.long(), 0) - 1
    prev = rows["prev_row_T"]
    prev_kept = (prev >= 0) & keep[prev.clamp(min=0)]
    out = {k: v[keep] for k, v in rows.items()}
    out["prev_row_T"] = torch.where(
        prev_kept, new_index[prev.clamp(min=0)], torch.full_like(prev, -1)
    )[keep]
    return out
