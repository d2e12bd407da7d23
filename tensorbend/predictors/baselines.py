"""Peer methods, each scoring experts from a SourceBatch: the yardsticks every result is set against.

Usage (`registry.build_baseline` builds one by name):
    p = build_baseline("spec_gate", spec, "d1", router_params=trace.router_params())
    p = build_baseline("transition", spec, "d1", train_rows=trace.load(("ids",), split="train"))
    scores_TE = p.scores(m, sources_from_rows(rows, p.lookahead, m))

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

Shapes: T tokens, L MoE layers, K top-k, E experts, D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorbend.errors import TensorbendError
from tensorbend.predictors.base import (
    PredictorBase,
    SourceBatch,
    TrainData,
    check_state,
)
from tensorbend.predictors.ops import multi_hot, rmsnorm
from tensorbend.routers import router_scores

_TIE = 1e-3  # weight of frequency as a tie-breaker


@dataclass(frozen=True)
class RandomConfig:
    seed: int = 0
    """Seed of the random scores."""


class RandomPredictor(PredictorBase):
    kind = "random"

    def __init__(self, spec, la, cfg: RandomConfig):
        super().__init__(spec, la, cfg)
        self._gen = torch.Generator().manual_seed(cfg.seed)

    @classmethod
    def fit(cls, spec, la, data: TrainData, cfg: RandomConfig | None = None, progress=False):
        return cls(spec, la, cfg or RandomConfig())

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        return torch.rand(len(src), self.spec.num_experts, generator=self._gen)


class OraclePredictor(PredictorBase):
    """Scores the true experts; the evaluator (or runtime) hands it the truth before scoring."""

    kind = "oracle"
    needs_truth = True

    def __init__(self, spec, la):
        super().__init__(spec, la)
        self._truth_TLK: torch.Tensor | None = None

    @classmethod
    def fit(cls, spec, la, data: TrainData, cfg=None, progress=False):
        return cls(spec, la)

    def set_truth(self, ids_TLK: torch.Tensor) -> None:
        self._truth_TLK = ids_TLK.long()

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        assert self._truth_TLK is not None and self._truth_TLK.shape[0] == len(src), (
            "set_truth first"
        )
        return multi_hot(self._truth_TLK[:, m], self.spec.num_experts)


class FrequencyPredictor(PredictorBase):
    kind = "frequency"

    def __init__(self, spec, la, freq_LE: torch.Tensor):
        super().__init__(spec, la)
        self.freq_LE = freq_LE

    @classmethod
    def fit(cls, spec, la, data: TrainData, cfg=None, progress=False):
        ids_TLK = _train_ids(data, cls.kind)
        counts_LE = torch.stack(
            [
                torch.bincount(ids_TLK[:, m].flatten(), minlength=spec.num_experts).float()
                for m in range(ids_TLK.shape[1])
            ]
        )
        return cls(spec, la, counts_LE / counts_LE.sum(-1, keepdim=True).clamp(min=1))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"freq_LE": self.freq_LE}

    @classmethod
    def from_state(cls, spec, la, config, tensors):
        L, E = spec.num_moe_layers, spec.num_experts
        check_state({"freq_LE": torch.empty(L, E)}, tensors, f"{cls.kind} checkpoint")
        return cls(spec, la, tensors["freq_LE"])

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        return self.freq_LE[m].expand(len(src), -1).clone()


class PrevTokenPredictor(PredictorBase):
    kind = "prev_token"

    def __init__(self, spec, la, freq: FrequencyPredictor):
        super().__init__(spec, la)
        self.freq = freq

    @classmethod
    def fit(cls, spec, la, data: TrainData, cfg=None, progress=False):
        return cls(spec, la, FrequencyPredictor.fit(spec, la, data))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.freq.state_tensors()

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        prev_TE = multi_hot(src.prev_ids_TK, self.spec.num_experts, src.has_prev_T)
        return prev_TE + _TIE * self.freq.scores(m, src)


class TransitionPredictor(PredictorBase):
    kind = "transition"

    def __init__(self, spec, la, P_LEE: torch.Tensor, freq: FrequencyPredictor):
        super().__init__(spec, la)
        self.P_LEE, self.freq = P_LEE, freq

    @classmethod
    def fit(cls, spec, la, data: TrainData, cfg=None, progress=False):
        ids_TLK = _train_ids(data, cls.kind)
        L, E = ids_TLK.shape[1], spec.num_experts
        # P_LEE[m, i, j] = P(expert j at target m | expert i at m's source routing layer)
        P_LEE = torch.zeros(L, E, E)
        for m in range(L):
            s = m - max(la.distance, 1)  # as SourceBatch.src_ids_TK
            if s < 0:
                continue
            counts_EE = multi_hot(ids_TLK[:, s], E).T @ multi_hot(ids_TLK[:, m], E)
            P_LEE[m] = counts_EE / counts_EE.sum(-1, keepdim=True).clamp(min=1)
        return cls(spec, la, P_LEE, FrequencyPredictor.fit(spec, la, data))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"P_LEE": self.P_LEE, "freq_LE": self.freq.freq_LE}

    @classmethod
    def from_state(cls, spec, la, config, tensors):
        L, E = spec.num_moe_layers, spec.num_experts
        want = {"P_LEE": torch.empty(L, E, E), "freq_LE": torch.empty(L, E)}
        check_state(want, tensors, f"{cls.kind} checkpoint")
        return cls(spec, la, tensors["P_LEE"], FrequencyPredictor(spec, la, tensors["freq_LE"]))

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        base_TE = _TIE * self.freq.scores(m, src)
        if src.src_ids_TK is None:
            return base_TE
        return multi_hot(src.src_ids_TK, self.spec.num_experts) @ self.P_LEE[m] + base_TE


class SpecGatePredictor(PredictorBase):
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

    @classmethod
    def fit(cls, spec, la, data: TrainData, cfg=None, progress=False):
        if data.router_params is None:
            raise TensorbendError(
                "spec_gate needs the model's router weights: expected a trace's "
                "router.safetensors, found none"
            )
        return cls(spec, la, data.router_params)

    def router_input(self, m: int, src: SourceBatch) -> torch.Tensor:
        x_TD = src.hidden_TD.float()
        if self.lookahead.hidden == "layer_input":  # a residual: RMS-normalise like the layer
            x_TD = rmsnorm(x_TD)
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


def _train_ids(data: TrainData, kind: str) -> torch.Tensor:
    rows = data.train_rows
    if rows is None or rows["expert_ids_TLK"].shape[0] == 0:
        raise TensorbendError(
            f"{kind} learns tables from data: expected train rows, found none (a trace with "
            "train prompts: collect with --split all)"
        )
    return rows["expert_ids_TLK"].long()
