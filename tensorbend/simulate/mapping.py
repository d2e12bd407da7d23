"""How a trace's layers and experts stand in for a geometry's: explicit, recorded, printed.

Usage:
    >>> m = make_mapping(trace_layers=6, trace_experts=32, trace_top_k=4,
    ...                  geometry_layers=60, geometry_experts=384, geometry_top_k=8)
    >>> m.layer_rule, m.layer_of[:8], m.expert_rule, m.unit_scale
    ('cycle', (0, 1, 2, 3, 4, 5, 0, 1), 'scaled', 2.0)

Layers. Geometry MoE layer g replays trace layer `layer_of[g]`:
  identity   same count;
  cycle      the geometry has more layers: the trace's layers repeat in order (g mod L_trace);
  subsample  the geometry has fewer: evenly spaced trace layers (g * L_trace // L_geometry).
A predictor keeps its lookahead in geometry layers: a d-layer prediction for geometry layer g is
issued d geometry layers earlier and is the predictor's prediction for trace layer layer_of[g]
(none where that trace layer has no source layer, i.e. layer_of[g] < d).

Experts. With the same experts and top-k the ids are used as they are (identity). Otherwise
(scaled) the trace's expert ids are kept: each of a token's K_trace experts stands for
K_geometry / K_trace of the geometry's experts, in bytes and in compute, so a token reads the
geometry's bytes per layer; the cache holds the same *fraction* of each layer's experts as asked
(hit rates are the trace model's at that fraction; a geometry with a larger pool of experts
usually reuses less); cache bytes are reported for the geometry's own experts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Mapping:
    geometry_layers: int
    trace_layers: int
    layer_of: tuple[int, ...]  # trace MoE layer replayed as geometry MoE layer g
    layer_rule: str  # identity | cycle | subsample
    trace_experts: int
    geometry_experts: int
    trace_top_k: int
    geometry_top_k: int
    expert_rule: str  # identity | scaled
    unit_scale: float  # geometry experts (bytes, compute) one simulated expert stands for

    def to_json(self) -> dict:
        return {**asdict(self), "layer_of": list(self.layer_of), "notes": self.lines()}

    def lines(self) -> list[str]:
        """Human-readable statement of the mapping (the CLI prints it)."""
        out = []
        if self.layer_rule == "identity":
            out.append(f"layers: the trace's {self.trace_layers} MoE layers as they are")
        elif self.layer_rule == "cycle":
            out.append(
                f"layers: trace has {self.trace_layers} MoE layers, geometry {self.geometry_layers}: "
                f"geometry layer g replays trace layer g mod {self.trace_layers}"
            )
        else:
            out.append(
                f"layers: trace has {self.trace_layers} MoE layers, geometry {self.geometry_layers}: "
                f"geometry layer g replays trace layer g*{self.trace_layers}//{self.geometry_layers}"
            )
        if self.expert_rule == "identity":
            out.append(
                f"experts: {self.trace_experts} experts, top-{self.trace_top_k}, as they are"
            )
        else:
            out.append(
                f"experts: trace routes top-{self.trace_top_k} of {self.trace_experts}, geometry "
                f"top-{self.geometry_top_k} of {self.geometry_experts}: each trace expert stands for "
                f"{self.unit_scale:g} geometry experts' bytes and compute; the cache holds the asked "
                f"fraction of each layer's {self.trace_experts} trace experts (hit rates are the "
                "trace model's; a larger pool usually reuses less)"
            )
        return out


def make_mapping(
    trace_layers: int,
    trace_experts: int,
    trace_top_k: int,
    geometry_layers: int,
    geometry_experts: int,
    geometry_top_k: int,
) -> Mapping:
    Lt, Lg = trace_layers, geometry_layers
    if Lg == Lt:
        rule, layer_of = "identity", tuple(range(Lg))
    elif Lg > Lt:
        rule, layer_of = "cycle", tuple(g % Lt for g in range(Lg))
    else:
        rule, layer_of = "subsample", tuple(g * Lt // Lg for g in range(Lg))
    same = (trace_experts, trace_top_k) == (geometry_experts, geometry_top_k)
    return Mapping(
        geometry_layers=Lg,
        trace_layers=Lt,
        layer_of=layer_of,
        layer_rule=rule,
        trace_experts=trace_experts,
        geometry_experts=geometry_experts,
        trace_top_k=trace_top_k,
        geometry_top_k=geometry_top_k,
        expert_rule="identity" if same else "scaled",
        unit_scale=1.0 if same else geometry_top_k / trace_top_k,
    )
