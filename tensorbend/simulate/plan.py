"""The work of a simulated run: per forward and geometry MoE layer, the demand and the predictions.

Usage:
    demand = demand_lists(rows, fwds)                       # [forward][trace layer]
    preds = prediction_lists(ranked, fwds, top_k=K, extra=0)  # [forward][trace layer] or None
    work = build_work(fwds, demand, mapping, ranked, preds)  # list[ForwardWork]
    add_oracle(work, distance=1, at_router=True, foresight=None)  # policy oracle: exact routing
    steps = steps_by_key(work)                              # Belady's future (the oracle)

Geometry layer g replays trace layer `mapping.layer_of[g]`; its demand is that layer's experts
for the forward's rows (with how many of the rows each serves). A prediction for target g at
lookahead distance d is issued at the router of geometry layer g - d (pre_attn: before layer
g's attention; same_layer: at g's own router) and is the predictor's list for trace layer
layer_of[g], when that trace layer is a valid target of the lookahead (see mapping.py). The
oracle instead names the exact experts of the step `distance` ahead of every source point,
also in the next forward (`add_oracle`, as `offload.recorded.RecordedRouting.ahead`). Every
prediction carries the absolute step it is for.
"""

from __future__ import annotations

import torch

from tensorbend.cache.oracle import steps_by_key as oracle_steps
from tensorbend.cache.policies import Key
from tensorbend.capture.rows import Forward
from tensorbend.predictors.prefetch import likeliest, prefetch_list
from tensorbend.simulate.events import ForwardWork, LayerWork
from tensorbend.simulate.mapping import Mapping
from tensorbend.simulate.predictions import Ranked


def demand_lists(
    rows: dict[str, torch.Tensor], fwds: list[Forward]
) -> list[list[list[tuple[int, int]]]]:
    """[forward][trace layer] -> [(expert, tokens routed to it)], ascending expert id."""
    ids_TLK = rows["expert_ids_TLK"].long()
    L = ids_TLK.shape[1]
    out = []
    for f in fwds:
        sel = ids_TLK[f.rows]  # [N, L, K]
        per_layer = []
        for m in range(L):
            e, n = torch.unique(sel[:, m], return_counts=True)
            per_layer.append(list(zip(e.tolist(), n.tolist(), strict=True)))
        out.append(per_layer)
    return out


def prediction_lists(ranked: Ranked, fwds: list[Forward], top_k: int, extra: int) -> list:
    """[forward][trace layer] -> the runtime's prefetch list (`prefetch.prefetch_list`), or
    None where no prediction exists."""
    valid = ranked.valid_L.tolist()
    out = []
    for f in fwds:
        sel = ranked.ids_TLJ[f.rows]  # [N, L, J]
        out.append(
            [
                prefetch_list(sel[:, m], top_k, extra) if valid[m] else None
                for m in range(len(valid))
            ]
        )
    return out


def build_work(
    fwds: list[Forward],
    demand: list[list[list[tuple[int, int]]]],
    mapping: Mapping,
    ranked: Ranked | None,
    preds: list[list[list[int] | None]] | None,
) -> list[ForwardWork]:
    Lg, layer_of = mapping.geometry_layers, mapping.layer_of
    work = []
    for f, fw in enumerate(fwds):
        layers = [LayerWork(demand=demand[f][layer_of[g]]) for g in range(Lg)]
        if ranked is not None:
            d = ranked.distance
            for g in range(Lg):
                ids = preds[f][layer_of[g]]
                if ids is None or g - d < 0:
                    continue
                if ranked.issue_at_router:
                    layers[g - d].at_router.append((f * Lg + g, ids))
                else:
                    layers[g].at_start.append((f * Lg + g, ids))
        work.append(ForwardWork(phase=fw.phase, tokens=len(fw.rows), layers=layers))
    return work


def add_oracle(
    work: list[ForwardWork], distance: int, at_router: bool, foresight: int | None
) -> None:
    """The runtime's oracle (`offload.recorded.RecordedRouting.ahead`): at each source point
    (step now = forward * L + s) the exact experts of step now + distance, most tokens first,
    also in the next forward, if that step is within its foresight."""
    L = len(work[0].layers) if work else 1
    by_step = [
        [e for e, _ in sorted(lw.demand, key=lambda en: -en[1])] for fw in work for lw in fw.layers
    ]
    for f, fw in enumerate(work):
        for s, lw in enumerate(fw.layers):
            now = f * L + s
            target = now + distance
            horizon = float("inf") if foresight is None else (now // L + foresight) * L
            if target < len(by_step) and target < horizon:
                (lw.at_router if at_router else lw.at_start).append((target, by_step[target]))


def add_horizon(work: list[ForwardWork], mapping: Mapping, forecasts, ahead_layers: int, K: int):
    """A cross-token predictor's forecast after each forward (batch 1: one per forward, in run
    order), handed to the policy at the forward's last geometry layer, plus prefetches of the
    likeliest experts of the next forward's first `ahead_layers` layers (as the runtime)."""
    layer_of = list(mapping.layer_of)
    Lg = mapping.geometry_layers
    assert len(forecasts) == len(work), "one forecast per forward (batch 1)"
    for f, (fw, fc) in enumerate(zip(work, forecasts, strict=True)):
        first_use_GEJ, tail_GE = fc.first_use_LEJ[layer_of], fc.tail_LE[layer_of]
        last = fw.layers[-1]
        last.forecast = (f, *type(fc)(first_use_GEJ, tail_GE).next_use_steps(f, Lg))
        last.ahead = [
            ((f + 1) * Lg + g, likeliest(first_use_GEJ[g, :, 0], K))
            for g in range(min(ahead_layers, Lg))
        ]


def steps_by_key(work: list[ForwardWork]) -> dict[Key, list[int]]:
    """Sorted steps (forward * L + g) at which each (g, e) is demanded (cache/oracle.py)."""
    return oracle_steps(
        (f * len(fw.layers) + g, g, e)
        for f, fw in enumerate(work)
        for g, lw in enumerate(fw.layers)
        for e, _ in lw.demand
    )
