"""Ours across tokens (kind `horizon`): when each MoE layer next uses each expert.

Usage:
    p = HorizonPredictor.fit(spec, None, TrainData(train_rows, val_rows))   # Trace.load rows
    state = p.new_state()                  # one per request (prompt)
    state.observe(used_LE, hidden_D)       # after each forward: experts it used per layer
    fc = p.forecast(state)                 # Forecast: P(first next use j forwards ahead)
    fc.first_use_LEJ[m, e, j - 1]          #   for j = 1..h, and [..., h] = later than h
    fc.within_LE(), fc.expected_offset_LE()

Shape legend: N rows (forwards) of many requests, L MoE layers, E experts, J = h + 1 classes,
X history features per (layer, expert), D hidden size.

What exists at the end of forward f (prefill: the whole prompt in one forward; decode: one
token), and nothing later: which experts every layer used in this request's forwards <= f, and
the hidden state of f's last token. Per (m, e) the history features are: used in f (1),
recency exp(-age / tau) for tau in RECENCY_TAUS (age: forwards since the last use), and
log(1 + decayed use count) for each decay in COUNT_DECAYS. For every class j (first next use
1..h forwards ahead, or later):
    logit_LEJ = sum_x w[m, j, x] * feature[m, e, x] + b[m, e, j] + (W2 GELU(W1 h))[m, e, j]
with h = [rmsnorm(gate input of the last MoE layer), its running mean over the request]
(`inputs="routing+hidden"`), or no h term (`inputs="routing"`: what a routing-only trace
imported from a serving engine supports). Softmax over j; cross-entropy against the true
offset of the next use (a request that ends first counts as later), on the train split, early
stopped on val. Linear in monotone recency features, classes still own intervals of age, so a
routing that cycles across tokens is learned exactly (tested).

How it is used: `cache.predicted.Reuse` turns a forecast into the expected step of every
cached expert's next use and evicts the farthest (Belady with predicted distances);
`AdmitPredicted` bypasses a miss expected back later than the victim; the runtime prefetches
the first layers' likeliest experts of the next forward during the last layers of this one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from tensorbend.capture.rows import forwards
from tensorbend.models import RoutingSpec
from tensorbend.predictors.base import (
    Lookahead,
    PredictorConfigError,
    PredictorInputError,
    TrainData,
    check_state,
    config_from_dict,
)
from tensorbend.predictors.fit import FitConfig, fit, fit_options
from tensorbend.predictors.ops import rmsnorm

# Where its predictions start: the end of a forward, for the next `foresight` forwards.
NEXT_FORWARDS = Lookahead(
    "next_forwards", 0, "gate_input", "one forward (a decode token) or more: across tokens"
)
RECENCY_TAUS = (1.0, 4.0, 16.0)
COUNT_DECAYS = (0.7, 0.9, 0.97)
NUM_FEATURES = 1 + len(RECENCY_TAUS) + len(COUNT_DECAYS)
HIDDEN_EMA = 0.8  # running mean of the hidden state over a request's forwards


@dataclass(frozen=True)
class HorizonConfig:
    foresight: int = 8
    """Forwards ahead it places the next use (h); anything later is one class."""
    inputs: Literal["routing", "routing+hidden"] = "routing+hidden"
    """Routing history only (imported traces), or also the last layer's hidden state."""
    width: int = 64
    """Width of the hidden-state MLP."""
    fit: FitConfig = field(
        default_factory=lambda: FitConfig(epochs=30, batch_rows=256, lr=5e-3, min_steps=600)
    )
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

    @property
    def features(self) -> tuple[str, ...]:
        """Trace features it reads."""
        return ("ids", "gate_input") if self.uses_hidden else ("ids",)

    @classmethod
    def from_train(cls, t) -> HorizonConfig:
        """From `tensorbend train`'s options (a train.TrainConfig); None keeps the default."""
        for name in ("loss", "prev_routing", "src_scores", "fit_layers"):
            if getattr(t, name) is not None:
                raise PredictorConfigError(
                    f"horizon has no option {name}: expected it unset, found {getattr(t, name)!r}"
                    + ("; it fits one network over every MoE layer" if name == "fit_layers" else "")
                )
        if t.tokens_per_forward is not None:
            raise PredictorConfigError(
                f"horizon has no option tokens_per_forward: expected it unset, found "
                f"{t.tokens_per_forward!r}; its rows are whole forwards (a prefill is one row): "
                "limit them with --max-train-rows"
            )
        if not t.use_prev:
            raise PredictorConfigError(
                "horizon has no option use_prev: expected it set, found False; the previous "
                "forwards' routing is what it reads: drop --no-use-prev"
            )
        d = cls()
        return cls(
            foresight=t.foresight or d.foresight,
            inputs=t.inputs or d.inputs,
            width=t.width or d.width,
            fit=fit_options(d.fit, t),
        )


@dataclass(frozen=True)
class Forecast:
    """After forward f: first_use_LEJ[m, e, j-1] = P(next use of e at layer m is at forward
    f + j), j = 1..h; [..., h] = P(later than f + h). tail_LE: forwards beyond h expected for
    "later" (from the long-run use rate)."""

    first_use_LEJ: torch.Tensor
    tail_LE: torch.Tensor

    def within_LE(self) -> torch.Tensor:
        """P(used within the next h forwards)."""
        return 1 - self.first_use_LEJ[..., -1]

    def next_use_steps(self, forward: int, num_layers: int) -> tuple[list, list]:
        """For a forecast made after `forward`: the expected step of every (m, e)'s next use
        (step = forward * L + m), as nested lists [L][E] for `predicted.Reuse`: with every class
        still ahead, and once layer m of the next forward has passed without it (class 1
        dropped, the rest renormalised)."""
        ahead_LE, after_LE = self.next_use_tensors(forward, num_layers)
        return ahead_LE.tolist(), after_LE.tolist()

    def next_use_tensors(self, forward, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`next_use_steps` as float64 tensors [..., L, E]; forecasts stacked over forwards
        take `forward` as a tensor of theirs ([F]: the replay's `cache.replay.Forecasts`)."""
        h = self.first_use_LEJ.shape[-1] - 1
        L, lead = num_layers, self.first_use_LEJ.shape[:-3]
        fwd = torch.as_tensor(forward, dtype=torch.float64).reshape(*lead, 1, 1, 1)
        m_L11 = torch.arange(self.first_use_LEJ.shape[-3], dtype=torch.float64)[:, None, None]
        j_J = torch.arange(1, h + 1, dtype=torch.float64)
        p_LEJ = self.first_use_LEJ.double()
        steps_LEJ = (fwd + j_J) * L + m_L11  # [..., L, 1, h]
        later_LE = ((fwd + h) * L + m_L11)[..., 0] + L * self.tail_LE.double()
        soon_LE = (p_LEJ[..., :h] * steps_LEJ).sum(-1)
        ahead_LE = soon_LE + p_LEJ[..., h] * later_LE
        rest_LE = (1 - p_LEJ[..., 0]).clamp(min=1e-12)
        after_LE = (
            soon_LE - p_LEJ[..., 0] * steps_LEJ[..., 0] + p_LEJ[..., h] * later_LE
        ) / rest_LE
        return ahead_LE, after_LE

    def expected_offset_LE(self) -> torch.Tensor:
        """Expected forwards until the next use."""
        h = self.first_use_LEJ.shape[-1] - 1
        j_J = torch.arange(1, h + 1, dtype=torch.float32)
        soon = (self.first_use_LEJ[..., :h] * j_J).sum(-1)
        return soon + self.first_use_LEJ[..., h] * (h + self.tail_LE)


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
            mean_D = HIDDEN_EMA * self.hidden_mean_D + (1 - HIDDEN_EMA) * h_D
            self.hidden_mean_D, self.hidden_D = (h_D if first else mean_D), h_D
        self.forwards += 1

    def features(self) -> torch.Tensor:
        """[L, E, X] history features (see the module docstring)."""
        rec = [torch.exp(-self.age_LE / tau) for tau in RECENCY_TAUS]
        return torch.stack([self.used_LE, *rec, *torch.log1p(self.counts_CLE)], dim=-1)

    def hidden(self) -> torch.Tensor:
        return torch.cat([self.hidden_D, self.hidden_mean_D])

    def tail(self) -> torch.Tensor:
        """[L, E] forwards expected beyond h for a "later" use: the odds against use per forward
        at the long-run rate (the slowest decayed count), capped at 1000."""
        rate_LE = (self.counts_CLE[-1] * (1 - COUNT_DECAYS[-1])).clamp(1e-3, 1.0)
        return (1 - rate_LE) / rate_LE


class _HorizonNet(torch.nn.Module):
    def __init__(self, L: int, E: int, J: int, D: int, width: int, uses_hidden: bool):
        super().__init__()
        self.w_LJX = torch.nn.Parameter(torch.zeros(L, J, NUM_FEATURES))
        self.b_LEJ = torch.nn.Parameter(torch.zeros(L, E, J))
        self.shape = (L, E, J)
        self.mlp = None
        if uses_hidden:
            self.mlp = torch.nn.Sequential(
                torch.nn.Linear(2 * D, width),
                torch.nn.GELU(approximate="tanh"),  # the runtime's numpy path computes the same
                torch.nn.Linear(width, L * E * J),
            )
            torch.nn.init.zeros_(self.mlp[2].weight)
            torch.nn.init.zeros_(self.mlp[2].bias)

    def forward(self, X_NLEX: torch.Tensor, h_ND: torch.Tensor | None) -> torch.Tensor:
        """Class logits [N, L, E, J]."""
        z_NLEJ = torch.einsum("nlex,ljx->nlej", X_NLEX, self.w_LJX) + self.b_LEJ
        if self.mlp is not None:
            z_NLEJ = z_NLEJ + self.mlp(h_ND).view(-1, *self.shape)
        return z_NLEJ


class HorizonPredictor:
    kind = "horizon"
    needs_truth = False
    recorded_routing = False
    predicts_nothing = False
    checkpoint: str | None = None
    lookahead = NEXT_FORWARDS

    def __init__(self, spec: RoutingSpec, cfg: HorizonConfig):
        self.spec, self.cfg = spec, cfg
        L, E, D = spec.num_moe_layers, spec.num_experts, spec.hidden_size
        self.net = _HorizonNet(L, E, cfg.foresight + 1, D, cfg.width, cfg.uses_hidden).eval()
        self.history: list[dict] = []
        self.rows: dict[str, int] = {}  # fit_dataset: rows it was trained and early-stopped on

    # ------------------------------------------------------------ API

    @classmethod
    def fit(cls, spec, la=None, data: TrainData | None = None, cfg=None, progress=False):
        p = cls.seeded(spec, cfg or HorizonConfig())
        return p.fit_dataset(p.dataset(data.train_rows), p.dataset(data.val_rows), progress)

    @classmethod
    def seeded(cls, spec: RoutingSpec, cfg: HorizonConfig) -> HorizonPredictor:
        """An untrained predictor initialised under cfg's seed (what `fit` starts from)."""
        torch.manual_seed(cfg.fit.seed)
        return cls(spec, cfg)

    def fit_dataset(self, train: dict, val: dict, progress: bool = False) -> HorizonPredictor:
        """Train on `dataset` rows (early stopped on `val`'s); `train.py` streams them from a
        trace larger than memory."""
        J = self.cfg.foresight + 1

        def loss_fn(net, b, layers):  # one stacked "layer": the net spans every MoE layer
            return F.cross_entropy(net(b["X"][0], _h(b)).reshape(-1, J), b["Y"][0].reshape(-1))

        def val_fn(net, layers):
            z = net(val["X"][0], _h(val)).reshape(-1, J)
            return -float(F.cross_entropy(z, val["Y"][0].reshape(-1)))

        _, self.history = fit(self.net, train, loss_fn, val_fn, self.cfg.fit, progress, "horizon")
        self.rows = {"train_rows": train["X"].shape[1], "val_rows": val["X"].shape[1]}
        return self

    def new_state(self) -> HorizonState:
        s = self.spec
        return HorizonState(s.num_moe_layers, s.num_experts, s.hidden_size)

    @torch.no_grad()
    def forecast(self, state: HorizonState) -> Forecast:
        h = state.hidden()[None] if self.cfg.uses_hidden else None
        probs_LEJ = torch.softmax(self.net(state.features()[None], h)[0], dim=-1)
        return Forecast(probs_LEJ, state.tail())

    def dataset(
        self, rows: dict[str, torch.Tensor], keep_N: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Training rows ([1, N, ...], the layout fit() takes): one per forward that has a
        successor in its request (`training_rows` counts them); Y_NLE = class of the next use
        (offset - 1, h: later); decode_N: the forward is a decode step. keep_N: [N] bool, the
        rows to keep (None: all); every forward still feeds its request's history."""
        X, Y, H, dec = [], [], [], []
        h, n = self.cfg.foresight, 0
        for request in request_forwards(rows, self.spec):
            used_FLE = torch.stack([used for _, used, _ in request])
            state = self.new_state()
            for f, (phase, used_LE, hidden_D) in enumerate(request[:-1]):
                state.observe(used_LE, hidden_D)
                n += 1
                if keep_N is not None and not keep_N[n - 1]:
                    continue
                X.append(state.features())
                H.append(state.hidden())
                Y.append(first_use_class(used_FLE[f + 1 : f + 1 + h], h))
                dec.append(phase == "decode")
        assert keep_N is None or keep_N.numel() == n, (keep_N.numel(), n)
        if not X and keep_N is None:
            raise PredictorInputError(
                "horizon: expected requests of at least two forwards (a prompt with decode "
                "steps), found none; collect with --max-new-tokens > 0"
            )
        L, E = self.spec.num_moe_layers, self.spec.num_experts
        out = {
            "X": torch.stack(X)[None] if X else torch.zeros(1, 0, L, E, NUM_FEATURES),
            "Y": torch.stack(Y)[None] if Y else torch.zeros(1, 0, L, E, dtype=torch.long),
            "decode_N": torch.tensor(dec, dtype=torch.bool)[None],
        }
        if self.cfg.uses_hidden:
            D = 2 * self.spec.hidden_size
            out["H"] = torch.stack(H)[None] if H else torch.zeros(1, 0, D)
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
        """Rows (forwards) it was trained and early-stopped on; {} when not fitted here."""
        return dict(self.rows)


def training_rows(prefill: int, decode: int) -> int:
    """Training rows of one request of `prefill` prompt tokens and `decode` steps: its forwards
    (the prefill is one) but the last, which has no successor."""
    return max(int(prefill > 0) + decode - 1, 0)


def first_use_class(next_FLE: torch.Tensor, h: int) -> torch.Tensor:
    """[L, E] class of the first use within the next forwards next_FLE (j - 1 for a first use
    j forwards ahead; h when none of the <= h forwards uses it)."""
    F_ = next_FLE.shape[0]
    if F_ == 0:
        return torch.full(next_FLE.shape[1:], h, dtype=torch.long)
    used = next_FLE > 0
    first_LE = used.float().argmax(0)  # first True (0 when none)
    return torch.where(used.any(0), first_LE, torch.full_like(first_LE, h))


def _h(b: dict) -> torch.Tensor | None:
    return b["H"][0] if "H" in b else None


def request_forwards(rows: dict[str, torch.Tensor], spec: RoutingSpec) -> list[list[tuple]]:
    """Per request (prompt), its forwards in run order (`trace.forwards`, batch 1): for each,
    (phase "prefill"|"decode", experts used per layer [L, E] by any of its tokens, its last
    token's gate input of the last MoE layer [D] or None for a routing-only trace)."""
    ids_TLK = rows["expert_ids_TLK"].long()
    used_TLE = torch.zeros(*ids_TLK.shape[:2], spec.num_experts).scatter_(2, ids_TLK, 1.0)
    gate_TLD = rows.get("gate_input_TLD")
    has_hidden = gate_TLD is not None and gate_TLD.shape[-1] > 0  # zero-width: routing only
    hidden_TD = gate_TLD[:, -1].float() if has_hidden else None
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
