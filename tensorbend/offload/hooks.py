"""The runtime's prediction hooks: router hooks -> the engine-neutral Prefetcher -> loads + hints.

Usage (the session does this per policy run):
    hooks = PredictionHooks(model, spec, clock, history, predictor, loader, cache,
                            on_route=claim_layer, horizon=horizon)
    with hooks:
        model(input_ids)     # each source point asks the Prefetcher and queues its answer

Hooks go through `models.RouterHooks`. At MoE layer s's router the layer's own demand loads
are queued first (`on_route`), then `prefetch.Prefetcher.observe` (the same API an engine
calls) names the predictions: every one is queued as a prefetch in rank order and,
when it is a within-token prediction (`hint`), hinted to the cache (a call's hints before its
prefetches); a horizon's forecast goes to the cache's `Reuse` policy. The runtime's Recorder advances the shared clock and routing
history, so the Prefetcher's inputs are exactly those `sources_from_rows` builds offline
(tested).

Whether prediction overlapped I/O: each MoE layer `settle`s the decode predictions made
since the previous one; those followed by a wait for an expert load in the layer overlapped
it, the others count as exposed (`decode_exposed_s`: the compute thread had nothing to wait
for). Overlap is not the same as free here: the I/O threads need the GIL to complete a load,
so a prediction running in Python while a load lands still delays it (docs/results/headline_deep.md:
d1's prediction is mostly overlapped, yet its runs are slower than `prefetch:none`'s).
"""

from __future__ import annotations

import time

import torch

from tensorbend.models import RouterCall, RouterHooks, RoutingSpec
from tensorbend.predictors.base import Lookahead, SourceBatch
from tensorbend.predictors.prefetch import INF, Prediction, Prefetcher, RoutingHistory, StepClock

__all__ = ["NoPredictor", "PredictionHooks", "RoutingHistory", "StepClock"]


class NoPredictor:
    """Predicts nothing (scores -inf): `prefetch` with it isolates the `Predicted` eviction.
    It declares so (`predicts_nothing`): the Prefetcher never asks it, so a run with it pays
    only for the routing history, as a cache without prediction does."""

    kind = "none"
    needs_truth = False
    recorded_routing = False
    predicts_nothing = True
    checkpoint = None

    def __init__(self, num_experts: int, lookahead: Lookahead):
        self.num_experts, self.lookahead = num_experts, lookahead

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        return torch.full((len(src), self.num_experts), -INF)

    def num_params(self) -> int:
        return 0


class PredictionHooks:
    """Record routing; turn the Prefetcher's predictions into prefetches and cache hints."""

    def __init__(
        self,
        model,
        spec: RoutingSpec,
        clock: StepClock,
        history: RoutingHistory,
        predictor=None,
        loader=None,
        cache=None,
        extra: int = 0,
        on_route=None,
        horizon=None,
        token_ahead_layers: int = 0,
    ):
        self.loader, self.cache = loader, cache
        self.on_route = on_route  # (m, ids_TK): layer m's demand loads, before any prefetch
        self.prefetcher = Prefetcher(
            spec, predictor, horizon, extra, token_ahead_layers, clock=clock, history=history
        )
        self.observed: list | None = None  # (inputs, predictions) per call, when recording
        self.predict_s = 0.0  # wall seconds inside the Prefetcher and queueing, this run
        self.predict_calls = 0  # hook calls that predicted (one per source point and forward)
        self.phase = "decode"  # of the forward running (set by whoever runs forwards)
        self.decode_predict_s = 0.0  # the part of predict_s spent in decode forwards
        self.decode_predict_calls = 0  # the part of predict_calls made in decode forwards
        self.queue_s = 0.0  # the part of predict_s spent handing forecasts, hints, prefetches over
        self.decode_exposed_s = 0.0  # the part of decode_predict_s no load wait followed (`settle`)
        self.decode_score_s = 0.0  # the part of decode_predict_s scoring (`Prefetcher.score_s`)
        self.decode_queue_s = 0.0  # the part of decode_predict_s in queue_s
        self._unsettled = 0.0  # decode prediction seconds since the last MoE layer settled
        layer_input = self.prefetcher.wants_layer_input
        self._hooks = RouterHooks(
            model,
            spec,
            on_route=self._route,
            on_layer_input=self._layer_input if layer_input else None,
        )

    def __enter__(self) -> PredictionHooks:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _route(self, call: RouterCall) -> None:
        if self.on_route is not None:
            self.on_route(call.m, call.ids_TK)
        self._issue(call.m, call.gate_input_TD(), call.ids_TK)

    def _layer_input(self, m: int, hidden: torch.Tensor) -> None:
        self._issue(m, hidden, None)

    def _issue(self, m: int, hidden, ids_TK) -> None:
        pf = self.prefetcher
        score0, queue0 = pf.score_s, self.queue_s
        t0 = time.perf_counter()
        try:
            self._predict(m, hidden, ids_TK)
        finally:
            dt = time.perf_counter() - t0
            self.predict_s += dt
            if self.phase == "decode":
                self.decode_predict_s += dt
                self.decode_score_s += pf.score_s - score0
                self.decode_queue_s += self.queue_s - queue0
                self.decode_predict_calls += 1
                self._unsettled += dt
            self.predict_calls += 1

    def settle(self, waited: bool) -> None:
        """MoE layer m's experts ran (`layer.OffloadedExperts`); `waited`: the compute thread
        waited for an expert load after the predictions made since layer m - 1's experts
        (at m's router, before its attention). With a wait they overlapped that load (had the
        load kept its own pace, it and not they set when the layer ended); without one they
        are exposed, counted whole (an upper bound: a load may have landed while they ran).
        """
        if not waited:
            self.decode_exposed_s += self._unsettled
        self._unsettled = 0.0

    def reset_counters(self) -> None:
        self.predict_s = self.decode_predict_s = self.queue_s = self.decode_exposed_s = 0.0
        self.decode_score_s = self.decode_queue_s = 0.0
        self._unsettled = 0.0
        self.predict_calls = self.decode_predict_calls = 0

    def _predict(self, m: int, hidden, ids_TK) -> None:
        pf = self.prefetcher
        before = pf.forecast  # (observe rolls no history, the Recorder does: `first` holds)
        first = self.observed is not None and not pf.history.prev
        preds = pf.observe(m, hidden_TD=hidden, routed_ids_TK=ids_TK)
        if self.observed is not None:  # tests: replay these through a standalone Prefetcher
            inputs = (
                m,
                hidden.detach().cpu().clone(),
                None if ids_TK is None else ids_TK.detach().cpu().clone(),
            )
            self.observed.append((inputs, preds, (pf.clock.forward, first, pf.forecast)))
        t0 = time.perf_counter()
        if pf.forecast is not before and self.cache is not None:
            self.cache.set_forecast(*pf.forecast)
        if preds:
            self._queue(preds)
        self.queue_s += time.perf_counter() - t0

    def _queue(self, preds: list[Prediction]) -> None:
        """The call's hints, then its prefetches in rank order: one lock round-trip each (a
        few us apiece otherwise, per prediction). Hints first, as in the simulator, whose I/O
        starts only after the whole call: a load started for one prediction never evicts
        another of the same call for want of its hint."""
        if self.cache is not None:
            hints = [((p.layer, p.expert), p.step) for p in preds if p.hint]
            if hints:
                self.cache.hint_many(hints)
        if self.loader is not None:
            self.loader.prefetch_many([((p.layer, p.expert), p.rank, p.step) for p in preds])
