"""The seed's predictor (kind `seed_mlp`), reproduced exactly, runnable at any lookahead.

Usage:
    >>> p = SeedMLPPredictor.fit(spec, "same_layer", train_rows, val_rows)   # the seed's setup
    >>> p = SeedMLPPredictor.fit(spec, "d1", train_rows, val_rows)           # with real lead time

Per target layer (SEED.md): Linear(D + E -> p) -> BatchNorm1d -> GELU -> Dropout(0.1) ->
Linear(p -> E), p = 256; input = source hidden state + multi-hot routing of the previous
layer (zeros for the first MoE layer, as the seed describes it). Training: BCE on multi-hot
targets, AdamW (lr 1e-3, weight decay 0.01), cosine annealing to 1% over 200 full-batch
epochs, gradient clipping 1.0; the seed has no early stopping and reports the last/best
epoch on training rows, we select on the val split and report held-out numbers.
Parameters are stacked over layers; `seed_state_dict()` gives the seed's ModuleList keys.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from tensorbend.metrics import topk_hits
from tensorbend.models import RoutingSpec
from tensorbend.predictors.base import (
    Lookahead,
    SourceBatch,
    get_lookahead,
    multi_hot,
    sources_from_rows,
)
from tensorbend.predictors.fit import FitConfig, fit

SEED_FIT = FitConfig(
    epochs=200,
    batch_rows=0,
    lr=1e-3,
    weight_decay=0.01,
    cosine_to=0.01,
    grad_clip=1.0,
    patience=0,
    optimizer="adamw",
)


@dataclass(frozen=True)
class SeedMLPConfig:
    width: int = 256  # p: 256 in the seed's code, 2048 in its report for 288 experts
    dropout: float = 0.1
    use_prev_routing: bool = True  # the seed's "previous routing" input
    loss: str = (
        "bce"  # bce (the seed) | ranking (the seed's variant: margin ranking + importance weights)
    )
    fit: FitConfig = SEED_FIT


class SeedMLPNet(torch.nn.Module):
    """L independent seed MLPs, parameters stacked: [L, ...]. BatchNorm statistics per layer."""

    def __init__(self, L: int, Din: int, p: int, E: int, dropout: float = 0.1):
        super().__init__()
        # PyTorch's default Linear init per layer, as the seed's nn.Linear modules get.
        self.fc1_w = torch.nn.Parameter(
            torch.stack([torch.nn.Linear(Din, p).weight.detach() for _ in range(L)])
        )
        self.fc1_b = torch.nn.Parameter(
            torch.stack([torch.nn.Linear(Din, p).bias.detach() for _ in range(L)])
        )
        self.bn_w = torch.nn.Parameter(torch.ones(L, p))
        self.bn_b = torch.nn.Parameter(torch.zeros(L, p))
        self.fc2_w = torch.nn.Parameter(
            torch.stack([torch.nn.Linear(p, E).weight.detach() for _ in range(L)])
        )
        self.fc2_b = torch.nn.Parameter(
            torch.stack([torch.nn.Linear(p, E).bias.detach() for _ in range(L)])
        )
        self.register_buffer("bn_mean", torch.zeros(L, p))
        self.register_buffer("bn_var", torch.ones(L, p))
        self.register_buffer("bn_count", torch.zeros(L, dtype=torch.long))
        self.dropout = dropout

    def forward(self, x_LND: torch.Tensor, layers: slice | None = None) -> torch.Tensor:
        sl = layers or slice(None)
        h = torch.baddbmm(self.fc1_b[sl, None], x_LND, self.fc1_w[sl].transpose(1, 2))
        if self.training:
            mean, var = h.mean(1), h.var(1, unbiased=False)
            with torch.no_grad():  # BatchNorm1d running stats (momentum 0.1, unbiased var)
                n = h.shape[1]
                self.bn_mean[sl] = 0.9 * self.bn_mean[sl] + 0.1 * mean
                self.bn_var[sl] = 0.9 * self.bn_var[sl] + 0.1 * var * n / max(n - 1, 1)
                self.bn_count[sl] += 1
        else:
            mean, var = self.bn_mean[sl], self.bn_var[sl]
        h = (h - mean[:, None]) * torch.rsqrt(var[:, None] + 1e-5) * self.bn_w[
            sl, None
        ] + self.bn_b[sl, None]
        h = F.dropout(F.gelu(h), self.dropout, self.training)
        return torch.baddbmm(self.fc2_b[sl, None], h, self.fc2_w[sl].transpose(1, 2))


class SeedMLPPredictor:
    kind = "seed_mlp"

    def __init__(self, spec: RoutingSpec, la: Lookahead, cfg: SeedMLPConfig):
        self.spec, self.lookahead, self.cfg = spec, la, cfg
        self.targets = list(la.targets(spec.num_moe_layers))
        self.net = SeedMLPNet(
            len(self.targets),
            spec.hidden_size + spec.num_experts,
            cfg.width,
            spec.num_experts,
            cfg.dropout,
        ).eval()

    @classmethod
    def fit(
        cls, spec, lookahead, train_rows, val_rows, cfg: SeedMLPConfig | None = None, progress=False
    ):
        cfg = cfg or SeedMLPConfig()
        la = get_lookahead(lookahead) if isinstance(lookahead, str) else lookahead
        torch.manual_seed(cfg.fit.seed)
        p = cls(spec, la, cfg)
        train, val = p._inputs(train_rows), p._inputs(val_rows)
        K, E = spec.top_k, spec.num_experts

        def loss_fn(net, b):
            s = net(b["x"])
            tgt = torch.zeros_like(s).scatter_(2, b["truth"], 1.0)
            if cfg.loss == "bce":
                return F.binary_cross_entropy_with_logits(s, tgt)
            # The seed's variant: margin ranking (true above false) + per-expert importance weights.
            imp = 1.0 / (tgt.mean(1, keepdim=True) + 1.0 / E)
            pos = s.gather(2, b["truth"])  # [L, N, K]
            margin = F.relu(1.0 - pos[..., :, None] + s[..., None, :]) * (1 - tgt)[..., None, :]
            return (margin * imp[..., None, :]).mean() + F.binary_cross_entropy_with_logits(s, tgt)

        def val_fn(net):
            s = net(val["x"])
            return sum(
                float(topk_hits(s[i], val["truth"][i], K).mean()) for i in range(s.shape[0])
            ) / (K * s.shape[0])

        def train_fn(net):  # what the seed reports: accuracy on (the first 200) training rows
            s = net(train["x"][:, :200])
            t = train["truth"][:, :200]
            return sum(float(topk_hits(s[i], t[i], K).mean()) for i in range(s.shape[0])) / (
                K * s.shape[0]
            )

        _, p.history = fit(
            p.net, train, loss_fn, val_fn, cfg.fit, progress=progress, desc=f"seed_mlp {la.name}"
        )
        p.val_recall = max(h["val"] for h in p.history)
        with torch.no_grad():
            p.train_rows_recall = train_fn(p.net)
        return p

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        li = m - self.lookahead.distance
        with torch.no_grad():
            return self.net(self._x(src)[None], slice(li, li + 1))[0]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.net.parameters())

    def config_dict(self) -> dict:
        return asdict(self.cfg)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone().contiguous() for k, v in self.net.state_dict().items()}

    @classmethod
    def from_state(cls, spec, la, config: dict, tensors):
        config = dict(config)
        cfg = SeedMLPConfig(**{**config, "fit": FitConfig(**config["fit"])})
        p = cls(spec, la, cfg)
        p.net.load_state_dict(tensors)
        return p

    def seed_state_dict(self) -> dict[str, torch.Tensor]:
        """The seed's checkpoint keys ("0.fc1.weight", "0.bn.running_mean", ...), one per layer."""
        n, out = self.net, {}
        for i in range(len(self.targets)):
            out.update(
                {
                    f"{i}.fc1.weight": n.fc1_w[i],
                    f"{i}.fc1.bias": n.fc1_b[i],
                    f"{i}.bn.weight": n.bn_w[i],
                    f"{i}.bn.bias": n.bn_b[i],
                    f"{i}.bn.running_mean": n.bn_mean[i],
                    f"{i}.bn.running_var": n.bn_var[i],
                    f"{i}.bn.num_batches_tracked": n.bn_count[i],
                    f"{i}.fc2.weight": n.fc2_w[i],
                    f"{i}.fc2.bias": n.fc2_b[i],
                }
            )
        return {k: v.detach().clone() for k, v in out.items()}

    # ------------------------------------------------------------ features

    def _x(self, src: SourceBatch) -> torch.Tensor:
        E = self.spec.num_experts
        routing = (
            multi_hot(src.src_ids_TK, E)
            if src.src_ids_TK is not None and self.cfg.use_prev_routing
            else torch.zeros(len(src), E)
        )
        return torch.cat([src.hidden_TD.float(), routing], dim=-1)

    def _inputs(self, rows) -> dict[str, torch.Tensor]:
        x, truth = [], []
        for m in self.targets:
            x.append(self._x(sources_from_rows(rows, self.lookahead, m)))
            truth.append(rows["expert_ids_TLK"][:, m].long())
        return {"x": torch.stack(x), "truth": torch.stack(truth)}
