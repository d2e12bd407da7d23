"""Ours (kind `tensorbend`): the target router's speculative guess plus a small learned correction.

Usage:
    >>> p = ResidualGatePredictor.fit(spec, "d1", router_params, train_rows, val_rows)
    >>> scores_TE = p.scores(m, sources_from_rows(test_rows, p.lookahead, m))

For target layer m, from what exists at the source point (see predictors/base.py):
    g   = standardise(spec_gate scores of m on the source hidden state)        [T, E]
    u   = [rmsnorm(source hidden) (D), source routing multi-hot (E),
           previous token's experts at m (E, decode only), has_prev (1)]          [T, F]
    score = alpha_m * g + W2_m GELU(W1_m u + b1_m) + b2_m
The correction starts at zero (W2 = 0, alpha = 1), so an untrained predictor is spec_gate and
training can only move away from it where the train split says so. Loss: listwise softmax
cross-entropy with the k true experts as targets (ranks experts, which is what top-k needs),
or the seed's BCE (`loss="bce"`). Parameters per layer: F*H + H + H*E + E + 1, with H capped
so that this stays <= 25% of the seed MLP at the same D and E.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from tensorbend.metrics import topk_hits
from tensorbend.models import RoutingSpec, router_scores, scores_from_logits
from tensorbend.predictors.base import Lookahead, SourceBatch, get_lookahead, multi_hot
from tensorbend.predictors.baselines import SpecGatePredictor
from tensorbend.predictors.fit import FitConfig, fit


@dataclass(frozen=True)
class ResidualGateConfig:
    hidden: int = 64  # correction MLP width H (capped by the 25%-of-seed budget)
    loss: str = "listwise"  # listwise | bce
    use_prev: bool = True  # feed the previous token's experts at the target layer
    use_gate: bool = True  # start from spec_gate (False: a plain small MLP)
    use_src_scores: bool = False  # also feed the source layer's own router scores (d >= 1)
    budget_frac: float = 0.25  # max params per layer relative to the seed MLP (p = 256)
    fit: FitConfig = FitConfig(min_steps=600)

    def __post_init__(self):
        assert self.loss in ("listwise", "bce") and self.hidden >= 1


def seed_params_per_layer(D: int, E: int, p: int = 256) -> int:
    """The seed MLP's learned parameters per layer (fc1, BatchNorm affine, fc2)."""
    return (D + E) * p + p + 2 * p + p * E + E


def input_width(D: int, E: int, src_scores: bool) -> int:
    return D + 2 * E + 1 + (E if src_scores else 0)


def width_for_budget(D: int, E: int, want: int, frac: float, src_scores: bool = False) -> int:
    Fin = input_width(D, E, src_scores)
    per_h = Fin + 1 + E
    cap = int((frac * seed_params_per_layer(D, E) - E - 1) // per_h)
    return max(1, min(want, cap))


class _Net(torch.nn.Module):
    """Per-target-layer parameters stacked over layers: [Lt, ...]."""

    def __init__(self, Lt: int, Fin: int, H: int, E: int):
        super().__init__()
        self.W1 = torch.nn.Parameter(torch.randn(Lt, Fin, H) / Fin**0.5)
        self.b1 = torch.nn.Parameter(torch.zeros(Lt, 1, H))
        self.W2 = torch.nn.Parameter(torch.zeros(Lt, H, E))
        self.b2 = torch.nn.Parameter(torch.zeros(Lt, 1, E))
        self.alpha = torch.nn.Parameter(torch.ones(Lt, 1, 1))

    def forward(self, g_LNE: torch.Tensor, u_LNF: torch.Tensor) -> torch.Tensor:
        h_LNH = F.gelu(torch.baddbmm(self.b1, u_LNF, self.W1))
        return self.alpha * g_LNE + torch.baddbmm(self.b2, h_LNH, self.W2)


class ResidualGatePredictor:
    kind = "tensorbend"

    def __init__(
        self, spec: RoutingSpec, la: Lookahead, router_params: dict, cfg: ResidualGateConfig, H: int
    ):
        self.spec, self.lookahead, self.cfg, self.H = spec, la, cfg, H
        self.router_params = router_params
        self.gate = SpecGatePredictor(spec, la, router_params)
        self.targets = list(la.targets(spec.num_moe_layers))
        E, D = spec.num_experts, spec.hidden_size
        self.net = _Net(len(self.targets), input_width(D, E, cfg.use_src_scores), H, E).eval()
        self._fast: dict[int, dict] = {}

    # ------------------------------------------------------------ API

    @classmethod
    def fit(
        cls,
        spec,
        lookahead,
        router_params,
        train_rows,
        val_rows,
        cfg: ResidualGateConfig | None = None,
        progress: bool = False,
    ):
        cfg = cfg or ResidualGateConfig()
        la = get_lookahead(lookahead) if isinstance(lookahead, str) else lookahead
        torch.manual_seed(cfg.fit.seed)
        H = width_for_budget(
            spec.hidden_size, spec.num_experts, cfg.hidden, cfg.budget_frac, cfg.use_src_scores
        )
        p = cls(spec, la, router_params, cfg, H)
        train, val = p._inputs(train_rows), p._inputs(val_rows)
        K = spec.top_k

        def loss_fn(net, b):
            s = net(b["g"], b["u"])
            if cfg.loss == "bce":
                tgt = torch.zeros_like(s).scatter_(2, b["truth"], 1.0)
                return F.binary_cross_entropy_with_logits(s, tgt)
            return -(F.log_softmax(s, -1).gather(2, b["truth"])).mean()

        def val_fn(net):
            s = net(val["g"], val["u"])
            return sum(
                float(topk_hits(s[i], val["truth"][i], K).mean()) for i in range(s.shape[0])
            ) / (K * s.shape[0])

        _, p.history = fit(
            p.net, train, loss_fn, val_fn, cfg.fit, progress=progress, desc=f"tensorbend {la.name}"
        )
        p.val_recall = max(h["val"] for h in p.history)
        p._fast = {}
        return p

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        """Fast path (batch 1 decode in the runtime): one matmul for the correction's input layer
        and the folded router, row gathers for the multi-hot inputs. Equal to the training-time
        computation (`scores_reference`) up to float rounding."""
        f = self._fast.get(m) or self._build_fast(m)
        H, E = self.H, self.spec.num_experts
        with torch.no_grad():
            x = src.hidden_TD if src.hidden_TD.dtype == torch.float32 else src.hidden_TD.float()
            r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            y = x @ f["Wcat"]  # [T, H + E]: correction input layer | router logits
            if len(src) == 1:  # decode: one gather over [source experts | previous experts]
                h = self._one_token_hidden(f, src, y[:, :H], r)
            else:
                h = torch.addcmul(f["b1"], y[:, :H], r)
                if src.src_ids_TK is not None:
                    h = h + f["W1src"][src.src_ids_TK.long()].sum(1)
                if self.cfg.use_prev and bool(src.has_prev_T.any()):
                    hp = f["W1prev"][src.prev_ids_TK.long()].sum(1) + f["w1hp"]
                    h = h + hp * src.has_prev_T.float()[:, None]
            if "W1sc" in f:
                sc = scores_from_logits(self.spec, f["src_router"], src.src_layer, y[:, H + E :])
                std, mean = torch.std_mean(sc, -1, keepdim=True)
                h = h + ((sc - mean) / (std + 1e-6)) @ f["W1sc"]
            out = torch.addmm(f["b2"], F.gelu(h), f["W2"])
            if self.cfg.use_gate:
                logits = (
                    y[:, H : H + E] * r
                    if self.lookahead.hidden == "layer_input"
                    else y[:, H : H + E]
                )
                g = scores_from_logits(self.spec, f["router"], m, logits)
                std, mean = torch.std_mean(g, -1, keepdim=True)
                out = out + (g - mean) * (f["alpha"] / (std + 1e-6))
            return out

    def _one_token_hidden(
        self, f: dict, src: SourceBatch, yh: torch.Tensor, r: torch.Tensor
    ) -> torch.Tensor:
        E = self.spec.num_experts
        parts = []
        if src.src_ids_TK is not None:
            parts.append(src.src_ids_TK[0])
        prev = self.cfg.use_prev and bool(src.has_prev_T[0])
        if prev:
            parts.append(src.prev_ids_TK[0] + E)
        b1 = f["b1_prev"] if prev else f["b1"]
        if not parts:
            return torch.addcmul(b1, yh, r)
        idx = parts[0] if len(parts) == 1 else torch.cat(parts)
        return torch.addcmul(b1, yh, r) + f["W1ids"].index_select(0, idx).sum(0)

    def _build_fast(self, m: int) -> dict:
        li, D, E = m - self.lookahead.distance, self.spec.hidden_size, self.spec.num_experts
        net = self.net
        W1 = net.W1[li].detach()
        rp = self.router_params
        scale_D = self.gate.input_scale(m)
        Wg = rp[f"layers.{m}.weight"]  # [E, D], with the re-normalisation folded in
        if scale_D is not None:
            Wg = Wg * scale_D[None, :]
        router = {
            k: v
            for k, v in rp.items()
            if k.startswith(f"layers.{m}.") and not k.endswith(".weight")
        }
        cols = [W1[:D], Wg.T]
        extra = {}
        s_layer = m - self.lookahead.distance
        if self.cfg.use_src_scores and self.lookahead.distance >= 1:
            cols.append(rp[f"layers.{s_layer}.weight"].T)
            extra = {
                "W1sc": W1[D + 2 * E + 1 :],
                "src_router": {
                    k: v
                    for k, v in rp.items()
                    if k.startswith(f"layers.{s_layer}.") and not k.endswith(".weight")
                },
            }
        self._fast[m] = {
            **extra,
            "Wcat": torch.cat(cols, dim=1).contiguous(),
            "W1src": W1[D : D + E],
            "W1prev": W1[D + E : D + 2 * E],
            "w1hp": W1[D + 2 * E],
            "W1ids": W1[D : D + 2 * E].contiguous(),  # [source experts | previous experts]
            "b1_prev": net.b1[li, 0].detach() + W1[D + 2 * E],
            "b1": net.b1[li, 0].detach(),
            "W2": net.W2[li].detach(),
            "b2": net.b2[li, 0].detach(),
            "alpha": net.alpha[li, 0, 0].detach(),
            "router": router,
        }
        return self._fast[m]

    def scores_reference(self, m: int, src: SourceBatch) -> torch.Tensor:
        """The training-time computation (tests compare the fast path against it)."""
        li = m - self.lookahead.distance
        g = (
            self._gate_scores(m, src)
            if self.cfg.use_gate
            else torch.zeros(len(src), self.spec.num_experts)
        )
        u = self._features(src)
        net = self.net
        with torch.no_grad():
            h = F.gelu(u @ net.W1[li] + net.b1[li])
            return net.alpha[li] * g + h @ net.W2[li] + net.b2[li]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.net.parameters())

    def config_dict(self) -> dict:
        return {**asdict(self.cfg), "H": self.H}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {
            f"net.{k}": v.detach().clone().contiguous() for k, v in self.net.state_dict().items()
        }
        out.update({f"router.{k}": v for k, v in self.router_params.items()})
        return out

    @classmethod
    def from_state(cls, spec, la, config: dict, tensors: dict[str, torch.Tensor]):
        config = dict(config)
        H = config.pop("H")
        fit_cfg = FitConfig(**config.pop("fit"))
        cfg = ResidualGateConfig(**config, fit=fit_cfg)
        router = {k[len("router.") :]: v for k, v in tensors.items() if k.startswith("router.")}
        p = cls(spec, la, router, cfg, H)
        p.net.load_state_dict(
            {k[len("net.") :]: v for k, v in tensors.items() if k.startswith("net.")}
        )
        return p

    # ------------------------------------------------------------ features

    def _gate_scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        s = self.gate.scores(m, src)
        return (s - s.mean(-1, keepdim=True)) / (s.std(-1, keepdim=True) + 1e-6)

    def _features(self, src: SourceBatch) -> torch.Tensor:
        E = self.spec.num_experts
        x = src.hidden_TD.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        srcmh = (
            multi_hot(src.src_ids_TK, E) if src.src_ids_TK is not None else torch.zeros(len(src), E)
        )
        has_prev = src.has_prev_T & torch.tensor(self.cfg.use_prev)
        prev = multi_hot(src.prev_ids_TK, E, has_prev)
        parts = [x, srcmh, prev, has_prev.float()[:, None]]
        if self.cfg.use_src_scores:
            if self.lookahead.distance >= 1:
                sc = router_scores(
                    self.spec, self.router_params, src.src_layer, src.hidden_TD.float()
                )
                parts.append((sc - sc.mean(-1, keepdim=True)) / (sc.std(-1, keepdim=True) + 1e-6))
            else:
                parts.append(torch.zeros(len(src), E))
        return torch.cat(parts, dim=-1)

    def _inputs(self, rows) -> dict[str, torch.Tensor]:
        from tensorbend.predictors.base import sources_from_rows

        g, u, truth = [], [], []
        for m in self.targets:
            src = sources_from_rows(rows, self.lookahead, m)
            g.append(
                self._gate_scores(m, src)
                if self.cfg.use_gate
                else torch.zeros(len(src), self.spec.num_experts)
            )
            u.append(self._features(src))
            truth.append(rows["expert_ids_TLK"][:, m].long())
        return {"g": torch.stack(g), "u": torch.stack(u), "truth": torch.stack(truth)}
