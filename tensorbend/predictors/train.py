"""Train a predictor on a trace's train split (val split for model selection) and save it.

Usage:
    from tensorbend.predictors.train import TrainConfig, train
    result = train(TrainConfig(trace=Path("runs/trace"), out=Path("runs/pred_d1.safetensors"),
                               predictor="tensorbend", lookahead="d1"))
    result.to_json()["val"]["decode"]        # val recall@k of the saved checkpoint

The test split is never read here. Options are checked before any trace is loaded. The saved
checkpoint carries the val metrics and the ids of the prompts it saw (train and val), so
`evaluate` can refuse to score it on them.

`TrainResult.to_json()` keys (what `tensorbend train` prints):
  predictor   the kind (registry name)         lookahead   the lookahead name
  out         checkpoint path                  params      learned parameters (table entries count)
  val         {phase: val recall@k, rounded to 4 places, or None without rows of that phase}
  seconds     wall time of the whole call      train_prompts  train prompts used
  + the predictor's fit summary (seed_mlp: train_rows_recall, the seed's own training-rows number;
    horizon: train_rows, val_rows, the forwards it was fitted and early-stopped on)

Row selection (`rows.select_rows`): the first N train prompts, the first
N prefill tokens of each prompt (the seed's hook kept at most 4 tokens per forward pass; decode
steps are one token each), and a uniform sample of N rows (the seed kept at most 10,000 per
layer), in that order. Each kept row keeps its previous token's routing even when that token's
row is dropped. horizon's rows are forwards (each with its request's history up to it): the
first N train prompts, then a uniform sample of N forwards; it refuses --tokens-per-forward.
Either way only the kept rows and one shard are in memory.

Shapes: T tokens (rows), L MoE layers, K top-k.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from tensorbend.capture.ranks import DistContext
from tensorbend.capture.rows import RowSelection, keep_mask, load_selected
from tensorbend.capture.trace import Trace
from tensorbend.errors import TensorbendError
from tensorbend.predictors.base import (
    LookaheadName,
    PredictorConfigError,
    TrainData,
    get_lookahead,
)
from tensorbend.predictors.checkpoint import save_predictor
from tensorbend.predictors.registry import (
    TRAINABLE,
    LossName,
    PrevRoutingName,
    TrainableKind,
    config_from_train,
    get_kind,
)
from tensorbend.predictors.scoring import score_predictor


@dataclass(frozen=True)
class TrainConfig:
    trace: Path
    """Trace directory with train and val prompts (from `tensorbend collect`)."""
    out: Path
    """Predictor checkpoint to write (.safetensors)."""
    predictor: TrainableKind = "tensorbend"
    """Kind of predictor to train."""
    lookahead: LookaheadName | None = None
    """Source point of the predictions (default d1; horizon predicts across tokens instead)."""
    seed: int = 0
    """Seed of initialisation, shuffling and row sampling."""
    loss: LossName | None = None
    """Training loss, one the kind's config accepts (None: the kind's default)."""
    width: int | None = None
    """tensorbend: correction width H; seed_mlp: hidden width p (None: the kind's default)."""
    use_prev: bool = True
    """Feed previous routing (False: none, for either kind)."""
    prev_routing: PrevRoutingName | None = None
    """seed_mlp: which previous routing to feed (None: the seed's, the previous token's)."""
    epochs: int | None = None
    """Epoch budget (None: the kind's default)."""
    src_scores: bool | None = None
    """tensorbend: also feed the source layer's router scores (None: the default)."""
    foresight: int | None = None
    """horizon: forwards ahead its reuse label looks (None: the default, 4)."""
    inputs: Literal["routing", "routing+hidden"] | None = None
    """horizon: routing history only (imported traces), or also the last hidden state."""
    fit_layers: Literal["joint", "separate"] | None = None
    """tensorbend, seed_mlp: fit all target layers in one loop (the default), or each alone
    with its own early stopping; `separate` is what training over ranks under torchrun runs,
    and gives the same bytes as one process."""
    max_train_prompts: int | None = None
    """Use only the first N train prompts (ablations)."""
    tokens_per_forward: int | None = None
    """Keep only the first N prefill tokens of each train prompt (the seed's hook kept 4)."""
    max_train_rows: int | None = None
    """Uniform random sample of N train rows (the seed kept at most 10,000 per layer; horizon:
    N forwards, each with its request's history)."""
    max_val_rows: int | None = None
    """Uniform random sample of N val rows; with --max-train-rows, training memory is bounded
    whatever the trace size, for every kind (the rows streamed out of the shards)."""
    threads: int | None = None
    """Torch CPU threads (None: leave as is)."""

    def __post_init__(self):
        if self.predictor not in TRAINABLE:
            raise PredictorConfigError(
                f"--predictor {self.predictor!r}: expected one of {', '.join(TRAINABLE)} "
                "(peers are built by `tensorbend eval --baselines`)"
            )
        if self.lookahead is not None:
            get_lookahead(self.lookahead)
            if get_kind(self.predictor).cross_token:
                raise PredictorConfigError(
                    f"--lookahead {self.lookahead} with --predictor {self.predictor}: expected "
                    "no lookahead (it predicts the next forwards from the end of each forward)"
                )
        counts = (
            "foresight",
            "width",
            "epochs",
            "max_train_prompts",
            "tokens_per_forward",
            "max_train_rows",
            "max_val_rows",
        )
        for name in counts:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise PredictorConfigError(f"{name}: expected a positive integer, found {value}")
        _ = self.kind_config  # the kind's own checks: loss names, options it has

    @property
    def kind_config(self):
        """The predictor kind's config built from these options."""
        return config_from_train(get_kind(self.predictor), self)


@dataclass(frozen=True)
class TrainResult:
    predictor: str
    lookahead: str
    out: str
    params: int
    val: dict
    seconds: float
    train_prompts: int
    fit_summary: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "predictor": self.predictor,
            "lookahead": self.lookahead,
            "out": self.out,
            "params": self.params,
            "val": self.val,
            "seconds": self.seconds,
            "train_prompts": self.train_prompts,
            **self.fit_summary,
        }


def train(cfg: TrainConfig, progress: bool = True) -> TrainResult:
    """Fit on the train split, score on val, save the checkpoint."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    kind, kind_cfg = get_kind(cfg.predictor), cfg.kind_config
    tr = Trace.open(cfg.trace)
    ctx = _ranks(kind, kind_cfg)
    if kind.cross_token:
        return _train_cross_token(cfg, kind, kind_cfg, tr, t0, progress)
    la = get_lookahead(cfg.lookahead or "d1")
    feats = kind.features(la)
    missing = [f for f in feats if f not in tr.features]
    if missing:
        raise TensorbendError(
            f"--predictor {kind.name} at lookahead {la.name} needs trace features {list(feats)}, "
            f"found {tr.features} in {cfg.trace}: recollect with --features "
            f"{' '.join(sorted({*tr.features, *missing}))} (a routing-only trace trains "
            "frequency, transition or horizon --inputs routing)"
        )
    sel = RowSelection(cfg.max_train_prompts, cfg.tokens_per_forward, cfg.max_train_rows, cfg.seed)
    train_rows = load_selected(tr, feats, "train", sel)
    val_rows = load_selected(
        tr, feats, "val", RowSelection(max_rows=cfg.max_val_rows, seed=cfg.seed)
    )
    for name, rows in (("train", train_rows), ("val", val_rows)):
        if rows["expert_ids_TLK"].shape[0] == 0:
            raise TensorbendError(
                f"trace {cfg.trace} has no {name} prompts: collect with --split all (the default) "
                "so train and val prompts are present"
            )
    data = TrainData(train_rows, val_rows, tr.router_params())
    p = kind.cls.fit(tr.spec, la, data, kind_cfg, progress=progress and ctx.is_main)
    val = {
        ph: {k: v for k, v in r.items() if k != "per_layer"}
        for ph, r in score_predictor(p, val_rows).items()
    }
    seen = sorted(q["id"] for q in tr.prompts if q["split"] in ("train", "val"))
    extra = {  # no timings in the checkpoint: the same seed gives the same bytes
        "train_prompts": int(train_rows["prompt_index_T"].unique().numel()),
        "trace": str(cfg.trace),
        "seen_prompts": seen,
        **p.fit_summary(),
    }
    fingerprint = tr.manifest["model"]["fingerprint"]
    if ctx.is_main:  # every rank holds the merged predictor; one writes it
        save_predictor(p, cfg.out, fingerprint=fingerprint, val_metrics=val, extra=extra)
    ctx.barrier()
    ctx.close()
    return TrainResult(
        predictor=p.kind,
        lookahead=la.name,
        out=str(cfg.out),
        params=p.num_params(),
        val={
            ph: None if v["recall_at_k"] is None else round(v["recall_at_k"], 4)
            for ph, v in val.items()
        },
        seconds=round(time.perf_counter() - t0, 1),
        train_prompts=extra["train_prompts"],
        fit_summary=p.fit_summary(),
    )


def _train_cross_token(cfg: TrainConfig, kind, kind_cfg, tr: Trace, t0: float, progress: bool):
    """horizon: its rows are forwards, each with its request's history up to it; they are
    streamed out of the shards (`_horizon_rows`), fitted, early stopped on val's, and scored on
    them (foresight.dataset_recalls, kept in the checkpoint)."""
    from tensorbend.predictors.foresight import dataset_recalls

    missing = [f for f in kind_cfg.features if f not in tr.features]
    if missing:
        raise TensorbendError(
            f"--predictor {kind.name} with inputs {kind_cfg.inputs} needs trace features "
            f"{list(kind_cfg.features)}, found {tr.features} in {cfg.trace}: use --inputs routing "
            "(a routing-only trace) or recollect with --features ids gate_input"
        )
    p = kind.cls.seeded(tr.spec, kind_cfg)
    sel = RowSelection(
        max_prompts=cfg.max_train_prompts, max_rows=cfg.max_train_rows, seed=cfg.seed
    )
    train_ds, n_train = _horizon_rows(p, tr, "train", sel)
    val_ds, _ = _horizon_rows(p, tr, "val", RowSelection(max_rows=cfg.max_val_rows, seed=cfg.seed))
    p.fit_dataset(train_ds, val_ds, progress=progress)
    val = dataset_recalls(p, val_ds)
    seen = sorted(q["id"] for q in tr.prompts if q["split"] in ("train", "val"))
    extra = {"train_prompts": n_train, "trace": str(cfg.trace), "seen_prompts": seen}
    fingerprint = tr.manifest["model"]["fingerprint"]
    save_predictor(
        p, cfg.out, fingerprint=fingerprint, val_metrics=val, extra={**extra, **p.fit_summary()}
    )
    return TrainResult(
        predictor=p.kind,
        lookahead=p.lookahead.name,
        out=str(cfg.out),
        params=p.num_params(),
        val={
            "next_forward_recall": round(_mean(val["next_forward_recall"]), 4),
            "within_h_recall": round(_mean(val["within_h_recall"]), 4),
        },
        seconds=round(time.perf_counter() - t0, 1),
        train_prompts=n_train,
        fit_summary=p.fit_summary(),
    )


def _horizon_rows(p, tr: Trace, split: str, sel: RowSelection) -> tuple[dict, int]:
    """(p.dataset rows of `split` kept by `sel`, prompts they come from), in bounded memory as
    `rows.load_selected`: the manifest's per-prompt counts give every row (forward) its prompt,
    `sel` picks rows as it picks token rows (first prompts, then a uniform sample), and one
    shard at a time is read and turned into the kept rows only."""
    from tensorbend.predictors.horizon import training_rows

    prompts = [q for q in tr.prompts if q["split"] == split]
    counts = [training_rows(q["prefill"], q["decode"]) for q in prompts]
    prompt_N = torch.repeat_interleave(
        torch.arange(len(prompts)), torch.tensor(counts, dtype=torch.long)
    )
    keep_N = keep_mask({"prompt_index_T": prompt_N}, sel)
    if not bool(keep_N.any()):
        raise TensorbendError(
            f"trace {tr.root} has no {split} requests of two forwards or more: collect with "
            "--split all (the default) and --max-new-tokens > 0"
        )
    parts, start = [], 0
    for rows in tr.iter_shards(p.cfg.features, split=split):  # whole prompts, manifest order
        shard_prompts = [tr.prompts[q] for q in rows["prompt_index_T"].unique().tolist()]
        n = sum(training_rows(q["prefill"], q["decode"]) for q in shard_prompts)
        if bool(keep_N[start : start + n].any()):
            parts.append(p.dataset(rows, keep_N[start : start + n]))
        start += n
    assert start == keep_N.numel(), (start, keep_N.numel())
    ds = {k: torch.cat([d[k] for d in parts], dim=1) for k in parts[0]}
    return ds, int(prompt_N[keep_N].unique().numel())


def _ranks(kind, kind_cfg) -> DistContext:
    """torchrun's group (training over ranks splits the target layers), or a single rank;
    a kind that cannot be split is refused before joining the group."""
    world = DistContext.world_size_from_env()
    if world > 1 and kind.cross_token:
        raise TensorbendError(
            f"--predictor {kind.name} fits one network over every MoE layer: expected one "
            f"process, found {world} ranks; train it without torchrun"
        )
    if world > 1 and kind_cfg is None:
        raise TensorbendError(
            f"--predictor {kind.name} counts its tables in one pass over the train rows, with no "
            f"per-layer fit to spread: expected one process, found {world} ranks; train it "
            "without torchrun"
        )
    if world > 1 and kind_cfg.fit.layers != "separate":
        raise TensorbendError(
            f"training over {world} ranks spreads the target layers: pass "
            f"--fit-layers separate (each layer fits alone; one process with the same flag "
            f"writes the same bytes), found {kind_cfg.fit.layers!r} for --predictor {kind.name}"
        )
    return DistContext.from_env()


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)
