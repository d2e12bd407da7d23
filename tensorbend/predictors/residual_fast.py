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

A one-token batch is scored in numpy (`TokenWeights`, `score_token`): the runtime scores one
token per target layer per decode step, where torch's ~5-10 us dispatch per op is most of the
cost of matrices this small. Same operations, same order; float rounding may differ from the
torch path, the top-k lists it yields do not on real traces (tested). Source-router scores
(use_src_scores) keep the torch path.

Shapes: T tokens, D hidden, E experts, K top-k, H correction width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tensorbend.predictors.base import SourceBatch
from tensorbend.predictors.ops import EPS_RMS, EPS_STD, rms_inverse, standardise
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
    has_prev = p.cfg.use_prev and bool(src.has_prev_T.item())
    if has_prev:
        parts.append(src.prev_ids_TK[0] + p.spec.num_experts)
    h_TH = torch.addcmul(f.b1_prev_H if has_prev else f.b1_H, yh_TH, inv_rms_T1)
    if not parts:
        return h_TH
    idx_N = parts[0] if len(parts) == 1 else torch.cat(parts)
    return h_TH + f.w_ids_2EH.index_select(0, idx_N.long()).sum(0)


@dataclass
class TokenWeights:
    """A FoldedLayer as float32 numpy arrays, for scoring one token (`score_token`)."""

    w_cat_DX: np.ndarray  # only the W1 hidden rows and the target router are used
    w_ids_2EH: np.ndarray
    b1_H: np.ndarray
    b1_prev_H: np.ndarray
    w2_HE: np.ndarray
    b2_E: np.ndarray
    alpha: np.float32
    bias_E: np.ndarray | None  # the router's logit bias
    correction_E: np.ndarray | None  # sigmoid_bias: added after the sigmoid
    correction2_E: np.ndarray | None  # twice that (score_token's tanh form)


def token_weights(p, f: FoldedLayer, m: int) -> TokenWeights | None:
    """f in numpy, or None when `score_token` does not cover it (the torch path scores it)."""
    if f.w_src_score_EH is not None:
        return None
    a = lambda t: None if t is None else t.detach().float().numpy()  # noqa: E731
    H, E = p.H, p.spec.num_experts
    correction_E = a(f.router.get(f"layers.{m}.correction_bias"))
    return TokenWeights(
        w_cat_DX=np.ascontiguousarray(a(f.w_cat_DX)[:, : H + E]),
        w_ids_2EH=a(f.w_ids_2EH),
        b1_H=a(f.b1_H),
        b1_prev_H=a(f.b1_prev_H),
        w2_HE=np.ascontiguousarray(a(f.w2_HE)),
        b2_E=a(f.b2_E),
        alpha=np.float32(f.alpha),
        bias_E=a(f.router.get(f"layers.{m}.bias")),
        correction_E=correction_E,
        correction2_E=None if correction_E is None else 2 * correction_E,
    )


def score_token(p, w: TokenWeights, src: SourceBatch) -> torch.Tensor:
    """[1, E] scores of a one-token batch: score_folded's operations in numpy."""
    H, E = p.H, p.spec.num_experts
    # (tensor.numpy()[0], np.dot, np.add.reduce, scalars in Python floats: np.mean/std, numpy
    # scalar arithmetic and torch indexing cost ~1-10 us a call, more than the arithmetic here)
    x_D = src.hidden_TD.float().numpy()[0]
    inv_rms = 1.0 / math.sqrt(float(np.dot(x_D, x_D)) / x_D.shape[0] + EPS_RMS)
    y_X = x_D @ w.w_cat_DX
    has_prev = p.cfg.use_prev and bool(src.has_prev_T.item())
    h_H = (w.b1_prev_H if has_prev else w.b1_H) + y_X[:H] * inv_rms
    parts = [] if src.src_ids_TK is None else [src.src_ids_TK.numpy()[0]]
    if has_prev:
        parts.append(src.prev_ids_TK.numpy()[0] + E)
    if parts:
        idx_N = np.concatenate(parts) if len(parts) > 1 else parts[0]
        h_H = h_H + np.add.reduce(w.w_ids_2EH[idx_N], axis=0)
    # exact GELU (erf form, as F.gelu): numpy has no erf, math.erf over H values is cheap
    erf_H = np.fromiter(map(math.erf, (h_H * _INV_SQRT2).tolist()), np.float32, count=H)
    out_E = w.b2_E + (np.float32(0.5) * h_H * (np.float32(1.0) + erf_H)) @ w.w2_HE
    if p.cfg.use_gate:
        logits_E = y_X[H : H + E]
        if p.lookahead.hidden == "layer_input":  # a residual: RMS-normalise like the layer
            logits_E = logits_E * inv_rms
        if w.bias_E is not None:
            logits_E = logits_E + w.bias_E
        g_E, eps = logits_E, EPS_STD
        kind = p.spec.router_kind
        if kind == "sigmoid_bias":
            # standardise is blind to a positive affine map: of sigmoid(l) + c = (tanh(l / 2)
            # + 2c + 1) / 2 it takes tanh(l / 2) + 2c, its eps doubled
            g_E = np.tanh(np.float32(0.5) * logits_E)
            if w.correction_E is not None:
                g_E = g_E + w.correction2_E
            eps = 2 * EPS_STD
        elif kind == "group_limited":  # (sigmoid in tanh form: no overflow)
            g_E = np.float32(0.5) * (np.float32(1.0) + np.tanh(np.float32(0.5) * logits_E))
            if w.correction_E is not None:
                g_E = g_E + w.correction_E
            g_E = _group_limited(p.spec, g_E)
        d_E = g_E - float(np.add.reduce(g_E)) / E  # standardise: unbiased std, as torch.std_mean
        scale = float(w.alpha) / (math.sqrt(float(np.dot(d_E, d_E)) / (E - 1)) + eps)
        out_E = out_E + d_E * scale
    return torch.from_numpy(out_E.reshape(1, E))


def _group_limited(spec, s_E: np.ndarray) -> np.ndarray:
    """routers.scores_from_logits' group limit: experts outside the top groups (by the sum
    of their two best scores) lose 1e4."""
    G = spec.n_group
    group_G = np.sort(s_E.reshape(G, -1), axis=1)[:, -2:].sum(1)
    out_G = np.ones(G, dtype=bool)
    out_G[np.argsort(-group_G, kind="stable")[: spec.topk_group]] = False
    return np.where(np.repeat(out_G, s_E.shape[0] // G), s_E - np.float32(1e4), s_E)


_INV_SQRT2 = np.float32(1 / math.sqrt(2))


def _router_rest(router_params: dict, layer: int) -> dict[str, torch.Tensor]:
    """Layer `layer`'s router params except its weight (bias, correction bias, norm weight)."""
    pre = f"layers.{layer}."
    return {
        k: v for k, v in router_params.items() if k.startswith(pre) and not k.endswith(".weight")
    }
