"""What every predictor sees and returns: lookaheads, source batches, the Predictor protocol.

Usage (offline, on a trace; the runtime builds the same SourceBatch from hooks online):
    la = LOOKAHEADS["d1"]
    rows = trace.load(la.features, split="test")
    for m in la.targets(spec.num_moe_layers):
        src = sources_from_rows(rows, la, m)
        scores_TE = predictor.scores(m, src)      # higher = more likely routed

A prediction for target MoE layer m under lookahead `d` may use only what exists at its source
point for the current token, plus anything from earlier tokens:
  pre_attn    layer_input[m] (before layer m's attention) and routing of layers < m
  dN          gate_input[m-N] and routing[m-N] (and everything before), for N = 1, 2, 3
  same_layer  gate_input[m]: the seed's setup, zero lead time; for comparison only
and, from tokens processed in an earlier forward pass, their routing at every layer
(`prev_ids_TK`: the previous token's experts at the target layer). In prefill the previous
prompt token is routed at layer m in the same pass as the current one, so at a real lookahead
its experts at the target layer do not exist yet at the source point: `has_prev_T` is False
for those rows. Decode rows (and the first decode step, whose previous token was prefilled)
have them. At `same_layer` the source point is layer m's router input, which exists for every
token of the pass at once, so the previous prompt token's layer-m routing counts as available
there too (the seed fed it; `Lookahead.prev_in_pass`). Targets m < N have no source layer at
lookahead dN and are not scored: `Lookahead.targets` lists the valid ones. The table of
lookaheads lives in tensorbend/lookahead.py (re-exported here), low enough for `cache.config`.

Shapes: T tokens (rows), L MoE layers, K top-k, E experts, D hidden size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from tensorbend.capture.rows import previous_token
from tensorbend.errors import (
    CheckpointError,
    PredictorConfigError,
    PredictorInputError,
    TensorbendError,
)
from tensorbend.lookahead import (
    HEADLINE_LOOKAHEADS,
    LOOKAHEADS,
    Lookahead,
    LookaheadName,
    get_lookahead,
)
from tensorbend.models import RoutingSpec

__all__ = [  # re-exported
    "HEADLINE_LOOKAHEADS",
    "LOOKAHEADS",
    "Lookahead",
    "LookaheadName",
    "PredictorConfigError",
    "PredictorInputError",
    "get_lookahead",
    "previous_token",
]


@dataclass
class SourceBatch:
    """Inputs available for predicting target layer m for T tokens (all on CPU).

    hidden_TD:    the source hidden state (gate_input[m-d], or layer_input[m] for pre_attn)
    src_ids_TK:   experts of the latest layer routed before the source point (m-d for d >= 1,
                  m-1 for pre_attn and same_layer), or None when there is none (m = 0)
    prev_ids_TK:  the previous token's experts at the target layer (rows with has_prev_T False
                  are undefined, e.g. a prompt's first token)
    """

    hidden_TD: torch.Tensor
    src_ids_TK: torch.Tensor | None
    prev_ids_TK: torch.Tensor
    has_prev_T: torch.Tensor
    src_layer: int  # MoE layer index of src_ids_TK (-1 when None)

    def __len__(self) -> int:
        return self.hidden_TD.shape[0]

    def row(self, i: int) -> SourceBatch:
        """The one-token batch of row i (what the runtime scores at decode)."""
        return SourceBatch(
            self.hidden_TD[i : i + 1],
            None if self.src_ids_TK is None else self.src_ids_TK[i : i + 1],
            self.prev_ids_TK[i : i + 1],
            self.has_prev_T[i : i + 1],
            self.src_layer,
        )


def sources_from_rows(rows: dict[str, torch.Tensor], la: Lookahead, m: int) -> SourceBatch:
    """SourceBatch for target layer m from rows loaded with `Trace.load(la.features)`."""
    ids_TLK = rows["expert_ids_TLK"].long()
    T, L = ids_TLK.shape[:2]  # a routing-only trace: an empty hidden state (routing-only kinds)
    hidden_TLD = rows.get(f"{la.hidden}_TLD", torch.zeros(T, L, 0))
    s = la.source_layer(m)
    assert 0 <= s < ids_TLK.shape[1], f"target {m} has no source layer at {la.name}"
    route_layer = m - max(la.distance, 1)  # latest layer routed before the source point
    prev_ids_TLK, prev_phase_T = previous_token(rows)
    has_prev_T = prev_phase_T >= 0
    if not la.prev_in_pass:  # a prefill predecessor of a prefill row is routed in the same pass
        has_prev_T &= ~((rows["phase_T"] == 0) & (prev_phase_T == 0))
    return SourceBatch(
        hidden_TD=hidden_TLD[:, s].float(),
        src_ids_TK=ids_TLK[:, route_layer] if route_layer >= 0 else None,
        prev_ids_TK=prev_ids_TLK[:, m].long(),
        has_prev_T=has_prev_T,
        src_layer=route_layer,
    )


@dataclass
class TrainData:
    """What fitting may read: train rows, val rows (model selection), the trace's router weights."""

    train_rows: dict[str, torch.Tensor] | None = None
    val_rows: dict[str, torch.Tensor] | None = None
    router_params: dict[str, torch.Tensor] | None = None


class Predictor(Protocol):
    """Scores experts of a target layer from a SourceBatch. Fit once, score many times."""

    kind: str  # the registry name: "tensorbend", "seed_mlp", "frequency", ...
    spec: RoutingSpec
    lookahead: Lookahead
    needs_truth: bool  # scores read the true routing (the oracle): call set_truth first
    recorded_routing: bool  # asked `ahead(now)` at its source points instead of scored (the
    #                         runtime's oracle, offload.recorded.RecordedRouting)
    predicts_nothing: bool  # every score is -inf (the runtime's empty predictor): not asked
    checkpoint: str | None  # the file it was loaded from; None when built in this run

    @classmethod
    def fit(cls, spec, la: Lookahead, data: TrainData, cfg=None, progress: bool = False): ...

    @classmethod
    def from_state(cls, spec, la: Lookahead, config: dict, tensors: dict[str, torch.Tensor]): ...

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        """[T, E] scores for target layer m; top-k of a row is the predicted expert set."""
        ...

    def set_truth(self, ids_TLK: torch.Tensor) -> None: ...
    def num_params(self) -> int: ...
    def config_dict(self) -> dict: ...
    def state_tensors(self) -> dict[str, torch.Tensor]: ...
    def fit_summary(self) -> dict:
        """Numbers from fitting worth keeping in the checkpoint (e.g. the seed's train-rows recall)."""
        ...


class PredictorBase:
    """Defaults of the Predictor protocol for kinds without parameters, truth or a config."""

    kind = "?"
    needs_truth = False
    recorded_routing = False
    predicts_nothing = False
    checkpoint: str | None = None

    def __init__(self, spec: RoutingSpec, la: Lookahead, cfg=None):
        self.spec, self.lookahead, self.cfg = spec, la, cfg

    def set_truth(self, ids_TLK: torch.Tensor) -> None:
        raise AssertionError(f"{self.kind} does not read the truth")

    def num_params(self) -> int:
        return sum(t.numel() for t in self.state_tensors().values())

    def config_dict(self) -> dict:
        return dataclasses.asdict(self.cfg) if self.cfg is not None else {}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def fit_summary(self) -> dict:
        return {}


def check_state(
    expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], what: str
) -> None:
    """Raise CheckpointError unless `found` has exactly the keys and shapes of `expected`."""
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"{what}: expected tensors {sorted(expected)[:6]}..., found missing {missing[:4]} and "
            f"unexpected {extra[:4]}: the file is from another version or kind; retrain it"
        )
    for k, want in expected.items():
        if tuple(found[k].shape) != tuple(want.shape):
            raise CheckpointError(
                f"{what}: tensor {k} expected shape {tuple(want.shape)}, found "
                f"{tuple(found[k].shape)}: the file does not match its own metadata; retrain it"
            )


def config_from_dict(config_cls, d: dict, what: str):
    """Rebuild a (possibly nested) config dataclass from its asdict(); CheckpointError on mismatch."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise CheckpointError(
            f"{what}: config keys {unknown} unknown to {config_cls.__name__} (expected some of "
            f"{sorted(fields)}): the file is from another tensorbend version; retrain it"
        )
    kw = {}
    for k, v in d.items():
        default = fields[k].default
        kw[k] = (
            config_from_dict(type(default), v, what)
            if dataclasses.is_dataclass(default) and isinstance(v, dict)
            else v
        )
    try:
        return config_cls(**kw)
    except TensorbendError as e:
        raise CheckpointError(f"{what}: invalid config ({e})") from e
