"""Demand replay of a routing trace through a resident set: victims, misses, layer-steps per second.

Usage:
    >>> from tensorbend.cache.victim_heap import IndexedResidentSet
    >>> ids_FLK = planted_trace(prompts=2, tokens=8, layers=3, experts=8, top_k=2)
    >>> policy, feed = replay_policy("lfru", ids_FLK, num_layers=3)
    >>> out = replay(ids_FLK, IndexedResidentSet(4, 3, policy), feed)
    >>> len(out.victims) == out.misses + out.prefetches
    True

Shape legend: F forwards (prompts x tokens, one after another), L MoE layers, E experts,
K top-k. `ids_FLK[f][m]` lists the experts layer m routes forward f to, ascending; the step of
layer m of forward f is f * L + m (the policies' clock).

`replay` walks the steps as the runtime and the simulator do: first the feed's predictions
for the step (hints, and prefetches placed with the step they are for), then each routed expert
used, and placed on a miss, with the experts of the step already used pinned (not evictable).
After each forward the feed may hand the policy a cross-token forecast. It records every
placement's outcome and victim, so two resident sets can be compared victim for victim.

`REPLAY_POLICIES` names what the bench and the victim test replay: the no-prediction caches,
`Predicted` fed no predictions, `prefetch` (`Predicted` told the exact experts of the next
layer, as a perfect d1 predictor would, and prefetching them), `reuse` (`Reuse` given the
exact next use of every expert as its forecast), and Belady with all or h forwards of sight.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tensorbend.cache.oracle import steps_by_key as oracle_steps
from tensorbend.cache.policies import INF, LFRU, LFU, LRU, NextUse
from tensorbend.cache.predicted import Predicted, Reuse
from tensorbend.cache.resident import ResidentSet, inherited

REPLAY_POLICIES = (
    "lru", "lfu", "lfru", "predicted", "prefetch", "reuse", "belady", "belady/h=1", "belady/h=2"
)  # fmt: skip


@dataclass
class Replayed:
    misses: int = 0
    prefetches: int = 0  # prefetch placements asked (the step's expert was not resident)
    victims: list = field(default_factory=list)  # per placement: (step, key, outcome, victim)


def planted_trace(
    prompts: int, tokens: int, layers: int, experts: int, top_k: int, reuse: float = 0.5,
    seed: int = 0,
) -> list[list[list[int]]]:  # fmt: skip
    """Routing with planted reuse: each layer has a Zipf-like popularity over its experts; each
    prompt draws its own hot set; a token keeps each of the previous token's experts with
    probability `reuse`, then fills top-k from the prompt's hot set (2/3) or the popularity."""
    rng = random.Random(seed)
    weights = [[1.0 / (1 + rng.randrange(experts)) for _ in range(experts)] for _ in range(layers)]
    ids_FLK = []
    for _ in range(prompts):
        hot = [rng.sample(range(experts), min(experts, 2 * top_k)) for _ in range(layers)]
        prev = [[] for _ in range(layers)]
        for _ in range(tokens):
            forward = []
            for m in range(layers):
                chosen = {e for e in prev[m] if rng.random() < reuse}
                while len(chosen) < top_k:
                    if rng.random() < 2 / 3:
                        chosen.add(rng.choice(hot[m]))
                    else:
                        chosen.add(rng.choices(range(experts), weights[m])[0])
                prev[m] = sorted(chosen)
                forward.append(prev[m])
            ids_FLK.append(forward)
    return ids_FLK


class Feed:
    """What a policy is told besides demands: nothing (the base), hints, or forecasts."""

    def before(self, rs: ResidentSet, f: int, m: int, now: int, out: Replayed) -> None:
        pass

    def after(self, rs: ResidentSet, f: int) -> None:
        pass


class NextLayerHints(Feed):
    """A perfect d1 predictor: at layer m, the experts of layer m + 1 (or of layer 0 of the
    next forward) are hinted for their step and prefetched."""

    def __init__(self, ids_FLK: list):
        self.ids, self.L = ids_FLK, len(ids_FLK[0])

    def before(self, rs, f, m, now, out):
        f2, m2 = (f, m + 1) if m + 1 < self.L else (f + 1, 0)
        if f2 >= len(self.ids):
            return
        for e in self.ids[f2][m2]:
            rs.hint((m2, e), now + 1)
            if (m2, e) not in rs:
                out.prefetches += 1
                placed = rs.place((m2, e), now, now + 1)
                out.victims.append((now, (m2, e), placed.outcome, placed.victim))


class ExactForecast(Feed):
    """After forward f: every expert's next use after forward f (`ahead`) and after forward
    f + 1 (`after_first`), INF when never; what `Reuse.set_forecast` takes."""

    def __init__(self, ids_FLK: list, num_experts: int):
        self.ids, self.L = ids_FLK, len(ids_FLK[0])
        # then_F[f][m]: [(e, the step of (m, e)'s next use after its use in forward f)]
        later: dict = {}
        self.then_F: list = [None] * len(ids_FLK)
        for f in range(len(ids_FLK) - 1, -1, -1):
            rows = self.then_F[f] = []
            for m, ids in enumerate(ids_FLK[f]):
                rows.append([(e, later.get((m, e), INF)) for e in ids])
                for e in ids:
                    later[m, e] = f * self.L + m
        self.next_LE = [[INF] * num_experts for _ in range(self.L)]
        for (m, e), step in later.items():  # (now each key's first use)
            self.next_LE[m][e] = step

    def after(self, rs, f):
        for row, then in zip(self.next_LE, self.then_F[f], strict=True):
            for e, step in then:  # the keys whose next use was in forward f move on
                row[e] = step
        after_LE = [row[:] for row in self.next_LE]
        if f + 1 < len(self.ids):
            for row, then in zip(after_LE, self.then_F[f + 1], strict=True):
                for e, step in then:
                    row[e] = step
        rs.set_forecast(f, [row[:] for row in self.next_LE], after_LE)


def replay_policy(name: str, ids_FLK: list, num_layers: int, num_experts: int = 0):
    """(a fresh policy, its feed) for a name of REPLAY_POLICIES."""
    L = num_layers
    if name == "predicted":
        return Predicted(L), Feed()
    if name == "prefetch":
        return Predicted(L), NextLayerHints(ids_FLK)
    if name == "reuse":
        E = num_experts or 1 + max(e for layers in ids_FLK for ids in layers for e in ids)
        return Reuse(L), ExactForecast(ids_FLK, E)
    if name.startswith("belady"):
        h = None if name == "belady" else int(name.split("=")[1])
        return NextUse(steps_by_key(ids_FLK), L, h), Feed()
    return {"lru": LRU, "lfu": LFU, "lfru": LFRU}[name](), Feed()


def replay(ids_FLK: list, rs: ResidentSet, feed: Feed | None = None) -> Replayed:
    """Every step of the trace through `rs` (module docstring); the placements it made."""
    feed = feed or Feed()
    out = Replayed()
    L = len(ids_FLK[0]) if ids_FLK else 1
    step, victims = rs.demand_step, out.victims
    before = None if inherited(feed.before, Feed.before) else feed.before  # (no-op calls skipped)
    after = None if inherited(feed.after, Feed.after) else feed.after
    E = 1 + max((max(ids) for layers in ids_FLK for ids in layers if ids), default=0)
    keys_LE = [[(m, e) for e in range(E)] for m in range(L)]  # one tuple per key, made once
    misses = 0
    for f, layers in enumerate(ids_FLK):
        now = f * L
        for m, ids in enumerate(layers):
            if before is not None:
                before(rs, f, m, now, out)
            row = keys_LE[m]
            misses += step([row[e] for e in ids], now, victims)
            now += 1
        if after is not None:
            after(rs, f)
    out.misses += misses
    return out


def steps_by_key(ids_FLK: list) -> dict:
    """Sorted steps at which each (m, e) is used in a list trace (`cache.oracle.steps_by_key`)."""
    L = len(ids_FLK[0]) if ids_FLK else 1
    return oracle_steps((f * L + m, m, e) for f, layers in enumerate(ids_FLK)
                        for m, ids in enumerate(layers) for e in ids)  # fmt: skip
