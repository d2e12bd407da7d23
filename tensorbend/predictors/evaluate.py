"""Evaluate predictors and peers on a trace's held-out prompts, per lookahead and phase.

Usage:
    from tensorbend.predictors.evaluate import EvalConfig, evaluate
    report = evaluate(EvalConfig(trace=Path("runs/trace"), predictors=(Path("p.safetensors"),),
                                 baselines=("all",), lookaheads=("d1",)))
    report.to_json()["results"][0]["recall_at_k"]

Metrics are averaged over tokens per target layer, then over the lookahead's valid target
layers (m >= d). Table-based peers (frequency, prev_token, transition) are fitted on the same
trace's train split; the test split is only scored. A checkpoint is refused on prompts it was
trained or early-stopped on unless `allow_seen_split` is set.

`EvalReport.to_json()` keys (`tensorbend eval --json`; other tools read them):
  model, trace, split, top_k, num_experts, num_moe_layers, decode_mode,
  lookaheads {name: lead time in words}, prompts {train, val, test: prompt counts},
  results: one per predictor x lookahead x phase with rows of that phase:
    predictor (kind), checkpoint (path or null for a peer built in the run), lookahead, phase,
    recall_at_k, hit_at_k_plus_p {"0", "2", "4", ..., "K": hits among top-(k+p) / k},
    exact_match, miss_rate, tokens, params, us_per_token (batch 1, one thread, per target
    layer; null when not timed), us_per_token_all_layers, target_layers, per_layer [{layer,
    recall_at_k, hit_at_k_plus_p, exact_match, miss_rate, tokens}]

Shapes: T tokens, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tensorbend.capture.trace import PHASES, Trace
from tensorbend.errors import TensorbendError
from tensorbend.predictors.base import (
    HEADLINE_LOOKAHEADS,
    LookaheadName,
    PredictorConfigError,
    TrainData,
    get_lookahead,
)
from tensorbend.predictors.checkpoint import check_held_out, load_predictor
from tensorbend.predictors.latency import us_per_token
from tensorbend.predictors.registry import BASELINES, KINDS, BaselineChoice, build
from tensorbend.predictors.scoring import merge_scores, score_predictor


@dataclass(frozen=True)
class EvalConfig:
    trace: Path
    """Trace directory to score."""
    predictors: tuple[Path, ...] = ()
    """Trained checkpoints (each at its own lookahead)."""
    baselines: tuple[BaselineChoice, ...] = ("all",)
    """Peers to build in the run (all: every baseline kind; empty: none)."""
    lookaheads: tuple[LookaheadName, ...] = ()
    """Lookaheads of the peers (empty: every headline lookahead the trace supports)."""
    split: Literal["test", "val", "train", "all"] = "test"
    """Prompts to score (all: for a trace never used in training)."""
    timing_rows: int = 50
    """Batch-1 calls per target layer for us_per_token (0: no timing)."""
    overprovision: tuple[int, ...] = (0, 2, 4)
    """Over-provision p of hit@k+p (k itself is always added, as "K")."""
    allow_seen_split: bool = False
    """Score a checkpoint on prompts it was trained or early-stopped on (not held out)."""
    cache_frac: float = 0.25
    """Cache size (fraction of all routed experts) of the replay that scores a cross-token
    (horizon) checkpoint against the caches and oracles."""

    def __post_init__(self):
        bad = [b for b in self.baselines if b != "all" and b not in BASELINES]
        if bad:
            raise PredictorConfigError(
                f"--baselines {bad}: expected 'all' or names from {', '.join(BASELINES)}"
            )
        for la in self.lookaheads:
            get_lookahead(la)
        if self.split not in ("test", "val", "train", "all") or self.timing_rows < 0:
            raise PredictorConfigError(
                f"eval: expected split in test|val|train|all and timing_rows >= 0, found "
                f"split={self.split!r}, timing_rows={self.timing_rows}"
            )


@dataclass(frozen=True)
class EvalRow:
    predictor: str
    checkpoint: str | None
    lookahead: str
    phase: str
    recall_at_k: float
    hit_at_k_plus_p: dict
    exact_match: float
    miss_rate: float
    tokens: int
    params: int
    us_per_token: float | None
    us_per_token_all_layers: float | None
    target_layers: list
    per_layer: list

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EvalReport:
    model: str
    trace: str
    split: str
    top_k: int
    num_experts: int
    num_moe_layers: int
    decode_mode: str
    lookaheads: dict
    prompts: dict
    results: list  # of EvalRow
    foresight: list = dataclasses.field(default_factory=list)  # cross-token checkpoints' reports

    def to_json(self) -> dict:
        return dataclasses.asdict(self)  # results: EvalRow -> dicts too


def evaluate(cfg: EvalConfig, progress: bool = False) -> EvalReport:
    tr = Trace.open(cfg.trace)
    spec = tr.spec
    lookaheads = _lookaheads(cfg, tr)
    fingerprint = tr.manifest["model"]["fingerprint"]
    scored = [p["id"] for p in tr.prompts if cfg.split == "all" or p["split"] == cfg.split]
    for path in () if cfg.allow_seen_split else cfg.predictors:  # metadata only: before rows
        check_held_out(path, scored, cfg.split, fingerprint)
    loaded = [load_predictor(p, spec=spec, fingerprint=fingerprint) for p in cfg.predictors]
    across = [p for p in loaded if KINDS[p.kind].cross_token]
    loaded = [p for p in loaded if not KINDS[p.kind].cross_token]
    names = _check_features(_baseline_names(cfg, tr), lookaheads, tr, "all" not in cfg.baselines)
    needs_train = any(KINDS[n].needs_train_data for n in names)
    data = TrainData(
        train_rows=tr.load(("ids",), split="train") if needs_train else None,
        router_params=tr.router_params(),
    )
    jobs = [(build(n, spec, get_lookahead(la), data), None) for la in lookaheads for n in names]
    results = _score_jobs([*jobs, *((p, p.checkpoint) for p in loaded)], tr, cfg)
    info = tr.info()
    named = dict.fromkeys([*lookaheads, *(p.lookahead.name for p in loaded)])
    return EvalReport(
        model=info["model"],
        trace=str(cfg.trace),
        split=cfg.split,
        top_k=spec.top_k,
        num_experts=spec.num_experts,
        num_moe_layers=spec.num_moe_layers,
        decode_mode=info["decode_mode"],
        lookaheads={n: get_lookahead(n).lead_time for n in named},
        prompts={s: info["splits"][s] for s in ("train", "val", "test")},
        results=results,
        foresight=[_foresight(p, tr, cfg) for p in across],
    )


def _foresight(pred, tr: Trace, cfg: EvalConfig) -> dict:
    """A cross-token checkpoint's foresight metrics and cache replay (foresight.py)."""
    from tensorbend.predictors.foresight import evaluate_foresight

    rows = tr.load(pred.cfg.features, split=None if cfg.split == "all" else cfg.split)
    report = evaluate_foresight(pred, rows, cache_frac=cfg.cache_frac)
    return {"predictor": pred.kind, "checkpoint": pred.checkpoint, **report}


def _lookaheads(cfg: EvalConfig, tr: Trace) -> tuple[str, ...]:
    """The peers' lookaheads: as configured, or every headline one the trace has features for
    (on a routing-only trace: d1..d3, where routing-only peers read the source layer's ids)."""
    routing_only = not any(f in tr.features for f in ("gate_input", "layer_input"))
    default = tuple(n for n in HEADLINE_LOOKAHEADS if get_lookahead(n).hidden in tr.features)
    return cfg.lookaheads or (("d1", "d2", "d3") if routing_only else default)


def _check_features(names: list[str], lookaheads, tr: Trace, explicit: bool) -> list[str]:
    """Drop (all) or refuse (named) peers whose lookahead needs a hidden state the trace lacks."""
    keep = []
    for n in names:
        missing = [
            h
            for la in lookaheads
            if KINDS[n].needs_hidden and (h := get_lookahead(la).hidden) not in tr.features
        ]
        if not missing:
            keep.append(n)
        elif explicit:
            raise TensorbendError(
                f"{n} at lookahead {', '.join(lookaheads)} needs trace feature {missing[0]!r}, "
                f"found {tr.features} in {tr.root}: recollect with --features ids {missing[0]}, "
                "or use routing-only peers (frequency, transition, prev_token)"
            )
    return keep


def _score_jobs(jobs: list, tr: Trace, cfg: EvalConfig) -> list[EvalRow]:
    """Score (predictor, checkpoint) pairs on the split, streaming the rows shard by shard
    (whole prompts; memory: one shard's rows per feature set) and merging the per-layer
    token means by token counts."""
    over = tuple(dict.fromkeys((*cfg.overprovision, tr.spec.top_k)))  # p = K reported as "K"
    split = None if cfg.split == "all" else cfg.split
    by_feats: dict[tuple, list[int]] = {}
    for j, (pred, _) in enumerate(jobs):
        by_feats.setdefault(KINDS[pred.kind].features(pred.lookahead), []).append(j)
    parts: list[list[dict]] = [[] for _ in jobs]
    timing: list[float | None] = [None] * len(jobs)
    for feats, js in by_feats.items():
        for rows in tr.iter_shards(feats, split=split):
            for j in js:
                pred = jobs[j][0]
                parts[j].append(score_predictor(pred, rows, over))
                if timing[j] is None:
                    timing[j] = us_per_token(pred, rows, cfg.timing_rows)
    if jobs and not parts[0]:
        raise TensorbendError(f"trace {cfg.trace} has no {cfg.split} prompts to evaluate on")
    return [
        row
        for (pred, ckpt), ps, us in zip(jobs, parts, timing, strict=True)
        for row in _rows_of(pred, ckpt, merge_scores(ps), us)
    ]


def _rows_of(pred, ckpt, by_phase: dict, us: float | None) -> list[EvalRow]:
    K = pred.spec.top_k
    out = []
    for phase in PHASES:
        r = by_phase[phase]
        if not r["tokens"]:
            continue
        n_layers = len(r["per_layer"])
        out.append(
            EvalRow(
                predictor=pred.kind,
                checkpoint=ckpt,
                lookahead=pred.lookahead.name,
                phase=phase,
                recall_at_k=r["recall_at_k"],
                hit_at_k_plus_p={**r["hit_at_k_plus_p"], "K": r["hit_at_k_plus_p"][str(K)]},
                exact_match=r["exact_match"],
                miss_rate=r["miss_rate"],
                tokens=r["tokens"],
                params=pred.num_params(),
                us_per_token=us,
                us_per_token_all_layers=None if us is None else us * n_layers,
                target_layers=[x["layer"] for x in r["per_layer"]],
                per_layer=r["per_layer"],
            )
        )
    return out


def _baseline_names(cfg: EvalConfig, tr: Trace) -> list[str]:
    """Peers to build; table peers need a train split that is not being scored."""
    names = list(BASELINES) if "all" in cfg.baselines else list(cfg.baselines)
    has_train = any(p["split"] == "train" for p in tr.prompts)
    if has_train and cfg.split not in ("train", "all"):
        return names
    skipped = [n for n in names if KINDS[n].needs_train_data]
    if skipped and "all" not in cfg.baselines:
        why = "is being evaluated" if has_train else "this trace lacks"
        raise TensorbendError(
            f"baselines {skipped} fit tables on the trace's train split, which {why}: "
            "drop them or use another trace"
        )
    return [n for n in names if n not in skipped]


def format_table(report) -> str:
    """Terminal table: one line per predictor x lookahead x phase (report: EvalReport or its JSON)."""
    rep = report.to_json() if isinstance(report, EvalReport) else report
    K = rep["top_k"]
    head = (
        f"{'predictor':<12} {'lookahead':<10} {'phase':<8} {'recall@' + str(K):>9} {'hit@k+2':>8} "
        f"{'hit@k+4':>8} {'hit@2k':>7} {'exact':>6} {'params':>9} {'us/tok/layer':>12}"
    )
    lines = [
        f"model {rep['model']}  split {rep['split']}  decode rows: {rep['decode_mode']}  "
        f"top-k {K} of {rep['num_experts']}  prompts {rep['prompts']}",
        head,
        "-" * len(head),
    ]
    for r in sorted(rep["results"], key=lambda r: (r["phase"], r["lookahead"], -r["recall_at_k"])):
        h = r["hit_at_k_plus_p"]
        us = "-" if r["us_per_token"] is None else f"{r['us_per_token']:.1f}"
        lines.append(
            f"{r['predictor']:<12} {r['lookahead']:<10} {r['phase']:<8} {r['recall_at_k']:>9.4f} "
            f"{h.get('2', float('nan')):>8.4f} {h.get('4', float('nan')):>8.4f} {h['K']:>7.4f} "
            f"{r['exact_match']:>6.3f} {r['params']:>9} {us:>12}"
        )
    lines.append("lead times: " + "; ".join(f"{k}: {v}" for k, v in rep["lookaheads"].items()))
    for f in rep.get("foresight", []):
        from tensorbend.predictors.foresight import format_foresight

        lines += ["", format_foresight(f)]
    return "\n".join(lines)
