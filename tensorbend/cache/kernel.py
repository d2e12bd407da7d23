"""THE replay's kernel (numba): a whole routing trace through one cache policy, compiled.

Usage: through `cache.replay.replay`, which prepares the arguments (numpy) and imports this
module at its first call: numba loads only where a replay runs (never in serving).

It decides what `cache.victim_heap.IndexedResidentSet` decides online, event for event (the
test oracle: tests/test_replay.py replays planted and random traces through both): per
layer-step, the feed's exact hints and prefetches for the next layer (`Rules.hints`), then each
demand in turn, placed on a miss with the step's demands used before it pinned; after forward
f, the forecast made after f comes into force (`ReplayInput.ahead_FK`, `after_FK`). The state is
that of the Python policies, per key k = m * E + e: recency sequence numbers, counts and last
uses (LFU, LFRU), Predicted's log counts and hints, each key's next recorded use (Belady) and
its recent uses (frequency admission). A victim is the evictable entry of its pool with the
highest rank, compared field by field as `policy.rank` orders them, ties to the least recent:
  Belady (NEXT_USE)  the farthest next use within sight, then its `beyond` rule among those tied
  LRU, LFU, LFRU     (0 | -count | -count / (age + 1), -recency)
  PREDICTED          (hint or estimate, -inf | -log count, -recency); only the head of each
                     layer's (log count, recency) order is estimated (cache/predicted.py)
  REUSE              (hint or forecast next use, -inf, -recency); before a forecast, PREDICTED
"""

from __future__ import annotations

import math

from numba import njit

from tensorbend.cache.kernel_state import (
    ADMIT_FREQUENCY,
    ADMIT_PREDICTED,
    ADMITTED,
    BLOCKED,
    CLOCK,
    EVICTIONS,
    FORECAST,
    GOOD,
    INF,
    JUDGED,
    LFRU,
    LFU,
    LRU,
    NEXT_USE,
    NONE,
    PLACEMENTS,
    PREDICTED,
    PREFETCHES,
    REFUSED,
    REUSE,
    SEQ,
)


@njit(cache=True)
def run(rules, tr, st, out):
    """Every layer-step of the trace (module docstring); fills `out`."""
    F, L, _ = tr.ids_FLK.shape
    E = tr.num_experts
    st.seen[1, :] = tr.seen_ptr[:-1]
    st.used[1, :] = tr.used_ptr[:-1]
    record = out.step_P.shape[0] > 0
    for f in range(F):
        for m in range(L):
            now = f * L + m
            if rules.hints:  # the next layer's experts, hinted for now + 1 and prefetched
                f2, m2 = (f, m + 1) if m + 1 < L else (f + 1, 0)
                for j in range(tr.n_FL[f2, m2] if f2 < F else 0):
                    k = m2 * E + tr.ids_FLK[f2, m2, j]
                    _hint(k, now + 1, L, E, st)
                    if st.pos[k] == NONE:
                        out.tally[PREFETCHES] += 1
                        _place(k, now, now + 1, rules, tr, st, out, record)
            for j in range(tr.n_FL[f, m]):
                k = m * E + tr.ids_FLK[f, m, j]
                _touch(k, now, rules, st)
                st.tick[SEQ] += 1
                if st.pos[k] != NONE:
                    st.rec[k] = st.tick[SEQ]
                else:
                    st.missed[k] = st.tick[SEQ]
                    out.misses_F[f] += 1
                    _place(k, now, NONE, rules, tr, st, out, record)
                st.pin[k] = now
        if tr.ahead_FK.shape[0] > 0:
            st.tick[FORECAST] = f


@njit(cache=True)
def _touch(k, now, rules, st):
    """A demand use of k at step now, as the policy and the admission rule hear it."""
    st.count[k] += 1
    st.last[k] = now
    if now > st.tick[CLOCK]:
        st.tick[CLOCK] = now
    if rules.log_counts:  # Predicted.touch: the decayed count, as a log referred to step 0
        per_step = math.log(rules.decay) / st.layer_hint.shape[0]
        c = math.exp(st.g[k] + now * per_step)  # (0.0 never used)
        st.g[k] = math.log(c + 1.0) - now * per_step
    if rules.admit == ADMIT_FREQUENCY or rules.fallback == ADMIT_FREQUENCY:
        st.uses_KW[k, st.count[k] % st.uses_KW.shape[1]] = now


@njit(cache=True)
def _hint(k, when, L, E, st):
    """Predicted.hint: the earliest pending prediction; the layer's latest predicted step."""
    old = st.hint[k]
    if old == NONE or old <= st.tick[CLOCK] or when < old:
        st.hint[k] = when
    m = k // E
    st.layer_hint[m] = max(when, st.layer_hint[m])


@njit(cache=True)
def _place(k, now, when, rules, tr, st, out, record):
    """ResidentSet.place: a demand miss (when NONE) or a prefetch for step `when`."""
    n = out.tally[PLACEMENTS]
    out.tally[PLACEMENTS] += 1
    outcome, v = ADMITTED, NONE
    p = k // tr.num_experts if rules.per_layer else 0
    if st.size[p] < st.caps[p]:
        _admit(k, NONE, p, st)
    elif st.caps[p] == 0:
        outcome = REFUSED
    else:
        best = _farthest(p, now, tr, st) if rules.judge and when == NONE else -1.0
        v = _victim(p, now, rules, tr, st)
        if v == NONE:
            outcome = BLOCKED
        elif not (
            _admits(k, v, now, rules, tr, st)
            if when == NONE
            else _worth(v, when, now, rules, tr, st)
        ):
            outcome, v = REFUSED, NONE
        else:
            _admit(k, v, p, st)
            out.tally[EVICTIONS] += 1
            if best >= 0:
                out.tally[JUDGED] += 1
                out.tally[GOOD] += int(
                    _advance(v, now, st.used, tr.used_ptr, tr.used_steps) >= best
                )
    if outcome == REFUSED:
        st.missed[k] = NONE
    if record:
        out.step_P[n], out.key_P[n], out.outcome_P[n], out.victim_P[n] = now, k, outcome, v


@njit(cache=True)
def _admit(k, v, p, st):
    """Victim v (NONE: there was room) leaves pool p; k takes a slot with the recency of its
    pending demand, else a new one (ResidentSet._add)."""
    if v != NONE:
        i, last = st.pos[v], st.size[p] - 1
        st.members[p, i] = st.members[p, last]
        st.pos[st.members[p, i]] = i
        st.pos[v] = NONE
        st.size[p] = last
    s = st.missed[k]
    if s == NONE:
        st.tick[SEQ] += 1
        s = st.tick[SEQ]
    st.missed[k] = NONE
    st.rec[k] = s
    st.pos[k] = st.size[p]
    st.members[p, st.size[p]] = k
    st.size[p] += 1


@njit(cache=True)
def _admits(k, v, now, rules, tr, st):
    """The admission rule (cache/admission.py): may demand k take victim v's slot?"""
    rule = rules.admit
    if rule == ADMIT_PREDICTED:
        mine, theirs = _next_use(k, now, rules, tr, st), _next_use(v, now, rules, tr, st)
        if not (mine == INF and theirs == INF and rules.fallback != NONE):
            return mine <= theirs
        rule = rules.fallback
    if rule == ADMIT_FREQUENCY:
        return _recent_uses(k, now, rules, st) > _recent_uses(v, now, rules, st)
    return True


@njit(cache=True)
def _worth(v, when, now, rules, tr, st):
    """admission.prefetch_worth: v's next use is after `when` (or the rule has none)."""
    theirs = _next_use(v, now, rules, tr, st)
    return theirs < 0 or theirs > when


@njit(cache=True)
def _recent_uses(k, now, rules, st):
    """AdmitFrequent.count: k's uses at steps > now - window (forwards) * L."""
    low, n = now - rules.window * st.layer_hint.shape[0], 0
    for s in st.uses_KW[k]:
        n += s > low
    return n


@njit(cache=True)
def _next_use(k, now, rules, tr, st):
    """policy.next_use(k, now): a step or INF; -1.0 for a rule without one (LRU, LFU, LFRU)."""
    L, E = st.layer_hint.shape[0], tr.num_experts
    if rules.evict == NEXT_USE:
        s = _advance(k, now, st.seen, tr.seen_ptr, tr.seen_steps)
        return INF if s >= _sight(now, L, rules.foresight) else s
    if rules.evict < PREDICTED:
        return -1.0
    if st.hint[k] > now:
        return st.hint[k] * 1.0
    f = st.tick[FORECAST]
    if rules.evict == REUSE and f != NONE:
        return _forecast(f, k // E, now, L, tr.ahead_FK[f, k], tr.after_FK[f, k])
    return _estimate(k // E, st.g[k], now, L, st.layer_hint[k // E], rules.decay)


# The per-entry helpers below take scalars, and the loops over a pool read the state's
# arrays directly: an array passed to a function costs a reference count (~15 ns), and a
# NamedTuple of them one per array, against ~1 ns for the entry's own work.


@njit(cache=True)
def _advance(k, now, nxt, ptr, steps):
    """The first step after now of k's in steps[ptr[k]:ptr[k + 1]] (INF: none), kept in
    nxt[0, k]; its cursor nxt[1, k] only moves on (time never goes back)."""
    if nxt[0, k] <= now:
        c, end = int(nxt[1, k]), ptr[k + 1]
        while c < end and steps[c] <= now:
            c += 1
        nxt[1, k] = c
        nxt[0, k] = steps[c] * 1.0 if c < end else INF
    return nxt[0, k]


@njit(cache=True)
def _sight(now, L, foresight):
    """The first step Belady with `foresight` forwards cannot see (INF: the whole trace)."""
    return INF if foresight == NONE else (now // L + foresight) * L * 1.0


@njit(cache=True)
def _forecast(f, m, now, L, ahead, after):
    """Reuse.next_use without a hint under the forecast made after forward f (`ahead`, or
    `after` once layer m of forward f + 1 has passed): never before now + 1."""
    return max(ahead if (f + 1) * L + m > now else after, now + 1.0)


@njit(cache=True)
def _estimate(m, gk, now, L, layer_hint, decay):
    """Predicted._estimate for a key of layer m with log count gk: its layer's next visit (one
    later when the prediction for it left the key out), stretched by the odds against use."""
    visit = now - now % L + m
    if visit <= now:
        visit += L
    if layer_hint >= visit:
        visit += L
    p = min(1.0, math.exp(gk + now * math.log(decay) / L) * (1 - decay))
    return visit + L * (1 - p) / max(p, 1e-3)


@njit(cache=True)
def _ranks_above(a, b, rec, best_a, best_b, best_rec):
    """(a, b, -rec) > (best_a, best_b, -best_rec)."""
    return a > best_a or (a == best_a and (b > best_b or (b == best_b and rec < best_rec)))


@njit(cache=True)
def _victim(p, now, rules, tr, st):
    """The evictable (not pinned at now) entry of pool p with the highest rank (NONE: none):
    Belady's next use first, then the rule's (a, b, -recency) among the entries tied there."""
    members, pin, rec, g, hint, seen = st.members, st.pin, st.rec, st.g, st.hint, st.seen
    L, E, n = st.layer_hint.shape[0], tr.num_experts, st.size[p]
    rule, belady, top = rules.evict, rules.evict == NEXT_USE, -1.0  # top: the farthest use
    sight = _sight(now, L, rules.foresight)
    if belady:
        rule = rules.beyond
        for i in range(n):
            c = members[p, i]
            if pin[c] != now:
                s = (
                    seen[0, c]
                    if seen[0, c] > now
                    else _advance(c, now, seen, tr.seen_ptr, tr.seen_steps)
                )
                top = max(top, s if s < sight else INF)
    f = st.tick[FORECAST]
    forecast = rule == REUSE and f != NONE
    if rule == REUSE and not forecast:
        rule = PREDICTED
    best, b_a, b_b, b_rec = NONE, 0.0, 0.0, 0
    head_L = st.head_L
    for i in range(n):
        c = members[p, i]
        if pin[c] == now or (belady and (seen[0, c] if seen[0, c] < sight else INF) != top):
            continue  # (pinned, or Belady ranks it below the top)
        b = -INF
        if rule == LRU:
            a = 0.0
        elif rule == LFU:
            a = -st.count[c] * 1.0
        elif rule == LFRU:
            a = 0.0 if st.last[c] == NONE else -(st.count[c] / (now - st.last[c] + 1))
        elif hint[c] > now:  # PREDICTED or REUSE: a predicted step
            a = hint[c] * 1.0
        elif forecast:
            a = _forecast(f, c // E, now, L, tr.ahead_FK[f, c], tr.after_FK[f, c])
        else:  # PREDICTED: only the head of its layer's order (log count, recency) competes
            m = c // E
            h = head_L[m]
            if h == NONE or g[c] < g[h] or (g[c] == g[h] and rec[c] < rec[h]):
                head_L[m] = c
            continue
        if best == NONE or _ranks_above(a, b, rec[c], b_a, b_b, b_rec):
            best, b_a, b_b, b_rec = c, a, b, rec[c]
    if rule == PREDICTED:
        for m in range(L):
            c = head_L[m]
            if c == NONE:
                continue
            head_L[m] = NONE
            a, b = _estimate(m, g[c], now, L, st.layer_hint[m], rules.decay), -g[c]
            if best == NONE or _ranks_above(a, b, rec[c], b_a, b_b, b_rec):
                best, b_a, b_b, b_rec = c, a, b, rec[c]
    return best


@njit(cache=True)
def _farthest(p, now, tr, st):
    """The judge: the farthest demand after now among pool p's evictable entries, the victim
    Belady would pick (-1.0: nothing evictable)."""
    best, used = -1.0, st.used
    for i in range(st.size[p]):
        c = st.members[p, i]
        if st.pin[c] != now:
            s = (
                used[0, c]
                if used[0, c] > now
                else _advance(c, now, used, tr.used_ptr, tr.used_steps)
            )
            best = max(best, s)
    return best
