"""A predictor group: within-token predictors of lookaheads d1..dn that fire together, from every
n-th MoE layer's router, so that a decode token makes one prediction call site per n layers.

Usage (runtime: `tensorbend run --predictor-group D1.safetensors D2.safetensors`):
    group = PredictorGroup((load_predictor("ours_d1.safetensors"), load_predictor("ours_d2...")))
    pf = Prefetcher(spec, group, horizon)      # layer 0's router names layers 1 and 2, layer 2's
                                               # names 3 and 4, ...: each target exactly once

Why: inside the runtime a prediction call costs what the CPU's state after the model's work
makes it cost (bench/cold_call.py: ~130 us after a decode forward against ~40 us right after
another call), so a token's prediction cost is about its call sites x that cold cost. A group
of n makes ceil((L - 1) / n) call sites instead of L - 1; its second member's call finds the
CPU warm. The price is accuracy: target s + j is predicted at lookahead dj (recall falls with
the distance, docs/results_default.md) but with j layers of lead time to load in.

    >>> [group_targets(6, 2, s) for s in range(6)]
    [(1, 2), (), (3, 4), (), (5,), ()]
    >>> [group_targets(6, 1, s) for s in range(6)]
    [(1,), (2,), (3,), (4,), (5,), ()]
    >>> group_schedule(5, 2)         # (source router, target layer, member index)
    [(0, 1, 0), (0, 2, 1), (2, 3, 0), (2, 4, 1)]
"""

from __future__ import annotations

from tensorbend.errors import PredictorConfigError


class PredictorGroup:
    """Within-token predictors of lookaheads d1, d2, ..., dn (in that order) as one
    within-token stack (`members`); the Prefetcher fires them by `group_targets`."""

    recorded_routing = False
    predicts_nothing = False
    needs_truth = False

    def __init__(self, members):
        from tensorbend.predictors.registry import KINDS

        members = tuple(members)
        if any(p.kind in KINDS and KINDS[p.kind].cross_token for p in members):
            raise PredictorConfigError(
                "--predictor-group: expected within-token predictors, found a cross-token one: "
                "pass it as --horizon"
            )
        names = [getattr(p.lookahead, "name", "?") for p in members]
        want = [f"d{j}" for j in range(1, len(members) + 1)]
        if len(members) < 2 or names != want:
            raise PredictorConfigError(
                f"--predictor-group: expected within-token checkpoints of lookaheads "
                f"{', '.join(want if len(members) >= 2 else ['d1', 'd2'])} in that order (at "
                f"least two), found {', '.join(names) or 'none'}; train each with `tensorbend "
                f"train --lookahead dN`"
            )
        kinds = {p.kind for p in members}
        self.members = members
        self.lookahead = members[0].lookahead  # (the group's shortest lead time)
        self.kind = kinds.pop() if len(kinds) == 1 else "+".join(p.kind for p in members)
        self.lookahead_label = "+".join(names)  # d1+d2: what a result row names
        paths = [p.checkpoint for p in members]
        self.checkpoint = None if None in paths else "+".join(str(p) for p in paths)

    @property
    def stride(self) -> int:
        return len(self.members)

    def num_params(self) -> int:
        return sum(p.num_params() for p in self.members)


def group_targets(num_layers: int, stride: int, source: int) -> tuple[int, ...]:
    """The target layers fired from MoE layer `source`'s router: s + 1 .. s + stride for every
    stride-th source layer (0, stride, 2 * stride, ...), below num_layers."""
    if source % stride:
        return ()
    return tuple(range(source + 1, min(source + stride, num_layers - 1) + 1))


def group_schedule(num_layers: int, stride: int) -> list[tuple[int, int, int]]:
    """Every (source router, target layer, member index) a group of `stride` fires, in order:
    the one rule the runtime's Prefetcher and the simulator (per geometry layer) follow."""
    return [
        (s, m, j)
        for s in range(num_layers)
        for j, m in enumerate(group_targets(num_layers, stride, s))
    ]
