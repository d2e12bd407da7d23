"""Prediction metrics over expert sets: recall@k, hit@k+p, exact match.

Usage:
    >>> import torch
    >>> scores_TE = torch.tensor([[0.9, 0.8, 0.1, 0.0], [0.1, 0.2, 0.9, 0.3]])
    >>> true_ids_TK = torch.tensor([[0, 2], [2, 3]])
    >>> m = set_metrics(scores_TE, true_ids_TK, overprovision=(0, 1))
    >>> m["recall_at_k"], m["hit_at_k_plus_p"], m["exact_match"]   # |top-k & true| / k per token
    (0.75, {'0': 0.75, '1': 1.0}, 0.5)

All metrics are averaged over tokens here; callers average per-layer values over layers.
A predictor scored on trace rows per target layer and phase: scoring.py.
Shapes: T tokens, E experts, K top-k, L layers, N rows.
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


def merge_token_means(parts: list[dict]) -> dict:
    """set_metrics results of disjoint token sets -> the result over their union (token means
    weighted by token counts; equal to set_metrics on the union up to float rounding)."""
    rows = [r for r in parts if r["tokens"]]
    if not rows:
        return {**parts[0], "tokens": 0}
    T = sum(r["tokens"] for r in rows)

    def mean(get):
        return sum(get(r) * r["tokens"] for r in rows) / T

    out = {k: mean(lambda r, k=k: r[k]) for k in ("recall_at_k", "exact_match", "miss_rate")}
    out["hit_at_k_plus_p"] = {
        p: mean(lambda r, p=p: r["hit_at_k_plus_p"][p]) for p in rows[0]["hit_at_k_plus_p"]
    }
    out["tokens"] = T
    return out


def layer_mean_recall(scores_LNE: torch.Tensor, true_ids_LNK: torch.Tensor, K: int) -> float:
    """recall@K averaged over rows, then over layers (the training loops' validation score)."""
    L = scores_LNE.shape[0]
    return sum(float(topk_hits(scores_LNE[i], true_ids_LNK[i], K).mean()) for i in range(L)) / (
        K * L
    )
