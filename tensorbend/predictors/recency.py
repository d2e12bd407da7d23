"""The training-free cross-token peer (kind `recency`): a request's own recent routing as the
forecast of its next forwards, for the same eviction and next-forward prefetches ours' horizon
drives. It is what ours' cross-token forecast is compared with.

Usage:
    p = RecencyForecaster(spec)                # nothing to fit, no checkpoint
    state = p.new_state()                      # one per request (horizon.HorizonState)
    state.observe(used_LE)                     # after each forward
    fc = p.forecast(state)                     # a horizon.Forecast, as HorizonPredictor's
    tensorbend generate ... --policy prefetch --horizon recency

Shape legend: L MoE layers, E experts, J = h + 1 classes, C count decays.

After forward f, each (layer m, expert e) is used at a next forward with probability p, the
request's decayed use rate: p = c (1 - d) / (1 - d^n), where c is the use count decayed by
d = DECAY per forward (the count `HorizonState` keeps at that decay) and n the forwards seen (the
usual bias correction of an exponential moving average: after one forward p is 1 for the
experts it used, 0 for the rest). Forwards are taken as independent draws, so
P(first next use j forwards ahead) = p (1 - p)^(j - 1) for j = 1..h and P(later) = (1 - p)^h;
"later" lies as far beyond h as HorizonState.tail says (the long-run rate), as for ours.
DECAY is fixed a priori (the fastest of horizon.COUNT_DECAYS: the last few forwards weigh
most), never tuned on a test split. With d -> 0 it is the current forward's routing alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tensorbend.cache.report import PEER_HORIZON
from tensorbend.models import RoutingSpec
from tensorbend.predictors.horizon import COUNT_DECAYS, NEXT_FORWARDS, Forecast, HorizonState
from tensorbend.predictors.horizon_fast import FastHorizon, FastState

DECAY = COUNT_DECAYS[0]
NAME = PEER_HORIZON  # what --horizon takes instead of a checkpoint; its rows' label


@dataclass(frozen=True)
class RecencyConfig:
    foresight: int = 8
    """Forwards ahead it places the next use (h), as ours' default."""
    inputs: str = "routing"
    """What it reads: the request's routing only."""
    uses_hidden: bool = False
    features: tuple[str, ...] = ("ids",)
    """Trace features it reads."""


class RecencyForecaster:
    kind = NAME
    needs_truth = False
    recorded_routing = False
    predicts_nothing = False
    checkpoint: str | None = None
    lookahead = NEXT_FORWARDS

    def __init__(self, spec: RoutingSpec, cfg: RecencyConfig | None = None):
        self.spec, self.cfg = spec, cfg or RecencyConfig()

    def new_state(self) -> HorizonState:
        s = self.spec
        return HorizonState(s.num_moe_layers, s.num_experts, s.hidden_size)

    @torch.no_grad()
    def forecast(self, state: HorizonState) -> Forecast:
        rate_LE = torch.from_numpy(use_rate(state.counts_CLE[0].numpy(), state.forwards))
        return Forecast(first_use(rate_LE, self.cfg.foresight, dim=-1), state.tail())

    def fast(self) -> FastRecency:
        """Its twin for the runtime's per-forward work (numpy)."""
        return FastRecency(self)

    def num_params(self) -> int:
        return 0

    def fit_summary(self) -> dict:
        return {}


class FastRecency(FastHorizon):
    """`RecencyForecaster` in the runtime's numpy layout ([L, J, E]); equal to it up to float
    rounding (tests/test_recency.py)."""

    def __init__(self, pred: RecencyForecaster):  # FastHorizon's, less the network's weights
        self.spec, self.cfg = pred.spec, pred.cfg
        self._steps(pred.spec.num_moe_layers, pred.cfg.foresight)

    def _probs(self, st: FastState) -> np.ndarray:
        rate_LE = use_rate(st.counts_LCE[:, 0], st.forwards)
        return first_use(rate_LE, self.cfg.foresight, dim=1)


def use_rate(count_LE, forwards: int):
    """The bias-corrected decayed use rate p (module docstring), in [0, 1]."""
    assert forwards >= 1, "a forecast follows an observed forward"
    return (count_LE * ((1 - DECAY) / (1 - DECAY**forwards))).clip(0.0, 1.0)


def first_use(rate_LE, h: int, dim: int):
    """P(first next use j forwards ahead), j = 1..h, then P(later), stacked along `dim` (-1:
    [L, E, J] torch, as Forecast; 1: [L, J, E] numpy, as FastHorizon)."""
    lib = torch if isinstance(rate_LE, torch.Tensor) else np
    miss = 1 - rate_LE
    classes = [rate_LE * miss**j for j in range(h)] + [miss**h]
    return lib.stack(classes, dim) if lib is torch else np.stack(classes, axis=dim)
