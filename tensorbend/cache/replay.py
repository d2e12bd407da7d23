"""THE demand replay: a routing trace through one cache policy, compiled; every replay number
(eval's foresight report, the zoo card, bench/replay_speed.py) comes from here.

Usage:
    >>> ids_FLK = planted_trace(prompts=2, tokens=8, layers=3, experts=8, top_k=2)
    >>> out = replay(ids_FLK, ReplayConfig("lfru", slots=6))
    >>> out.misses == int(out.misses_F.sum()), out.evictions <= out.misses
    (True, True)
    >>> replay_named(ids_FLK, "belady", 6).misses <= out.misses    # Belady misses least
    True

Shape legend: F forwards (prompts x tokens, one after another), L MoE layers, E experts,
K top-k (a list trace may route fewer at some layer-steps: rows are padded). `ids_FLK[f][m]`
lists the experts layer m routes forward f to; the step of layer m of forward f is f * L + m.

It walks the steps as the runtime and the simulator do: first the exact hints and prefetches
for the next layer when `hints` is on (a perfect d1 predictor), then each routed expert used,
and placed on a miss with the step's experts already used pinned (not evictable); after
forward f the forecast made after f (`Forecasts`) comes into force for `reuse`. Victims,
admission and prefetch decisions are those of `cache.victim_heap.IndexedResidentSet` with the
policy `cache.config` builds, event for event: the kernel (cache/kernel.py, numba) is checked
against that index on planted and random traces (tests/test_replay.py; the index's driver is
bench/index_replay.py). numba is imported at the first replay, never by serving.

`REPLAY_POLICIES` names what the bench and the tests replay: the no-prediction caches,
`predicted` (Predicted fed no predictions), `prefetch` (Predicted told the exact experts of
the next layer, and prefetching them), `reuse` (Reuse given the exact next use of every expert
as its forecast), and Belady with all or h forwards of sight (`belady/h=N`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np

from tensorbend.cache import kernel_state as ks
from tensorbend.cache.admission import AdmissionName
from tensorbend.cache.resident import PoolName
from tensorbend.errors import TensorbendError

EvictionName = Literal["lru", "lfu", "lfru", "predicted", "reuse", "next_use"]
BeyondName = Literal["lru", "lfu", "lfru", "predicted"]
REPLAY_POLICIES = (
    "lru",
    "lfu",
    "lfru",
    "predicted",
    "prefetch",
    "reuse",
    "belady",
    "belady/h=1",
    "belady/h=2",
)
_EVICTIONS = ("lru", "lfu", "lfru", "predicted", "reuse", "next_use")  # kernel codes, in order
_ADMISSIONS = ("all", "frequency", "predicted")


@dataclass(frozen=True)
class ReplayConfig:
    eviction: EvictionName = "lru"
    """The rule (cache/policies.py, cache/predicted.py): next_use is Belady over `seen_FLK`."""
    slots: int = 0
    """Cache slots (per-layer pools: split evenly, the first slots % L layers one more)."""
    pool: PoolName = "global"
    admission: AdmissionName = "all"
    admission_window: int = 8
    """Forwards of use counts for admission frequency."""
    fallback: AdmissionName | None = None
    """Admission predicted: the rule deciding two unknown next uses (None: admit)."""
    foresight: int | None = None
    """next_use: forwards it sees, counting the current one (None: the whole trace)."""
    beyond: BeyondName = "lru"
    """next_use with a foresight: how the keys it does not see used rank among themselves."""
    hints: bool = False
    """Hint and prefetch the exact experts of the next layer (a perfect d1 predictor)."""
    judge: bool = False
    """Count evictions whose victim is next used no sooner than Belady's (`good`, `judged`)."""
    decay: float = 0.9
    """Predicted's decay of a use count per forward (cache/predicted.py's default)."""

    def __post_init__(self) -> None:
        if self.eviction not in _EVICTIONS or self.pool not in ("global", "per_layer"):
            raise TensorbendError(
                f"replay: expected eviction in {', '.join(_EVICTIONS)} and pool global or "
                f"per_layer, found {self.eviction!r}, {self.pool!r}"
            )
        if self.admission == "predicted" and self.eviction in ("lru", "lfu", "lfru"):
            raise TensorbendError(
                f"replay: admission predicted with eviction {self.eviction}: expected a rule "
                "with next uses (predicted, reuse, next_use)"
            )
        assert self.slots >= 0 and self.admission_window >= 1, self
        assert self.beyond in _EVICTIONS[:4] and self.admission in _ADMISSIONS, self
        assert self.fallback in (None, "all", "frequency"), self.fallback


class Forecasts(NamedTuple):
    """Per forward f, the forecast made after it (`predicted.Reuse.set_forecast`): each key's
    (k = m * E + e) expected next use, with every class still ahead (`ahead_FK`) and once
    layer m of forward f + 1 has passed without it (`after_FK`); float64 [F, L * E]."""

    ahead_FK: np.ndarray
    after_FK: np.ndarray


@dataclass
class Replayed:
    misses: int
    prefetches: int  # prefetch placements asked (the hinted expert was not resident)
    evictions: int
    misses_F: np.ndarray  # demand misses per forward
    good: int = 0  # with judge: evictions as good as Belady's, of `judged`
    judged: int = 0
    num_experts: int = 0
    placements: tuple = field(default=(), repr=False)  # (step_P, key_P, outcome_P, victim_P)

    def victims(self) -> list[tuple]:
        """Per placement, in order: (step, (m, e), outcome, victim (m, e) or None)."""
        E = self.num_experts
        step_P, key_P, outcome_P, victim_P = (a.tolist() for a in self.placements)
        return [
            (s, (k // E, k % E), ks.OUTCOMES[o], None if v < 0 else (v // E, v % E))
            for s, k, o, v in zip(step_P, key_P, outcome_P, victim_P, strict=True)
        ]


def replay(
    ids_FLK,
    cfg: ReplayConfig,
    num_experts: int = 0,
    seen_FLK=None,
    forecasts: Forecasts | None = None,
    record: bool = True,
) -> Replayed:
    """The trace through the cache `cfg` describes (module docstring). seen_FLK: the routing
    Belady ranks by (default: the demands themselves; a prediction of them, say); forecasts:
    what `reuse` evicts by; record: keep every placement (`Replayed.victims`)."""
    from tensorbend.cache.kernel import run

    ids, n_FL = as_padded(ids_FLK)
    seen, n_seen = (ids, n_FL) if seen_FLK is None else as_padded(seen_FLK)
    F, L, K = ids.shape
    if seen.shape[:2] != (F, L):
        raise TensorbendError(
            f"replay: seen_FLK covers {seen.shape[0]} forwards x {seen.shape[1]} layers; the "
            f"demands {F} x {L}: pass a routing of the same forwards"
        )
    E = max(num_experts, 1 + int(ids.max(initial=-1)), 1 + int(seen.max(initial=-1)))
    if forecasts is not None and forecasts.ahead_FK.shape != (F, L * E):
        raise TensorbendError(
            f"replay: forecasts of shape {forecasts.ahead_FK.shape}: expected ({F}, {L * E})"
        )
    none = np.zeros((0, L * E))
    belady, judge = cfg.eviction == "next_use", cfg.judge
    seen_ptr, seen_steps = _uses_by_key(seen, n_seen, E) if belady else _no_uses(L * E)
    used_ptr, used_steps = _uses_by_key(ids, n_FL, E) if judge else _no_uses(L * E)
    tr = ks.ReplayInput(
        ids,
        n_FL,
        E,
        seen_ptr,
        seen_steps,
        used_ptr,
        used_steps,
        *(forecasts if forecasts is not None else (none, none)),
    )
    beyond = cfg.beyond if cfg.foresight is not None else "lru"  # (NextUse: full sight, LRU)
    rules = ks.Rules(
        evict=_EVICTIONS.index(cfg.eviction),
        beyond=_EVICTIONS.index(beyond),
        foresight=ks.NONE if cfg.foresight is None else cfg.foresight,
        admit=_ADMISSIONS.index(cfg.admission),
        fallback=ks.NONE if cfg.fallback is None else _ADMISSIONS.index(cfg.fallback),
        window=cfg.admission_window,
        per_layer=cfg.pool == "per_layer",
        hints=cfg.hints,
        judge=judge,
        decay=cfg.decay,
        log_counts=cfg.eviction in ("predicted", "reuse") or (belady and beyond == "predicted"),
    )
    n_out = int(n_FL.sum()) * (2 if cfg.hints else 1) if record else 0
    out = ks.Out(
        *(np.empty(n_out, np.int64) for _ in range(4)), np.zeros(F, np.int64), np.zeros(5, np.int64)
    )
    run(rules, tr, ks.new_state(rules, cfg.slots, L, E), out)
    n = int(out.tally[ks.PLACEMENTS]) if record else 0
    return Replayed(
        misses=int(out.misses_F.sum()),
        prefetches=int(out.tally[ks.PREFETCHES]),
        evictions=int(out.tally[ks.EVICTIONS]),
        misses_F=out.misses_F,
        good=int(out.tally[ks.GOOD]),
        judged=int(out.tally[ks.JUDGED]),
        num_experts=E,
        placements=tuple(a[:n] for a in out[:4]),
    )


def named(name: str, slots: int, pool: PoolName = "global") -> ReplayConfig:
    """The ReplayConfig of a name of `REPLAY_POLICIES` (or belady/h=N)."""
    if name not in REPLAY_POLICIES and not re.fullmatch(r"belady/h=\d+", name):
        raise TensorbendError(
            f"unknown replay policy {name!r}; expected one of {', '.join(REPLAY_POLICIES)} "
            "(or belady/h=N, N >= 0)"
        )
    if name.startswith("belady"):
        h = int(name.split("=")[1]) if "=" in name else None
        return ReplayConfig("next_use", slots, pool, foresight=h)
    if name == "prefetch":
        return ReplayConfig("predicted", slots, pool, hints=True)
    return ReplayConfig(name, slots, pool)  # type: ignore[arg-type]


def replay_named(
    ids_FLK, name: str, slots: int, num_experts: int = 0, pool: PoolName = "global", seen_FLK=None
) -> Replayed:
    """`replay` of a name of `REPLAY_POLICIES` with its feed (reuse: the exact forecasts)."""
    cfg = named(name, slots, pool)
    fc = None
    if name == "reuse":
        ids, n_FL = as_padded(ids_FLK)
        fc = exact_forecasts(ids, n_FL, max(num_experts, 1 + int(ids.max(initial=-1))))
    return replay(ids_FLK, cfg, num_experts, seen_FLK, fc)


def exact_forecasts(ids_FLK: np.ndarray, n_FL: np.ndarray, num_experts: int) -> Forecasts:
    """Forecasts that know the future: after forward f, each key's first use in a forward
    > f (`ahead`) and > f + 1 (`after`; inf: never); views of one [F + 1, L * E] buffer."""
    F, L, K = ids_FLK.shape
    E = num_experts
    buf = np.full((F + 1, L * E), np.inf)
    live_LK = np.arange(K)[None, :] < n_FL[:, :, None]  # [F, L, K]
    key_FLK = np.arange(L)[None, :, None] * E + ids_FLK
    step_FLK = np.broadcast_to((np.arange(F)[:, None] * L + np.arange(L))[..., None], key_FLK.shape)
    for f in range(F - 2, -1, -1):  # buf[f]: uses in forwards f + 1, f + 2, ...
        buf[f] = buf[f + 1]
        live = live_LK[f + 1]
        buf[f, key_FLK[f + 1][live]] = step_FLK[f + 1][live]
    return Forecasts(buf[:F], buf[1:])


def as_padded(ids_FLK) -> tuple[np.ndarray, np.ndarray]:
    """(ids_FLK as int64 [F, L, K], padded with -1 where a layer-step routes fewer, n_FL)."""
    if isinstance(ids_FLK, np.ndarray):  # (padded already where it holds -1: at the end)
        a = ids_FLK.astype(np.int64)
        n_FL = (a >= 0).sum(-1)
        assert (a[np.arange(a.shape[2]) >= n_FL[..., None]] == -1).all(), "-1 pads the end"
        return a, n_FL
    F = len(ids_FLK)
    L = len(ids_FLK[0]) if F else 1
    K = max((len(ids) for layers in ids_FLK for ids in layers), default=0)
    n_FL = np.array([[len(ids) for ids in layers] for layers in ids_FLK], np.int64).reshape(F, L)
    if (n_FL == K).all():
        return np.array(ids_FLK, np.int64).reshape(F, L, K), n_FL
    a = np.full((F, L, K), -1, np.int64)
    for f, layers in enumerate(ids_FLK):
        for m, ids in enumerate(layers):
            a[f, m, : len(ids)] = ids
    return a, n_FL


def planted_trace(
    prompts: int,
    tokens: int,
    layers: int,
    experts: int,
    top_k: int,
    reuse: float = 0.5,
    seed: int = 0,
) -> list[list[list[int]]]:
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


def _uses_by_key(ids_FLK: np.ndarray, n_FL: np.ndarray, E: int):
    """CSR of `cache.oracle.steps_by_key`: key k = m * E + e is used at steps[ptr[k]:ptr[k+1]],
    ascending."""
    F, L, K = ids_FLK.shape
    live = np.arange(K)[None, None, :] < n_FL[:, :, None]
    step_FLK = np.broadcast_to((np.arange(F)[:, None] * L + np.arange(L))[..., None], (F, L, K))
    keys, steps = (np.arange(L)[None, :, None] * E + ids_FLK)[live], step_FLK[live]
    order = np.argsort(keys, kind="stable")  # (C order is step order: stable keeps it)
    ptr = np.zeros(L * E + 1, np.int64)
    np.cumsum(np.bincount(keys, minlength=L * E), out=ptr[1:])
    return ptr, steps[order].astype(np.int64)


def _no_uses(n_keys: int):
    return np.zeros(n_keys + 1, np.int64), np.zeros(0, np.int64)
