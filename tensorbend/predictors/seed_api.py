"""The seed's API (tensorbend-predictor's ExpertPredictorSet), behaving like the seed's own.

Usage (the seed's README, unchanged):
    pset = ExpertPredictorSet(num_layers=60, hidden_dim=7168, num_experts=72,
                              predictor_dim=256, device="cpu", use_prev_routing=True)
    pset.load("predictor_reap72_dim256.pt")   # the seed's torch.save dict, read with weights_only
    experts = pset.predict(layer_idx=0, hidden_states=h, top_k=8)   # top k + 4 ids
    pset.update_routing(expert_ids); pset.reset_routing(); pset.save("p.pt")

As in the seed: `predict` feeds the hidden state plus the multi-hot of the ids last given to
`update_routing`, at every layer including layer 0 (zeros before any update and after
`reset_routing`); `update_routing` ignores ids outside [0, num_experts); with
`use_prev_routing=False` the MLPs take the hidden state alone. `save` writes the seed's format
(`torch.save({"state_dict", "num_layers", "trained"})`, readable by the seed and by
`torch.load(weights_only=True)`), or safetensors with the same keys when the path ends in
`.safetensors`; `load` reads either (the seed's `.pt` with `weights_only=True`). Extensions:
a [T, D] hidden state gives a list of T id lists (the seed returns row 0's only), and wrong
shapes raise a one-line error instead of predicting from part of the input. Remember what the
seed's numbers mean (docs/guide/predictors.md): trained on the router's own input, this predictor has
zero lead time; `tensorbend train --predictor seed_mlp --lookahead d1` trains it with some.

Shapes: L layers, T tokens, D hidden_dim, E num_experts.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import torch

from tensorbend.atomic import atomic_save_tensors, atomic_write
from tensorbend.errors import CheckpointError, PredictorInputError
from tensorbend.predictors.seed_net import SeedMLPNet

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default (zip) format
_PICKLE_MAGIC = b"\x80"  # torch.save's legacy format starts with a pickle protocol byte


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
        self.predictor_dim, self.device = predictor_dim, device
        self.use_prev_routing = use_prev_routing
        din = hidden_dim + (num_experts if use_prev_routing else 0)
        self.net = SeedMLPNet(num_layers, din, predictor_dim, num_experts).to(device).eval()
        self._trained = False
        self._prev_routing_E: torch.Tensor | None = None

    # ------------------------------------------------------------ the seed's methods

    @torch.no_grad()
    def predict(
        self, layer_idx: int, hidden_states: torch.Tensor, top_k: int = 8, overprovision: int = 4
    ):
        """Top-(k + overprovision) expert ids: a list for [D] or [1, D], a list of lists for [T, D]."""
        h_TD = self._check_hidden(layer_idx, hidden_states)
        if self.use_prev_routing:
            routing_E = (
                self._prev_routing_E
                if self._prev_routing_E is not None
                else torch.zeros(self.num_experts, device=self.device)
            )
            h_TD = torch.cat([h_TD, routing_E.expand(h_TD.shape[0], -1)], dim=-1)
        logits_TE = self.net(h_TD[None], slice(layer_idx, layer_idx + 1))[0]
        n = min(top_k + overprovision, self.num_experts)
        ids = logits_TE.topk(n, dim=-1).indices.tolist()
        return ids[0] if hidden_states.dim() == 1 or len(ids) == 1 else ids

    def update_routing(self, expert_ids) -> None:
        """Remember these experts as the routing to feed next; ids outside [0, E) are ignored."""
        ids = torch.as_tensor(expert_ids).long().flatten()
        ids = ids[(ids >= 0) & (ids < self.num_experts)]
        routing_E = torch.zeros(self.num_experts, device=self.device)
        routing_E[ids.to(self.device)] = 1.0
        self._prev_routing_E = routing_E

    def reset_routing(self) -> None:
        self._prev_routing_E = None

    @property
    def total_params(self) -> int:
        return sum(p.numel() for p in self.net.parameters())

    @property
    def size_mb(self) -> float:
        return sum(p.numel() * p.element_size() for p in self.net.parameters()) / 1e6

    def save(self, path: str | Path) -> None:
        """The seed's torch.save dict, or safetensors with the same keys for `*.safetensors`."""
        state = {k: v.cpu().contiguous() for k, v in self.net.to_seed_state().items()}
        if Path(path).suffix == ".safetensors":
            meta = {"num_layers": str(self.num_layers), "trained": json.dumps(self._trained)}
            atomic_save_tensors(state, path, metadata=meta)
            return
        obj = {"state_dict": state, "num_layers": self.num_layers, "trained": self._trained}
        atomic_write(path, lambda f: torch.save(obj, f))

    def load(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"predictor checkpoint {path}: no such file")
        with open(path, "rb") as f:
            head = f.read(4)
        if head.startswith(_ZIP_MAGIC) or head.startswith(_PICKLE_MAGIC):
            state, trained = self._read_torch(path)
        else:
            state, trained = self._read_safetensors(path)
        self.net.from_seed_state(state, str(path))
        self.net.to(self.device)
        self._trained = trained

    # ------------------------------------------------------------ helpers

    def _check_hidden(self, layer_idx: int, hidden_states: torch.Tensor) -> torch.Tensor:
        if not 0 <= layer_idx < self.num_layers:
            raise PredictorInputError(
                f"layer_idx: expected 0 <= layer_idx < {self.num_layers}, found {layer_idx}"
            )
        shape = tuple(hidden_states.shape)
        if hidden_states.dim() not in (1, 2) or shape[-1] != self.hidden_dim:
            raise PredictorInputError(
                f"hidden_states: expected shape ({self.hidden_dim},) or (T, {self.hidden_dim}), "
                f"found {shape}: pass the router input of the model this set was built for"
            )
        return hidden_states.to(self.device, torch.float32).reshape(-1, self.hidden_dim)

    def _read_torch(self, path: Path) -> tuple[dict, bool]:
        try:
            obj = torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
            raise CheckpointError(
                f"{path}: not a seed checkpoint readable with weights_only=True ({e})"
            ) from e
        if not isinstance(obj, dict) or not isinstance(obj.get("state_dict"), dict):
            raise CheckpointError(
                f"{path}: expected the seed's dict with a 'state_dict', found "
                f"{type(obj).__name__} with keys {sorted(obj) if isinstance(obj, dict) else []}"
            )
        return obj["state_dict"], bool(obj.get("trained", True))

    def _read_safetensors(self, path: Path) -> tuple[dict, bool]:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "pt") as f:
                state = {k: f.get_tensor(k) for k in f.keys()}
                meta = f.metadata() or {}
        except (SafetensorError, OSError) as e:
            raise CheckpointError(
                f"{path}: expected the seed's .pt (torch.save) or safetensors, found neither ({e})"
            ) from e
        return state, meta.get("trained", "true") == "true"
