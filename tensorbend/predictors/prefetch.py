"""From a prediction to a prefetch list: the one path (runtime hooks, engine API, simulator).

Usage (any engine; no torch-module hooks, no dependency on our runtime):
    pf = Prefetcher(spec, predictor=load_predictor("ours_d1.safetensors"),
                    horizon=load_predictor("horizon.safetensors"))
    for request in requests:
        pf.begin_request()
        for forward in request:                   # prefill, then one forward per decode token
            for m in range(spec.num_moe_layers):
                todo = pf.observe(m, hidden_TD=layer_input_TD)              # before attention
                ...attention, then router m picks ids_TK from gate_input_TD...
                todo += pf.observe(m, hidden_TD=gate_input_TD, routed_ids_TK=ids_TK)
                engine.prefetch(todo)             # [Prediction(layer, expert, step, rank, hint)]
            pf.on_token_end()
        pf.forecast                               # after each forward, with a horizon:
                                                  #   (forward, ahead_LE, after_first_LE)

The list rule, shared with the simulator (which ranks a trace's rows offline):
    >>> import torch
    >>> ids_NJ = ranked_ids(torch.tensor([[-float("inf"), 0.9, -float("inf"), 0.5]]), width=3)
    >>> ids_NJ.tolist(), prefetch_list(ids_NJ, top_k=1, extra=2)
    ([[1, 3, -1]], [1, 3])
    >>> prefetch_list(torch.tensor([[2, 0], [2, 1], [3, -1]]), top_k=2, extra=0)
    [2, 0, 1, 3]
    >>> likeliest([0.2, 0.7, 0.7, 0.1], 2)
    [1, 2]

One token: its top-(K + extra) guesses, best first (`-1`: no guess; the width is checked by
`predictors.spec.prefetch_width`), scored in numpy by ours (`residual_fast.score_token`) and
the horizon (`horizon_fast.FastHorizon`): torch's per-op dispatch would be most of the cost of
arrays this small (bench/cold_call.py). Several tokens (prefill, a batch): the union of their
top-K, most voted first (ties by expert id). A cross-token horizon names the next forward's
likeliest experts per layer (`likeliest`, ties by expert id). The runtime (`offload.hooks.PredictionHooks`) drives a `Prefetcher`; the simulator
(`simulate.plan`) applies `prefetch_list` and `likeliest` to ranked rows; an engine calls the
`Prefetcher` directly (documented path: `tensorbend.engines.prefetcher`, docs/guide/prefetch_api.md).

Shape legend: T tokens of the forward, K top-k, E experts, D hidden size, L MoE layers.

A within-token predictor fires at its lookahead's source point: `pre_attn` at the call without
routed ids (layer m's input, before attention) for target m; `dN` at the call with layer s's
routed ids (its router input as `hidden_TD`) for target s + N; `same_layer` at layer m's router.
The inputs it sees are exactly what `predictors.base.sources_from_rows` builds offline from a
trace (tested through the runtime, which drives this class). A cross-token `horizon` predictor
runs at the last MoE layer's router: it updates the request's history, publishes `forecast`
(the expected step of every (layer, expert)'s next use, for a `predicted.Reuse` cache) and
names the next forward's first `token_ahead_layers` layers' likeliest experts (`hint=False`:
a guess to prefetch, not a step to plan around). Steps count forward * L + m over the
Prefetcher's life; `Prediction.step` is the step the expert is wanted at. A predictor of
`recorded_routing` (the runtime's oracle) is asked `ahead(now)` at its source points instead.
`score_s` adds up the wall seconds spent scoring (the horizon's step, a predictor's `scores`):
the rest of `observe` is the Python around it. `token_topk[m]` keeps the per-token top-K of
the latest prediction for target m (a list for one token, else [T, K] with -1: no guess):
what per-expert token counts are predicted from (engines/vllm_counters.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from tensorbend.errors import PredictorInputError
from tensorbend.models import RoutingSpec
from tensorbend.predictors.base import Lookahead, SourceBatch
from tensorbend.predictors.horizon_fast import FastHorizon
from tensorbend.predictors.recency import RecencyForecaster
from tensorbend.predictors.registry import check_roles
from tensorbend.predictors.spec import prefetch_width

INF = float("inf")


class Prediction(NamedTuple):
    """One expert to prefetch (an immutable tuple: a decode token makes dozens of them)."""

    layer: int
    expert: int
    step: int  # forward * L + layer: when the expert is wanted
    rank: int  # 0 = the most likely of its call
    hint: bool = True  # a within-token prediction (a cache may plan its eviction on it)


@dataclass
class StepClock:
    """Logical time: step = forward * L + m, counted over the whole run (all requests)."""

    num_layers: int
    forward: int = -1

    def begin_forward(self) -> None:
        self.forward += 1

    def step(self, m: int) -> int:
        return self.forward * self.num_layers + m


@dataclass
class RoutingHistory:
    """Routing seen so far: this forward's ids per layer, and the previous forward's last token's
    (numpy views of the same memory beside the tensors: a decode token reads them once per
    layer, and indexing an array costs less than a tensor op)."""

    num_layers: int
    cur: dict[int, torch.Tensor] = field(default_factory=dict)  # m -> ids_TK (CPU)
    cur_np: dict[int, np.ndarray] = field(default_factory=dict)  # m -> the same, numpy
    prev: dict[int, np.ndarray] = field(default_factory=dict)  # m -> ids_K (last token)
    batch: int = 1
    """Sequences per forward, in lockstep (their tokens in order): prev then holds each
    sequence's last token, [B, K]."""

    def put(self, m: int, ids_TK: torch.Tensor) -> np.ndarray:
        """Layer m's routed ids this forward ([T, K], or [..., K]; on any device); returns
        their numpy view [T, K] (on the CPU)."""
        try:
            a = ids_TK.numpy()  # (the CPU case first: no attribute read before it)
        except TypeError:  # on a GPU
            ids_TK = ids_TK.cpu()
            a = ids_TK.numpy()
        if a.ndim != 2:
            a = a.reshape(-1, a.shape[-1])
            ids_TK = ids_TK.reshape(-1, ids_TK.shape[-1])
        self.cur[m] = ids_TK
        self.cur_np[m] = a
        return a

    def begin_prompt(self) -> None:
        self.cur.clear()
        self.cur_np.clear()
        self.prev.clear()

    def begin_forward(self) -> None:
        if self.batch == 1:
            self.prev.update({m: ids_TK[-1] for m, ids_TK in self.cur_np.items()})
        else:
            B = self.batch
            self.prev.update(
                {m: ids.reshape(B, -1, ids.shape[-1])[:, -1] for m, ids in self.cur_np.items()}
            )
        self.cur.clear()
        self.cur_np.clear()

    def ids_TLK(self) -> torch.Tensor:
        """This forward's routing, [T, L, K]."""
        return torch.stack([self.cur[m] for m in range(self.num_layers)], dim=1)


class Prefetcher:
    """Predictions for an engine's source points (see the module docstring)."""

    def __init__(
        self,
        spec: RoutingSpec,
        predictor=None,
        horizon=None,
        extra: int = 0,
        token_ahead_layers: int = 1,
        clock: StepClock | None = None,
        history: RoutingHistory | None = None,
    ):
        """clock/history: shared with a driver that advances them itself (the runtime's
        Recorder); an engine leaves them None and calls begin_request / on_token_end."""
        check_roles(
            None if predictor is None else predictor.kind, None if horizon is None else horizon.kind
        )
        prefetch_width(spec.top_k, extra)
        self.spec, self.predictor, self.extra = spec, predictor, extra
        self.token_ahead_layers = token_ahead_layers
        self.horizon = None if horizon is None else _fast(horizon)
        self.la: Lookahead | None = None if predictor is None else predictor.lookahead
        # a predictor of only -inf scores names nothing: not asked (its lookahead still labels)
        self._asks = predictor is not None and not predictor.predicts_nothing
        self.ahead = (
            predictor.ahead if predictor is not None and predictor.recorded_routing else None
        )
        self._own_clock = clock is None
        self.clock = clock or StepClock(spec.num_moe_layers)
        self.history = history or RoutingHistory(spec.num_moe_layers)
        self.forecast: tuple | None = None  # (forward, ahead_LE, after_first_LE)
        self.score_s = 0.0  # wall seconds scoring (model calls): the rest is glue
        self.token_topk: dict = {}  # target layer -> its latest per-token top-K guesses
        self._state = None  # the horizon's per-request history
        self._new_forward = True
        # decode's one-token inputs, made once (read-only: predictors build new tensors)
        self._has_prev_1 = (torch.tensor([False]), torch.tensor([True]))
        self._no_prev_1K = torch.zeros(1, spec.top_k, dtype=torch.long)
        self._no_grad = torch.no_grad()  # one reusable context (a new one per call: ~2 us)
        self._rows_L1 = np.arange(spec.num_moe_layers)[:, None]
        # observe's per-call constants (it runs at every source point of every forward)
        self._L, self._D = spec.num_moe_layers, spec.hidden_size
        self._layer_input = self._asks and self.la.hidden == "layer_input"
        self._fires = self._fire_table(spec.num_moe_layers)  # router layer -> target layers

    @property
    def wants_layer_input(self) -> bool:
        """Whether observe() before attention does anything (lookahead pre_attn)."""
        return self._layer_input

    def begin_request(self) -> None:
        self.history.begin_prompt()
        self._state = None
        self._new_forward = True

    def on_token_end(self) -> None:
        """The forward (a decode token, or a whole prefill) is over."""
        self._new_forward = True

    def observe(
        self,
        layer: int,
        hidden_TD: torch.Tensor | None = None,
        routed_ids_TK: torch.Tensor | None = None,
    ) -> list[Prediction]:
        """What to prefetch now: before layer `layer`'s attention (hidden_TD = its input, no
        routed ids) or right after its router (hidden_TD = the router's input, its ids)."""
        if self._new_forward:
            if self._own_clock:
                self.clock.begin_forward()
                self.history.begin_forward()
            self._new_forward = False
        if routed_ids_TK is None:
            if hidden_TD is not None:
                self._check_hidden(layer, hidden_TD.shape)
            return self._within(layer, layer, hidden_TD) if self._layer_input else []
        self.history.put(layer, routed_ids_TK)  # (integer ids carry no gradient)
        if hidden_TD is not None:
            self._check_hidden(layer, hidden_TD.shape)
        out = []
        if self.horizon is not None and layer == self._L - 1:
            out = self._foresee(hidden_TD.reshape(-1, self._D))
        for m in self._fires[layer]:
            out += self._within(layer, m, hidden_TD)
        return out

    # ------------------------------------------------------------ helpers

    def _check_hidden(self, layer: int, shape) -> None:
        if shape[-1] != self._D:
            raise PredictorInputError(
                f"Prefetcher.observe(layer {layer}): expected hidden_TD [..., "
                f"{self._D}] (this model's hidden size), found "
                f"{tuple(shape)}; pass the router's input or the layer's input"
            )

    def _fire_table(self, L: int) -> tuple:
        """The target layers each router fires: a dN predictor fires s + N from router s (the
        runtime's oracle, `ahead`, at every router: it ignores the target); nothing but the
        horizon fires at a router for pre_attn or without a predictor."""
        d = None if not self._asks else self.la.distance
        if d is None or self.la.hidden != "gate_input":  # pre_attn: asked before attention
            return ((),) * L
        return tuple((s + d,) if self.ahead is not None or s + d < L else () for s in range(L))

    def _within(self, source: int, m: int, hidden_TD: torch.Tensor | None) -> list[Prediction]:
        if not self._asks:
            return []
        if self.ahead is not None:
            return self._ranked_pairs(self.ahead(self.clock.step(source)), hint=True)
        return self._predict(m, hidden_TD)

    def _predict(self, m: int, hidden_TD: torch.Tensor) -> list[Prediction]:
        """Score target layer m from its source point, as sources_from_rows does offline
        (hidden_TD: any leading shape, [..., D])."""
        D, K = self._D, self.spec.top_k
        T = hidden_TD.numel() // D
        p = self.predictor
        la = p.lookahead
        route_layer = m - max(la.distance, 1)  # latest layer routed before the source
        prev_np = self.history.prev.get(m)
        src_ids_TK = self.history.cur[route_layer] if route_layer >= 0 else None
        prev = None if prev_np is None else torch.from_numpy(prev_np)
        hidden_TD = hidden_TD.reshape(T, D)
        if T == 1:  # decode, the hot path: no tensor made here (~2-10 us of dispatch each)
            has_prev_T = self._has_prev_1[prev is not None]
            prev_TK = prev.view(1, K) if prev is not None else self._no_prev_1K
        else:
            has_prev_T = torch.full((T,), prev is not None, dtype=torch.bool)
            prev_TK = prev.expand(T, K) if prev is not None else torch.zeros(T, K, dtype=torch.long)
        if la.prev_in_pass and T > 1:  # same_layer: layer m routed every token already
            prev_TK = torch.cat([prev_TK[:1], self.history.cur[m][:-1]])
            has_prev_T[1:] = True
        hidden = hidden_TD.detach().float().cpu()
        src = SourceBatch(hidden, src_ids_TK, prev_TK, has_prev_T, route_layer)
        t0 = time.perf_counter()
        with self._no_grad:
            scores_TE = p.scores(m, src).float()
        self.score_s += time.perf_counter() - t0
        if T == 1:
            experts = _token_list(scores_TE, K + self.extra)
            self.token_topk[m] = experts[:K]
        else:
            self.token_topk[m] = ranked = ranked_ids(scores_TE, K)
            experts = prefetch_list(ranked, K, self.extra)
        when = self.clock.step(m)
        return [Prediction(m, e, when, r) for r, e in enumerate(experts)]

    def _foresee(self, hidden_TD) -> list[Prediction]:
        """At the last MoE layer's router: update the horizon's request history (a new one at
        a request's first forward), publish the forecast, name the next forward's experts.
        With B sequences in lockstep (history.batch), each keeps its own history and the
        forecasts merge: the soonest expected use of any sequence, and the chance that any
        uses an expert in the next forward. hidden_TD: [T, D], a tensor or a numpy array."""
        L, E, K, B = (
            self.spec.num_moe_layers,
            self.spec.num_experts,
            self.spec.top_k,
            self.history.batch,
        )
        if not self.history.prev or self._state is None:  # a request's first forward
            self._state = [self.horizon.new_state() for _ in range(B)]
        f = self.clock.forward
        D = hidden_TD.shape[-1]  # (numpy views from here: no tensor op per layer or sequence)
        hidden_BD = _host_f32(hidden_TD).reshape(B, -1, D)[:, -1]
        cur = self.history.cur_np
        ids_LBN = np.stack([cur[m].reshape(B, -1) for m in range(L)])  # (ids_TLK's)
        rows_L1 = self._rows_L1
        ahead, after, first = [], [], []
        for b in range(B):
            used_LE = np.zeros((L, E), dtype=np.float32)
            used_LE[rows_L1, ids_LBN[:, b]] = 1.0
            t0 = time.perf_counter()
            fc = self.horizon.step(self._state[b], used_LE, hidden_BD[b], forward=f)
            self.score_s += time.perf_counter() - t0
            ahead.append(fc[0])
            after.append(fc[1])
            first.append(self.horizon.next_forward_probs)
        if B == 1:
            self.forecast, first_LE = (f, ahead[0], after[0]), first[0]
        else:
            self.forecast = (f, np.min(ahead, axis=0).tolist(), np.min(after, axis=0).tolist())
            first_LE = 1 - np.prod(1 - np.asarray(first), axis=0)
        pairs = [
            ((m, int(e)), (f + 1) * L + m)
            for m in range(min(self.token_ahead_layers, L))
            for e in likeliest(first_LE[m], K)
        ]
        return self._ranked_pairs(pairs, hint=False)

    @staticmethod
    def _ranked_pairs(pairs, hint: bool) -> list[Prediction]:
        return [_new(Prediction, (m, e, when, r, hint)) for r, ((m, e), when) in enumerate(pairs)]


_new = tuple.__new__  # Prediction(*fields) without its __new__'s argument handling


def _host_f32(t: torch.Tensor) -> np.ndarray:
    """A hidden state as a float32 numpy array on the CPU (a view when it is one already:
    tried first, without reading the tensor's attributes one by one); a numpy array passes."""
    if type(t) is np.ndarray:
        return t if t.dtype is _F32 else t.astype(np.float32)
    try:
        a = t.numpy()
    except (RuntimeError, TypeError):  # it needs a gradient, lives on a GPU, or is bfloat16
        return t.detach().float().cpu().numpy()
    return a if a.dtype is _F32 else a.astype(np.float32)


_F32 = np.dtype(np.float32)  # (`is`: cheaper than a dtype's ==)


def ranked_ids(scores_TE: torch.Tensor, width: int) -> torch.Tensor:
    """Each token's top-`width` experts, best first, [T, J]; -1 where the score is -inf (no
    prediction)."""
    top = scores_TE.topk(min(width, scores_TE.shape[1]), dim=1)
    return torch.where(top.values > -INF, top.indices, -1)


def _token_list(scores_1E: torch.Tensor, width: int) -> list[int]:
    """prefetch_list(ranked_ids(scores_1E, width), width, 0) for one token, in two lists."""
    top = scores_1E.topk(min(width, scores_1E.shape[1]), dim=1)  # (ranked_ids' own call)
    ids_J, values_J = top.indices.tolist()[0], top.values.tolist()[0]
    return [e for e, v in zip(ids_J, values_J, strict=True) if v > -INF]


def prefetch_list(ids_NJ: torch.Tensor, top_k: int, extra: int) -> list[int]:
    """The prefetch list for one forward's N tokens at one target layer: one token, its
    top-(K + extra); several, the union of their top-K by votes (ties by expert id)."""
    if ids_NJ.shape[0] == 1:
        row = ids_NJ[0, : top_k + extra]
        return row[row >= 0].tolist()
    top = ids_NJ[:, :top_k].flatten()
    top = top[top >= 0]
    if top.numel() == 0:
        return []
    votes = torch.bincount(top, minlength=int(top.max()) + 1)
    order = torch.argsort(votes, descending=True, stable=True)
    return order[: int((votes > 0).sum())].tolist()


def likeliest(probs_E, k: int) -> list[int]:
    """The `k` experts of highest probability (a horizon's next-forward guess), ties by id."""
    return np.argsort(-np.asarray(probs_E), kind="stable")[:k].tolist()


def _fast(horizon):
    """A cross-token forecaster's numpy twin for the per-forward work: ours' or the peer's."""
    return horizon.fast() if isinstance(horizon, RecencyForecaster) else FastHorizon(horizon)
