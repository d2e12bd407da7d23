"""What every predictor sees and returns: lookaheads, source batches, the Predictor protocol.

Usage (offline, on a trace; the runtime builds the same SourceBatch from hooks online):
    >>> la = LOOKAHEADS["d1"]
    >>> rows = trace.load(("ids", "gate_input"), split="test")
    >>> for m in la.targets(spec.num_moe_layers):
    ...     src = sources_from_rows(rows, la, m)
    ...     scores_TE = predictor.scores(m, src)      # higher = more likely routed

A prediction for target MoE layer m under lookahead `d` may use only what exists at its source
point for the current token, plus anything from earlier tokens:
  pre_attn    layer_input[m] (before layer m's attention) and routing of layers < m
  dN          gate_input[m-N] and routing[m-N] (and everything before), for N = 1, 2, 3
  same_layer  gate_input[m]: the seed's setup, zero lead time; for comparison only
and, from tokens processed in an earlier forward pass, their routing at every layer
(`prev_ids_TK`: the previous token's experts at the target layer). In prefill the previous
prompt token is routed at layer m in the same pass as the current one, so its experts at the
target layer do not exist yet at the source point: `has_prev_T` is False for those rows (the
seed used them, a leak). Decode rows (and the first decode step, whose previous token was
prefilled) have them. Targets m < N have no source layer at lookahead dN and are
not scored (reported as n/a): `Lookahead.targets` lists the valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tensorbend.errors import TensorbendError


@dataclass(frozen=True)
class Lookahead:
    name: str
    distance: int  # MoE layers between the source layer and the target (0 for pre_attn)
    hidden: str  # source hidden feature: "gate_input" or "layer_input"
    lead_time: str  # what the prediction runs ahead of, in words

    def source_layer(self, m: int) -> int:
        return m - self.distance

    def targets(self, num_layers: int) -> range:
        return range(self.distance, num_layers)

    @property
    def features(self) -> tuple[str, ...]:
        """Trace features needed to build its sources."""
        return ("ids", self.hidden)


LOOKAHEADS: dict[str, Lookahead] = {
    "same_layer": Lookahead("same_layer", 0, "gate_input", "none (router input itself)"),
    "pre_attn": Lookahead("pre_attn", 0, "layer_input", "attention of layer m"),
    "d1": Lookahead("d1", 1, "gate_input", "experts of m-1 + attention of m"),
    "d2": Lookahead("d2", 2, "gate_input", "2 MoE layers"),
    "d3": Lookahead("d3", 3, "gate_input", "3 MoE layers"),
}
HEADLINE_LOOKAHEADS = ("pre_attn", "d1", "d2", "d3")


def get_lookahead(name: str) -> Lookahead:
    if name not in LOOKAHEADS:
        raise TensorbendError(f"lookahead {name!r}: expected one of {', '.join(LOOKAHEADS)}")
    return LOOKAHEADS[name]


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


def sources_from_rows(rows: dict[str, torch.Tensor], la: Lookahead, m: int) -> SourceBatch:
    """SourceBatch for target layer m from rows loaded with `Trace.load(la.features)`."""
    ids_TLK = rows["expert_ids_TLK"].long()
    hidden_TLD = rows[f"{la.hidden}_TLD"]
    s = la.source_layer(m)
    assert 0 <= s < ids_TLK.shape[1], f"target {m} has no source layer at {la.name}"
    route_layer = m - max(la.distance, 1)  # latest layer routed before the source point
    prev = rows["prev_row_T"]
    has_prev = prev >= 0
    if "phase_T" in rows:  # a prefill row's predecessor in prefill was routed in the same pass
        phase = rows["phase_T"]
        has_prev &= ~((phase == 0) & (phase[prev.clamp(min=0)] == 0))
    prev_ids = ids_TLK[prev.clamp(min=0), m]
    return SourceBatch(
        hidden_TD=hidden_TLD[:, s].float(),
        src_ids_TK=ids_TLK[:, route_layer] if route_layer >= 0 else None,
        prev_ids_TK=prev_ids,
        has_prev_T=has_prev,
        src_layer=route_layer,
    )


def multi_hot(
    ids_TK: torch.Tensor, num_experts: int, valid_T: torch.Tensor | None = None
) -> torch.Tensor:
    """[T, E] float 0/1 from expert ids; rows where valid_T is False are all zero."""
    out = torch.zeros(ids_TK.shape[0], num_experts)
    out.scatter_(1, ids_TK.long(), 1.0)
    if valid_T is not None:
        out *= valid_T.float()[:, None]
    return out


class Predictor(Protocol):
    """Scores experts of a target layer from a SourceBatch. Fit once, score many times."""

    kind: str  # "tensorbend", "seed_mlp", "frequency", ...
    lookahead: Lookahead

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        """[T, E] scores for target layer m; top-k of a row is the predicted expert set."""
        ...

    def num_params(self) -> int:
        """Learned parameters (table entries count as parameters)."""
        ...
