"""Compiled one-token decode paths: ours' scores, their top experts, and the horizon's step.

Usage (residual_fast.score_token, prefetch._token_list and horizon_fast.FastHorizon call these
when numba is installed, `tensorbend.jit.AVAILABLE`; otherwise they run their numpy code):
    out_E = np.empty(E, np.float32)
    score_token_kernel(x_D, w_cat_DX, H, w_ids_2EH, b_H, src_K, prev_K, w2_HE, b2_E, alpha,
                       gate, layer_input, bias_E, correction_E, eps, out_E)
    ids = top_ids(out_E, K + extra)              # best first; -inf scores left out
    n = predict_token_kernel(x_D, src_K, prev_K, *plan, width, out_E, out_J)  # both in one call
    horizon_step_kernel(state arrays..., forward, ahead_LE, after_LE, first_LE)
    horizon_token_kernel(ids_LK, ..., forward, used_LE, ahead_LE, after_LE, first_LE, k, out_NK)

In the runtime, a decode token asks ours once per target layer and the horizon once per forward,
for arrays of a few hundred values: numpy's ~1-3 us per call, not the arithmetic, was most of
that time (docs/bench/predictor_cost.md). Each kernel is the numpy path's operations in one
compiled loop nest. They keep the interpreter lock: each runs for microseconds, less than
handing the lock to an I/O thread and waiting to get it back would cost (a prediction thread
of their own would not take them off the compute thread's path: the Python around them, and
their queueing, needs the lock either way). Float32 as there; sums may round in another order,
so scores agree to rounding and the experts they rank first are the same on real traces
(tests/test_predictors.py, tests/test_horizon.py compare both paths).

Shapes: D hidden, H correction width, E experts, K top-k, L MoE layers, J = h + 1 horizon
classes, X horizon features, C count decays, T recency taus, M the horizon MLP's width.
"""

from __future__ import annotations

import math

import numpy as np

from tensorbend.jit import njit

GATE_NONE, GATE_LOGITS, GATE_SIGMOID, GATE_GROUP = 0, 1, 2, 3  # score_token_kernel's `gate`


@njit(cache=True)
def score_token_kernel(x_D, w_cat_DX, H, w_ids_2EH, b_H, src_K, prev_K, w2_HE, b2_E, alpha,
                       gate, layer_input, bias_E, correction_E, eps, eps_rms, n_group, topk_group,
                       out_E):  # fmt: skip
    """residual_fast.score_token for one token, into out_E [E]. src_K / prev_K: the source
    layer's and the previous token's expert ids (empty when absent); b_H: b1 or b1 + the
    has_prev row; gate: GATE_NONE (no router term), GATE_LOGITS (standardised logits) or
    GATE_SIGMOID (sigmoid_bias in tanh form: tanh(l / 2) + 2 * correction, eps doubled by
    the caller) or GATE_GROUP (group_limited: the sigmoid in tanh form + correction, experts
    outside the `topk_group` best of `n_group` groups less 1e4); bias_E / correction_E:
    empty when the router has none."""
    D, X = x_D.shape[0], w_cat_DX.shape[1]
    E = out_E.shape[0]
    ss = np.float32(0.0)
    for i in range(D):
        ss += x_D[i] * x_D[i]
    inv_rms = np.float32(1.0 / math.sqrt(ss / D + eps_rms))
    y_X = np.zeros(X, np.float32)
    for i in range(D):
        xi = x_D[i]
        for j in range(X):
            y_X[j] += xi * w_cat_DX[i, j]
    h_H = np.empty(H, np.float32)
    for j in range(H):
        h_H[j] = b_H[j] + y_X[j] * inv_rms
    for idx in src_K:
        for j in range(H):
            h_H[j] += w_ids_2EH[idx, j]
    for idx in prev_K:
        for j in range(H):
            h_H[j] += w_ids_2EH[idx + E, j]
    for e in range(E):
        out_E[e] = b2_E[e]
    for j in range(H):  # exact GELU (erf form, as F.gelu)
        a = np.float32(0.5) * h_H[j] * (np.float32(1.0) + math.erf(h_H[j] * _INV_SQRT2))
        for e in range(E):
            out_E[e] += a * w2_HE[j, e]
    if gate == GATE_NONE:
        return
    g_E = np.empty(E, np.float32)
    for e in range(E):
        lg = y_X[H + e] * inv_rms if layer_input else y_X[H + e]
        if bias_E.shape[0]:
            lg += bias_E[e]
        if gate == GATE_SIGMOID:
            lg = math.tanh(np.float32(0.5) * lg)
            if correction_E.shape[0]:
                lg += 2 * correction_E[e]
        elif gate == GATE_GROUP:
            lg = np.float32(0.5) * (np.float32(1.0) + np.float32(math.tanh(np.float32(0.5) * lg)))
            if correction_E.shape[0]:
                lg += correction_E[e]
        g_E[e] = lg
    if gate == GATE_GROUP:
        _limit_groups(g_E, n_group, topk_group)
    mean = g_E.sum() / E  # standardise: unbiased std, as torch.std_mean
    var = np.float32(0.0)
    for e in range(E):
        g_E[e] -= mean
        var += g_E[e] * g_E[e]
    scale = alpha / (math.sqrt(var / (E - 1)) + eps)
    for e in range(E):
        out_E[e] += g_E[e] * scale


@njit(cache=True)
def _limit_groups(s_E, n_group, topk_group):
    """residual_fast._group_limited in place: each group's score is the sum of its two best;
    experts outside the topk_group best groups (ties: lower group first) lose 1e4."""
    S = s_E.shape[0] // n_group
    group_G = np.empty(n_group, np.float32)
    for g in range(n_group):
        a1, a2 = -np.inf, -np.inf  # the best and the second best (np.sort(...)[-2:])
        for i in range(g * S, (g + 1) * S):
            v = s_E[i]
            if v > a1:
                a1, a2 = v, a1
            elif v > a2:
                a2 = v
        group_G[g] = np.float32(a2) + np.float32(a1)
    keep_G = np.zeros(n_group, np.bool_)
    for _ in range(topk_group):
        best = -1
        for g in range(n_group):
            if not keep_G[g] and (best < 0 or group_G[g] > group_G[best]):
                best = g
        keep_G[best] = True
    for g in range(n_group):
        if not keep_G[g]:
            for i in range(g * S, (g + 1) * S):
                s_E[i] -= np.float32(1e4)


@njit(cache=True)
def top_ids(values_E, width):
    """The indices of the `width` largest values, largest first (ties: lower index first),
    leaving out -inf (no prediction): prefetch._token_list's list."""
    n = min(width, values_E.shape[0])
    out = np.empty(n, np.int64)
    taken = np.zeros(values_E.shape[0], np.bool_)
    k = 0
    for _ in range(n):
        best, bv = -1, -np.inf
        for e in range(values_E.shape[0]):
            if not taken[e] and values_E[e] > bv:
                best, bv = e, values_E[e]
        if best < 0:
            break
        taken[best] = True
        out[k] = best
        k += 1
    return out[:k]


@njit(cache=True)
def predict_token_kernel(x_D, src_K, prev_K, w_cat_DX, w_ids_2EH, b1_H, b1_prev_H, w2_HE, b2_E,
                         bias_E, correction_E, cfg_8, width, out_E, out_J):  # fmt: skip
    """One decode call in one compiled call: score_token_kernel (prev_K empty: no previous
    token, and b1 without the has_prev row), then the `width` top ids into out_J; returns how
    many it wrote (width 0: scores only). residual_fast.TokenWeights.plan holds the arguments
    from w_cat_DX to cfg_8: score_token_kernel's scalars in one float64 array (H, alpha,
    gate, layer_input, eps, eps_rms, n_group, topk_group; exact in float64), since each
    argument costs the call's dispatch time, and most in the runtime, where a call finds the
    dispatcher's code out of the CPU caches."""
    H, alpha = int(cfg_8[0]), np.float32(cfg_8[1])
    gate, layer_input = int(cfg_8[2]), cfg_8[3] != 0.0
    n_group, topk_group = int(cfg_8[6]), int(cfg_8[7])
    b_H = b1_prev_H if prev_K.shape[0] else b1_H
    score_token_kernel(x_D, w_cat_DX, H, w_ids_2EH, b_H, src_K, prev_K, w2_HE, b2_E, alpha, gate,
                       layer_input, bias_E, correction_E, cfg_8[4], cfg_8[5], n_group,
                       topk_group, out_E)  # fmt: skip
    ids = top_ids(out_E, width)
    for j in range(ids.shape[0]):
        out_J[j] = ids[j]
    return ids.shape[0]


@njit(cache=True)
def horizon_step_kernel(used_LE, hidden_D, age_LE, counts_LCE, hidden_2D, forwards, w_LJX, b_LJE,
                        decays_C, neg_inv_tau_T, W1, b1, W2, b2, hidden_ema, eps_rms, forward,
                        ahead_LE, after_LE, first_LE):  # fmt: skip
    """horizon_fast.FastHorizon.step: observe the forward (state arrays updated in place;
    hidden_D empty: none), then the forecast into ahead_LE / after_LE (float64 expected steps)
    and first_LE (P(next use in the next forward)). W1 empty: no hidden-state MLP."""
    L, J, X = w_LJX.shape
    E, C, T = used_LE.shape[1], decays_C.shape[0], neg_inv_tau_T.shape[0]
    for m in range(L):  # _observe
        for e in range(E):
            age_LE[m, e] = 0.0 if used_LE[m, e] > 0 else age_LE[m, e] + 1
            for c in range(C):
                counts_LCE[m, c, e] = counts_LCE[m, c, e] * decays_C[c] + used_LE[m, e]
    D = hidden_D.shape[0]
    if D:
        ss = np.float32(0.0)
        for i in range(D):
            ss += hidden_D[i] * hidden_D[i]
        r = np.float32(1.0 / math.sqrt(ss / D + eps_rms))
        for i in range(D):
            h = hidden_D[i] * r
            mean = h if forwards == 0 else hidden_2D[D + i] * hidden_ema + (1 - hidden_ema) * h
            hidden_2D[D + i] = mean
            hidden_2D[i] = h
    z_LJE = np.empty((L, J, E), np.float32)
    x_XE = np.empty((X, E), np.float32)
    for m in range(L):  # _probs
        for e in range(E):
            x_XE[0, e] = used_LE[m, e]
            for t in range(T):
                x_XE[1 + t, e] = math.exp(age_LE[m, e] * neg_inv_tau_T[t])
            for c in range(C):
                x_XE[1 + T + c, e] = math.log1p(counts_LCE[m, c, e])
        for j in range(J):
            for e in range(E):
                z_LJE[m, j, e] = b_LJE[m, j, e]
            for x in range(X):
                w = w_LJX[m, j, x]
                for e in range(E):
                    z_LJE[m, j, e] += w * x_XE[x, e]
    if W1.shape[0]:
        M = W1.shape[1]
        a_M = b1.copy()
        for i in range(W1.shape[0]):
            hv = hidden_2D[i]
            for k in range(M):
                a_M[k] += hv * W1[i, k]
        for k in range(M):  # GELU, tanh form
            a = a_M[k]
            a_M[k] = 0.5 * a * (1 + math.tanh(_GELU_C * (a + 0.044715 * a * a * a)))
        z_N = z_LJE.reshape(-1)
        extra_N = b2.copy()
        for k in range(M):
            a = a_M[k]
            for n in range(extra_N.shape[0]):
                extra_N[n] += a * W2[k, n]
        for n in range(extra_N.shape[0]):
            z_N[n] += extra_N[n]
    h = J - 1
    rate_decay = 1 - decays_C[C - 1]
    for m in range(L):  # softmax over j, then _next_use_steps
        base = (forward + 1) * L + m  # the step of class 1 (forward + 1), layer m
        for e in range(E):
            top = z_LJE[m, 0, e]
            for j in range(1, J):
                top = max(top, z_LJE[m, j, e])
            s = np.float32(0.0)
            for j in range(J):
                z_LJE[m, j, e] = math.exp(z_LJE[m, j, e] - top)
                s += z_LJE[m, j, e]
            within = 0.0
            spread = 0.0
            for j in range(J):
                z_LJE[m, j, e] /= s
                if j < h:
                    within += np.float64(z_LJE[m, j, e])
                    spread += j * np.float64(z_LJE[m, j, e])
            rate = min(max(counts_LCE[m, C - 1, e] * rate_decay, np.float32(1e-3)), 1.0)
            later = (base + (h - 1) * L) + np.float32(L * (1 - rate) / rate)
            soon = base * within + L * spread
            tail = np.float64(z_LJE[m, h, e]) * later
            p0 = np.float64(z_LJE[m, 0, e])
            ahead_LE[m, e] = soon + tail
            after_LE[m, e] = (soon - p0 * base + tail) / max(1 - p0, 1e-12)
            first_LE[m, e] = z_LJE[m, 0, e]


@njit(cache=True)
def horizon_token_kernel(ids_LK, hidden_D, age_LE, counts_LCE, hidden_2D, forwards, w_LJX, b_LJE,
                         decays_C, neg_inv_tau_T, W1, b1, W2, b2, hidden_ema, eps_rms, forward,
                         used_LE, ahead_LE, after_LE, first_LE, k, out_NK):  # fmt: skip
    """horizon_step_kernel for one token's forward (a decode token at batch 1): the routed ids
    [L, K] in place of used_LE (filled here), then the `k` likeliest experts of the next
    forward (first_LE's largest, ties by lower id: prefetch.likeliest) at each of the first
    out_NK.shape[0] layers into out_NK."""
    used_LE[:, :] = 0.0
    for m in range(ids_LK.shape[0]):
        for j in range(ids_LK.shape[1]):
            used_LE[m, ids_LK[m, j]] = 1.0
    horizon_step_kernel(used_LE, hidden_D, age_LE, counts_LCE, hidden_2D, forwards, w_LJX, b_LJE,
                        decays_C, neg_inv_tau_T, W1, b1, W2, b2, hidden_ema, eps_rms, forward,
                        ahead_LE, after_LE, first_LE)  # fmt: skip
    for m in range(out_NK.shape[0]):
        ids = top_ids(first_LE[m], k)
        for j in range(ids.shape[0]):
            out_NK[m, j] = ids[j]


def warm() -> None:
    """Compile (or load from numba's cache) every kernel for the argument types the runtime
    passes, so that no decode token pays for it (`prefetch.Prefetcher` calls this)."""
    f32, i64 = np.float32, np.int64
    z1, z2 = np.zeros(2, f32), np.zeros((2, 2), f32)
    out = np.zeros(2, f32)
    score_token_kernel(z1, np.zeros((2, 3), f32), 1, z2, z1[:1].copy(), np.zeros(1, i64),
                       np.zeros(1, i64), np.zeros((1, 2), f32), z1, f32(1.0), GATE_GROUP, True,
                       z1, z1, 1e-6, 1e-6, 1, 1, out)  # fmt: skip
    top_ids(out, 1)
    predict_token_kernel(z1, np.zeros(1, i64), np.zeros(1, i64), np.zeros((2, 3), f32), z2,
                         z1[:1].copy(), z1[:1].copy(), np.zeros((1, 2), f32), z1, z1, z1,
                         np.array([1, 1, GATE_GROUP, 1, 1e-6, 1e-6, 1, 1], np.float64), 1, out,
                         np.zeros(2, i64))  # fmt: skip
    L, J, X, E = 1, 2, 7, 2
    horizon_step_kernel(np.zeros((L, E), f32), z1, np.zeros((L, E), f32), np.zeros((L, 3, E), f32),
                        np.zeros(4, f32), 0, np.zeros((L, J, X), f32), np.zeros((L, J, E), f32),
                        np.zeros(3, f32), np.zeros(3, f32), np.zeros((4, 1), f32), np.zeros(1, f32),
                        np.zeros((1, L * J * E), f32), np.zeros(L * J * E, f32), 0.8, 1e-6, 0,
                        np.zeros((L, E)), np.zeros((L, E)), np.zeros((L, E), f32))  # fmt: skip
    horizon_token_kernel(np.zeros((L, 1), i64), z1, np.zeros((L, E), f32),
                         np.zeros((L, 3, E), f32), np.zeros(4, f32), 0, np.zeros((L, J, X), f32),
                         np.zeros((L, J, E), f32), np.zeros(3, f32), np.zeros(3, f32),
                         np.zeros((4, 1), f32), np.zeros(1, f32), np.zeros((1, L * J * E), f32),
                         np.zeros(L * J * E, f32), 0.8, 1e-6, 0, np.zeros((L, E), f32),
                         np.zeros((L, E)), np.zeros((L, E)), np.zeros((L, E), f32), 1,
                         np.zeros((L, 1), i64))  # fmt: skip


_INV_SQRT2 = np.float32(1 / math.sqrt(2))
_GELU_C = np.float32(math.sqrt(2 / math.pi))
