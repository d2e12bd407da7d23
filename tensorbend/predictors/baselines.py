"""Peer methods, each scoring experts from a SourceBatch: the yardsticks every result is set against.

Usage:
    >>> p = build_baseline("spec_gate", spec, "d1", router_params=trace.router_params())
    >>> p = build_baseline("transition", spec, "d1", train_rows=trace.load(("ids",), split="train"))
    >>> scores_TE = p.scores(m, sources_from_rows(rows, p.lookahead, m))

  random      uniform random scores (the floor)
  oracle      the true experts (needs `set_truth`; the ceiling)
  frequency   per-layer expert popularity on the train split
  prev_token  the previous token's experts at the target layer (when they exist at the source
              point: decode rows); frequency breaks ties and fills in otherwise
  transition  P(target expert | source-layer expert) tables from the train split, summed over
              the source layer's experts (MoE-Infinity / ProMoE-style id tables)
  spec_gate   the target layer's own router applied to the earlier hidden state, with the
              exact router function (softmax / sigmoid + bias / group limits); no training
              (FATE / HOBBIT / Mixtral-offloading speculative gating)
"""

from __future__ import annotations

import torch

from tensorbend.errors import TensorbendError
from tensorbend.models import RoutingSpec, router_scores
from tensorbend.predictors.base import Lookahead, SourceBatch, get_lookahead, multi_hot

BASELINES = ("random", "oracle", "frequency", "prev_token", "transition", "spec_gate")
NEEDS_TRAIN = ("frequency", "prev_token", "transition")
_TIE = 1e-3  # weight of frequency as a tie-breaker


def build_baseline(
    name: str,
    spec: RoutingSpec,
    lookahead: str | Lookahead,
    router_params: dict[str, torch.Tensor] | None = None,
    train_rows: dict[str, torch.Tensor] | None = None,
    seed: int = 0,
):
    """A ready-to-score baseline predictor."""
    la = get_lookahead(lookahead) if isinstance(lookahead, str) else lookahead
    if name not in BASELINES:
        raise TensorbendError(f"baseline {name!r}: expected one of {', '.join(BASELINES)}")
    if name == "random":
        return RandomPredictor(spec, la, seed)
    if name == "oracle":
        return OraclePredictor(spec, la)
    if name == "spec_gate":
        if router_params is None:
            raise TensorbendError(
                "spec_gate needs the model's router weights (a trace's router.safetensors)"
            )
        return SpecGatePredictor(spec, la, router_params)
    if train_rows is None or train_rows["expert_ids_TLK"].shape[0] == 0:
        raise TensorbendError(f"{name} learns tables from data: expected train rows, found none")
    freq = FrequencyPredictor.from_rows(spec, la, train_rows)
    if name == "frequency":
        return freq
    if name == "prev_token":
        return PrevTokenPredictor(spec, la, freq)
    return TransitionPredictor.from_rows(spec, la, train_rows, freq)


class _Base:
    kind = "?"

    def __init__(self, spec: RoutingSpec, la: Lookahead):
        self.spec, self.lookahead = spec, la

    def num_params(self) -> int:
        return 0

    def config_dict(self) -> dict:
        return {}


class RandomPredictor(_Base):
    kind = "random"

    def __init__(self, spec, la, seed: int = 0):
        super().__init__(spec, la)
        self.seed = seed
        self._gen = torch.Generator().manual_seed(seed)

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        return torch.rand(len(src), self.spec.num_experts, generator=self._gen)


class OraclePredictor(_Base):
    """Scores the true experts; the evaluator (or runtime) hands it the truth before scoring."""

    kind = "oracle"

    def __init__(self, spec, la):
        super().__init__(spec, la)
        self._truth_TLK: torch.Tensor | None = None

    def set_truth(self, ids_TLK: torch.Tensor) -> None:
        self._truth_TLK = ids_TLK.long()

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        assert self._truth_TLK is not None and self._truth_TLK.shape[0] == len(src), (
            "set_truth first"
        )
        return multi_hot(self._truth_TLK[:, m], self.spec.num_experts)


class FrequencyPredictor(_Base):
    kind = "frequency"

    def __init__(self, spec, la, freq_LE: torch.Tensor):
        super().__init__(spec, la)
        self.freq_LE = freq_LE

    @classmethod
    def from_rows(cls, spec, la, train_rows):
        ids_TLK = train_rows["expert_ids_TLK"].long()
        L = ids_TLK.shape[1]
        counts_LE = torch.zeros(L, spec.num_experts)
        for m in range(L):
            counts_LE[m] = torch.bincount(
                ids_TLK[:, m].flatten(), minlength=spec.num_experts
            ).float()
        return cls(spec, la, counts_LE / counts_LE.sum(-1, keepdim=True).clamp(min=1))

    def num_params(self) -> int:
        return self.freq_LE.numel()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"freq_LE": self.freq_LE}

    @classmethod
    def from_state(cls, spec, la, config, tensors):
        return cls(spec, la, tensors["freq_LE"])

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        return self.freq_LE[m].expand(len(src), -1).clone()


class PrevTokenPredictor(_Base):
    kind = "prev_token"

    def __init__(self, spec, la, freq: FrequencyPredictor):
        super().__init__(spec, la)
        self.freq = freq

    def num_params(self) -> int:
        return self.freq.num_params()

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        prev_TE = multi_hot(src.prev_ids_TK, self.spec.num_experts, src.has_prev_T)
        return prev_TE + _TIE * self.freq.scores(m, src)


class TransitionPredictor(_Base):
    kind = "transition"

    def __init__(self, spec, la, P_LEE: torch.Tensor, freq: FrequencyPredictor):
        super().__init__(spec, la)
        self.P_LEE, self.freq = P_LEE, freq

    @classmethod
    def from_rows(cls, spec, la, train_rows, freq: FrequencyPredictor):
        ids_TLK = train_rows["expert_ids_TLK"].long()
        L, E = ids_TLK.shape[1], spec.num_experts
        # P_LEE[m, i, j] = P(expert j at target m | expert i at m's source routing layer)
        P_LEE = torch.zeros(L, E, E)
        for m in range(L):
            s = m - max(la.distance, 1)  # as SourceBatch.src_ids_TK
            if s < 0:
                continue
            counts = multi_hot(ids_TLK[:, s], E).T @ multi_hot(ids_TLK[:, m], E)
            P_LEE[m] = counts / counts.sum(-1, keepdim=True).clamp(min=1)
        return cls(spec, la, P_LEE, freq)

    def num_params(self) -> int:
        return self.P_LEE.numel() + self.freq.num_params()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"P_LEE": self.P_LEE, "freq_LE": self.freq.freq_LE}

    @classmethod
    def from_state(cls, spec, la, config, tensors):
        return cls(spec, la, tensors["P_LEE"], FrequencyPredictor(spec, la, tensors["freq_LE"]))

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        base = _TIE * self.freq.scores(m, src)
        if src.src_ids_TK is None:
            return base
        return multi_hot(src.src_ids_TK, self.spec.num_experts) @ self.P_LEE[m] + base


class SpecGatePredictor(_Base):
    """The target router on the source hidden state, renormalised the way the target layer would.

    Router inputs are RMS-normalised residuals times the layer's norm weight. From gate_input[s]
    we undo layer s's norm weight and apply layer m's; from layer_input[m] (pre_attn) we apply
    RMSNorm with layer m's post-attention norm weight. Without norm weights in the router
    params the hidden state is used as is.
    """

    kind = "spec_gate"

    def __init__(self, spec, la, router_params: dict[str, torch.Tensor]):
        super().__init__(spec, la)
        self.params = router_params

    def router_input(self, m: int, src: SourceBatch) -> torch.Tensor:
        x_TD = src.hidden_TD.float()
        if self.lookahead.hidden == "layer_input":  # a residual: RMS-normalise like the layer
            x_TD = x_TD * torch.rsqrt(x_TD.pow(2).mean(-1, keepdim=True) + 1e-6)
        scale_D = self.input_scale(m)
        return x_TD if scale_D is None else x_TD * scale_D

    def input_scale(self, m: int) -> torch.Tensor | None:
        """Per-dimension factor [D] from the (normalised) source hidden state to layer m's router
        input: layer m's norm weight, divided by the source layer's for a gate input; None when
        the hidden state is used as is. (Ours folds it into the router weights.)"""
        w_m = self.params.get(f"layers.{m}.gate_norm")
        if w_m is None:
            return None
        if self.lookahead.hidden == "layer_input":
            return w_m
        s = self.lookahead.source_layer(m)
        if s == m:
            return None
        w_s = self.params[f"layers.{s}.gate_norm"]
        return w_m / torch.where(w_s.abs() < 1e-4, torch.full_like(w_s, 1e-4), w_s)

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        return router_scores(self.spec, self.params, m, self.router_input(m, src))
