"""The seed's predictor (kind `seed_mlp`) and its training recipe, runnable at any lookahead.

Usage:
    p = SeedMLPPredictor.fit(spec, LOOKAHEADS["same_layer"], TrainData(train_rows, val_rows))
    p = SeedMLPPredictor.fit(spec, LOOKAHEADS["d1"], data, SeedMLPConfig(loss="ranking"))

Per target layer (the seed's predictor/model.py): Linear(D + E -> p) -> BatchNorm1d -> GELU ->
Dropout(0.1) -> Linear(p -> E), p = 256. Input: the source hidden state and a multi-hot
"previous routing" (`prev_routing`):
  token  (default, the seed) the previous token's experts at the target layer m. The seed's data
         builder fed each row the routing of the row before it at the same layer; we feed the
         previous token of the same prompt (zeros for a prompt's first token). At `same_layer`
         this includes the previous prompt token in prefill, as the seed did: its source point
         is layer m's router input, which exists for every token of the pass at once. At a real
         lookahead the previous token's routing at m only exists when that token ran in an
         earlier forward pass (decode rows); prefill rows get zeros (SourceBatch.has_prev_T).
  layer  the routing of the latest layer before the source point (m-1, or m-d at dN): what the
         seed's description said and our older variant did
  none   no routing input (fc1 then has D inputs, as the seed's use_prev_routing=False)
Training (the seed's predictor/train.py): BCE weighted 3.0 on the picked experts and 0.5 on the
rest (`weighted_bce`), AdamW (lr 1e-3, weight decay 0.01), cosine annealing to 1% over 200
full-batch epochs (rows in order), gradient-norm clipping 1.0 per layer, the last epoch kept.
`ranking` is the seed's variant: the weights scaled by per-expert boundary/rarity importance
plus 0.3 * relu(0.1 - (mean sigmoid of picked - mean sigmoid of the rest)); `bce` is plain BCE
(our older default). The seed reports the best epoch's top-k overlap on the first 200 training
rows; we keep that number (`train_rows_recall`) beside held-out ones.

Shapes: L target layers, N rows, D hidden size, E experts, K top-k, P width p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from tensorbend.predictors.base import (
    PredictorBase,
    PredictorConfigError,
    SourceBatch,
    TrainData,
    check_state,
    config_from_dict,
    sources_from_rows,
)
from tensorbend.predictors.fit import FitConfig, fit, fit_options, max_over_ranks
from tensorbend.predictors.metrics import layer_mean_recall, topk_hits
from tensorbend.predictors.ops import multi_hot
from tensorbend.predictors.seed_net import SeedMLPNet

SeedLoss = Literal["weighted_bce", "ranking", "bce"]
PrevRouting = Literal["token", "layer", "none"]
POS_WEIGHT, NEG_WEIGHT = 3.0, 0.5  # the seed's BCE weights on picked / other experts
RANK_WEIGHT, RANK_MARGIN = 0.3, 0.1  # the seed's ranking variant
TRAIN_ROWS_SCORED = 200  # the seed's accuracy: the first 200 training rows

SEED_FIT = FitConfig(
    epochs=200,
    batch_rows=0,
    lr=1e-3,
    weight_decay=0.01,
    cosine_to=0.01,
    grad_clip=1.0,
    clip="per_layer",
    patience=0,
    keep="last",
    optimizer="adamw",
)


@dataclass(frozen=True)
class SeedMLPConfig:
    width: int = 256
    """Hidden width p of each layer's MLP (256 in the seed's code, 2048 in its report)."""
    dropout: float = 0.1
    """Dropout after GELU."""
    loss: SeedLoss = "weighted_bce"
    """weighted_bce: the seed's; ranking: its importance-weighted ranking variant; bce: plain."""
    prev_routing: PrevRouting = "token"
    """Routing input: previous token's experts at the target layer (the seed's), the latest
    routed layer before the source point, or none."""
    fit: FitConfig = SEED_FIT
    """Optimizer and schedule (the seed's recipe by default)."""

    def __post_init__(self):
        if self.width < 1 or not 0 <= self.dropout < 1:
            raise PredictorConfigError(
                f"seed_mlp: expected width >= 1 and 0 <= dropout < 1, found width={self.width}, "
                f"dropout={self.dropout}"
            )
        for name, value, choices in (
            ("loss", self.loss, get_args(SeedLoss)),
            ("prev_routing", self.prev_routing, get_args(PrevRouting)),
        ):
            if value not in choices:
                raise PredictorConfigError(
                    f"seed_mlp {name}: expected one of {', '.join(choices)}, found {value!r}"
                )

    @classmethod
    def from_train(cls, t) -> SeedMLPConfig:
        """From `tensorbend train`'s options (a train.TrainConfig); None keeps the default."""
        if t.src_scores is not None:
            raise PredictorConfigError(
                f"seed_mlp has no option src_scores: expected it unset, found {t.src_scores!r}"
            )
        if not t.use_prev and t.prev_routing not in (None, "none"):
            raise PredictorConfigError(
                f"use_prev=False means prev_routing 'none', found {t.prev_routing!r}: pass one"
            )
        d = cls()
        return cls(
            width=t.width or d.width,
            loss=t.loss or d.loss,
            prev_routing=t.prev_routing or (d.prev_routing if t.use_prev else "none"),
            fit=fit_options(d.fit, t),
        )


def seed_loss(
    logits_LNE: torch.Tensor,
    target_LNE: torch.Tensor,
    loss: SeedLoss,
    importance_LE: torch.Tensor | None = None,
) -> torch.Tensor:
    """The seed's loss per layer [L] (each layer's loss is a mean over its N x E entries)."""
    if loss == "bce":
        weight = torch.ones_like(target_LNE)
    else:
        imp = torch.zeros(target_LNE.shape[-1]) if importance_LE is None else importance_LE
        pos, neg = POS_WEIGHT + 2.0 * imp, NEG_WEIGHT * (1.0 - 0.3 * imp)
        if loss == "weighted_bce":
            pos, neg = torch.full_like(pos, POS_WEIGHT), torch.full_like(neg, NEG_WEIGHT)
        weight = torch.where(target_LNE > 0, pos[..., None, :], neg[..., None, :])
    bce = F.binary_cross_entropy_with_logits(logits_LNE, target_LNE, reduction="none")
    out_L = (weight * bce).mean((-2, -1))
    if loss == "ranking":
        p, t = torch.sigmoid(logits_LNE), target_LNE
        top_LN = (p * t).sum(-1) / t.sum(-1).clamp(min=1)
        rest_LN = (p * (1 - t)).sum(-1) / (1 - t).sum(-1).clamp(min=1)
        out_L = out_L + RANK_WEIGHT * F.relu(RANK_MARGIN - (top_LN - rest_LN)).mean(-1)
    return out_L


def expert_importance(target_LNE: torch.Tensor) -> torch.Tensor:
    """[L, E] the seed's per-expert importance: near the decision boundary or rare, max 1."""
    freq_LE = target_LNE.mean(-2)
    boundary_LE = 1.0 - (2.0 * freq_LE - 1.0).abs()
    rarity_LE = 1.0 - freq_LE.clamp(max=0.5) * 2
    score_LE = 0.6 * boundary_LE + 0.4 * rarity_LE
    return score_LE / (score_LE.amax(-1, keepdim=True) + 1e-10)


class SeedMLPPredictor(PredictorBase):
    kind = "seed_mlp"

    def __init__(self, spec, la, cfg: SeedMLPConfig):
        super().__init__(spec, la, cfg)
        self.targets = list(la.targets(spec.num_moe_layers))
        E = spec.num_experts
        din = spec.hidden_size + (0 if cfg.prev_routing == "none" else E)
        self.net = SeedMLPNet(len(self.targets), din, cfg.width, E, cfg.dropout).eval()
        self.val_recall: float | None = None
        self.train_rows_recall: float | None = None

    @classmethod
    def fit(cls, spec, la, data: TrainData, cfg: SeedMLPConfig | None = None, progress=False):
        cfg = cfg or SeedMLPConfig()
        torch.manual_seed(cfg.fit.seed)
        p = cls(spec, la, cfg)
        train, val = p._inputs(data.train_rows), p._inputs(data.val_rows)
        K, E = spec.top_k, spec.num_experts
        target_LNE = torch.zeros(*train["truth"].shape[:2], E).scatter_(2, train["truth"], 1.0)
        importance_LE = expert_importance(target_LNE) if cfg.loss == "ranking" else None
        best_L = torch.zeros(len(p.targets))

        def loss_fn(net, b, layers):
            s_LNE = net(b["x"])
            t_LNE = torch.zeros_like(s_LNE).scatter_(2, b["truth"], 1.0)
            with torch.no_grad():  # the seed's number: training-mode logits, best epoch per layer
                n = TRAIN_ROWS_SCORED
                hits = [
                    topk_hits(s_LNE[i, :n], b["truth"][i, :n], K).mean() / K
                    for i in range(s_LNE.shape[0])
                ]
                best_L[layers] = torch.maximum(best_L[layers], torch.stack(hits))
            imp = None if importance_LE is None else importance_LE[layers]
            return seed_loss(s_LNE, t_LNE, cfg.loss, imp).sum()

        def val_fn(net, layers):
            return layer_mean_recall(net(val["x"][layers]), val["truth"][layers], K)

        _, p.history = fit(
            p.net, train, loss_fn, val_fn, cfg.fit, progress=progress, desc=f"seed_mlp {la.name}"
        )
        p.val_recall = p.history[-1]["val"]
        if cfg.fit.layers == "separate":
            max_over_ranks(best_L)  # each rank scored its own layers
        p.train_rows_recall = float(best_L.mean())
        return p

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        li = m - self.lookahead.distance
        with torch.no_grad():
            return self.net(self._x(src)[None], slice(li, li + 1))[0]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone().contiguous() for k, v in self.net.state_dict().items()}

    def num_params(self) -> int:
        return sum(q.numel() for q in self.net.parameters())

    def fit_summary(self) -> dict:
        return (
            {} if self.train_rows_recall is None else {"train_rows_recall": self.train_rows_recall}
        )

    @classmethod
    def from_state(cls, spec, la, config: dict, tensors):
        p = cls(spec, la, config_from_dict(SeedMLPConfig, config, f"{cls.kind} checkpoint"))
        check_state(p.state_tensors(), tensors, f"{cls.kind} checkpoint")
        p.net.load_state_dict(tensors)
        return p

    def seed_state_dict(self) -> dict[str, torch.Tensor]:
        """The seed's checkpoint keys ("0.fc1.weight", "0.bn.running_mean", ...), one per layer."""
        return self.net.to_seed_state()

    # ------------------------------------------------------------ features

    def _x(self, src: SourceBatch) -> torch.Tensor:
        E, how = self.spec.num_experts, self.cfg.prev_routing
        if how == "none":
            return src.hidden_TD.float()
        if how == "token":
            routing_TE = multi_hot(src.prev_ids_TK, E, src.has_prev_T)
        elif src.src_ids_TK is not None:
            routing_TE = multi_hot(src.src_ids_TK, E)
        else:
            routing_TE = torch.zeros(len(src), E)
        return torch.cat([src.hidden_TD.float(), routing_TE], dim=-1)

    def _inputs(self, rows) -> dict[str, torch.Tensor]:
        x, truth = [], []
        for m in self.targets:
            x.append(self._x(sources_from_rows(rows, self.lookahead, m)))
            truth.append(rows["expert_ids_TLK"][:, m].long())
        return {"x": torch.stack(x), "truth": torch.stack(truth)}
