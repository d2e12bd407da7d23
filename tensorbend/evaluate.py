"""Evaluate predictors and peers on a trace's held-out prompts, per lookahead and phase.

Usage:
    >>> from tensorbend.evaluate import EvalConfig, evaluate
    >>> report = evaluate(EvalConfig(trace=Path("runs/trace"), predictors=(Path("p.safetensors"),),
    ...                              baselines=("all",), lookaheads=("d1",)))
    >>> report["results"][0]["recall_at_k"]

Metrics are averaged over tokens per target layer, then over the lookahead's valid target
layers (m >= d). Table-based peers (frequency, prev_token, transition) are fitted on the same
trace's train split; the test split is only scored. Each result states the predictor kind,
checkpoint, lookahead and phase; JSON keys follow DESIGN.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tensorbend.errors import TensorbendError
from tensorbend.metrics import mean_over_layers, set_metrics
from tensorbend.predictors import (
    BASELINES,
    build_baseline,
    get_lookahead,
    load_predictor,
    sources_from_rows,
)
from tensorbend.predictors.base import HEADLINE_LOOKAHEADS
from tensorbend.predictors.baselines import NEEDS_TRAIN
from tensorbend.trace import PHASES, Trace


@dataclass(frozen=True)
class EvalConfig:
    trace: Path
    predictors: tuple[Path, ...] = ()  # trained checkpoints (each at its own lookahead)
    baselines: tuple[str, ...] = ("all",)  # names from BASELINES, or "all", or () for none
    lookaheads: tuple[
        str, ...
    ] = ()  # for baselines; () = every headline lookahead the trace supports
    split: str = "test"  # test | val | train | all (all: a trace never used in training)
    timing_rows: int = 50  # batch-1 calls per layer for us_per_token
    overprovision: tuple[int, ...] = field(default=(0, 2, 4))  # plus K, always

    def __post_init__(self):
        bad = [b for b in self.baselines if b != "all" and b not in BASELINES]
        if bad:
            raise TensorbendError(
                f"--baselines {bad}: expected 'all' or names from {', '.join(BASELINES)}"
            )
        for la in self.lookaheads:
            get_lookahead(la)


def evaluate(cfg: EvalConfig, progress: bool = False) -> dict:
    tr = Trace.open(cfg.trace)
    spec = tr.spec
    K = spec.top_k
    over = tuple(dict.fromkeys((*cfg.overprovision, K)))  # p = K is reported as "K"
    lookaheads = cfg.lookaheads or tuple(
        name for name in HEADLINE_LOOKAHEADS if get_lookahead(name).hidden in tr.features
    )
    for name in lookaheads:
        if get_lookahead(name).hidden not in tr.features:
            raise TensorbendError(
                f"lookahead {name} needs feature {get_lookahead(name).hidden!r}, trace has {tr.features}: "
                f"recollect with --features ids {get_lookahead(name).hidden}"
            )
    names = [b for b in BASELINES] if "all" in cfg.baselines else list(cfg.baselines)
    has_train = any(p["split"] == "train" for p in tr.prompts)
    if not has_train or cfg.split in ("train", "all"):
        skipped = [n for n in names if n in NEEDS_TRAIN]
        names = [n for n in names if n not in NEEDS_TRAIN]
        if skipped and "all" not in cfg.baselines:
            raise TensorbendError(
                f"baselines {skipped} fit tables on the trace's train split, which "
                f"{'is being evaluated' if has_train else 'this trace lacks'}: drop them or use another trace"
            )
    results = []
    train_ids = tr.load(("ids",), split="train") if any(n in NEEDS_TRAIN for n in names) else None
    router = tr.router_params()
    loaded = [
        load_predictor(p, spec=spec, fingerprint=tr.manifest["model"]["fingerprint"])
        for p in cfg.predictors
    ]
    jobs = [
        (build_baseline(n, spec, la, router_params=router, train_rows=train_ids), None)
        for la in lookaheads
        for n in names
    ]
    jobs += [(p, p.checkpoint) for p in loaded]
    rows_cache: dict[str, dict] = {}
    for pred, ckpt in jobs:
        la = pred.lookahead
        if la.hidden not in rows_cache:
            rows_cache[la.hidden] = tr.load(
                ("ids", la.hidden), split=None if cfg.split == "all" else cfg.split
            )
        rows = rows_cache[la.hidden]
        if rows["expert_ids_TLK"].shape[0] == 0:
            raise TensorbendError(f"trace {cfg.trace} has no {cfg.split} prompts to evaluate on")
        by_phase = score_predictor(pred, rows, over)
        us = _us_per_token(pred, rows, cfg.timing_rows)
        for phase in PHASES:
            r = by_phase[phase]
            if not r["tokens"]:
                continue
            results.append(
                {
                    "predictor": pred.kind,
                    "checkpoint": ckpt,
                    "lookahead": la.name,
                    "phase": phase,
                    "recall_at_k": r["recall_at_k"],
                    "hit_at_k_plus_p": _rename_k(r["hit_at_k_plus_p"], K),
                    "exact_match": r["exact_match"],
                    "miss_rate": r["miss_rate"],
                    "tokens": r["tokens"],
                    "params": pred.num_params(),
                    "us_per_token": us,
                    "us_per_token_all_layers": us * len(r["per_layer"]),
                    "target_layers": [x["layer"] for x in r["per_layer"]],
                    "per_layer": r["per_layer"],
                }
            )
    info = tr.info()
    return {
        "model": info["model"],
        "trace": str(cfg.trace),
        "split": cfg.split,
        "top_k": K,
        "num_experts": spec.num_experts,
        "num_moe_layers": spec.num_moe_layers,
        "decode_mode": info["decode_mode"],
        "lookaheads": {
            n: get_lookahead(n).lead_time
            for n in dict.fromkeys([*lookaheads, *(p.lookahead.name for p in loaded)])
        },
        "prompts": {s: info["splits"][s] for s in ("train", "val", "test")},
        "results": results,
    }


def score_predictor(pred, rows: dict, overprovision=(0, 2, 4)) -> dict:
    """{phase: {recall_at_k, hit_at_k_plus_p, exact_match, miss_rate, tokens, per_layer}}."""
    la = pred.lookahead
    L = rows["expert_ids_TLK"].shape[1]
    if getattr(pred, "kind", None) == "oracle":
        pred.set_truth(rows["expert_ids_TLK"])
    per_phase = {ph: [] for ph in PHASES}
    for m in la.targets(L):
        src = sources_from_rows(rows, la, m)
        scores_TE = pred.scores(m, src)
        truth_TK = rows["expert_ids_TLK"][:, m].long()
        for code, ph in enumerate(PHASES):
            mask = rows["phase_T"] == code
            r = set_metrics(scores_TE[mask], truth_TK[mask], overprovision)
            per_phase[ph].append({"layer": m, **r})
    return {ph: {**mean_over_layers(v), "per_layer": v} for ph, v in per_phase.items()}


def _us_per_token(pred, rows, n: int) -> float:
    """Mean microseconds to score one token for one target layer (batch 1, one CPU thread)."""
    la = pred.lookahead
    L = rows["expert_ids_TLK"].shape[1]
    targets = list(la.targets(L))
    T = rows["expert_ids_TLK"].shape[0]
    if getattr(pred, "kind", None) == "oracle" or not targets or not T:
        return 0.0
    idx = torch.linspace(1, T - 1, steps=min(n, T - 1)).long()
    one = {k: v[idx] for k, v in rows.items()}
    one["prev_row_T"] = torch.full((len(idx),), -1)  # timing only; prev lookup is free
    batches = [(m, sources_from_rows(one, la, m)) for m in targets]
    single = [(m, _row(src, i)) for m, src in batches for i in range(len(idx))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # batch-1 scoring is latency-bound; extra threads only add sync cost
    try:
        for m, s in single[: len(targets)]:  # warm-up (lazy caches)
            pred.scores(m, s)
        t0 = time.perf_counter()
        for m, s in single:
            pred.scores(m, s)
        return (time.perf_counter() - t0) / len(single) * 1e6
    finally:
        torch.set_num_threads(threads)


def _row(src, i: int):
    from tensorbend.predictors.base import SourceBatch

    return SourceBatch(
        src.hidden_TD[i : i + 1],
        None if src.src_ids_TK is None else src.src_ids_TK[i : i + 1],
        src.prev_ids_TK[i : i + 1],
        src.has_prev_T[i : i + 1],
        src.src_layer,
    )


def _rename_k(hits: dict, K: int) -> dict:
    """hit_at_k_plus_p keys "0", "2", "4" and "K" (p = k), as DESIGN.md spells them."""
    return {**hits, "K": hits[str(K)]}


def format_table(report: dict) -> str:
    """Terminal table: one line per predictor x lookahead x phase."""
    K = report["top_k"]
    head = (
        f"{'predictor':<12} {'lookahead':<10} {'phase':<8} {'recall@' + str(K):>9} {'hit@k+2':>8} "
        f"{'hit@k+4':>8} {'hit@2k':>7} {'exact':>6} {'params':>9} {'us/tok/layer':>12}"
    )
    lines = [
        f"model {report['model']}  split {report['split']}  decode rows: {report['decode_mode']}  "
        f"top-k {K} of {report['num_experts']}  prompts {report['prompts']}",
        head,
        "-" * len(head),
    ]
    for r in sorted(
        report["results"], key=lambda r: (r["phase"], r["lookahead"], -r["recall_at_k"])
    ):
        h = r["hit_at_k_plus_p"]
        lines.append(
            f"{r['predictor']:<12} {r['lookahead']:<10} {r['phase']:<8} {r['recall_at_k']:>9.4f} "
            f"{h.get('2', float('nan')):>8.4f} {h.get('4', float('nan')):>8.4f} {h['K']:>7.4f} "
            f"{r['exact_match']:>6.3f} {r['params']:>9} {r['us_per_token']:>12.1f}"
        )
    lines.append("lead times: " + "; ".join(f"{k}: {v}" for k, v in report["lookaheads"].items()))
    return "\n".join(lines)
