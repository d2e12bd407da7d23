"""What an oracle knows: the steps at which each expert is used, and how far ahead it sees.

Usage:
    >>> steps_by_key([(0, 0, 3), (2, 0, 3), (1, 1, 3)])      # (step, layer, expert) uses
    {(0, 3): [0, 2], (1, 3): [1]}
    >>> sight(now=5, num_layers=2, foresight=2), sight(5, 2, None)   # first step it cannot see
    (8, inf)

Every oracle in the project reads these two: Belady's `NextUse` (cache/policies.py), the
runtime's `RecordedRouting` (offload/recorded.py), the demand replays (cache/replay.py,
foresight.py) and the simulator's workload (simulate/plan.py). Steps count
forward * L + m; with foresight h an oracle knows every use at a step < (now // L + h) * L:
the rest of the current forward and the next h - 1 (None: the whole run).
"""

from __future__ import annotations

from collections.abc import Iterable

Key = tuple[int, int]  # (MoE layer m, expert e)
INF = float("inf")


def steps_by_key(uses: Iterable[tuple[int, int, int]]) -> dict[Key, list[int]]:
    """Sorted steps at which each (layer, expert) is used, from (step, layer, expert) triples."""
    out: dict[Key, list[int]] = {}
    for step, m, e in uses:
        out.setdefault((int(m), int(e)), []).append(int(step))
    for steps in out.values():
        steps.sort()
    return out


def sight(now: int, num_layers: int, foresight: int | None) -> float:
    """The first step an oracle with `foresight` forwards cannot see at step `now`."""
    return INF if foresight is None else (now // num_layers + foresight) * num_layers
