"""A learned eviction policy that imitates Belady, and the shadow guard that watches it.

Usage (a trained `EvictorModel` from `cache/imitation.py`, `fit_evictor`):
    policy = Evictor(num_layers=L, num_experts=E, model=model)
    rs = IndexedResidentSet(slots, L, policy, admission=AdmitByPolicy())
    guarded = ShadowGuard(Evictor(L, E, model), slots, L, window=48)   # never far below LFRU
    rs = IndexedResidentSet(slots, L, guarded, admission=AdmitByPolicy())

Shape legend: C candidates of one eviction decision (the evictable residents of the pool, then
the missed key), X features, H hidden width, K = L * E keys (index m * E + e).

At each miss that finds its pool full, the policy scores only the candidates: features of each
(layer m, expert e) from what the cache has seen (`Features`), a tiny MLP in numpy
(`EvictorModel.score`), and the highest score leaves; the missed key is scored with them, and
`AdmitByPolicy` bypasses it when it outscores the victim (Belady's bypass). Its ranking is
declared `scan`: the victim index asks `choose(candidates, now)` once per full miss (C <= pool
size + 1; no per-step re-ranking). `next_use` is None: the score is not a step.

Features and their groups (`GROUPS`, each model trained with a subset): `cache/features.py`;
every one exists for a routing-only trace, so the same learner serves imported traces. At run
time a decision scores through `FoldedScore` (the same scores, one smaller matrix product).

The shadow guard (`ShadowGuard`) replays a no-prediction cache (LFRU, global pool, TinyLFU
admission: the best no-prediction cache on both bundled models) on the same demands, as a
ghost (keys only). After each window of `window` forwards in which the learned policy drove the
cache and missed more than the ghost, the cache follows the shadow for the next windows (1,
then twice as many after each further lost learner window, at most `max_backoff`; a learner
window that does not lose resets the back-off). Following the shadow means mirroring the ghost:
a miss is kept iff the ghost kept it, and the victim is a resident the ghost does not hold
(LFRU's choice among those). The bound, per run: misses <= the shadow's + lost windows x
(window cost + capacity) + one window cost (the run's last, unfinished window), the window
cost being the demands of `window` forwards (window x L x K). Learner windows that are not
lost miss no more than the ghost did; a lost one misses at most its demands more; while mirroring, each miss the ghost does not have takes the slot of a
resident outside the ghost, so the difference d = |ghost - cache| falls by one, and a miss both
have never raises d: mirroring costs at most d <= capacity misses over the ghost per switch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from tensorbend.cache.admission import AdmitAll, AdmitFrequent
from tensorbend.cache.features import ALL_GROUPS, GROUPS, Features, FoldedScore
from tensorbend.cache.policies import LFRU, LRU, Key, Ranking
from tensorbend.cache.resident import ResidentSet
from tensorbend.cache.victim_heap import IndexedResidentSet
from tensorbend.errors import CheckpointError


@dataclass
class EvictorModel:
    """score(x) = w0 . z + w2 . relu(W1 z + b1), z = (x - mean) / std; higher leaves first.

    groups: the feature groups it reads; num_layers: L its one-hot layer columns assume."""

    groups: tuple[str, ...]
    num_layers: int
    mean_X: np.ndarray
    std_X: np.ndarray
    w0_X: np.ndarray
    W1_XH: np.ndarray
    b1_H: np.ndarray
    w2_H: np.ndarray
    meta: dict = field(default_factory=dict)

    def score(self, x_CX: np.ndarray) -> np.ndarray:
        z = (x_CX - self.mean_X) / self.std_X
        return z @ self.w0_X + np.maximum(z @ self.W1_XH + self.b1_H, 0.0) @ self.w2_H

    def save(self, path: str) -> None:
        """A safetensors file: the weights, the train prior, and what they mean (metadata)."""
        from safetensors.numpy import save_file

        arrays = {k: np.ascontiguousarray(getattr(self, k)) for k in _WEIGHTS}
        arrays["prior_K"] = np.asarray(self.meta["prior_K"], dtype=np.float64)
        meta = {"format_version": str(FORMAT_VERSION), "kind": "evictor",
                "groups": ",".join(self.groups), "num_layers": str(self.num_layers),
                **{k: str(v) for k, v in self.meta.items() if k != "prior_K"}}  # fmt: skip
        save_file(arrays, path, metadata=meta)

    @classmethod
    def load(cls, path: str) -> EvictorModel:
        from safetensors import safe_open
        from safetensors.numpy import load_file

        with safe_open(path, "np") as f:
            meta = f.metadata() or {}
        if meta.get("kind") != "evictor" or meta.get("format_version") != str(FORMAT_VERSION):
            raise CheckpointError(
                f"{path}: expected an evictor checkpoint (format {FORMAT_VERSION}), found kind "
                f"{meta.get('kind')!r} format {meta.get('format_version')!r}; train one with "
                "bench/evictor_eval.py or cache.imitation.fit_evictor"
            )
        arrays = load_file(path)
        groups = tuple(meta["groups"].split(","))
        unknown = [g for g in groups if g not in ALL_GROUPS]
        if unknown:
            raise CheckpointError(
                f"{path}: feature groups {', '.join(unknown)} unknown to this tensorbend (it "
                f"knows {', '.join(ALL_GROUPS)}); use the version that trained it, or retrain"
            )
        kept = {"prior_K": arrays["prior_K"]}
        if "horizon" in meta:  # the horizon a `forecast` model was trained with
            kept["horizon"] = meta["horizon"]
        return cls(groups, int(meta["num_layers"]), *(arrays[k] for k in _WEIGHTS),
                   meta=kept)  # fmt: skip


_WEIGHTS = ("mean_X", "std_X", "w0_X", "W1_XH", "b1_H", "w2_H")
FORMAT_VERSION = 1


class Evictor(LFRU):
    """Evict the candidate the model scores highest (module docstring). model None: rank as
    LFRU while keeping the features (the round-0 rollouts of training use that).

    `log`, when a list, receives (features [C, X], candidate keys) of every decision, for
    labelling; `new_request()` resets the request-level history."""

    name = "evictor"
    ranking: ClassVar[Ranking] = "scan"
    use_lowers_rank: ClassVar[bool] = False

    def __init__(self, num_layers: int, num_experts: int, model: EvictorModel | None = None,
                 prior_K: np.ndarray | None = None, groups: tuple[str, ...] = GROUPS):  # fmt: skip
        super().__init__()
        self.model = model
        self.groups = model.groups if model is not None else groups
        self.features = Features(num_layers, num_experts, prior_K)
        self.folded = FoldedScore(model) if model is not None else None
        self.last_key: Key | None = None  # the latest demand: the missed key at a place()
        self.scores: dict[Key, float] = {}  # of the latest decision (training's path)
        self.log: list | None = None
        self._scored_at: int | None = None  # run time: the step s0_K / s1_K were scored at
        self._s0_K = self._s1_K = None  # every key's score as a resident / as the missed key
        self._decision: tuple | None = None  # (missed key, victim, scored as the missed key?)
        self._dirty: list = []  # keys used since the scores were made (theirs are stale)

    def touch(self, key: Key, now: int) -> None:
        if self.model is None:  # (ranks as LFRU)
            super().touch(key, now)
        self.features.touch(key, now)
        self.last_key = key
        if self._scored_at == now:  # only this key's features changed: rescore it alone
            self._dirty.append(key)
        else:  # (a later step: every score moves with the clock)
            self._scored_at = None

    def bind(self, rs: ResidentSet) -> None:
        """Called by the resident set that uses it (ranking `scan`); the evictor needs nothing."""

    def incoming(self, key: Key) -> None:
        """The key the resident set is placing (before it asks `choose`): a demand miss or a
        prefetch. A replay places each miss right after its use; a runtime claims a layer's
        experts first and places them later, from its I/O threads."""
        self.last_key = key

    def new_request(self) -> None:
        self.features.new_request()
        self._scored_at = None

    def set_forecast(self, forward: int, ahead_LE, after_first_LE) -> None:
        """A cross-token forecast (read by a model with the `forecast` feature group)."""
        self.features.set_forecast(forward, ahead_LE, after_first_LE)
        self._scored_at = None

    def choose(self, cands: list[Key], now: int) -> Key:
        """The victim among the evictable residents `cands`; scores the missed key too.

        At run time (a model, no log) every key is scored once per step and kept until a use
        or a new request changes a feature: the misses of one step (a runtime places them
        after the layer's uses) then cost a lookup each, and a key's score never depends on
        which keys were scored with it."""
        E = self.features.E
        if self.log is None and self.folded is not None:
            if self._scored_at != now:
                self._s0_K, self._s1_K = self.folded.score_all(self.features, now)
                self._scored_at, self._dirty = now, []
            elif self._dirty:  # a replay uses, then places, each miss: rescore those used
                idx = np.fromiter({m * E + e for m, e in self._dirty}, np.int64)
                self._s0_K[idx], self._s1_K[idx] = self.folded.score_all(self.features, now, idx)
                self._dirty = []
            idx_C = np.fromiter((m * E + e for m, e in cands), np.int64, len(cands))
            victim = cands[int(np.argmax(self._s0_K[idx_C]))]
            self._decision = (self.last_key, victim, self.last_key not in cands)
            return victim
        keys = cands + [self.last_key] if self.last_key not in cands else list(cands)
        idx_C = np.fromiter((m * E + e for m, e in keys), np.int64, len(keys))
        x_CX = self.features.matrix(idx_C, now, self.groups)
        x_CX[len(cands) :, -1] = 1.0
        if self.log is not None:
            self.log.append((x_CX, keys))
        if self.model is None:
            s_C = np.array([-self.score(k, now) for k in keys])
        else:
            s_C = self.model.score(x_CX)
        self.scores = dict(zip(keys, s_C.tolist(), strict=True))
        return cands[int(np.argmax(s_C[: len(cands)]))]

    def admit(self, key: Key, victim: Key, now: int) -> bool:
        """Belady's bypass on scores: keep the miss unless it outscores the victim."""
        if self._decision is not None:
            scored, chosen, as_incoming = self._decision
            self._decision = None
            if key != scored or victim != chosen:
                return True  # (not the decision just made: keep, as below)
            E = self.features.E
            s_key = (self._s1_K if as_incoming else self._s0_K)[key[0] * E + key[1]]
            return bool(s_key <= self._s0_K[victim[0] * E + victim[1]])
        s = self.scores
        return key not in s or victim not in s or s[key] <= s[victim]

    def next_use(self, key: Key, now: int) -> None:
        return None


def check_geometry(model: EvictorModel, path, num_layers: int, num_experts: int) -> None:
    """Refuse an evictor trained for another number of MoE layers or experts."""
    prior = np.asarray(model.meta["prior_K"])
    if model.num_layers != num_layers or prior.shape != (num_layers * num_experts,):
        raise CheckpointError(
            f"{path}: an evictor for {model.num_layers} MoE layers x "
            f"{prior.size // max(1, model.num_layers)} experts, found a model of {num_layers} x "
            f"{num_experts}: train one on this model's trace (tensorbend train --predictor evictor)"
        )


def reads_forecast(path) -> bool:
    """Whether the eviction model at `path` reads a horizon's forecasts (group `forecast`)."""
    return "forecast" in EvictorModel.load(str(path)).groups


def check_forecast_input(path, has_horizon: bool) -> None:
    """Refuse a forecast-reading model without a horizon, and a horizon it would not read.
    (A learner's horizon only forecasts: it prefetches nothing.)"""
    reads = reads_forecast(path)
    if reads and not has_horizon:
        raise CheckpointError(
            f"--evictor {path}: this model reads a horizon's forecasts (trained with "
            "`train --predictor evictor --horizon H`): pass that horizon with --horizon H"
        )
    if has_horizon and not reads:
        raise CheckpointError(
            f"--horizon with --evictor {path}: this model reads no forecasts; drop --horizon, "
            "or train one that does (`tensorbend train --predictor evictor --horizon H`)"
        )


def learned_eviction(path, num_layers: int, num_experts: int, capacity: int,
                     guard_window: int = 48) -> LRU:  # fmt: skip
    """`--policy evictor`: the trained model at `path` under its shadow guard (guard_window
    forwards per window; 0: the learner alone). Refuses a model of another geometry."""
    model = EvictorModel.load(str(path))
    check_geometry(model, path, num_layers, num_experts)
    prior = np.asarray(model.meta["prior_K"])
    learner = Evictor(num_layers, num_experts, model, prior_K=prior)
    if guard_window == 0:
        return learner
    return ShadowGuard(learner, capacity, num_layers, window=guard_window)


class AdmitByPolicy(AdmitAll):
    """Admission asked of the policy (`policy.admit(key, victim, now)`)."""

    name = "policy"

    def admit(self, key: Key, victim: Key, policy, now: int) -> bool:
        return policy.admit(key, victim, now)


class ShadowGuard(LFRU):
    """The learned policy, followed only while it misses no more than a shadow cache (module
    docstring). Bound to its resident set (`bind`, by the set) to see which demands miss."""

    name = "guarded"
    ranking: ClassVar[Ranking] = "scan"
    use_lowers_rank: ClassVar[bool] = False

    def __init__(self, learner: Evictor, capacity: int, num_layers: int, window: int = 48,
                 max_backoff: int = 64, admission_window: int = 8):  # fmt: skip
        super().__init__()
        self.learner, self.L, self.window, self.max_backoff = (
            learner,
            num_layers,
            window,
            max_backoff,
        )
        self.shadow = IndexedResidentSet(capacity, num_layers, LFRU(),
                                         admission=AdmitFrequent(admission_window * num_layers))  # fmt: skip
        self.rs: ResidentSet | None = None
        self.following_learner = True
        self.backoff, self.left = 1, window  # shadow windows still to go when not following
        self.mine = self.theirs = 0  # misses in the current window
        self.window_start = 0
        self.switches = 0
        self.learner_windows = self.lost_windows = 0

    def bind(self, rs: ResidentSet) -> None:
        self.rs = rs

    def incoming(self, key: Key) -> None:
        self.learner.incoming(key)

    def new_request(self) -> None:
        self.learner.new_request()

    def set_forecast(self, forward: int, ahead_LE, after_first_LE) -> None:
        self.learner.set_forecast(forward, ahead_LE, after_first_LE)

    def touch(self, key: Key, now: int) -> None:
        f = now // self.L
        if f - self.window_start >= self.window:
            self._end_window(f)
        super().touch(key, now)
        self.learner.touch(key, now)
        if self.rs is not None and key not in self.rs:
            self.mine += 1
        if not self.shadow.access(key, now):
            self.theirs += 1

    def choose(self, cands: list[Key], now: int) -> Key:
        if self.following_learner:
            return self.learner.choose(cands, now)
        outside = [k for k in cands if k not in self.shadow] or cands  # mirror the ghost
        return max(outside, key=lambda k: self.rank(k, self.rs._recency[k], now))

    def admit(self, key: Key, victim: Key, now: int) -> bool:
        if self.following_learner:
            return self.learner.admit(key, victim, now)
        return key in self.shadow  # the ghost (already told of this use) kept it

    def next_use(self, key: Key, now: int) -> None:
        return None

    def _end_window(self, f: int) -> None:
        if self.following_learner:
            self.learner_windows += 1
            if self.mine > self.theirs:
                self.lost_windows += 1
                self.following_learner, self.left = False, self.backoff
                self.backoff = min(2 * self.backoff, self.max_backoff)
                self.switches += 1
            else:
                self.backoff = 1
        else:
            self.left -= 1
            if self.left <= 0:
                self.following_learner = True
                self.switches += 1
        self.mine = self.theirs = 0
        self.window_start = f
