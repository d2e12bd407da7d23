"""Predictions -> prioritised, cancellable expert loads, issued from hooks inside the forward pass.

Usage (the runtime does this per policy run):
    >>> loader = Loader(store, cache, threads=2)            # I/O threads, demand before prefetch
    >>> hooks = PredictionHooks(model, spec, predictor, loader, cache, clock, history)
    >>> with hooks:
    ...     model(input_ids)      # each source point scores its target layer and queues prefetches
    >>> loader.close()

Source points follow the predictor's lookahead (see predictors/base.py): for dN the router
forward hook of MoE layer s has gate_input[s] and ids[s] and predicts target s + N; for
`pre_attn` a forward pre-hook on the decoder layer of MoE layer m has layer_input[m] (and
ids[m-1] of the same token); `same_layer` predicts m at its own router (zero lead time).
`prev_ids_TK` are the previous forward's last-token experts at the target layer.

A batch-1 decode prediction queues the top-(K + extra) experts, priority = rank. A prefill
prediction queues the union of every token's top-K, most-voted first. Every predicted expert
is also hinted to the cache (`NextUse` keeps it). Queued prefetches whose target layer has
started are cancelled (`cancel_stale`); a needed one is upgraded to a demand load instead.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass, field

import torch

from tensorbend.models import RoutingSpec, decoder_layers, router_module, router_outputs
from tensorbend.offload.cache import ExpertCache
from tensorbend.offload.policies import INF, Key
from tensorbend.offload.store import ExpertStore
from tensorbend.predictors.base import Lookahead, SourceBatch, multi_hot

DEMAND, PREFETCH = 0, 1


@dataclass
class StepClock:
    """Logical time: step = forward * L + m, counted over the whole run (all prompts)."""

    num_layers: int
    forward: int = -1

    def begin_forward(self) -> None:
        self.forward += 1

    def step(self, m: int) -> int:
        return self.forward * self.num_layers + m


@dataclass
class RoutingHistory:
    """Routing seen so far: this forward's ids per layer, and the previous token's."""

    num_layers: int
    cur: dict[int, torch.Tensor] = field(default_factory=dict)  # m -> [T, K]
    prev: dict[int, torch.Tensor] = field(default_factory=dict)  # m -> [K] (last token)

    def begin_prompt(self) -> None:
        self.cur.clear()
        self.prev.clear()

    def begin_forward(self) -> None:
        self.prev.update({m: ids_TK[-1] for m, ids_TK in self.cur.items()})
        self.cur.clear()


class RecordedRouting:
    """The oracle: routing recorded from the resident run, replayed as perfect predictions.

    `ids_per_forward[f]` is [T, L, K] for forward f of the run; scores are its multi-hot.
    """

    kind = "oracle"

    def __init__(
        self,
        ids_per_forward: list[torch.Tensor],
        lookahead: Lookahead,
        clock: StepClock,
        num_experts: int,
    ):
        self.ids_per_forward, self.lookahead, self.clock = ids_per_forward, lookahead, clock
        self.num_experts = num_experts

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        ids_TLK = self.ids_per_forward[self.clock.forward]
        return multi_hot(ids_TLK[:, m], self.num_experts)

    def num_params(self) -> int:
        return 0

    def steps_by_key(self) -> dict[Key, list[int]]:
        """Sorted steps at which each (m, e) is used: Belady's future knowledge."""
        out: dict[Key, list[int]] = {}
        for f, ids_TLK in enumerate(self.ids_per_forward):
            L = ids_TLK.shape[1]
            for m in range(L):
                for e in sorted(set(ids_TLK[:, m].flatten().tolist())):
                    out.setdefault((m, e), []).append(f * L + m)
        return out


class NoPredictor:
    """Predicts nothing (scores -inf): `prefetch` with it isolates the `Predicted` eviction."""

    kind = "none"

    def __init__(self, num_experts: int, lookahead: Lookahead):
        self.num_experts, self.lookahead = num_experts, lookahead

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        return torch.full((len(src), self.num_experts), -INF)

    def num_params(self) -> int:
        return 0


class Loader:
    """I/O threads serving one priority queue: demand loads first, then prefetches by rank."""

    def __init__(
        self, store: ExpertStore, cache: ExpertCache, threads: int = 2, max_backlog_s: float = INF
    ):
        self.store, self.cache = store, cache
        self.max_backlog_s = max_backlog_s  # start a prefetch only if the link frees up by then
        self._heap: list[list] = []  # [kind, priority, seq, key, when, alive]
        self._queued: dict[Key, list] = {}
        self._seq = 0
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, daemon=True, name=f"tb-io-{i}")
            for i in range(threads)
        ]
        self._cuda = cache.device.type == "cuda"
        self._stream = torch.cuda.Stream(cache.device) if self._cuda else None
        self._local = threading.local()
        for t in self._threads:
            t.start()

    def demand(self, key: Key) -> None:
        with self._cond:
            req = self._queued.get(key)
            if req is not None and req[0] == DEMAND:
                return
            if req is not None:
                req[5] = False  # upgraded: the demand below replaces it
            self._push(DEMAND, 0, key, INF)

    def prefetch(self, key: Key, priority: float, when: int) -> bool:
        with self._cond:
            if key in self._queued or key in self.cache.entries:
                return False
            self._push(PREFETCH, priority, key, when)
            self.cache.stats.prefetch_issued += 1
            return True

    def cancel_stale(self, now: int) -> None:
        """Drop queued prefetches for layers that have started (their use is now or past)."""
        with self._cond:
            for req in self._heap:
                if req[5] and req[0] == PREFETCH and req[4] <= now:
                    req[5] = False
                    self._queued.pop(req[3], None)
                    self.cache.stats.prefetch_cancelled += 1

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.cache.abort()  # an I/O thread waiting for a slot must not outlive the run
        for t in self._threads:
            t.join()

    def _push(self, kind: int, priority: float, key: Key, when: float) -> None:
        self._seq += 1
        req = [kind, priority, self._seq, key, when, True]
        heapq.heappush(self._heap, req)
        self._queued[key] = req
        self._cond.notify()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._heap:
                    self._cond.wait()
                if self._closed:
                    return
                kind, _, _, key, when, alive = heapq.heappop(self._heap)
                if not alive:
                    continue
                self._queued.pop(key, None)
            demand = kind == DEMAND
            if not demand and self.store.backlog_s() > self.max_backlog_s:
                self.cache.stats.prefetch_dropped += 1  # the link is busy: demand loads come first
                continue
            try:
                slot = self.cache.start_load(key, demand=demand, block=demand, when=when)
                if slot is None:
                    continue
                nbytes = self._read(key, self.cache.buffer(slot))
                self.cache.finish_load(key, nbytes)
            except BaseException as e:  # noqa: BLE001 - handed to the compute thread, re-raised there
                self.cache.fail_load(key, e)

    def _read(self, key: Key, slot_flat: torch.Tensor) -> int:
        m, e = key
        if not self._cuda:
            return self.store.read_into(m, e, slot_flat)
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = torch.empty_like(slot_flat, device="cpu").pin_memory()
        nbytes = self.store.read_into(m, e, staging)
        with torch.cuda.stream(self._stream):
            slot_flat.copy_(staging, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()
        return nbytes


class PredictionHooks:
    """Forward hooks that record routing and turn predictions into prefetches and cache hints."""

    def __init__(
        self,
        model,
        spec: RoutingSpec,
        predictor,
        loader: Loader | None,
        cache: ExpertCache,
        clock: StepClock,
        history: RoutingHistory,
        extra: int = 0,
        on_route=None,
    ):
        self.model, self.spec, self.predictor = model, spec, predictor
        self.loader, self.cache, self.clock, self.history = loader, cache, clock, history
        self.extra = extra
        self.on_route = on_route  # (s, ids_TK) -> None, called first in layer s's router hook
        self.la: Lookahead | None = predictor.lookahead if predictor is not None else None
        self._handles: list = []

    def __enter__(self) -> PredictionHooks:
        spec = self.spec
        for s in range(spec.num_moe_layers):
            self._handles.append(
                router_module(self.model, spec, s).register_forward_hook(self._router_hook(s))
            )
        if self.la is not None and self.la.hidden == "layer_input":
            layers = decoder_layers(self.model)
            for m, lid in enumerate(spec.moe_layer_ids):
                self._handles.append(
                    layers[lid].register_forward_pre_hook(self._layer_hook(m), with_kwargs=True)
                )
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _router_hook(self, s: int):
        def hook(module, args, output):
            _, _, ids_TK = router_outputs(self.spec, output)
            if self.on_route is not None:
                self.on_route(s, ids_TK)  # demand loads of layer s before any prefetch
            self.history.cur[s] = ids_TK.detach().reshape(-1, ids_TK.shape[-1]).cpu()
            la = self.la
            if la is None or la.hidden != "gate_input":
                return
            m = s + la.distance
            if m < self.spec.num_moe_layers:
                hidden_TD = args[0].detach().reshape(-1, self.spec.hidden_size)
                self._predict(m, hidden_TD, self.history.cur[s], s)

        return hook

    def _layer_hook(self, m: int):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            src = self.history.cur.get(m - 1) if m >= 1 else None
            self._predict(
                m, h.detach().reshape(-1, self.spec.hidden_size), src, m - 1 if m >= 1 else -1
            )

        return hook

    def _predict(self, m: int, hidden_TD: torch.Tensor, src_ids_TK, src_layer: int) -> None:
        T, K = hidden_TD.shape[0], self.spec.top_k
        prev = self.history.prev.get(m)
        has_prev_T = torch.full((T,), prev is not None, dtype=torch.bool)
        prev_TK = prev.expand(T, K) if prev is not None else torch.zeros(T, K, dtype=torch.long)
        src = SourceBatch(hidden_TD.float().cpu(), src_ids_TK, prev_TK, has_prev_T, src_layer)
        with torch.no_grad():
            scores_TE = self.predictor.scores(m, src).float()
        when = self.clock.step(m)
        E = scores_TE.shape[1]
        if T == 1:
            top = scores_TE[0].topk(min(K + self.extra, E))
            ids = top.indices[top.values > -INF].tolist()  # -inf: "no prediction"
        else:
            top = scores_TE.topk(K, dim=1)
            votes_E = torch.bincount(top.indices[top.values > -INF], minlength=E)
            order = torch.argsort(votes_E, descending=True, stable=True)
            ids = order[: int((votes_E > 0).sum())].tolist()
        for rank, e in enumerate(ids):
            self.cache.hint((m, e), when)
            if self.loader is not None:
                self.loader.prefetch((m, e), rank, when)
