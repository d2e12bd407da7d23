"""The horizon predictor's per-forward work in the runtime, in numpy (small arrays: numpy's
per-op overhead is a fraction of torch's). Equal to `HorizonPredictor` up to float rounding
(tests/test_horizon.py).

Usage:
    fast = FastHorizon(pred)                    # pred: a trained HorizonPredictor
    state = fast.new_state()                    # one per request
    ahead, after = fast.step(state, used_LE, hidden_D, forward=f)   # Reuse.set_forecast lists
    first_LE = fast.next_forward_probs          # P(next use at f + 1) [L, E], for prefetches

Shape legend: L MoE layers, E experts, J = h + 1 classes, X features, D hidden, H width.
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
    def __init__(self, L: int, E: int, D: int):
        self.age_LE = np.full((L, E), 1e6, dtype=np.float32)
        self.counts_CLE = np.zeros((len(COUNT_DECAYS), L, E), dtype=np.float32)
        self.used_LE = np.zeros((L, E), dtype=np.float32)
        self.hidden_2D = np.zeros(2 * D, dtype=np.float32)  # [current | running mean]
        self.forwards = 0


class FastHorizon:
    def __init__(self, pred: HorizonPredictor):
        self.spec, self.cfg = pred.spec, pred.cfg
        sd = {k: v.detach().float().numpy() for k, v in pred.net.state_dict().items()}
        self.w_LJX, self.b_LEJ = sd["w_LJX"], sd["b_LEJ"]
        self.mlp = None
        if self.cfg.uses_hidden:
            self.mlp = (sd["mlp.0.weight"].T.copy(), sd["mlp.0.bias"], sd["mlp.2.weight"].T.copy(),
                        sd["mlp.2.bias"])  # fmt: skip
        self.decays_C11 = np.asarray(COUNT_DECAYS, dtype=np.float32)[:, None, None]
        self.inv_tau_T11 = (1 / np.asarray(RECENCY_TAUS, dtype=np.float32))[:, None, None]
        self.next_forward_probs = None

    def new_state(self) -> FastState:
        s = self.spec
        return FastState(s.num_moe_layers, s.num_experts, s.hidden_size)

    def step(self, st: FastState, used_LE: np.ndarray, hidden_D: np.ndarray | None, forward: int):
        """Observe forward `forward` and forecast: (ahead, after_first) lists for Reuse."""
        self._observe(st, used_LE, hidden_D)
        p_LEJ = self._probs(st)
        self.next_forward_probs = p_LEJ[..., 0]
        return self._next_use_steps(p_LEJ, st, forward)

    def _observe(self, st: FastState, used_LE: np.ndarray, hidden_D: np.ndarray | None) -> None:
        st.age_LE += 1
        st.age_LE[used_LE > 0] = 0
        st.counts_CLE *= self.decays_C11
        st.counts_CLE += used_LE
        st.used_LE = used_LE.astype(np.float32)
        if hidden_D is not None:
            D = hidden_D.shape[0]
            h_D = hidden_D / np.sqrt(np.mean(hidden_D * hidden_D) + EPS_RMS)
            mean_D = st.hidden_2D[D:]
            st.hidden_2D[D:] = (
                h_D if st.forwards == 0 else HIDDEN_EMA * mean_D + (1 - HIDDEN_EMA) * h_D
            )
            st.hidden_2D[:D] = h_D
        st.forwards += 1

    def _probs(self, st: FastState) -> np.ndarray:
        rec_TLE = np.exp(-st.age_LE[None] * self.inv_tau_T11)
        X_XLE = np.concatenate([st.used_LE[None], rec_TLE, np.log1p(st.counts_CLE)])
        z_LEJ = np.einsum("xle,ljx->lej", X_XLE, self.w_LJX) + self.b_LEJ
        if self.mlp is not None:
            W1, b1, W2, b2 = self.mlp
            a = st.hidden_2D @ W1 + b1
            a = 0.5 * a * (1 + np.tanh(_GELU_C * (a + 0.044715 * a * a * a)))  # GELU, tanh form
            z_LEJ += (a @ W2 + b2).reshape(z_LEJ.shape)
        z_LEJ -= z_LEJ.max(-1, keepdims=True)
        e_LEJ = np.exp(z_LEJ)
        return e_LEJ / e_LEJ.sum(-1, keepdims=True)

    def _next_use_steps(self, p_LEJ: np.ndarray, st: FastState, forward: int):
        L, h = p_LEJ.shape[0], p_LEJ.shape[-1] - 1
        m_L1 = np.arange(L, dtype=np.float64)[:, None]
        steps_LJ = (forward + np.arange(1, h + 1)) * L + m_L1  # [L, h]
        rate_LE = np.clip(st.counts_CLE[-1] * (1 - COUNT_DECAYS[-1]), 1e-3, 1.0)
        later_LE = (forward + h) * L + m_L1 + L * (1 - rate_LE) / rate_LE
        p = p_LEJ.astype(np.float64)
        soon_LE = np.einsum("lej,lj->le", p[..., :h], steps_LJ)
        ahead_LE = soon_LE + p[..., h] * later_LE
        rest_LE = np.maximum(1 - p[..., 0], 1e-12)
        after_LE = (soon_LE - p[..., 0] * steps_LJ[:, :1] + p[..., h] * later_LE) / rest_LE
        return ahead_LE.tolist(), after_LE.tolist()


_GELU_C = float(np.sqrt(2 / np.pi))
