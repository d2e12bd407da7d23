"""Expert-parallel pre-staging: does a prediction size the dispatch all-to-all's buffers?

Usage:
    >>> import torch
    >>> truth = torch.tensor([[[0, 1]], [[2, 3]]])        # [T=2 tokens, L=1, K=2], one step
    >>> pred = torch.tensor([[[0, 2]], [[2, 3]]])
    >>> s = ep_stats(truth, pred, torch.tensor([0, 0]), num_experts=4, cfg=EPConfig(degree=2))
    >>> s["mae_tokens"], s["all_ranks_predicted_share"]
    (0.5, 1.0)

With EP degree R, expert e lives on rank `placement(e)`: `contiguous` (e * R // E) or
`round_robin` (e % R). A step's dispatch sends each token once to every rank holding one of its
experts, so the receive count of rank r at layer m is the number of the step's tokens with at
least one expert on r. Per predictor (its top-k per token), over steps x layers x ranks:
  mae_tokens                 mean |predicted count - actual count|
  buffer_p99_static          buffer (tokens per rank) covering the actual count in 99% of
                             (step, layer, rank): what is reserved without prediction
  buffer_p99_predicted_mean  mean over (step, layer, rank) of predicted count + margin, the
                             margin being the 99th percentile of (actual - predicted): a buffer
                             sized per step from the prediction that is as often enough
  all_ranks_predicted_share  share of (token, layer) whose actual destination ranks are all
                             among the predicted ones (those tokens could be sent early)
Steps are the simulated forwards (a decode step of `batch` sequences, or a prompt's prefill);
layers without a prediction (targets before the lookahead's first source layer) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from tensorbend.errors import TensorbendError


@dataclass(frozen=True)
class EPConfig:
    degree: int
    """Expert-parallel ranks R."""
    placement: Literal["contiguous", "round_robin"] = "contiguous"
    """Expert-to-rank placement: contiguous blocks (e * R // E) or round robin (e % R)."""
    quantile: float = 0.99
    """Share of steps the buffer must cover."""

    def __post_init__(self) -> None:
        if self.degree < 1 or not 0 < self.quantile <= 1:
            raise TensorbendError(
                f"--ep-degree {self.degree} / quantile {self.quantile}: expected degree >= 1 "
                "and a quantile in (0, 1]"
            )


def rank_of(num_experts: int, cfg: EPConfig) -> torch.Tensor:
    """[E] rank of each expert."""
    e = torch.arange(num_experts)
    return e * cfg.degree // num_experts if cfg.placement == "contiguous" else e % cfg.degree


def ep_stats(
    truth_TLK: torch.Tensor,
    pred_TLK: torch.Tensor,
    step_T: torch.Tensor,
    num_experts: int,
    cfg: EPConfig,
    valid_L: torch.Tensor | None = None,
) -> dict:
    """Predicted vs actual per-rank dispatch counts (see the module docstring)."""
    L = truth_TLK.shape[1]
    if valid_L is None:
        valid_L = torch.ones(L, dtype=torch.bool)
    layers = valid_L.nonzero().flatten()
    if len(layers) == 0 or truth_TLK.shape[0] == 0:
        return {"steps": 0, "layers": 0}
    ranks = rank_of(num_experts, cfg)
    actual_TLR = _ranks_hit(truth_TLK[:, layers].long(), ranks, cfg.degree)
    pred_TLR = _ranks_hit(pred_TLK[:, layers].long(), ranks, cfg.degree)
    _, step_index = torch.unique(step_T, return_inverse=True)
    S = int(step_index.max()) + 1
    act_SLR = _per_step(actual_TLR, step_index, S)
    pre_SLR = _per_step(pred_TLR, step_index, S)
    q = cfg.quantile
    margin = torch.quantile((act_SLR - pre_SLR).flatten(), q).clamp(min=0)
    covered = (actual_TLR & ~pred_TLR).sum(-1) == 0  # [T, L']
    return {
        "steps": S,
        "layers": len(layers),
        "mae_tokens": round(float((pre_SLR - act_SLR).abs().mean()), 4),
        "buffer_p99_static": float(torch.quantile(act_SLR.flatten(), q)),
        "buffer_p99_predicted_mean": round(float((pre_SLR + margin).mean()), 4),
        "margin_tokens": float(margin),
        "actual_mean_tokens": round(float(act_SLR.mean()), 4),
        "all_ranks_predicted_share": round(float(covered.float().mean()), 4),
    }


def _ranks_hit(ids_TLK: torch.Tensor, ranks_E: torch.Tensor, R: int) -> torch.Tensor:
    """[T, L, R] bool: the token has at least one expert on rank r (ids -1: no guess)."""
    ranks = torch.where(ids_TLK >= 0, ranks_E[ids_TLK.clamp(min=0)], R)
    out = torch.zeros(*ids_TLK.shape[:2], R + 1, dtype=torch.bool)
    out.scatter_(2, ranks, True)
    return out[..., :R]


def _per_step(hit_TLR: torch.Tensor, step_T: torch.Tensor, S: int) -> torch.Tensor:
    out = torch.zeros(S, *hit_TLR.shape[1:])
    out.index_add_(0, step_T, hit_TLR.float())
    return out


def ep_report(rankeds, rows: dict, fwds, num_experts: int, cfg: EPConfig) -> list[dict]:
    """ep_stats per predictor and phase over the simulated forwards (steps)."""
    step_T = torch.zeros(rows["expert_ids_TLK"].shape[0], dtype=torch.long)
    for f, fw in enumerate(fwds):
        step_T[fw.rows] = f
    K = rows["expert_ids_TLK"].shape[2]
    out = []
    for r in rankeds:
        if r.kind == "none":
            continue
        for code, phase in ((0, "prefill"), (1, "decode")):
            sel = (rows["phase_T"] == code).nonzero().flatten()
            truth, pred = rows["expert_ids_TLK"][sel].long(), r.ids_TLJ[sel, :, :K]
            s = ep_stats(truth, pred, step_T[sel], num_experts, cfg, r.valid_L)
            out.append(
                {
                    "predictor": r.kind,
                    "lookahead": r.lookahead,
                    "phase": phase,
                    "degree": cfg.degree,
                    "placement": cfg.placement,
                    **s,
                }
            )
    return out
