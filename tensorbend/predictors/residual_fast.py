"""Ours' fast scoring path: one matmul for the correction's input layer and the folded router.

Usage (ResidualGatePredictor.scores does this, caching one FoldedLayer per target layer):
    folded = fold_layer(predictor, m)
    scores_TE = score_folded(predictor, folded, m, src)

The training computation (`ResidualGatePredictor.scores_reference`) builds u = FeatureLayout
columns and multiplies it by W1. Here the hidden-state columns of W1, the target router
(with spec_gate's re-normalisation folded into its weights) and, optionally, the source
router are concatenated into one [D, H + E (+ E)] matrix; the multi-hot columns become row
gathers of W1 by expert id, and has_prev becomes a second bias. RMS normalisation commutes
with the matmul, so it is applied to the product. A one-token batch (decode) does a single
gather over [source experts | previous experts + E]. Tests check equality with the
reference on real traces, in batch and one token at a time.

Shapes: T tokens, D hidden, E experts, K top-k, H correction width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tensorbend.predictors.base import SourceBatch
from tensorbend.predictors.ops import rms_inverse, standardise
from tensorbend.routers import scores_from_logits


@dataclass
class FoldedLayer:
    """One target layer's weights, rearranged for scoring (all detached)."""

    w_cat_DX: torch.Tensor  # [D, H + E (+ E)]: W1 hidden rows | target router | source router
    w_ids_2EH: torch.Tensor  # W1 rows of [source experts | previous experts]
    b1_H: torch.Tensor
    w_has_prev_H: torch.Tensor  # the has_prev row of W1
    b1_prev_H: torch.Tensor  # b1 + w_has_prev_H (the one-token path's bias)
    w2_HE: torch.Tensor
    b2_E: torch.Tensor
    alpha: torch.Tensor  # scalar weight of the standardised router scores
    router: dict[str, torch.Tensor]  # layer m's router params other than its weight
    w_src_score_EH: torch.Tensor | None = None  # W1 rows of the source-layer router scores
    src_router: dict[str, torch.Tensor] | None = None


def fold_layer(p, m: int) -> FoldedLayer:
    """Rearrange predictor p's weights for target layer m (p: a ResidualGatePredictor)."""
    li, lay, rp = m - p.lookahead.distance, p.layout, p.router_params
    w1_FH = p.net.W1[li].detach()
    router_ED = rp[f"layers.{m}.weight"]
    scale_D = p.gate.input_scale(m)  # spec_gate's re-normalisation, folded into the weights
    if scale_D is not None:
        router_ED = router_ED * scale_D[None, :]
    cols = [w1_FH[lay.hidden], router_ED.T]
    extra = {}
    s = m - p.lookahead.distance
    if p.cfg.use_src_scores and p.lookahead.distance >= 1:
        cols.append(rp[f"layers.{s}.weight"].T)
        extra = {"w_src_score_EH": w1_FH[lay.src_score], "src_router": _router_rest(rp, s)}
    b1_H = p.net.b1[li, 0].detach()
    return FoldedLayer(
        w_cat_DX=torch.cat(cols, dim=1).contiguous(),
        w_ids_2EH=w1_FH[lay.ids].contiguous(),
        b1_H=b1_H,
        w_has_prev_H=w1_FH[lay.has_prev],
        b1_prev_H=b1_H + w1_FH[lay.has_prev],
        w2_HE=p.net.W2[li].detach(),
        b2_E=p.net.b2[li, 0].detach(),
        alpha=p.net.alpha[li, 0, 0].detach(),
        router=_router_rest(rp, m),
        **extra,
    )


def score_folded(p, f: FoldedLayer, m: int, src: SourceBatch) -> torch.Tensor:
    """[T, E] scores of target layer m: p.scores_reference(m, src) up to float rounding."""
    H, E = p.H, p.spec.num_experts
    with torch.no_grad():
        x_TD = src.hidden_TD if src.hidden_TD.dtype == torch.float32 else src.hidden_TD.float()
        inv_rms_T1 = rms_inverse(x_TD)
        y_TX = x_TD @ f.w_cat_DX  # correction input layer | router logits (| source logits)
        if len(src) == 1:
            h_TH = _one_token_hidden(p, f, src, y_TX[:, :H], inv_rms_T1)
        else:
            h_TH = _batch_hidden(p, f, src, y_TX[:, :H], inv_rms_T1)
        if f.w_src_score_EH is not None:
            logits_TE = y_TX[:, H + E :]
            sc_TE = scores_from_logits(p.spec, f.src_router, src.src_layer, logits_TE)
            h_TH = h_TH + standardise(sc_TE) @ f.w_src_score_EH
        out_TE = torch.addmm(f.b2_E, F.gelu(h_TH), f.w2_HE)
        if p.cfg.use_gate:
            logits_TE = y_TX[:, H : H + E]
            if p.lookahead.hidden == "layer_input":  # a residual: RMS-normalise like the layer
                logits_TE = logits_TE * inv_rms_T1
            g_TE = scores_from_logits(p.spec, f.router, m, logits_TE)
            out_TE = out_TE + f.alpha * standardise(g_TE)
        return out_TE


def _batch_hidden(p, f: FoldedLayer, src: SourceBatch, yh_TH, inv_rms_T1) -> torch.Tensor:
    E = p.spec.num_experts
    h_TH = torch.addcmul(f.b1_H, yh_TH, inv_rms_T1)
    if src.src_ids_TK is not None:
        h_TH = h_TH + f.w_ids_2EH[src.src_ids_TK.long()].sum(1)
    if p.cfg.use_prev and bool(src.has_prev_T.any()):
        prev_TH = f.w_ids_2EH[src.prev_ids_TK.long() + E].sum(1) + f.w_has_prev_H
        h_TH = h_TH + prev_TH * src.has_prev_T.float()[:, None]
    return h_TH


def _one_token_hidden(p, f: FoldedLayer, src: SourceBatch, yh_TH, inv_rms_T1) -> torch.Tensor:
    """Decode: one gather over [source experts | previous experts + E]."""
    parts = []
    if src.src_ids_TK is not None:
        parts.append(src.src_ids_TK[0])
    has_prev = p.cfg.use_prev and bool(src.has_prev_T[0])
    if has_prev:
        parts.append(src.prev_ids_TK[0] + p.spec.num_experts)
    h_TH = torch.addcmul(f.b1_prev_H if has_prev else f.b1_H, yh_TH, inv_rms_T1)
    if not parts:
        return h_TH
    idx_N = parts[0] if len(parts) == 1 else torch.cat(parts)
    return h_TH + f.w_ids_2EH.index_select(0, idx_N.long()).sum(0)


def _router_rest(router_params: dict, layer: int) -> dict[str, torch.Tensor]:
    """Layer `layer`'s router params except its weight (bias, correction bias, norm weight)."""
    pre = f"layers.{layer}."
    return {
        k: v for k, v in router_params.items() if k.startswith(pre) and not k.endswith(".weight")
    }
