"""Drop-in for the seed's API (tensorbend-predictor's ExpertPredictorSet), backed by our seed_mlp.

Usage (the seed's README, unchanged):
    >>> pset = ExpertPredictorSet(num_layers=60, hidden_dim=7168, num_experts=72,
    ...                           predictor_dim=256, device="cpu", use_prev_routing=True)
    >>> pset.load("predictor_reap72_dim256.pt")     # the seed's torch.save dict, read with weights_only=True
    >>> experts = pset.predict(layer_idx=0, hidden_states=h, top_k=8)   # k + 4 ids
    >>> pset.update_routing(expert_ids); pset.reset_routing(); pset.save("p.safetensors")

`predict` feeds the hidden state plus the multi-hot of the routing given to `update_routing`
(zeros for layer 0 and after `reset_routing`), like the seed. `save` writes safetensors with
the seed's key names ("0.fc1.weight", "0.bn.running_mean", ...); `load` reads that or the
seed's own `.pt` format. Remember what the seed's numbers mean (SEED.md): trained on the
router's own input, this predictor has zero lead time; train it at a real lookahead with
`tensorbend train --predictor seed_mlp --lookahead d1`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tensorbend.errors import CheckpointError
from tensorbend.predictors.seed_mlp import SeedMLPNet

_PER_LAYER = (
    "fc1.weight",
    "fc1.bias",
    "bn.weight",
    "bn.bias",
    "bn.running_mean",
    "bn.running_var",
    "bn.num_batches_tracked",
    "fc2.weight",
    "fc2.bias",
)
_STACKED = ("fc1_w", "fc1_b", "bn_w", "bn_b", "bn_mean", "bn_var", "bn_count", "fc2_w", "fc2_b")


class ExpertPredictorSet:
    def __init__(
        self,
        num_layers: int,
        hidden_dim: int,
        num_experts: int,
        predictor_dim: int = 256,
        device: str = "cpu",
        use_prev_routing: bool = True,
    ):
        self.num_layers, self.hidden_dim, self.num_experts = num_layers, hidden_dim, num_experts
        self.predictor_dim, self.device, self.use_prev_routing = (
            predictor_dim,
            device,
            use_prev_routing,
        )
        self.net = (
            SeedMLPNet(num_layers, hidden_dim + num_experts, predictor_dim, num_experts)
            .to(device)
            .eval()
        )
        self.trained = False
        self._prev = torch.zeros(num_experts, device=device)

    # ------------------------------------------------------------ the seed's methods

    @torch.no_grad()
    def predict(
        self, layer_idx: int, hidden_states: torch.Tensor, top_k: int = 8, overprovision: int = 4
    ):
        """Top-(k + overprovision) expert ids: a list for one token, a list of lists for [T, D]."""
        h = hidden_states.to(self.device, torch.float32)
        single = h.dim() == 1 or (h.dim() == 2 and h.shape[0] == 1)
        h = h.reshape(-1, self.hidden_dim)
        if h.shape[-1] != self.hidden_dim:
            raise CheckpointError(
                f"hidden_states: expected last dim {self.hidden_dim}, found {h.shape[-1]}"
            )
        routing = (
            self._prev
            if (self.use_prev_routing and layer_idx > 0)
            else torch.zeros_like(self._prev)
        )
        x = torch.cat([h, routing.expand(h.shape[0], -1)], dim=-1)
        logits = self.net(x[None], slice(layer_idx, layer_idx + 1))[0]
        ids = logits.topk(min(top_k + overprovision, self.num_experts), dim=-1).indices.tolist()
        return ids[0] if single else ids

    def update_routing(self, expert_ids) -> None:
        self._prev = torch.zeros(self.num_experts, device=self.device)
        ids = torch.as_tensor(expert_ids, device=self.device).long().flatten()
        self._prev[ids] = 1.0

    def reset_routing(self) -> None:
        self._prev = torch.zeros(self.num_experts, device=self.device)

    @property
    def total_params(self) -> int:
        return sum(p.numel() for p in self.net.parameters())

    @property
    def size_mb(self) -> float:
        return sum(t.numel() * t.element_size() for t in self.net.state_dict().values()) / 1e6

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        meta = {
            "format": "tensorbend-seed-compat",
            "num_layers": str(self.num_layers),
            "trained": json.dumps(self.trained),
            "config": json.dumps(
                {
                    "hidden_dim": self.hidden_dim,
                    "num_experts": self.num_experts,
                    "predictor_dim": self.predictor_dim,
                }
            ),
        }
        save_file(
            {k: v.contiguous().cpu() for k, v in self._seed_state().items()},
            str(path),
            metadata=meta,
        )

    def load(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"predictor checkpoint {path}: no such file")
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state, trained = load_file(str(path)), True
        else:
            try:
                obj = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - any unpickling refusal is a user-facing format error
                raise CheckpointError(
                    f"{path}: not a seed checkpoint readable with weights_only=True ({e})"
                ) from e
            if not isinstance(obj, dict) or "state_dict" not in obj:
                raise CheckpointError(
                    f"{path}: expected the seed's dict with 'state_dict', found {type(obj).__name__}"
                )
            state, trained = obj["state_dict"], bool(obj.get("trained", True))
        self._load_seed_state(state, path)
        self.trained = trained

    # ------------------------------------------------------------ helpers

    def _seed_state(self) -> dict[str, torch.Tensor]:
        sd = self.net.state_dict()
        return {
            f"{i}.{k}": sd[s][i]
            for i in range(self.num_layers)
            for k, s in zip(_PER_LAYER, _STACKED, strict=True)
        }

    def _load_seed_state(self, state: dict, path: Path) -> None:
        layers = sorted({int(k.split(".")[0]) for k in state})
        if len(layers) != self.num_layers:
            raise CheckpointError(f"{path}: expected {self.num_layers} layers, found {len(layers)}")
        w = state["0.fc1.weight"]
        want = (self.predictor_dim, self.hidden_dim + self.num_experts)
        if tuple(w.shape) != want:
            raise CheckpointError(
                f"{path}: fc1.weight expected shape {want} (predictor_dim, hidden_dim + num_experts), found "
                f"{tuple(w.shape)}: construct ExpertPredictorSet with the checkpoint's sizes"
            )
        stacked = {}
        for k, s in zip(_PER_LAYER, _STACKED, strict=True):
            missing = [i for i in range(self.num_layers) if f"{i}.{k}" not in state]
            if missing:
                raise CheckpointError(f"{path}: missing {k} for layers {missing[:5]}")
            stacked[s] = torch.stack([state[f"{i}.{k}"] for i in range(self.num_layers)])
        self.net.load_state_dict(stacked)
