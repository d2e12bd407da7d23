"""Ours (kind `tensorbend`): the target router's speculative guess plus a small learned correction.

Usage:
    p = ResidualGatePredictor.fit(spec, LOOKAHEADS["d1"], TrainData(train, val, router_params))
    scores_TE = p.scores(m, sources_from_rows(test_rows, p.lookahead, m))

For target layer m, from what exists at the source point (see predictors/base.py):
    g   = standardise(spec_gate scores of m on the source hidden state)        [T, E]
    u   = FeatureLayout: [rmsnorm(source hidden) (D), source routing multi-hot (E),
          previous token's experts at m (E, only where they exist), has_prev (1),
          standardised source-layer router scores (E, optional)]                 [T, F]
    score = alpha_m * g + W2_m GELU(W1_m u + b1_m) + b2_m
The correction starts at zero (W2 = 0, alpha = 1), so an untrained predictor is spec_gate and
training can only move away from it where the train split says so. Loss: listwise softmax
cross-entropy with the k true experts as targets (ranks experts, which is what top-k needs),
or plain BCE (`loss="bce"`). Parameters per layer: F*H + H + H*E + E + 1, with H capped so
that this stays <= 25% of the seed MLP's at the same D and E. `scores` is the fast path
(residual_fast.py); `scores_reference` the training computation it is tested equal to.

Shapes: T tokens, Lt target layers, N rows, D hidden, E experts, K top-k, F input width, H width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from tensorbend.models import RoutingSpec
from tensorbend.predictors.base import (
    Lookahead,
    PredictorBase,
    PredictorConfigError,
    SourceBatch,
    TrainData,
    check_state,
    config_from_dict,
    sources_from_rows,
)
from tensorbend.predictors.baselines import SpecGatePredictor
from tensorbend.predictors.fit import FitConfig, fit, fit_options
from tensorbend.predictors.metrics import layer_mean_recall
from tensorbend.predictors.ops import multi_hot, rmsnorm, standardise
from tensorbend.predictors.residual_fast import (
    fold_layer,
    score_folded,
    score_token,
    token_weights,
)
from tensorbend.routers import router_scores

OursLoss = Literal["listwise", "bce"]
SEED_WIDTH = 256  # the seed MLP's p that the parameter budget is measured against


@dataclass(frozen=True)
class ResidualGateConfig:
    hidden: int = 64
    """Correction MLP width H (capped by the parameter budget)."""
    loss: OursLoss = "listwise"
    """listwise: softmax cross-entropy over experts; bce: plain binary cross-entropy."""
    use_prev: bool = True
    """Feed the previous token's experts at the target layer (where they exist)."""
    use_gate: bool = True
    """Start from spec_gate (False: a plain small MLP)."""
    use_src_scores: bool = False
    """Also feed the source layer's own router scores (d >= 1)."""
    budget_frac: float = 0.25
    """Maximum parameters per layer relative to the seed MLP (p = 256) at the same D and E."""
    fit: FitConfig = FitConfig(min_steps=600)
    """Optimizer and schedule."""

    def __post_init__(self):
        if self.loss not in get_args(OursLoss):
            raise PredictorConfigError(
                f"tensorbend loss: expected one of {', '.join(get_args(OursLoss))}, "
                f"found {self.loss!r}"
            )
        if self.hidden < 1 or not 0 < self.budget_frac:
            raise PredictorConfigError(
                f"tensorbend: expected hidden >= 1 and budget_frac > 0, found "
                f"hidden={self.hidden}, budget_frac={self.budget_frac}"
            )

    @classmethod
    def from_train(cls, t) -> ResidualGateConfig:
        """From `tensorbend train`'s options (a train.TrainConfig); None keeps the default."""
        if t.prev_routing is not None:
            raise PredictorConfigError(
                f"tensorbend has no option prev_routing: expected it unset, found "
                f"{t.prev_routing!r}; it feeds the previous token's experts (use_prev) or none"
            )
        d = cls()
        return cls(
            hidden=t.width or d.hidden,
            loss=t.loss or d.loss,
            use_prev=t.use_prev,
            use_src_scores=d.use_src_scores if t.src_scores is None else t.src_scores,
            fit=fit_options(d.fit, t),
        )


@dataclass(frozen=True)
class FeatureLayout:
    """Column slices of ours' input u = [hidden | src | prev | has_prev | src_scores]."""

    hidden_size: int
    num_experts: int
    src_scores: bool

    @property
    def hidden(self) -> slice:
        return slice(0, self.hidden_size)

    @property
    def src(self) -> slice:
        return slice(self.hidden_size, self.hidden_size + self.num_experts)

    @property
    def prev(self) -> slice:
        return slice(self.src.stop, self.src.stop + self.num_experts)

    @property
    def ids(self) -> slice:
        """[src | prev]: rows gathered by expert id (previous experts offset by E)."""
        return slice(self.src.start, self.prev.stop)

    @property
    def has_prev(self) -> int:
        return self.prev.stop

    @property
    def src_score(self) -> slice:
        return slice(self.has_prev + 1, self.has_prev + 1 + (self.num_experts * self.src_scores))

    @property
    def width(self) -> int:
        return self.src_score.stop


def seed_params_per_layer(D: int, E: int, p: int = SEED_WIDTH) -> int:
    """The seed MLP's learned parameters per layer (fc1, BatchNorm affine, fc2)."""
    return (D + E) * p + p + 2 * p + p * E + E


def width_for_budget(D: int, E: int, want: int, frac: float, src_scores: bool = False) -> int:
    """The largest H <= want whose parameters per layer stay <= frac * the seed MLP's."""
    per_h = FeatureLayout(D, E, src_scores).width + 1 + E  # a W1 column, b1, a W2 row
    cap = int((frac * seed_params_per_layer(D, E) - E - 1) // per_h)
    return max(1, min(want, cap))


class _CorrectionNet(torch.nn.Module):
    """Per-target-layer parameters stacked over layers: [Lt, ...]."""

    def __init__(self, Lt: int, width: int, H: int, E: int):
        super().__init__()
        self.W1 = torch.nn.Parameter(torch.randn(Lt, width, H) / width**0.5)
        self.b1 = torch.nn.Parameter(torch.zeros(Lt, 1, H))
        self.W2 = torch.nn.Parameter(torch.zeros(Lt, H, E))
        self.b2 = torch.nn.Parameter(torch.zeros(Lt, 1, E))
        self.alpha = torch.nn.Parameter(torch.ones(Lt, 1, 1))

    def forward(self, g_LNE: torch.Tensor, u_LNF: torch.Tensor) -> torch.Tensor:
        h_LNH = F.gelu(torch.baddbmm(self.b1, u_LNF, self.W1))
        return self.alpha * g_LNE + torch.baddbmm(self.b2, h_LNH, self.W2)


class ResidualGatePredictor(PredictorBase):
    kind = "tensorbend"

    def __init__(
        self, spec: RoutingSpec, la: Lookahead, router_params: dict, cfg: ResidualGateConfig, H: int
    ):
        super().__init__(spec, la, cfg)
        self.H, self.router_params = H, router_params
        self.gate = SpecGatePredictor(spec, la, router_params)
        self.targets = list(la.targets(spec.num_moe_layers))
        E, D = spec.num_experts, spec.hidden_size
        self.layout = FeatureLayout(D, E, cfg.use_src_scores)
        self.net = _CorrectionNet(len(self.targets), self.layout.width, H, E).eval()
        self._fast: dict = {}  # target layer -> (FoldedLayer, TokenWeights | None)

    @classmethod
    def fit(cls, spec, la, data: TrainData, cfg: ResidualGateConfig | None = None, progress=False):
        cfg = cfg or ResidualGateConfig()
        if data.router_params is None:
            raise PredictorConfigError("tensorbend needs the trace's router weights, found none")
        torch.manual_seed(cfg.fit.seed)
        D, E = spec.hidden_size, spec.num_experts
        H = width_for_budget(D, E, cfg.hidden, cfg.budget_frac, cfg.use_src_scores)
        p = cls(spec, la, data.router_params, cfg, H)
        train, val = p._inputs(data.train_rows), p._inputs(data.val_rows)

        def loss_fn(net, b, layers):
            s_LNE = net(b["g"], b["u"])
            if cfg.loss == "bce":
                target_LNE = torch.zeros_like(s_LNE).scatter_(2, b["truth"], 1.0)
                return F.binary_cross_entropy_with_logits(s_LNE, target_LNE)
            return -(F.log_softmax(s_LNE, -1).gather(2, b["truth"])).mean()

        def val_fn(net, layers):
            v = {k: val[k][layers] for k in ("g", "u", "truth")}
            return layer_mean_recall(net(v["g"], v["u"]), v["truth"], spec.top_k)

        _, p.history = fit(
            p.net, train, loss_fn, val_fn, cfg.fit, progress=progress, desc=f"tensorbend {la.name}"
        )
        p.val_recall = max(h["val"] for h in p.history)
        return p

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        """Fast path (residual_fast.py): equal to `scores_reference` up to float rounding;
        one token (decode) in numpy where it covers the layer."""
        folded, token = self._fast_layer(m)
        if token is not None and len(src) == 1:
            return score_token(self, token, src)
        return score_folded(self, folded, m, src)

    def _fast_layer(self, m: int) -> tuple:
        """(FoldedLayer, TokenWeights | None) of target layer m, made at its first call."""
        if m not in self._fast:
            folded = fold_layer(self, m)
            self._fast[m] = (folded, token_weights(self, folded, m))
        return self._fast[m]

    def scores_reference(self, m: int, src: SourceBatch) -> torch.Tensor:
        """The training-time computation (tests compare the fast path against it)."""
        li = m - self.lookahead.distance
        net = self.net
        with torch.no_grad():
            h_TH = F.gelu(self._features(src) @ net.W1[li] + net.b1[li])
            return net.alpha[li] * self._gate_scores(m, src) + h_TH @ net.W2[li] + net.b2[li]

    def num_params(self) -> int:
        return sum(q.numel() for q in self.net.parameters())

    def config_dict(self) -> dict:
        return {**super().config_dict(), "H": self.H}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {
            f"net.{k}": v.detach().clone().contiguous() for k, v in self.net.state_dict().items()
        }
        out.update({f"router.{k}": v for k, v in self.router_params.items()})
        return out

    @classmethod
    def from_state(cls, spec, la, config: dict, tensors: dict[str, torch.Tensor]):
        config = dict(config)
        H = config.pop("H", None)
        what = f"{cls.kind} checkpoint"
        if not isinstance(H, int) or H < 1:
            raise PredictorConfigError(f"{what}: expected config H >= 1, found {H!r}; retrain it")
        router = {k[len("router.") :]: v for k, v in tensors.items() if k.startswith("router.")}
        p = cls(spec, la, router, config_from_dict(ResidualGateConfig, config, what), H)
        check_state(p.state_tensors(), tensors, what)
        p.net.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("net.")})
        return p

    # ------------------------------------------------------------ features

    def _gate_scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        if not self.cfg.use_gate:
            return torch.zeros(len(src), self.spec.num_experts)
        return standardise(self.gate.scores(m, src))

    def _features(self, src: SourceBatch) -> torch.Tensor:
        """u [T, F] laid out by self.layout."""
        E, lay = self.spec.num_experts, self.layout
        u_TF = torch.zeros(len(src), lay.width)
        u_TF[:, lay.hidden] = rmsnorm(src.hidden_TD.float())
        if src.src_ids_TK is not None:
            u_TF[:, lay.src] = multi_hot(src.src_ids_TK, E)
        has_prev_T = src.has_prev_T & self.cfg.use_prev
        u_TF[:, lay.prev] = multi_hot(src.prev_ids_TK, E, has_prev_T)
        u_TF[:, lay.has_prev] = has_prev_T.float()
        if self.cfg.use_src_scores and self.lookahead.distance >= 1:
            sc_TE = router_scores(
                self.spec, self.router_params, src.src_layer, src.hidden_TD.float()
            )
            u_TF[:, lay.src_score] = standardise(sc_TE)
        return u_TF

    def _inputs(self, rows) -> dict[str, torch.Tensor]:
        g, u, truth = [], [], []
        for m in self.targets:
            src = sources_from_rows(rows, self.lookahead, m)
            g.append(self._gate_scores(m, src))
            u.append(self._features(src))
            truth.append(rows["expert_ids_TLK"][:, m].long())
        return {"g": torch.stack(g), "u": torch.stack(u), "truth": torch.stack(truth)}
