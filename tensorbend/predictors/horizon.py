"""Ours across tokens (kind `horizon`): which experts each MoE layer uses in the next forwards.

Usage:
    p = HorizonPredictor.fit(spec, data=TrainData(train_rows, val_rows))   # rows: Trace.load
    state = p.new_state()                  # one per request (prompt)
    state.observe(used_LE, hidden_D)       # after each forward: experts it used per layer
    reuse_LE = p.reuse(state)              # P(expert e is used at layer m within `foresight`
                                           #   forwards after this one) [L, E]

Shape legend: F forwards of one request, N rows (forwards) of many, L MoE layers, E experts,
D hidden size, X history features per (layer, expert).

What exists at the end of forward f (prefill: the whole prompt in one forward; decode: one
token) and nothing later: which experts every layer used in forwards <= f of this request, and
the hidden state of f's last token. Per (m, e) the history features are: used in f (1),
recency exp(-age / tau) for tau in RECENCY_TAUS (age: forwards since the last use), and
log(1 + decayed use count) for each decay in COUNT_DECAYS. The score is
    logit_LE = sum_x w[m, x] * feature[m, e, x] + b[m, e] + (W2 GELU(W1 h))[m, e]
with h = [rmsnorm(gate input of the last MoE layer), its running mean over the request]
(`inputs="routing+hidden"`), or without the h term (`inputs="routing"`: what a routing-only
trace imported from a serving engine supports). Trained with BCE against "used within the next
`foresight` forwards" on the train split, early-stopped on val.

How it is used: `offload.policies.Reuse` turns reuse_LE into an estimated next use of every
cached expert (the next visit of its layer, stretched by the odds against use per forward) and
evicts the farthest; `AdmitPredicted` bypasses a miss predicted to return later than the victim.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from tensorbend.models import RoutingSpec
from tensorbend.predictors.base import (
    LOOKAHEADS,
    PredictorConfigError,
    PredictorInputError,
    TrainData,
    check_state,
    config_from_dict,
)
from tensorbend.predictors.fit import FitConfig, fit
from tensorbend.predictors.ops import rmsnorm
from tensorbend.trace import forwards

RECENCY_TAUS = (1.0, 4.0, 16.0)
COUNT_DECAYS = (0.7, 0.9, 0.97)
NUM_FEATURES = 1 + len(RECENCY_TAUS) + len(COUNT_DECAYS)
HIDDEN_EMA = 0.8  # running mean of the hidden state over a request's forwards


@dataclass(frozen=True)
class HorizonConfig:
    foresight: int = 4
    """Forwards ahead the label looks: used within the next `foresight` forwards."""
    inputs: Literal["routing", "routing+hidden"] = "routing+hidden"
    """Routing history only (imported traces), or also the last layer's hidden state."""
    width: int = 64
    """Width of the hidden-state MLP."""
    fit: FitConfig = field(default_factory=lambda: FitConfig(epochs=30, batch_rows=256, lr=5e-3))
    """Training loop settings."""

    def __post_init__(self) -> None:
        if self.foresight < 1 or self.width < 1:
            raise PredictorConfigError(
                f"horizon: expected foresight >= 1 and width >= 1, found foresight="
                f"{self.foresight}, width={self.width}"
            )
        if self.inputs not in ("routing", "routing+hidden"):
            raise PredictorConfigError(
                f"horizon inputs {self.inputs!r}: expected routing or routing+hidden"
            )

    @property
    def uses_hidden(self) -> bool:
        return self.inputs == "routing+hidden"


class HorizonState:
    """One request's history, updated after every forward (the runtime keeps one per prompt)."""

    def __init__(self, num_layers: int, num_experts: int, hidden_size: int):
        self.age_LE = torch.full((num_layers, num_experts), 1e6)
        self.counts_CLE = torch.zeros(len(COUNT_DECAYS), num_layers, num_experts)
        self.used_LE = torch.zeros(num_layers, num_experts)
        self.hidden_D = torch.zeros(hidden_size)
        self.hidden_mean_D = torch.zeros(hidden_size)
        self.forwards = 0

    def observe(self, used_LE: torch.Tensor, hidden_D: torch.Tensor | None = None) -> None:
        """Forward done: used_LE is 1 where layer m used expert e (any token of the forward)."""
        used_LE = used_LE.float()
        self.age_LE += 1
        self.age_LE[used_LE > 0] = 0
        decays_C11 = torch.tensor(COUNT_DECAYS)[:, None, None]
        self.counts_CLE = self.counts_CLE * decays_C11 + used_LE
        self.used_LE = used_LE
        if hidden_D is not None:
            h_D = rmsnorm(hidden_D.float()[None])[0]
            first = self.forwards == 0
            self.hidden_mean_D = (
                h_D if first else HIDDEN_EMA * self.hidden_mean_D + (1 - HIDDEN_EMA) * h_D
            )
            self.hidden_D = h_D
        self.forwards += 1

    def features(self) -> torch.Tensor:
        """[L, E, X] history features (see the module docstring)."""
        rec = [torch.exp(-self.age_LE / tau) for tau in RECENCY_TAUS]
        return torch.stack([self.used_LE, *rec, *torch.log1p(self.counts_CLE)], dim=-1)

    def hidden(self) -> torch.Tensor:
        return torch.cat([self.hidden_D, self.hidden_mean_D])


class _Net(torch.nn.Module):
    def __init__(self, L: int, E: int, D: int, width: int, uses_hidden: bool):
        super().__init__()
        self.w_LX = torch.nn.Parameter(torch.zeros(L, NUM_FEATURES))
        self.b_LE = torch.nn.Parameter(torch.zeros(L, E))
        self.L, self.E = L, E
        self.mlp = None
        if uses_hidden:
            self.mlp = torch.nn.Sequential(
                torch.nn.Linear(2 * D, width), torch.nn.GELU(), torch.nn.Linear(width, L * E)
            )
            torch.nn.init.zeros_(self.mlp[2].weight)
            torch.nn.init.zeros_(self.mlp[2].bias)

    def forward(self, X_NLEX: torch.Tensor, h_ND: torch.Tensor | None) -> torch.Tensor:
        z_NLE = (X_NLEX * self.w_LX[:, None, :]).sum(-1) + self.b_LE
        if self.mlp is not None:
            z_NLE = z_NLE + self.mlp(h_ND).view(-1, self.L, self.E)
        return z_NLE


class HorizonPredictor:
    kind = "horizon"
    needs_truth = False
    lookahead = LOOKAHEADS["d1"]  # unused; cross-token predictions are not per lookahead

    def __init__(self, spec: RoutingSpec, cfg: HorizonConfig):
        self.spec, self.cfg = spec, cfg
        L, E, D = spec.num_moe_layers, spec.num_experts, spec.hidden_size
        self.net = _Net(L, E, D, cfg.width, cfg.uses_hidden).eval()
        self.history: list[dict] = []

    # ------------------------------------------------------------ API

    @classmethod
    def fit(cls, spec, la=None, data: TrainData | None = None, cfg=None, progress=False):
        cfg = cfg or HorizonConfig()
        torch.manual_seed(cfg.fit.seed)
        p = cls(spec, cfg)
        train = p.dataset(data.train_rows)
        val = p.dataset(data.val_rows)

        def loss_fn(net, b):
            return F.binary_cross_entropy_with_logits(net(b["X"][0], _h(b)), b["Y"][0])

        def val_fn(net):
            return -float(
                F.binary_cross_entropy_with_logits(net(val["X"][0], _h(val)), val["Y"][0])
            )

        _, p.history = fit(p.net, train, loss_fn, val_fn, cfg.fit, progress, desc="horizon")
        return p

    def new_state(self) -> HorizonState:
        s = self.spec
        return HorizonState(s.num_moe_layers, s.num_experts, s.hidden_size)

    @torch.no_grad()
    def reuse(self, state: HorizonState) -> torch.Tensor:
        """[L, E] probability that each expert is used within the next `foresight` forwards."""
        h = state.hidden()[None] if self.cfg.uses_hidden else None
        return torch.sigmoid(self.net(state.features()[None], h))[0]

    def dataset(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Training rows ([1, N, ...], the layout fit() takes): one per forward that has a
        successor in its request, labelled by the next `foresight` forwards' experts."""
        X, Y, H = [], [], []
        for request in request_forwards(rows, self.spec):
            used_FLE = torch.stack([used for _, used, _ in request])
            state = self.new_state()
            for f, (_, used_LE, hidden_D) in enumerate(request[:-1]):
                state.observe(used_LE, hidden_D)
                X.append(state.features())
                H.append(state.hidden())
                Y.append(used_FLE[f + 1 : f + 1 + self.cfg.foresight].amax(0))
        if not X:
            raise PredictorInputError(
                "horizon: expected requests of at least two forwards (a prompt with decode "
                "steps), found none; collect with --max-new-tokens > 0"
            )
        out = {"X": torch.stack(X)[None], "Y": torch.stack(Y)[None]}
        if self.cfg.uses_hidden:
            out["H"] = torch.stack(H)[None]
        return out

    def num_params(self) -> int:
        return sum(p.numel() for p in self.net.parameters())

    def config_dict(self) -> dict:
        return asdict(self.cfg)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone().contiguous() for k, v in self.net.state_dict().items()}

    @classmethod
    def from_state(cls, spec, la, config: dict, tensors: dict[str, torch.Tensor]):
        p = cls(spec, config_from_dict(HorizonConfig, config, "horizon checkpoint"))
        check_state(p.state_tensors(), tensors, "horizon checkpoint")
        p.net.load_state_dict(tensors)
        return p

    def fit_summary(self) -> dict:
        return {}


def _h(b: dict) -> torch.Tensor | None:
    return b["H"][0] if "H" in b else None


def request_forwards(rows: dict[str, torch.Tensor], spec: RoutingSpec) -> list[list[tuple]]:
    """Per request (prompt), its forwards in run order (`trace.forwards`, batch 1): for each,
    (phase "prefill"|"decode", experts used per layer [L, E] by any of its tokens, its last
    token's gate input of the last MoE layer [D] or None for a routing-only trace)."""
    ids_TLK = rows["expert_ids_TLK"].long()
    used_TLE = torch.zeros(*ids_TLK.shape[:2], spec.num_experts).scatter_(2, ids_TLK, 1.0)
    hidden_TD = rows["gate_input_TLD"][:, -1].float() if "gate_input_TLD" in rows else None
    out, last_prompt = [], None
    for fw in forwards(rows, batch=1):
        prompt = int(rows["prompt_index_T"][fw.rows[0]])
        if prompt != last_prompt:
            out.append([])
            last_prompt = prompt
        hidden_D = None if hidden_TD is None else hidden_TD[int(fw.rows[-1])]
        phase = "prefill" if fw.phase == 0 else "decode"
        out[-1].append((phase, used_TLE[fw.rows].amax(0), hidden_D))
    return out
