"""Compiled demand replay: `cache.replay.replay`'s placements for every replay policy, from one
numba kernel, checked victim for victim against the Python resident set.

Usage (numba is optional: `pip install tensorbend[fast]`; `available()` says whether it is there):
    >>> from tensorbend.cache.replay import planted_trace, replay, replay_policy
    >>> from tensorbend.cache.victim_heap import IndexedResidentSet
    >>> ids_FLK = planted_trace(prompts=2, tokens=8, layers=3, experts=8, top_k=2)
    >>> policy, feed = replay_policy("prefetch", ids_FLK, 3, 8)
    >>> slow = replay(ids_FLK, IndexedResidentSet(6, 3, policy), feed)
    >>> fast = replay_compiled(ids_FLK, "prefetch", 6) if available() else slow
    >>> fast.victims == slow.victims, fast.misses == slow.misses
    (True, True)

What it replays: the names of `cache.replay.REPLAY_POLICIES` (the policy and the feed that
`replay_policy` builds for each: LRU, LFU, LFRU, `Predicted` fed nothing or the exact next
layer's experts as hints and prefetches, `Reuse` fed the exact next use of every expert after
each forward, Belady with all or h forwards of sight), through a resident set of `slots`
slots, one global pool or per-layer pools, admission of every demand miss (`AdmitAll`). The
Python classes stay the definition: the kernel keeps the same state (recency sequence
numbers, counts, log counts, hints, the forecast in force, each key's next recorded use) and
evicts the evictable entry of the pool with the highest `policy.rank`, comparing the same
tuples with the same floating-point operations (ties to the least recent). It compares every
entry of the pool at each miss, as `ResidentSet.victim` does (a few nanoseconds per entry
compiled, one loop per policy), except that `Predicted` estimates only the head of each
layer's (log count, recency) order, the order its estimates keep (cache/predicted.py), and
Belady keeps each key's next recorded use from its last use. tests/test_compiled.py replays planted and random traces through both
and asserts identical placements for every policy and pool; bench/replay_speed.py states the
rate per policy beside the Python index's.

Outcomes and victims come back as `cache.replay.Replayed` (the same tuples `replay` appends),
and as arrays (`Compiled`), which are cheaper for long traces.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from tensorbend.cache.replay import REPLAY_POLICIES, Replayed
from tensorbend.jit import AVAILABLE, njit

OUTCOMES = ("admitted", "refused", "blocked")  # the kernel's outcome codes 0, 1, 2
_LRU, _LFU, _LFRU, _PREDICTED, _REUSE, _NEXT_USE = range(6)
_CODES = {"lru": _LRU, "lfu": _LFU, "lfru": _LFRU, "predicted": _PREDICTED,
          "prefetch": _PREDICTED, "reuse": _REUSE}  # fmt: skip
INF = math.inf
DECAY = 0.9  # Predicted's default decay (cache/predicted.py), which replay_policy uses


@dataclass(frozen=True)
class Compiled:
    """One compiled replay: counters, and per placement (in order) its step, key (m * E + e),
    outcome code (`OUTCOMES`) and victim key (-1: none)."""

    misses: int
    prefetches: int
    evictions: int
    num_experts: int
    step_P: np.ndarray
    key_P: np.ndarray
    outcome_P: np.ndarray
    victim_P: np.ndarray

    def replayed(self) -> Replayed:
        """The placements as `cache.replay.replay` records them (tuples, keys as (m, e))."""
        E = self.num_experts
        victims = [
            (s, (k // E, k % E), OUTCOMES[o], None if v < 0 else (v // E, v % E))
            for s, k, o, v in zip(self.step_P.tolist(), self.key_P.tolist(),
                                  self.outcome_P.tolist(), self.victim_P.tolist(), strict=True)
        ]  # fmt: skip
        return Replayed(misses=self.misses, prefetches=self.prefetches, victims=victims)


def available() -> bool:
    """Whether numba is importable (the compiled replay needs it)."""
    return AVAILABLE


def replay_compiled(ids_FLK, name: str, slots: int, num_experts: int = 0,
                    pool: str = "global", seen_FLK=None) -> Replayed:  # fmt: skip
    """`replay(ids_FLK, IndexedResidentSet(slots, L, policy, pool=pool), feed)` for
    `policy, feed = replay_policy(name, ids_FLK, L, num_experts)`, compiled (module docstring).
    seen_FLK: what Belady sees instead of the demands (`NextUse(steps_by_key(seen_FLK), L, h)`,
    a trace of the same forwards and layers: a prediction of the routing, say)."""
    return run(ids_FLK, name, slots, num_experts, pool, seen_FLK).replayed()


def run(ids_FLK, name: str, slots: int, num_experts: int = 0, pool: str = "global",
        seen_FLK=None) -> Compiled:  # fmt: skip
    """`replay_compiled`'s placements as arrays (`Compiled`)."""
    if name not in REPLAY_POLICIES and not re.fullmatch(r"belady/h=\d+", name):
        raise ValueError(f"unknown replay policy {name!r}; expected one of "
                         f"{', '.join(REPLAY_POLICIES)} (or belady/h=N, N >= 0)")  # fmt: skip
    if pool not in ("global", "per_layer"):
        raise ValueError(f"pool must be 'global' or 'per_layer', got {pool!r}")
    if not available():
        raise ImportError("the compiled replay needs numba: pip install 'tensorbend[fast]'")
    ids_FLK, n_FL = _as_array(ids_FLK)
    seen, n_seen = (ids_FLK, n_FL) if seen_FLK is None else _as_array(seen_FLK)
    if seen.shape[:2] != ids_FLK.shape[:2]:
        raise ValueError(f"seen_FLK covers {seen.shape[0]} forwards x {seen.shape[1]} layers; "
                         f"the demands {ids_FLK.shape[0]} x {ids_FLK.shape[1]}: pass a trace "
                         "of the same forwards")  # fmt: skip
    F, L, K = ids_FLK.shape
    E = max(num_experts, 1 + int(ids_FLK.max(initial=-1)), 1 + int(seen.max(initial=-1)))
    code = _NEXT_USE if name.startswith("belady") else _CODES[name]
    foresight = int(name.split("=")[1]) if name.startswith("belady/h=") else -1
    ptr_K, steps = _steps_by_key(seen, n_seen, E)
    if name == "reuse":
        ahead_FK, after_FK = _exact_forecasts(ids_FLK, n_FL, E)
    else:
        ahead_FK = after_FK = np.zeros((0, L * E))
    n_out = F * L * K * (2 if name == "prefetch" else 1)
    step_P = np.empty(n_out, np.int64)
    key_P, outcome_P, victim_P = np.empty_like(step_P), np.empty_like(step_P), np.empty_like(step_P)
    n, misses, prefetches, evictions = _kernel(
        ids_FLK, n_FL, E, code, slots, pool == "per_layer", name == "prefetch", DECAY,
        foresight, ptr_K, steps, ahead_FK, after_FK, step_P, key_P, outcome_P, victim_P,
    )  # fmt: skip
    return Compiled(int(misses), int(prefetches), int(evictions), E,
                    step_P[:n], key_P[:n], outcome_P[:n], victim_P[:n])  # fmt: skip


# ---------------------------------------------------------------- preparation (numpy)


def _as_array(ids_FLK) -> tuple[np.ndarray, np.ndarray]:
    """(ids_FLK as int64, padded with -1 where a layer-step routes fewer than K, n_FL)."""
    if isinstance(ids_FLK, np.ndarray):
        a = ids_FLK.astype(np.int64)
        return a, np.full(a.shape[:2], a.shape[2], np.int64)
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


def _steps_by_key(ids_FLK: np.ndarray, n_FL: np.ndarray, E: int):
    """CSR of `cache.oracle.steps_by_key`: key k = m * E + e is used at steps[ptr[k]:ptr[k+1]],
    ascending."""
    F, L, K = ids_FLK.shape
    live = np.arange(K)[None, None, :] < n_FL[:, :, None]
    step_FLK = (np.arange(F)[:, None, None] * L + np.arange(L)[None, :, None]) + 0 * ids_FLK
    key_FLK = np.arange(L)[None, :, None] * E + ids_FLK
    keys, steps = key_FLK[live], step_FLK[live]  # (in step order: C order is forward-major)
    order = np.argsort(keys, kind="stable")
    ptr = np.zeros(L * E + 1, np.int64)
    np.cumsum(np.bincount(keys, minlength=L * E), out=ptr[1:])
    return ptr, steps[order].astype(np.int64)


def _exact_forecasts(ids_FLK: np.ndarray, n_FL: np.ndarray, E: int):
    """`cache.replay.ExactForecast`'s forecasts as (F, L * E) arrays: after forward f,
    ahead_FK[f] holds every key's first use in a forward > f, after_FK[f] its first use in a
    forward > f + 1 (inf: never); after_FK is ahead_FK one row on (views of one buffer)."""
    F, L, _ = ids_FLK.shape
    buf = np.empty((F + 1, L * E))
    _fill_forecasts(ids_FLK, n_FL, E, buf)
    return buf[:F], buf[1:]


# ---------------------------------------------------------------- the kernel (numba)
# Keys are k = m * E + e. Per key: rec (recency sequence number), missed (the sequence number
# of a pending demand, -1 none), pin (the step whose demand pinned it), count / last (LFU,
# LFRU), g (Predicted's log count; -inf: never used, whose count exp(-inf) is 0), hint (pending predicted step, -1 none), nxt and
# cursor (NextUse: its next recorded use, at steps[cursor[k]] of steps[ptr[k]:ptr[k + 1]]).


@njit(cache=True)
def _fill_forecasts(ids_FLK, n_FL, E, buf):
    """buf[f, k] = the first step of a forward > f at which key k is used (inf: none),
    for f < F; buf[F] = inf."""
    F, L, _ = ids_FLK.shape
    buf[F, :] = INF
    for f in range(F - 1, -1, -1):
        buf[f, :] = buf[f + 1, :]
        if f + 1 < F:
            for m in range(L):
                for j in range(n_FL[f + 1, m]):
                    buf[f, m * E + ids_FLK[f + 1, m, j]] = (f + 1) * L + m


@njit(cache=True)
def _next_recorded(k, now, cursor, ptr, steps):
    """The first recorded use of k after step now (inf: none); cursors only move on."""
    c, end = cursor[k], ptr[k + 1]
    while c < end and steps[c] <= now:
        c += 1
    cursor[k] = c
    return steps[c] * 1.0 if c < end else INF


@njit(cache=True)
def _estimate(m, gk, now, L, layer_hint, per_step, decay):
    """Predicted._estimate for a key of layer m with log count gk (-inf: no use): the layer's
    next visit (one later when its prediction left the key out), stretched by the odds."""
    visit = now - now % L + m
    if visit <= now:
        visit += L
    if layer_hint[m] >= visit:
        visit += L
    p = min(1.0, math.exp(gk + now * per_step) * (1 - decay))  # (0.0 for -inf, as for None)
    return visit + L * (1 - p) / max(p, 1e-3)


@njit(cache=True)
def _next_use(code, k, now, L, E, g, hint, layer_hint, per_step, decay, foresight,
              nxt, cursor, ptr, steps, fc, ahead_FK, after_FK):  # fmt: skip
    """policy.next_use(k, now) (prefetch_worth's question): a step or inf; -1.0 for None."""
    if code <= _LFRU:
        return -1.0
    if code == _NEXT_USE:
        if nxt[k] <= now:
            nxt[k] = _next_recorded(k, now, cursor, ptr, steps)
        if foresight >= 0 and nxt[k] >= (now // L + foresight) * L:
            return INF
        return nxt[k]
    if hint[k] > now:
        return hint[k] * 1.0
    m = k // E
    if code == _REUSE and fc >= 0:
        v = ahead_FK[fc, k] if (fc + 1) * L + m > now else after_FK[fc, k]
        return max(v, now + 1.0)
    return _estimate(m, g[k], now, L, layer_hint, per_step, decay)


@njit(cache=True)
def _victim(code, p, now, members, size, pin, rec, count, last, g, hint, layer_hint,
            head_L, nxt, cursor, ptr, steps, layer_K, L, E, per_step, decay, foresight, fc,
            ahead_FK, after_FK):  # fmt: skip
    """ResidentSet.victim: the evictable (pin != now) entry of pool p with the highest
    policy.rank (-1: none). Each loop compares that rank's fields; Predicted (and Reuse before
    a forecast) ranks a layer's unpredicted keys in the order of their log counts, then
    recency (cache/predicted.py), so only each layer's head of that order is estimated."""
    best, b1, b2, b3 = -1, 0.0, 0.0, 0  # rank (b1, b2, -b3): b3 the recency
    n = size[p]
    if code == _LRU:  # (integer ranks: their own loops, several times faster)
        for i in range(n):
            c = members[p, i]
            if pin[c] != now and (best < 0 or rec[c] < b3):
                best, b3 = c, rec[c]
        return best
    if code == _LFU:
        for i in range(n):
            c = members[p, i]
            if pin[c] != now and (best < 0 or count[c] < b1 or (count[c] == b1 and rec[c] < b3)):
                best, b1, b3 = c, count[c], rec[c]
        return best
    if code != _PREDICTED and (code != _REUSE or fc >= 0):  # rank (first field, 0, -recency)
        sight = INF if foresight < 0 else (now // L + foresight) * L  # (NextUse)
        switch = now - (fc + 1) * L  # (Reuse) layers above it still read the first class
        for i in range(n):
            c = members[p, i]
            if pin[c] == now:
                continue
            if code == _LFRU:
                r1 = 0.0 if last[c] < 0 else -(count[c] / (now - last[c] + 1))
            elif code == _NEXT_USE:  # nxt: the next recorded use after the key's last use
                if nxt[c] <= now:  # used at this step, not yet touched: its next use after now
                    nxt[c] = _next_recorded(c, now, cursor, ptr, steps)
                r1 = nxt[c] if nxt[c] < sight else INF
            elif hint[c] > now:  # Reuse under a forecast: (next use, -inf, -recency)
                r1 = hint[c] * 1.0
            else:
                r1 = ahead_FK[fc, c] if layer_K[c] > switch else after_FK[fc, c]
                r1 = max(r1, now + 1.0)
            if best < 0 or r1 > b1 or (r1 == b1 and rec[c] < b3):
                best, b1, b3 = c, r1, rec[c]
        return best
    # Predicted (and Reuse before a forecast): hinted keys rank (hint, -inf, -recency); the
    # rest by layer heads
    b2 = -INF
    head_L[:] = -1
    for i in range(n):
        c = members[p, i]
        if pin[c] == now:
            continue
        if hint[c] > now:
            r1 = hint[c] * 1.0
            if best < 0 or r1 > b1 or (r1 == b1 and rec[c] < b3):
                best, b1, b3 = c, r1, rec[c]
            continue
        m = layer_K[c]
        h = head_L[m]
        if h < 0 or g[c] < g[h] or (g[c] == g[h] and rec[c] < rec[h]):  # (log count, recency)
            head_L[m] = c
    for m in range(L):
        c = head_L[m]
        if c < 0:
            continue
        r1 = _estimate(m, g[c], now, L, layer_hint, per_step, decay)
        r2 = -g[c]  # (inf for a key never used: -log_count.get(key, -inf))
        if best < 0 or r1 > b1 or (r1 == b1 and (r2 > b2 or (r2 == b2 and rec[c] < b3))):
            best, b1, b2, b3 = c, r1, r2, rec[c]
    return best


@njit(cache=True)
def _kernel(ids_FLK, n_FL, E, code, slots, per_layer, prefetch_next, decay, foresight,
            ptr, steps, ahead_FK, after_FK, step_P, key_P, outcome_P, victim_P):  # fmt: skip
    """`cache.replay.replay` of one policy; fills the placement arrays; (placements, misses,
    prefetches, evictions)."""
    F, L, K = ids_FLK.shape
    NK, n_pools = L * E, (L if per_layer else 1)
    caps = np.empty(n_pools, np.int64)
    for p in range(n_pools):
        caps[p] = slots // L + (1 if p < slots % L else 0) if per_layer else slots
    members = np.empty((n_pools, max(1, caps.max())), np.int64)
    size = np.zeros(n_pools, np.int64)
    pos, missed, pin = np.full(NK, -1), np.full(NK, -1), np.full(NK, -1)
    rec, count, last = np.zeros(NK, np.int64), np.zeros(NK, np.int64), np.full(NK, -1)
    g = np.full(NK, -INF)
    hint, layer_hint, head_L = np.full(NK, -1), np.full(L, -1), np.full(L, -1)
    cursor = ptr[:-1].copy()
    layer_K = np.arange(NK) // E
    nxt = np.full(NK, INF)  # NextUse: each key's next recorded use after its last use
    if code == _NEXT_USE:
        for k in range(NK):
            nxt[k] = _next_recorded(k, -1, cursor, ptr, steps)
    per_step = math.log(decay) / L
    hints = code == _PREDICTED or code == _REUSE
    seq = evictions = n = misses = prefetches = 0
    clock = fc = -1  # Predicted's latest step seen; the forward of the forecast in force
    for f in range(F):
        for m in range(L):
            now = f * L + m
            # NextLayerHints.before: hint and prefetch the next layer's experts
            f2, m2 = (f, m + 1) if m + 1 < L else (f + 1, 0)
            n_next = n_FL[f2, m2] if prefetch_next and f2 < F else 0
            for j in range(n_next):
                k = m2 * E + ids_FLK[f2, m2, j]
                when = now + 1
                if hints:  # Predicted.hint
                    old = hint[k]
                    if old < 0 or old <= clock or when < old:
                        hint[k] = when
                    layer_hint[m2] = max(when, layer_hint[m2])
                if pos[k] >= 0:
                    continue
                prefetches += 1
                step_P[n], key_P[n], outcome_P[n], victim_P[n] = now, k, 0, -1
                p = m2 if per_layer else 0
                v = -1
                if size[p] >= caps[p] and caps[p] > 0:
                    v = _victim(code, p, now, members, size, pin, rec, count, last, g,
                                hint, layer_hint, head_L, nxt, cursor, ptr, steps, layer_K, L,
                                E, per_step, decay, foresight, fc, ahead_FK,
                                after_FK)  # fmt: skip
                    if v < 0:  # (nothing is pinned before the step's demands)
                        outcome_P[n] = 2
                        n += 1
                        continue
                    theirs = _next_use(code, v, now, L, E, g, hint, layer_hint,
                                       per_step, decay, foresight, nxt, cursor, ptr,
                                       steps, fc, ahead_FK, after_FK)  # fmt: skip
                    if not (theirs < 0 or theirs > when):  # prefetch_worth: no
                        missed[k] = -1
                        outcome_P[n] = 1
                        n += 1
                        continue
                elif caps[p] == 0:
                    missed[k] = -1
                    outcome_P[n] = 1
                    n += 1
                    continue
                seq = _admit(k, v, p, seq, members, size, pos, missed, rec)
                evictions += v >= 0
                victim_P[n] = v
                n += 1
            # the step's demands, each pinned once used
            for j in range(n_FL[f, m]):
                k = m * E + ids_FLK[f, m, j]
                if code == _LFU or code == _LFRU:  # policy.touch
                    count[k] += 1
                    last[k] = now
                elif code == _NEXT_USE:
                    nxt[k] = _next_recorded(k, now, cursor, ptr, steps)
                elif hints:
                    if now > clock:
                        clock = now
                    c = math.exp(g[k] + now * per_step)  # (0.0 never used)
                    g[k] = math.log(c + 1.0) - now * per_step
                seq += 1
                if pos[k] >= 0:
                    rec[k] = seq
                    pin[k] = now
                    continue
                missed[k] = seq
                misses += 1
                step_P[n], key_P[n], outcome_P[n], victim_P[n] = now, k, 0, -1
                p = m if per_layer else 0
                if caps[p] == 0:
                    missed[k] = -1
                    outcome_P[n] = 1
                elif size[p] < caps[p]:
                    seq = _admit(k, -1, p, seq, members, size, pos, missed, rec)
                else:
                    v = _victim(code, p, now, members, size, pin, rec, count, last, g,
                                hint, layer_hint, head_L, nxt, cursor, ptr, steps, layer_K, L,
                                E, per_step, decay, foresight, fc, ahead_FK,
                                after_FK)  # fmt: skip
                    if v < 0:
                        outcome_P[n] = 2  # blocked: the demand stays pending
                    else:
                        seq = _admit(k, v, p, seq, members, size, pos, missed, rec)
                        evictions += 1
                        victim_P[n] = v
                n += 1
                pin[k] = now
        fc = f  # ExactForecast.after: the forecast made after forward f
    return n, misses, prefetches, evictions


@njit(cache=True)
def _admit(k, v, p, seq, members, size, pos, missed, rec):
    """Victim v (-1: none, there is room) leaves pool p; k takes a slot with the recency of
    its pending demand, else a new one (ResidentSet._add); returns the sequence counter."""
    if v >= 0:
        i, last = pos[v], size[p] - 1
        members[p, i] = members[p, last]
        pos[members[p, i]] = i
        pos[v] = -1
        size[p] = last
    s = missed[k]
    if s < 0:
        seq += 1
        s = seq
    missed[k] = -1
    rec[k] = s
    pos[k] = size[p]
    members[p, size[p]] = k
    size[p] += 1
    return seq
