"""Predictors run offline over a trace's rows: each token's ranked expert guesses per target layer.

Usage:
    rows = routing_rows(trace, split="test")                 # routing-only traces too
    pred = build_predictor("transition", trace, lookahead="d1")
    ranked = ranked_predictions(pred, rows, width=spec.top_k)
    ranked.ids_TLJ.shape, ranked.valid_L                     # [T, L, J] best first; targets

A predictor spec is a checkpoint path (`tensorbend train` output), a peer name from
`predictors.BASELINES` (tables fitted on the trace's train split), `none` (no predictions:
`prefetch` then isolates the `Predicted` eviction). Routing-only traces (imported) carry no
hidden states: `routing_rows` gives them zero-width placeholders so that predictors reading
routing only (ROUTING_ONLY) run unchanged, and a predictor that needs hidden states is refused
with a message that says so. Guesses are ranked as the runtime ranks them
(`prefetch.ranked_ids`); simulate/plan.py turns them into its prefetch lists
(`prefetch.prefetch_list`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tensorbend.capture.trace import Trace
from tensorbend.errors import TraceError
from tensorbend.predictors import (
    BASELINES,
    build_baseline,
    get_lookahead,
    load_predictor,
    sources_from_rows,
)
from tensorbend.predictors.prefetch import ranked_ids
from tensorbend.timing.time_model import PredictorCost

ROUTING_ONLY = ("frequency", "transition", "prev_token", "random", "oracle", "none")
HIDDEN = ("gate_input", "layer_input")
NEEDS_TRAIN = ("frequency", "prev_token", "transition")


@dataclass
class Ranked:
    """A predictor's guesses for every row and target layer."""

    kind: str
    lookahead: str
    distance: int  # MoE layers between source and target (0: pre_attn / same_layer)
    ids_TLJ: torch.Tensor  # [T, L, J] expert ids, best first; -1 = no guess
    valid_L: torch.Tensor  # [L] bool: the lookahead has a source layer for this target
    cost: PredictorCost | None = None  # one call's work on a target (None: free, the oracle)

    @property
    def issue_at_router(self) -> bool:
        """dN and same_layer predictions are made in a router hook; pre_attn before attention."""
        return self.lookahead != "pre_attn"


def rank_all(
    specs, trace: Trace, rows: dict, lookahead: str, width: int, train_trace: Trace | None = None
) -> list[Ranked]:
    """Ranked guesses of each predictor spec on `rows` (`none`: no guesses at all)."""
    out = []
    for spec in specs:
        pred = build_predictor(spec, trace, lookahead, train_trace)
        if pred is None:
            T, L = rows["expert_ids_TLK"].shape[:2]
            out.append(
                Ranked(
                    "none",
                    lookahead,
                    0,
                    torch.full((T, L, 1), -1),
                    torch.zeros(L, dtype=torch.bool),
                )
            )
        else:
            out.append(ranked_predictions(pred, rows, width))
    return out


def routing_rows(
    trace: Trace, split: str | None = "test", features: tuple[str, ...] = ("ids",)
) -> dict[str, torch.Tensor]:
    """Rows of a split with the hidden features asked for; zero-width where the trace lacks them."""
    have = [f for f in features if f == "ids" or f in trace.features]
    rows = trace.load(tuple(dict.fromkeys(("ids", *have))), split=split)
    T, L = rows["expert_ids_TLK"].shape[:2]
    for f in HIDDEN:
        rows.setdefault(f"{f}_TLD", torch.zeros(T, L, 0))
    return rows


def build_predictor(
    spec: str, trace: Trace, lookahead: str = "d1", train_trace: Trace | None = None
):
    """A checkpoint, a named peer, or None for `none`; refuses what the trace cannot feed.
    Table peers fit on `train_trace`'s train split (default: `trace`'s)."""
    if spec == "none":
        return None
    la = get_lookahead(lookahead)
    if spec in BASELINES:
        if spec not in ROUTING_ONLY and la.hidden not in trace.features:
            raise _needs_hidden(spec, la.hidden, trace)
        src = train_trace or trace
        if (
            train_trace is not None
            and train_trace.spec.moe_layer_ids != trace.spec.moe_layer_ids
            or (src.spec.num_experts, src.spec.top_k) != (trace.spec.num_experts, trace.spec.top_k)
        ):
            raise TraceError(
                f"train trace {src.root} has another routing shape than {trace.root}: expected "
                "a trace of the same model"
            )
        train = routing_rows(src, "train") if spec in NEEDS_TRAIN else None
        if train is not None and train["expert_ids_TLK"].shape[0] == 0:
            raise TraceError(
                f"{spec} fits tables on the train split and trace {src.root} has no train "
                "prompts: pass --train-trace, use a trace with train prompts, or a checkpoint"
            )
        return build_baseline(
            spec, trace.spec, la, router_params=trace.router_params(), train_rows=train
        )
    path = Path(spec)
    if not path.is_file():
        raise TraceError(
            f"predictor {spec!r}: expected a checkpoint file, `none`, or one of {', '.join(BASELINES)}"
        )
    pred = load_predictor(path, spec=trace.spec, fingerprint=trace.manifest["model"]["fingerprint"])
    if pred.kind not in ROUTING_ONLY and pred.lookahead.hidden not in trace.features:
        raise _needs_hidden(pred.kind, pred.lookahead.hidden, trace)
    return pred


def ranked_predictions(pred, rows: dict[str, torch.Tensor], width: int) -> Ranked:
    """Top-`width` guesses of `pred` for every row and valid target layer (oracle: the truth)."""
    ids_TLK = rows["expert_ids_TLK"].long()
    T, L, K = ids_TLK.shape
    la = pred.lookahead
    out = torch.full((T, L, width), -1, dtype=torch.long)
    valid = torch.zeros(L, dtype=torch.bool)
    if pred.needs_truth:
        pred.set_truth(ids_TLK)
    with torch.no_grad():
        for m in la.targets(L):
            ids_TJ = ranked_ids(pred.scores(m, sources_from_rows(rows, la, m)).float(), width)
            out[:, m, : ids_TJ.shape[1]] = ids_TJ
            valid[m] = True
    if pred.needs_truth:  # the oracle: exact sets, in router order
        out[:, :, :K] = torch.where(valid[None, :, None], ids_TLK, -1)
        out[:, :, K:] = -1
    cost = None if pred.needs_truth else PredictorCost.of(pred, int(valid.sum()))
    return Ranked(pred.kind, la.name, la.distance, out, valid, cost)


def _needs_hidden(kind: str, hidden: str, trace: Trace) -> TraceError:
    return TraceError(
        f"predictor {kind} needs hidden states ({hidden}) and trace {trace.root} has none "
        f"(features {trace.features}{'; it was imported from routing only' if trace.spec.hidden_size == 0 else ''}): "
        f"use one that reads routing only ({', '.join(n for n in ROUTING_ONLY if n not in ('oracle', 'none'))}), "
        f"or collect with --features ids {hidden}"
    )
