"""The discrete-event run: a compute thread and a link, sharing the runtime's cache mechanism.

Usage (simulator.py builds the work and the resident set; one `EventRun` per simulated run):
    >>> from tensorbend.offload.policies import LRU
    >>> from tensorbend.offload.resident import ResidentSet
    >>> from tensorbend.simulate.link import Link
    >>> work = [ForwardWork(phase=1, tokens=1, layers=[LayerWork(demand=[(0, 1), (1, 1)])])]
    >>> run = EventRun(ResidentSet(0, 1, LRU()), Link(2.0, 0.0, 1, float("inf")),
    ...                times=Times(attn_s=lambda n: 1.0, expert_s=lambda n: 0.5,
    ...                            forward_s=lambda n: 0.0), scratch=2, unit_bytes=10)
    >>> run.run(work)
    >>> s = run.stats[1]; s.misses, s.stall_s, s.bytes_read, run.seconds[1]
    (2, 3.5, 20, 5.5)

Per forward: `forward_s` (dense layers, head), then per MoE layer g (step = forward * L + g):
predictions issued before attention (pre_attn), `attn_s`, the router (claims: hit if READY,
late if still loading, miss -> demand load, `miss_s` each; stale prefetches cancelled), predictions issued at
the router (dN, same_layer; `predict_s` each), then each expert computed (`expert_s` for the
tokens routed to it) as soon as it is READY; waiting for one is the stall. Claims, slots, pins,
bypass (staging `scratch` slots), victims and admission follow `offload.cache.ExpertCache`
with the same `offload.resident.ResidentSet` and policies, so the simulator and the runtime
pick the same victims; loads follow `offload.loader.Loader` over the link (link.py).
Counters are `offload.cache.CacheStats`, per phase (0 prefill, 1 decode).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tensorbend.offload.cache import CacheStats
from tensorbend.offload.policies import Key
from tensorbend.offload.resident import ResidentSet
from tensorbend.simulate.link import DEMAND, PREFETCH, Link, Request


@dataclass
class LayerWork:
    demand: list[tuple[int, int]]  # (expert, tokens routed to it), ascending expert id
    at_start: list[tuple[int, list[int]]] = field(
        default_factory=list
    )  # (target layer, ranked ids)
    at_router: list[tuple[int, list[int]]] = field(default_factory=list)
    forecast: tuple | None = None  # (forward, ahead_LE, after_first_LE) for policies.Reuse
    ahead: list[tuple[int, list[int]]] = field(default_factory=list)  # prefetched, not hinted


@dataclass
class ForwardWork:
    phase: int  # 0 prefill, 1 decode
    tokens: int
    layers: list[LayerWork]


@dataclass(frozen=True)
class Times:
    attn_s: Callable[[int], float]  # tokens -> seconds before the router
    expert_s: Callable[[int], float]  # tokens on the expert -> seconds
    forward_s: Callable[[int], float]  # tokens -> seconds outside the MoE layers
    predict_s: float = 0.0  # one prediction (one target layer)
    miss_s: float = 0.0  # compute-thread overhead of a demand miss


@dataclass
class _Entry:
    ready_at: float
    resident: bool
    pins: int = 0
    prefetched: bool = False
    used: bool = False


class EventRun:
    def __init__(
        self, resident: ResidentSet, link: Link, times: Times, scratch: int, unit_bytes: int
    ):
        self.rs, self.link, self.times = resident, link, times
        self.scratch_free, self.nbytes = scratch, unit_bytes
        self.entries: dict[Key, _Entry] = {}
        self.wanted: dict[Key, int] = {}
        self.done: list[tuple[float, Key]] = []  # loads in flight: (completion, key)
        self.total = CacheStats()
        self.stats = {0: CacheStats(), 1: CacheStats()}
        self.seconds = {0: 0.0, 1: 0.0}
        self.tokens = {0: 0, 1: 0}
        self.t, self.now = 0.0, 0

    def preload(self, keys: list[Key]) -> None:
        """Start with these experts resident and READY (policy resident: every expert)."""
        for key in keys:
            assert self.rs.place(key, 0).outcome == "admitted", "preload beyond capacity"
            self.entries[key] = _Entry(ready_at=0.0, resident=True)

    def run(self, work: list[ForwardWork]) -> None:
        L = self.L = len(work[0].layers) if work else 1
        for f, fw in enumerate(work):
            t0, before = self.t, self.total.copy()
            self.t += self.times.forward_s(fw.tokens)
            for g, lw in enumerate(fw.layers):
                self._layer(f * L + g, f * L, lw, fw.tokens)
            self.stats[fw.phase].add(self.total, before)
            self.seconds[fw.phase] += self.t - t0
            self.tokens[fw.phase] += fw.tokens
        self._advance(self.t)
        for e in self.entries.values():  # end of the run: prefetched, never used
            if e.prefetched and not e.used and e.ready_at <= self.t:
                self.total.prefetch_wasted += 1
                self.total.prefetch_wasted_bytes += self.nbytes

    # ------------------------------------------------------------ compute thread

    def _layer(self, step: int, base: int, lw: LayerWork, tokens: int) -> None:
        self._predict(lw.at_start)
        self.t += self.times.attn_s(tokens)
        self._advance(self.t)
        self.now = step
        for e, _ in lw.demand:
            self._claim((step - base, e))
        self.total.prefetch_cancelled += self.link.cancel_stale(step)
        if lw.forecast is not None:  # a cross-token forecast, as the runtime's last-layer hook
            self.rs.set_forecast(*lw.forecast)
            self._predict(lw.ahead, hint=False)
        self._predict(lw.at_router)
        pending = {(step - base, e): n for e, n in lw.demand}
        while pending:
            self._advance(self.t)
            ready = [k for k in pending if k in self.entries and self.entries[k].ready_at <= self.t]
            if not ready:
                nxt = min(
                    [self.entries[k].ready_at for k in pending if k in self.entries]
                    + [self._next_io()]
                )
                assert nxt > self.t and nxt < float("inf"), "simulated run is stuck"
                self.total.stall_s += nxt - self.t
                self.t = nxt
                continue
            for k in ready:
                self.t += self.times.expert_s(pending.pop(k))
                self._advance(self.t)
                self._release(k)

    def _predict(self, preds: list[tuple[int, list[int]]], hint: bool = True) -> None:
        """Hint each predicted (layer, expert) for its step and queue its prefetch, in rank order."""
        for when, ids in preds:
            self.t += self.times.predict_s
            for rank, e in enumerate(ids):
                key = (when % self.L, e)
                if hint:
                    self.rs.hint(key, when)
                if key not in self.link.queued and key not in self.entries:
                    self.link.push(PREFETCH, (when, rank), key, when, self.t)
                    self.total.prefetch_issued += 1

    def _claim(self, key: Key) -> None:
        self.rs.use(key, self.now)
        entry = self.entries.get(key)
        if entry is None:
            self.t += self.times.miss_s
            self.total.misses += 1
            self.wanted[key] = self.wanted.get(key, 0) + 1
            self.link.demand(key, self.t)
            return
        entry.pins += 1
        if entry.prefetched and not entry.used:
            self.total.prefetch_used += 1
        entry.used = True
        if entry.ready_at <= self.t:
            self.total.hits += 1
        else:
            self.total.late += 1

    def _release(self, key: Key) -> None:
        entry = self.entries[key]
        entry.pins -= 1
        if entry.pins == 0 and not entry.resident:
            del self.entries[key]
            self.scratch_free += 1
        self.link.retry_blocked(self.t, self._start)

    # ------------------------------------------------------------ I/O side

    def _advance(self, t: float) -> None:
        """Run the link up to time t, applying load completions in time order."""
        while True:
            first = min(self.done) if self.done else None
            c = first[0] if first else float("inf")
            if self.link.queued:
                self.link.advance(min(t, c), self._start)
            if c > t:
                return
            self.done.remove(first)
            self._finish(first[1], c)

    def _next_io(self) -> float:
        return min([self.link.next_free()] + [at for at, _ in self.done])

    def _start(self, req: Request, s: float) -> float | None:
        demand = req.kind == DEMAND
        if not demand and self.link.backlog(s) > self.link.max_backlog_s:
            self.total.prefetch_dropped += 1
            return s
        if req.key in self.entries:
            return s
        resident = self._reserve(req.key, demand, req.when, s)
        if resident is None:
            if demand:
                return None  # waits for a slot: retried at the next release or completion
            self.total.prefetch_dropped += 1
            return s
        pins = self.wanted.pop(req.key, 0)
        assert pins > 0 or not demand, f"demand load of unclaimed expert {req.key}"
        done = self.link.transfer(s)
        self.entries[req.key] = _Entry(done, resident, pins, prefetched=not demand, used=pins > 0)
        if pins and not demand:
            self.total.prefetch_used += 1
        self.total.peak_entries = max(self.total.peak_entries, len(self.rs))
        self.done.append((done, req.key))
        return done

    def _reserve(self, key: Key, demand: bool, when: float, s: float) -> bool | None:
        """True: a resident slot; False: a staging slot (bypass); None: no slot."""
        p = self.rs.place(key, self.now, None if demand else when, lambda k: self._evictable(k, s))
        if p.outcome == "admitted":
            if p.victim is not None:
                self._evict(p.victim)
            return True
        if p.outcome == "refused" and demand and self.scratch_free:
            self.total.bypassed += 1
            self.scratch_free -= 1
            return False
        return None

    def _evictable(self, key: Key, s: float) -> bool:
        e = self.entries[key]
        return e.ready_at <= s and e.pins == 0

    def _evict(self, key: Key) -> None:
        entry = self.entries.pop(key)
        self.total.evictions += 1
        if entry.prefetched and not entry.used:
            self.total.prefetch_wasted += 1
            self.total.prefetch_wasted_bytes += self.nbytes

    def _finish(self, key: Key, at: float) -> None:
        entry = self.entries.get(key)
        if entry is None:
            return
        self.total.bytes_read += self.nbytes
        if entry.prefetched:
            self.total.prefetch_loaded += 1
        else:
            self.total.demand_loads += 1
        self.link.retry_blocked(at, self._start)
