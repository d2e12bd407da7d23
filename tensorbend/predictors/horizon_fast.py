"""The horizon predictor's per-forward work in the runtime, in numpy (small arrays: numpy's
per-op overhead is a fraction of torch's). Equal to `HorizonPredictor` up to float rounding
(tests/test_horizon.py).

Usage:
    fast = FastHorizon(pred)                    # pred: a trained HorizonPredictor
    state = fast.new_state()                    # one per request
    ahead, after = fast.step(state, used_LE, hidden_D, forward=f)   # Reuse.set_forecast lists
    first_LE = fast.next_forward_probs          # P(next use at f + 1) [L, E], for prefetches

Shape legend: L MoE layers, E experts, J = h + 1 classes, X features, C count decays, T
recency taus, D hidden, H width.
"""

from __future__ import annotations

import numpy as np

from tensorbend.predictors.horizon import (
    COUNT_DECAYS,
    HIDDEN_EMA,
    RECENCY_TAUS,
    HorizonPredictor,
)
from tensorbend.predictors.ops import EPS_RMS


class FastState:
    """One request's history in the layout the forecast reads: features [L, X, E] filled in
    place (used | recency per tau | log1p of the counts per decay), counts [L, C, E]."""

    def __init__(self, L: int, E: int, D: int):
        T, C = len(RECENCY_TAUS), len(COUNT_DECAYS)
        self.age_L1E = np.full((L, 1, E), 1e6, dtype=np.float32)
        self.counts_LCE = np.zeros((L, C, E), dtype=np.float32)
        self.features_LXE = np.zeros((L, 1 + T + C, E), dtype=np.float32)
        self.hidden_2D = np.zeros(2 * D, dtype=np.float32)  # [current | running mean]
        self.forwards = 0


class FastHorizon:
    """The classes axis sits between layers and experts ([L, J, E]): numpy's reductions over
    it run along contiguous rows of E (several times faster than over a last axis of J)."""

    def __init__(self, pred: HorizonPredictor):
        self.spec, self.cfg = pred.spec, pred.cfg
        sd = {k: v.detach().float().numpy() for k, v in pred.net.state_dict().items()}
        self.w_LJX = np.ascontiguousarray(sd["w_LJX"])
        L, E, J = sd["b_LEJ"].shape
        self.b_LJE = np.ascontiguousarray(sd["b_LEJ"].transpose(0, 2, 1))
        self.mlp = None
        if self.cfg.uses_hidden:  # its outputs, ordered (l, e, j), reordered to (l, j, e)
            W2 = (
                sd["mlp.2.weight"].reshape(L, E, J, -1).transpose(0, 2, 1, 3).reshape(L * J * E, -1)
            )
            b2 = sd["mlp.2.bias"].reshape(L, E, J).transpose(0, 2, 1).reshape(-1)
            self.mlp = (sd["mlp.0.weight"].T.copy(), sd["mlp.0.bias"], W2.T.copy(), b2.copy())
        self.neg_inv_tau_T1 = (-1 / np.asarray(RECENCY_TAUS, dtype=np.float32))[:, None]
        self._steps(L, J - 1)

    def _steps(self, L: int, h: int) -> None:
        """What observing and the next-use steps need beside the forecast's own weights."""
        self.decays_C1 = np.asarray(COUNT_DECAYS, dtype=np.float32)[:, None]
        # sums_2J @ p_LJE = (P(next use within h), sum over j < h of j * P(class j)): the
        # expected step of a use within h is base * the first + L * the second (steps below)
        self.sums_2J = np.zeros((2, h + 1))
        self.sums_2J[0, :h], self.sums_2J[1, :h] = 1.0, np.arange(h)
        self.m_L1 = np.arange(L, dtype=np.float64)[:, None]
        self.next_forward_probs = None

    def new_state(self) -> FastState:
        s = self.spec
        return FastState(s.num_moe_layers, s.num_experts, s.hidden_size)

    def step(self, st: FastState, used_LE: np.ndarray, hidden_D: np.ndarray | None, forward: int):
        """Observe forward `forward` and forecast: (ahead, after_first) lists for Reuse."""
        self._observe(st, used_LE, hidden_D)
        p_LJE = self._probs(st)
        self.next_forward_probs = p_LJE[:, 0]
        return self._next_use_steps(p_LJE, st, forward)

    def _observe(self, st: FastState, used_LE: np.ndarray, hidden_D: np.ndarray | None) -> None:
        used_L1E = used_LE.reshape(used_LE.shape[0], 1, -1)
        st.age_L1E += 1
        st.age_L1E[used_L1E > 0] = 0
        st.counts_LCE *= self.decays_C1
        st.counts_LCE += used_L1E
        st.features_LXE[:, :1] = used_L1E
        if hidden_D is not None:
            D = hidden_D.shape[0]
            h_D = hidden_D * (1 / np.sqrt(np.dot(hidden_D, hidden_D) / D + EPS_RMS))
            mean_D = st.hidden_2D[D:]
            if st.forwards == 0:
                mean_D[:] = h_D
            else:
                mean_D *= HIDDEN_EMA
                mean_D += (1 - HIDDEN_EMA) * h_D
            st.hidden_2D[:D] = h_D
        st.forwards += 1

    def _probs(self, st: FastState) -> np.ndarray:
        """P(first use in class j) [L, J, E], a softmax over j."""
        T = self.neg_inv_tau_T1.shape[0]
        x_LXE = st.features_LXE
        np.exp(st.age_L1E * self.neg_inv_tau_T1, out=x_LXE[:, 1 : 1 + T])
        np.log1p(st.counts_LCE, out=x_LXE[:, 1 + T :])
        z_LJE = np.matmul(self.w_LJX, x_LXE)
        z_LJE += self.b_LJE
        if self.mlp is not None:
            W1, b1, W2, b2 = self.mlp
            a = st.hidden_2D @ W1 + b1
            a = 0.5 * a * (1 + np.tanh(_GELU_C * (a + 0.044715 * a * a * a)))  # GELU, tanh form
            z_LJE += (a @ W2 + b2).reshape(z_LJE.shape)
        z_LJE -= np.maximum.reduce(z_LJE, axis=1, keepdims=True)
        np.exp(z_LJE, out=z_LJE)
        z_LJE /= np.add.reduce(z_LJE, axis=1, keepdims=True)
        return z_LJE

    def _next_use_steps(self, p_LJE: np.ndarray, st: FastState, forward: int):
        L, h = p_LJE.shape[0], p_LJE.shape[1] - 1
        p = p_LJE.astype(np.float64)
        base_L1 = (forward + 1) * L + self.m_L1  # the step of class 1 (forward + 1), layer m
        rate_LE = np.clip(st.counts_LCE[:, -1] * (1 - COUNT_DECAYS[-1]), 1e-3, 1.0)
        later_LE = (base_L1 + (h - 1) * L) + L * (1 - rate_LE) / rate_LE
        sums_L2E = np.matmul(self.sums_2J, p)
        soon_LE = base_L1 * sums_L2E[:, 0] + L * sums_L2E[:, 1]
        tail_LE = p[:, h] * later_LE
        ahead_LE = soon_LE + tail_LE
        p0_LE = p[:, 0]
        after_LE = (soon_LE - p0_LE * base_L1 + tail_LE) / np.maximum(1 - p0_LE, 1e-12)
        return ahead_LE.tolist(), after_LE.tolist()


_GELU_C = float(np.sqrt(2 / np.pi))
