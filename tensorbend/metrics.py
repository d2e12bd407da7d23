"""Prediction metrics over expert sets (DESIGN.md): recall@k, hit@k+p, exact match.

Usage:
    >>> m = set_metrics(scores_TE, true_ids_TK, overprovision=(0, 2, 4, 8))
    >>> m["recall_at_k"]          # mean over tokens of |top-k(pred) & true| / k

All metrics are averaged over tokens here; callers average per-layer values over layers.
"""

from __future__ import annotations

import torch


def topk_hits(scores_TE: torch.Tensor, true_ids_TK: torch.Tensor, n: int) -> torch.Tensor:
    """|top-n(scores) & true| per token; [T] float."""
    E = scores_TE.shape[1]
    n = min(n, E)
    pred_Tn = scores_TE.topk(n, dim=-1).indices
    true_TE = torch.zeros(scores_TE.shape[0], E, dtype=torch.bool)
    true_TE.scatter_(1, true_ids_TK.long(), True)
    return true_TE.gather(1, pred_Tn).sum(-1).float()


def set_metrics(
    scores_TE: torch.Tensor, true_ids_TK: torch.Tensor, overprovision=(0, 2, 4)
) -> dict:
    """recall_at_k, hit_at_k_plus_p {str(p): x}, exact_match, miss_rate, tokens."""
    T, K = true_ids_TK.shape
    if T == 0:
        return {
            "recall_at_k": None,
            "hit_at_k_plus_p": {str(p): None for p in overprovision},
            "exact_match": None,
            "miss_rate": None,
            "tokens": 0,
        }
    hits_k = topk_hits(scores_TE, true_ids_TK, K)
    hit = {
        str(p): float((topk_hits(scores_TE, true_ids_TK, K + p) / K).mean()) for p in overprovision
    }
    recall = float((hits_k / K).mean())
    return {
        "recall_at_k": recall,
        "hit_at_k_plus_p": hit,
        "exact_match": float((hits_k == K).float().mean()),
        "miss_rate": 1.0 - recall,
        "tokens": T,
    }


def mean_over_layers(per_layer: list[dict]) -> dict:
    """Average per-layer metric dicts (each already a token average), skipping empty layers."""
    rows = [r for r in per_layer if r["tokens"]]
    if not rows:
        return set_metrics(torch.zeros(0, 1), torch.zeros(0, 1, dtype=torch.long), ())
    out = {
        k: sum(r[k] for r in rows) / len(rows) for k in ("recall_at_k", "exact_match", "miss_rate")
    }
    out["hit_at_k_plus_p"] = {
        p: sum(r["hit_at_k_plus_p"][p] for r in rows) / len(rows)
        for p in rows[0]["hit_at_k_plus_p"]
    }
    out["tokens"] = rows[0]["tokens"]
    return out
