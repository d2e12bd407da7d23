"""What the eviction learner sees of each (layer, expert), and its score folded for run time.

Usage:
    f = Features(num_layers=L, num_experts=E, prior_K=prior)
    f.touch((m, e), now)                       # at every demand use (now: the layer step)
    x_CX = f.matrix(idx_C, now, GROUPS)        # features of keys idx_C (= m * E + e), [C, X]
    s0_K, s1_K = FoldedScore(model).score_all(f, now)   # every key as a resident / as the miss

Shape legend: C candidates of one eviction decision, X features (`feature_names`), D the
count decays, H history visits / hidden width, K = L * E keys.

Feature groups (`GROUPS`; a model is trained with a subset, the ablation rows drop one each):
  recency    log(1 + forwards since the last use), capped at 64
  history    used at the last 4 visits of its layer (the last tokens' routing there)
  frequency  log(1 + decayed use count) for decays 0.5, 0.8, 0.95 per forward
  request    log(1 + uses in this request), used in this request at all
  layer      forwards until its layer comes round again (a global pool cycles through layers),
             one-hot layer
  prior      log share of the key's uses on the train split (a per-key constant)
plus always: 1 for the missed key (the bypass candidate, column `incoming`). All of them
exist for a routing-only trace (no hidden state is read). One optional group (`OPTIONAL`,
not in a default model) reads a cross-token predictor:
  forecast   log(1 + forwards until the horizon forecast's expected next use) and whether a
             forecast of this request was given (`set_forecast`, the lists
             `predicted.Reuse.set_forecast` takes, after each forward)

`FoldedScore` is the run-time form of `EvictorModel.score`: the normalisation is folded into
the weights and the one-hot layer columns into a per-layer table of the hidden layer's input,
so a decision multiplies a [C, X - L] matrix, not [C, X] (the same scores up to rounding:
tested). Training keeps the full matrix (`matrix`), whose rows it labels.
"""

from __future__ import annotations

import math

import numpy as np

GROUPS = ("recency", "history", "frequency", "request", "layer", "prior")
OPTIONAL = ("forecast",)  # groups a model may add, each needing more than the routing
ALL_GROUPS = GROUPS + OPTIONAL  # the column order
DECAYS = (0.5, 0.8, 0.95)  # per forward
HISTORY = 4  # visits of a layer
AGE_CAP = 64.0  # forwards
NEVER = -(10**9)
_HISTORY_MASK = (1 << HISTORY) - 1
_BIT_H = np.arange(HISTORY)


def feature_names(groups: tuple[str, ...], num_layers: int) -> list[str]:
    """Column names of `Features.matrix` for these groups (the order of GROUPS)."""
    names = {
        "recency": ["log_age"],
        "history": [f"used_visit-{j}" for j in range(HISTORY)],
        "frequency": [f"log_count@{d}" for d in DECAYS],
        "request": ["log_request_uses", "used_in_request"],
        "layer": ["visit_in", *[f"layer={m}" for m in range(num_layers)]],
        "prior": ["log_prior"],
        "forecast": ["log_forecast_forwards", "has_forecast"],
    }
    return [n for g in ALL_GROUPS if g in groups for n in names[g]] + ["incoming"]


class Features:
    """Per-key history as arrays [K], updated at every demand use; features of any keys now."""

    def __init__(self, num_layers: int, num_experts: int, prior_K: np.ndarray | None = None):
        self.L, self.E = num_layers, num_experts
        K = num_layers * num_experts
        self.last = np.full(K, NEVER, dtype=np.int64)  # step of the last use
        # decayed counts, scaled to step `base`: the count at `now` is
        # count_KD * exp(log_decay_D * (now - base)) (one exp per decay, not per key)
        self.count_KD = np.zeros((K, len(DECAYS)))
        self.base = 0
        self.request = np.zeros(K)
        self.used_at = np.full(K, NEVER, dtype=np.int64)  # forward of the last use
        self.bits = np.zeros(K, dtype=np.int64)  # bit j: used at forward used_at - j (j < 4)
        self.forecast_at: int | None = None  # the forward the forecast was made after
        self.ahead_K = self.after_K = None  # its expected next-use steps (Reuse's two lists)
        self.prior = np.zeros(K) if prior_K is None else np.asarray(prior_K, dtype=np.float64)
        self.layer_K = np.repeat(np.arange(num_layers), num_experts)
        self.log_decay_D = np.log(np.array(DECAYS)) / num_layers  # per step
        self._step_decay = [d / num_layers for d in map(math.log, DECAYS)]
        self._rebase_every = 256 * num_layers  # steps (keeps the scaled counts finite)
        self._eye_LL = np.eye(num_layers)
        r_L1 = np.arange(num_layers)[:, None]  # now % L
        self._later_LK = (self.layer_K > r_L1).astype(np.int64)  # layer m not yet run this forward
        self._visit_in_LK = ((self.layer_K - r_L1 - 1) % num_layers + 1) / num_layers

    def index(self, key) -> int:
        return key[0] * self.E + key[1]

    def touch(self, key, now: int) -> None:
        k = key[0] * self.E + key[1]
        if now - self.base > self._rebase_every:
            self.count_KD *= np.exp(self.log_decay_D * (now - self.base))
            self.base = now
        t = now - self.base
        d0, d1, d2 = self._step_decay
        row_D = self.count_KD[k]
        row_D += (math.exp(-d0 * t), math.exp(-d1 * t), math.exp(-d2 * t))
        self.last[k] = now
        self.request[k] += 1
        f = now // self.L
        shift = f - int(self.used_at[k])
        if shift:
            self.bits[k] = ((int(self.bits[k]) << min(shift, HISTORY)) | 1) & _HISTORY_MASK
            self.used_at[k] = f

    def new_request(self) -> None:
        self.request[:] = 0.0
        self.forecast_at = None  # (a forecast is of one request)

    def set_forecast(self, forward: int, ahead_LE, after_first_LE) -> None:
        """The horizon's forecast made after `forward`: expected next-use steps, [L][E] lists
        or arrays (`predictors.horizon.Forecast.next_use_steps`)."""
        self.forecast_at = forward
        self.ahead_K = np.asarray(ahead_LE, dtype=np.float64).reshape(-1)
        self.after_K = np.asarray(after_first_LE, dtype=np.float64).reshape(-1)

    def matrix(self, idx_C: np.ndarray, now: int, groups: tuple[str, ...]) -> np.ndarray:
        """Features [C, X] of keys idx_C at step now (columns: `feature_names`); the last
        column (incoming) is 0 here: the caller marks the missed key."""
        dense_CY = self.dense(idx_C, now, groups)
        if "layer" not in groups:
            return dense_CY
        at = _layer_column(groups) + 1  # the one-hot columns follow visit_in
        onehot_CL = self._eye_LL[self.layer_K[idx_C]]
        return np.concatenate([dense_CY[:, :at], onehot_CL, dense_CY[:, at:]], 1)

    def dense(self, idx_C: np.ndarray | None, now: int, groups: tuple[str, ...]) -> np.ndarray:
        """`matrix` without the one-hot layer columns, [C, X - L] (or [C, X] without them);
        idx_C None: every key, in index order."""
        L = self.L
        r = now % L

        def at(a):
            return a if idx_C is None else a[idx_C]

        out_CY = np.zeros((self.L * self.E if idx_C is None else len(idx_C), _dense_width(groups)))
        j = 0
        if "recency" in groups:
            out_CY[:, 0] = np.log1p(np.minimum((now - at(self.last)) / L, AGE_CAP))
            j = 1
        if "history" in groups:
            visit_C = now // L - at(self._later_LK[r])  # the latest forward that ran layer m
            shift_C = np.minimum(visit_C - at(self.used_at), HISTORY)
            rel_C = (at(self.bits) << shift_C) & _HISTORY_MASK  # bit j: used at visit - j
            out_CY[:, j : j + HISTORY] = (rel_C[:, None] >> _BIT_H) & 1
            j += HISTORY
        if "frequency" in groups:
            now_D = np.exp(self.log_decay_D * (now - self.base))
            nD = len(DECAYS)
            out_CY[:, j : j + nD] = np.log1p(at(self.count_KD) * now_D)
            j += nD
        if "request" in groups:
            r_C = at(self.request)
            out_CY[:, j] = np.log1p(r_C)
            out_CY[:, j + 1] = r_C > 0
            j += 2
        if "layer" in groups:
            out_CY[:, j] = at(self._visit_in_LK[r])
            j += 1
        if "prior" in groups:
            out_CY[:, j] = at(self.prior)
            j += 1
        if "forecast" in groups and self.forecast_at is not None:
            # class 1 of the forecast is layer m of the next forward: once it has run without
            # the key, the expected next use is the one after it (as `Reuse._forecast`)
            first_K = (self.forecast_at + 1) * L + at(self.layer_K)
            next_K = np.where(first_K > now, at(self.ahead_K), at(self.after_K))
            out_CY[:, j] = np.log1p(np.clip((next_K - now) / L, 0.0, AGE_CAP))
            out_CY[:, j + 1] = 1.0
        return out_CY


class FoldedScore:
    """`EvictorModel.score` folded for run time (module docstring): the same scores."""

    def __init__(self, model) -> None:
        names = feature_names(model.groups, model.num_layers)
        onehot_X = np.array([n.startswith("layer=") for n in names])
        inv_X = 1.0 / model.std_X
        shift_X = model.mean_X * inv_X  # z = x * inv - shift
        W1_XH = model.W1_XH * inv_X[:, None]
        w0_X = model.w0_X * inv_X
        b1_H = model.b1_H - shift_X @ model.W1_XH
        c0 = -float(shift_X @ model.w0_X)
        self.W1_YH, self.w0_Y = W1_XH[~onehot_X], w0_X[~onehot_X]
        L = model.num_layers
        if onehot_X.any():
            self.T1_LH, self.t0_L = W1_XH[onehot_X] + b1_H, w0_X[onehot_X] + c0
        else:
            self.T1_LH, self.t0_L = np.tile(b1_H, (L, 1)), np.full(L, c0)
        self.w2_H = model.w2_H
        self.groups = model.groups
        self.incoming_w1_H, self.incoming_w0 = self.W1_YH[-1], self.w0_Y[-1]

    def score_all(self, feats: Features, now: int, idx_C: np.ndarray | None = None):
        """Every key's score [K] as a resident and as the missed key (incoming = 1); idx_C:
        those keys' only, [C] each."""
        x_KY = feats.dense(idx_C, now, self.groups)
        layer_K = feats.layer_K if idx_C is None else feats.layer_K[idx_C]
        pre_KH = x_KY @ self.W1_YH + self.T1_LH[layer_K]
        lin_K = x_KY @ self.w0_Y + self.t0_L[layer_K]
        s0_K = lin_K + np.maximum(pre_KH, 0.0) @ self.w2_H
        s1_K = lin_K + self.incoming_w0 + np.maximum(pre_KH + self.incoming_w1_H, 0.0) @ self.w2_H
        return s0_K, s1_K


def _dense_width(groups: tuple[str, ...]) -> int:
    width = {"recency": 1, "history": HISTORY, "frequency": len(DECAYS), "request": 2,
             "layer": 1, "prior": 1, "forecast": 2}  # fmt: skip
    return sum(width[g] for g in ALL_GROUPS if g in groups) + 1  # + incoming


def _layer_column(groups: tuple[str, ...]) -> int:
    """Index of visit_in among the dense columns."""
    return _dense_width(tuple(g for g in GROUPS[: GROUPS.index("layer")] if g in groups)) - 1
