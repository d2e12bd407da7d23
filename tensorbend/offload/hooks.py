"""Predictions issued from inside the forward pass: router hooks -> predictor -> prefetches + hints.

Usage (the session does this per policy run):
    hooks = PredictionHooks(model, spec, clock, history, predictor, loader, cache,
                                on_route=claim_layer)
    with hooks:
            model(input_ids)     # each source point scores its target layer and queues prefetches

Shape legend: T tokens of the forward, K top-k, E experts, D hidden size.

Hooks go through `models.RouterHooks`. At MoE layer s's router the layer's own demand loads
are queued first (`on_route`), then its routing is recorded (`RoutingHistory`), then the
predictor's source points fire, building exactly the `SourceBatch` that
`predictors.base.sources_from_rows` builds offline from a trace (tested):
  dN          at router s: gate_input[s], ids[s], target m = s + N
  same_layer  at router m: gate_input[m], ids[m-1] (zero lead time)
  pre_attn    at decoder layer m's input: layer_input[m], ids[m-1]
`prev_ids_TK` are the previous forward's last-token experts at the target layer (none in a
prompt's prefill). A batch-1 decode prediction queues the top-(K + extra) experts, priority =
rank; a prefill prediction queues the union of every token's top-K, most-voted first. Every
predicted expert is also hinted to the cache (`Predicted` eviction keeps it).

A predictor with `ahead(now) -> [(key, step), ...]` (the oracle, and later a cross-token
"horizon" predictor) is asked at its source points instead (now = the source's step) and may
name keys of any later step, also in the next forward (at the last layers, the next token's
first layers): the loader and the cache treat every prediction by its step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tensorbend.models import RouterCall, RouterHooks, RoutingSpec
from tensorbend.offload.policies import INF, Key
from tensorbend.predictors.base import Lookahead, SourceBatch
from tensorbend.predictors.horizon_fast import FastHorizon


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
    """Routing seen so far: this forward's ids per layer, and the previous forward's last token's."""

    num_layers: int
    cur: dict[int, torch.Tensor] = field(default_factory=dict)  # m -> ids_TK (CPU)
    prev: dict[int, torch.Tensor] = field(default_factory=dict)  # m -> ids_K (last token)

    def begin_prompt(self) -> None:
        self.cur.clear()
        self.prev.clear()

    def begin_forward(self) -> None:
        self.prev.update({m: ids_TK[-1] for m, ids_TK in self.cur.items()})
        self.cur.clear()

    def ids_TLK(self) -> torch.Tensor:
        """This forward's routing, [T, L, K]."""
        return torch.stack([self.cur[m] for m in range(self.num_layers)], dim=1)


class NoPredictor:
    """Predicts nothing (scores -inf): `prefetch` with it isolates the `Predicted` eviction."""

    kind = "none"

    def __init__(self, num_experts: int, lookahead: Lookahead):
        self.num_experts, self.lookahead = num_experts, lookahead

    def scores(self, m: int, src: SourceBatch) -> torch.Tensor:
        return torch.full((len(src), self.num_experts), -INF)

    def num_params(self) -> int:
        return 0


class PredictionHooks:
    """Record routing; turn predictions into prefetches and cache hints (loader/cache optional)."""

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
        self.spec, self.clock, self.history = spec, clock, history
        self.predictor, self.loader, self.cache, self.extra = predictor, loader, cache, extra
        self.token_ahead_layers = token_ahead_layers
        self.horizon = None if horizon is None else FastHorizon(horizon)  # numpy per-forward path
        self._state = None  # the horizon's per-request history
        self.on_route = on_route  # (m, ids_TK): layer m's demand loads, before any prefetch
        self.la: Lookahead | None = getattr(predictor, "lookahead", None)
        self.ahead = getattr(predictor, "ahead", None)
        layer_input = self.la is not None and self.la.hidden == "layer_input"
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
        s = call.m
        if self.on_route is not None:
            self.on_route(s, call.ids_TK)
        self.history.cur[s] = call.ids_TK.detach().reshape(-1, call.ids_TK.shape[-1]).cpu()
        if self.horizon is not None and s == self.spec.num_moe_layers - 1:
            self._foresee(call.gate_input_TD()[-1])
        la = self.la
        if la is None or la.hidden != "gate_input":
            return
        if self.ahead is not None:
            self._issue(self.ahead(self.clock.step(s)))
        elif s + la.distance < self.spec.num_moe_layers:
            self._predict(s + la.distance, call.gate_input_TD())

    def _layer_input(self, m: int, hidden: torch.Tensor) -> None:
        if self.ahead is not None:
            self._issue(self.ahead(self.clock.step(m)))
        else:
            self._predict(m, hidden.reshape(-1, self.spec.hidden_size))

    def _predict(self, m: int, hidden_TD: torch.Tensor) -> None:
        """Score target layer m from its source point, as sources_from_rows does offline."""
        T, K = hidden_TD.shape[0], self.spec.top_k
        route_layer = m - max(self.la.distance, 1)  # latest layer routed before the source
        src_ids_TK = self.history.cur[route_layer] if route_layer >= 0 else None
        prev = self.history.prev.get(m)
        has_prev_T = torch.full((T,), prev is not None, dtype=torch.bool)
        prev_TK = prev.expand(T, K) if prev is not None else torch.zeros(T, K, dtype=torch.long)
        if self.la.prev_in_pass and T > 1:  # same_layer: layer m routed every token already
            prev_TK = torch.cat([prev_TK[:1], self.history.cur[m][:-1]])
            has_prev_T[1:] = True
        hidden = hidden_TD.detach().float().cpu()
        src = SourceBatch(hidden, src_ids_TK, prev_TK, has_prev_T, route_layer)
        with torch.no_grad():
            scores_TE = self.predictor.scores(m, src).float()
        when = self.clock.step(m)
        self._issue([((m, e), when) for e in _ranked(scores_TE, K, self.extra)])

    def _foresee(self, hidden_D: torch.Tensor) -> None:
        """At the last MoE layer's router: the forward's routing is known; update the horizon's
        request history (a new one at a prompt's first forward), hand its forecast to the
        cache's policy, and prefetch the next forward's first layers' likeliest experts."""
        L, E, K = self.spec.num_moe_layers, self.spec.num_experts, self.spec.top_k
        if not self.history.prev or self._state is None:  # a prompt's first forward
            self._state = self.horizon.new_state()
        used_LE = np.zeros((L, E), dtype=np.float32)
        for m in range(L):
            used_LE[m, self.history.cur[m].flatten().numpy()] = 1.0
        f = self.clock.forward
        hidden = hidden_D.detach().float().cpu().numpy()
        steps = self.horizon.step(self._state, used_LE, hidden, forward=f)
        if self.cache is not None:
            self.cache.set_forecast(f, *steps)
        first_LE = self.horizon.next_forward_probs
        ahead = [
            ((m, int(e)), (f + 1) * L + m)
            for m in range(min(self.token_ahead_layers, L))
            for e in np.argsort(-first_LE[m], kind="stable")[:K]
        ]
        self._issue(ahead, hint=False)

    def _issue(self, predictions: list[tuple[Key, int]], hint: bool = True) -> None:
        """Hint every predicted (key, step) to the cache and queue its prefetch, in rank order."""
        for rank, (key, when) in enumerate(predictions):
            if hint and self.cache is not None:
                self.cache.hint(key, when)
            if self.loader is not None:
                self.loader.prefetch(key, rank, when)


def _ranked(scores_TE: torch.Tensor, K: int, extra: int) -> list[int]:
    """Experts to prefetch, best first: top-(K + extra) of one token, or the union of every
    token's top-K by votes (prefill). Scores of -inf mean "no prediction"."""
    T, E = scores_TE.shape
    if T == 1:
        top = scores_TE[0].topk(min(K + extra, E))
        return top.indices[top.values > -INF].tolist()
    top = scores_TE.topk(min(K, E), dim=1)
    votes_E = torch.bincount(top.indices[top.values > -INF], minlength=E)
    order = torch.argsort(votes_E, descending=True, stable=True)
    return order[: int((votes_E > 0).sum())].tolist()
