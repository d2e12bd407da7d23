"""Lookaheads: where a prediction's source sits relative to the MoE layer it predicts.

Usage:
    >>> la = get_lookahead("d2")
    >>> la.targets(6), la.source_layer(5), la.features
    (range(2, 6), 3, ('ids', 'gate_input'))
    >>> [name for name, la in LOOKAHEADS.items() if la.prev_in_pass]
    ['same_layer']

A low module (it imports only `errors`): predictors read it to build their sources, and
`cache.config` names a lookahead (`--lookahead`) without importing `predictors/`. What each
lookahead may read is stated in predictors/base.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from tensorbend.errors import PredictorConfigError

LookaheadName = Literal["same_layer", "pre_attn", "d1", "d2", "d3"]


@dataclass(frozen=True)
class Lookahead:
    name: LookaheadName
    distance: int  # MoE layers between the source layer and the target (0 for pre_attn)
    hidden: str  # source hidden feature: "gate_input" or "layer_input"
    lead_time: str  # what the prediction runs ahead of, in words
    prev_in_pass: bool = False  # previous prompt token's routing at m exists in the same pass

    def source_layer(self, m: int) -> int:
        return m - self.distance

    def targets(self, num_layers: int) -> range:
        return range(self.distance, num_layers)

    @property
    def features(self) -> tuple[str, ...]:
        """Trace features needed to build its sources."""
        return ("ids", self.hidden)


LOOKAHEADS: dict[str, Lookahead] = {
    "same_layer": Lookahead("same_layer", 0, "gate_input", "none (router input itself)", True),
    "pre_attn": Lookahead("pre_attn", 0, "layer_input", "attention of layer m"),
    "d1": Lookahead("d1", 1, "gate_input", "experts of m-1 + attention of m"),
    "d2": Lookahead("d2", 2, "gate_input", "2 MoE layers"),
    "d3": Lookahead("d3", 3, "gate_input", "3 MoE layers"),
}
assert tuple(LOOKAHEADS) == get_args(LookaheadName)
HEADLINE_LOOKAHEADS = ("pre_attn", "d1", "d2", "d3")


def get_lookahead(name: str) -> Lookahead:
    if name not in LOOKAHEADS:
        raise PredictorConfigError(
            f"lookahead {name!r}: expected one of {', '.join(LOOKAHEADS)}, found {name!r}"
        )
    return LOOKAHEADS[name]
