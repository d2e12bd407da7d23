"""The seed's per-layer MLPs, stacked over layers, and the seed's checkpoint key names.

Usage:
    >>> import torch
    >>> net = SeedMLPNet(num_layers=2, din=6, width=8, num_experts=4).eval()
    >>> net(torch.randn(1, 3, 6), slice(1, 2)).shape          # layer 1 on 3 rows
    torch.Size([1, 3, 4])
    >>> sorted(net.to_seed_state())[:3]
    ['0.bn.bias', '0.bn.num_batches_tracked', '0.bn.running_mean']

Each layer is Linear(din -> P) -> BatchNorm1d(P) -> GELU -> Dropout -> Linear(P -> E), the
seed's `ExpertPredictor`; parameters are stacked on dimension 0 so all layers run in one
batched matmul. `to_seed_state` / `from_seed_state` convert to and from the seed's
`nn.ModuleList` state dict ("0.fc1.weight", "0.bn.running_mean", ...).

Shapes: L layers, N rows, P width, E experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorbend.errors import CheckpointError

# The seed's per-layer key -> our stacked parameter or buffer.
SEED_KEYS = {
    "fc1.weight": "fc1_w",
    "fc1.bias": "fc1_b",
    "bn.weight": "bn_w",
    "bn.bias": "bn_b",
    "bn.running_mean": "bn_mean",
    "bn.running_var": "bn_var",
    "bn.num_batches_tracked": "bn_count",
    "fc2.weight": "fc2_w",
    "fc2.bias": "fc2_b",
}


class SeedMLPNet(torch.nn.Module):
    """L independent seed MLPs, parameters stacked: [L, ...]. BatchNorm statistics per layer."""

    def __init__(self, num_layers: int, din: int, width: int, num_experts: int, dropout=0.1):
        super().__init__()
        L = num_layers
        # PyTorch's default Linear init per layer, as the seed's nn.Linear modules get.
        fc1 = [torch.nn.Linear(din, width) for _ in range(L)]
        fc2 = [torch.nn.Linear(width, num_experts) for _ in range(L)]
        self.fc1_w = torch.nn.Parameter(torch.stack([m.weight.detach() for m in fc1]))
        self.fc1_b = torch.nn.Parameter(torch.stack([m.bias.detach() for m in fc1]))
        self.bn_w = torch.nn.Parameter(torch.ones(L, width))
        self.bn_b = torch.nn.Parameter(torch.zeros(L, width))
        self.fc2_w = torch.nn.Parameter(torch.stack([m.weight.detach() for m in fc2]))
        self.fc2_b = torch.nn.Parameter(torch.stack([m.bias.detach() for m in fc2]))
        self.register_buffer("bn_mean", torch.zeros(L, width))
        self.register_buffer("bn_var", torch.ones(L, width))
        self.register_buffer("bn_count", torch.zeros(L, dtype=torch.long))
        self.dropout = dropout
        self.num_layers = L

    def forward(self, x_LND: torch.Tensor, layers: slice | None = None) -> torch.Tensor:
        sl = layers or slice(None)
        h_LNP = torch.baddbmm(self.fc1_b[sl, None], x_LND, self.fc1_w[sl].transpose(1, 2))
        if self.training:
            mean_LP, var_LP = h_LNP.mean(1), h_LNP.var(1, unbiased=False)
            with torch.no_grad():  # BatchNorm1d running stats (momentum 0.1, unbiased var)
                n = h_LNP.shape[1]
                self.bn_mean[sl] = 0.9 * self.bn_mean[sl] + 0.1 * mean_LP
                self.bn_var[sl] = 0.9 * self.bn_var[sl] + 0.1 * var_LP * n / max(n - 1, 1)
                self.bn_count[sl] += 1
        else:
            mean_LP, var_LP = self.bn_mean[sl], self.bn_var[sl]
        h_LNP = (h_LNP - mean_LP[:, None]) * torch.rsqrt(var_LP[:, None] + 1e-5)
        h_LNP = h_LNP * self.bn_w[sl, None] + self.bn_b[sl, None]
        h_LNP = F.dropout(F.gelu(h_LNP), self.dropout, self.training)
        return torch.baddbmm(self.fc2_b[sl, None], h_LNP, self.fc2_w[sl].transpose(1, 2))

    def to_seed_state(self) -> dict[str, torch.Tensor]:
        """The seed's ModuleList state dict: "{layer}.{key}" per layer."""
        sd = self.state_dict()
        return {
            f"{i}.{k}": sd[ours][i].detach().clone()
            for i in range(self.num_layers)
            for k, ours in SEED_KEYS.items()
        }

    def from_seed_state(self, state: dict[str, torch.Tensor], what: str) -> None:
        """Load the seed's ModuleList state dict; CheckpointError naming any key or shape off."""
        want = self.to_seed_state()
        missing = sorted(set(want) - set(state), key=_layer_order)
        extra = sorted(set(state) - set(want), key=_layer_order)
        if missing or extra:
            raise CheckpointError(
                f"{what}: expected the seed's keys for {self.num_layers} layers, found missing "
                f"{missing[:4]} and unexpected {extra[:4]}: construct ExpertPredictorSet with the "
                "checkpoint's num_layers and use_prev_routing"
            )
        for k, w in want.items():
            if tuple(state[k].shape) != tuple(w.shape):
                raise CheckpointError(
                    f"{what}: {k} expected shape {tuple(w.shape)}, found {tuple(state[k].shape)}: "
                    "construct ExpertPredictorSet with the checkpoint's hidden_dim, num_experts, "
                    "predictor_dim and use_prev_routing"
                )
        stacked = {
            ours: torch.stack([state[f"{i}.{k}"] for i in range(self.num_layers)])
            for k, ours in SEED_KEYS.items()
        }
        self.load_state_dict(stacked)


def _layer_order(key: str) -> tuple:
    head, _, rest = key.partition(".")
    return (int(head) if head.isdigit() else -1, rest)
