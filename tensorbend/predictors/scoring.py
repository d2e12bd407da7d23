"""A predictor scored on trace rows: the metrics per target layer and phase (train and eval).

Usage:
    rows = trace.load(pred.lookahead.features, split="val")
    report = score_predictor(pred, rows)        # {phase: {recall_at_k, ..., per_layer}}
    whole = merge_scores([score_predictor(pred, chunk) for chunk in chunks])  # disjoint rows

`tensorbend train` scores its validation split with it; `tensorbend eval` scores the held-out
split shard by shard and merges the chunks (the same numbers as scoring the split at once).
The metrics themselves: metrics.py.
"""

from __future__ import annotations

from tensorbend.capture.trace import PHASES
from tensorbend.predictors.base import sources_from_rows
from tensorbend.predictors.metrics import mean_over_layers, merge_token_means, set_metrics


def score_predictor(pred, rows: dict, overprovision=(0, 2, 4)) -> dict:
    """{phase: {recall_at_k, hit_at_k_plus_p, exact_match, miss_rate, tokens, per_layer}}."""
    la = pred.lookahead
    L = rows["expert_ids_TLK"].shape[1]
    if pred.needs_truth:
        pred.set_truth(rows["expert_ids_TLK"])
    per_phase = {ph: [] for ph in PHASES}
    for m in la.targets(L):
        scores_TE = pred.scores(m, sources_from_rows(rows, la, m))
        truth_TK = rows["expert_ids_TLK"][:, m].long()
        for code, ph in enumerate(PHASES):
            mask_T = rows["phase_T"] == code
            per_phase[ph].append(
                {"layer": m, **set_metrics(scores_TE[mask_T], truth_TK[mask_T], overprovision)}
            )
    return {ph: {**mean_over_layers(v), "per_layer": v} for ph, v in per_phase.items()}


def merge_scores(parts: list[dict]) -> dict:
    """score_predictor results of disjoint row chunks -> the result over all their rows."""
    out = {}
    for ph in PHASES:
        layers = zip(*(p[ph]["per_layer"] for p in parts), strict=True)
        per_layer = [{"layer": ms[0]["layer"], **merge_token_means(ms)} for ms in layers]
        out[ph] = {**mean_over_layers(per_layer), "per_layer": per_layer}
    return out
