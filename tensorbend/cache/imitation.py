"""Training the eviction learner by imitating Belady on its own cache states, and measuring it.

Usage:
    train, val, test = (load_requests(trace_dir, s) for s in ("train", "val", "test"))
    model, log = fit_evictor(train, val, cache_frac=0.25)        # DAgger rounds, listwise loss
    report = evaluate_evictor({"evictor": model}, test, train, cache_frac=0.25)

Shape legend: F forwards (requests one after another), L MoE layers, E experts, N decisions,
C candidates (padded to the largest decision), X features, K = L * E keys.

The replay is the foresight replay's (`foresight._replay`): requests in order, each forward's
experts used layer by layer, demand loads only, experts read per decode token. At each miss
that finds the pool full, the policy in charge (`cache/evictor.py`) scores the candidates (the
residents, then the missed key); a label is what Belady would do in that same state: every
candidate's next use (the step, over the whole replay; INF when never), the farthest ones
being Belady's choice (the missed key among them: Belady bypasses it).

DAgger: round 0 rolls out an `Evictor` with no model (LFRU's ranking) to collect states; each
later round rolls out the model just trained, adds its states to the pool of decisions, and
refits on all of them. The loss is listwise: softmax over a decision's candidates, cross-entropy
against the uniform distribution over Belady's farthest candidates. The round whose model
misses least on the val split is kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from tensorbend.cache.admission import make_admission
from tensorbend.cache.evictor import AdmitByPolicy, Evictor, EvictorModel, ShadowGuard
from tensorbend.cache.features import GROUPS, feature_names
from tensorbend.cache.oracle import steps_by_key as oracle_steps
from tensorbend.cache.policies import INF, LFRU, LFU, LRU, NextUse
from tensorbend.cache.predicted import Predicted
from tensorbend.cache.victim_heap import IndexedResidentSet
from tensorbend.errors import CheckpointError

DIST_CAP = 4096.0  # steps: a next use farther (or never) counts as this far in soft targets
ADMISSION_WINDOW = 8  # forwards (the runtime's and the foresight replay's default)
NO_PREDICTION = {  # every eviction rule that reads no prediction, built for L MoE layers
    "lru": lambda L: LRU(),
    "lfu": lambda L: LFU(),
    "lfru": lambda L: LFRU(),
    "prefetch:none": Predicted,  # Predicted eviction fed no predictions (layer-cycle-aware LFU)
}


@dataclass
class Requests:
    """Forwards of requests in run order: used_FLE [F, L, E] bool, phases ("prefill" or
    "decode") per forward, starts (first forward of each request); forecast_F2K, when a
    horizon predictor was run over them: the forecast made after each forward, as the expected
    next-use steps with every class ahead and after class 1 ([F, 2, L * E] float32,
    `Forecast.next_use_steps`)."""

    used_FLE: np.ndarray
    phases: list[str]
    starts: list[int]
    forecast_F2K: np.ndarray | None = None

    @property
    def L(self) -> int:
        return self.used_FLE.shape[1]

    @property
    def E(self) -> int:
        return self.used_FLE.shape[2]

    def subset(self, n: int) -> Requests:
        """The first n requests."""
        if n >= len(self.starts):
            return self
        end = self.starts[n]
        fc = None if self.forecast_F2K is None else self.forecast_F2K[:end]
        return Requests(self.used_FLE[:end], self.phases[:end], self.starts[:n], fc)

    def steps_by_key(self) -> dict:
        L = self.used_FLE.shape[1]
        return oracle_steps((int(f) * L + int(m), m, e)
                            for f, m, e in zip(*np.nonzero(self.used_FLE), strict=True))  # fmt: skip

    def prior_K(self) -> np.ndarray:
        """log share of each key's uses (a per-key constant learned from these requests)."""
        c = self.used_FLE.sum(0).reshape(-1).astype(np.float64) + 1.0
        return np.log(c / c.sum())


def load_requests(trace_dir: str, split: str, horizon: str | None = None) -> Requests:
    """A trace's requests of one split (batch 1, prefill and decode forwards); with a horizon
    checkpoint, its forecast after every forward (made from that request's forwards so far)."""
    from tensorbend.predictors.horizon import request_forwards
    from tensorbend.trace import Trace

    tr = Trace.open(trace_dir)
    rows = tr.load(("ids",), split=split)
    used, phases, starts = [], [], []
    for request in request_forwards(rows, tr.spec):
        starts.append(len(phases))
        for phase, used_LE, _ in request:
            phases.append(phase)
            used.append(used_LE.numpy() > 0)
    req = Requests(np.stack(used), phases, starts)
    if horizon is not None:
        req.forecast_F2K = horizon_forecasts(tr, split, horizon, len(phases))
    return req


def horizon_forecasts(tr, split: str, horizon: str, forwards: int) -> np.ndarray:
    """[F, 2, L * E]: the horizon's forecast after each forward of the split (Requests)."""
    from tensorbend.foresight import forecasts
    from tensorbend.predictors.checkpoint import load_predictor

    pred = load_predictor(horizon, spec=tr.spec)
    fcs = forecasts(pred, tr.load(pred.cfg.features, split=split))
    assert len(fcs) == forwards, (len(fcs), forwards)
    L = tr.spec.num_moe_layers
    out = np.empty((forwards, 2, L * tr.spec.num_experts), dtype=np.float32)
    for f, fc in enumerate(fcs):
        ahead, after = fc.next_use_steps(f, L)
        out[f, 0], out[f, 1] = np.ravel(ahead), np.ravel(after)
    return out


def replay(req: Requests, policy, slots: int, pool: str = "global", admission: str = "all",
           label: bool = False, max_labels: int | None = None, seed: int = 0) -> dict:  # fmt: skip
    """The demand replay (module docstring). admission: all | frequency | predicted | policy.
    Returns experts_per_token, good_decisions (victims next used no sooner than Belady's
    choice among the residents) and, with label, the decisions [(x [C, X] float32, next use
    [C])]: all of them, or a uniform sample of max_labels kept while rolling out (reservoir
    sampling, so memory stays bounded however long the replay), and `labelled` (how many
    decisions there were)."""
    L, E = req.L, req.E
    adm = (
        AdmitByPolicy() if admission == "policy" else make_admission(admission, L, ADMISSION_WINDOW)
    )
    rs = IndexedResidentSet(slots, L, policy, pool=pool, admission=adm)
    learner = policy.learner if isinstance(policy, ShadowGuard) else policy
    if isinstance(learner, Evictor) and label:
        learner.log = []
    reads_forecast = isinstance(learner, Evictor) and "forecast" in learner.groups
    if reads_forecast and req.forecast_F2K is None:
        raise CheckpointError(
            "this eviction model reads the horizon's forecasts (feature group `forecast`): "
            "load the requests with the horizon checkpoint (load_requests(..., horizon=PATH))"
        )
    fc_F2K = req.forecast_F2K if reads_forecast else None
    requester = rs.new_request
    steps = req.steps_by_key()
    nxt_K = np.full(L * E, INF)  # next use after the latest use of each key (INF: never)
    pos = {k: 0 for k in steps}
    for (m, e), s in steps.items():
        nxt_K[m * E + e] = s[0]
    starts = set(req.starts)
    reads = decode = good = evictions = labelled = 0
    decisions = []
    rng = np.random.default_rng(seed)
    ids_F = [[np.flatnonzero(req.used_FLE[f, m]).tolist() for m in range(L)]
             for f in range(len(req.phases))]  # fmt: skip
    for f, phase in enumerate(req.phases):
        if f in starts:
            requester()
        is_decode = phase == "decode"
        for m in range(L):
            now = f * L + m
            for e in ids_F[f][m]:
                k, key = m * E + e, (m, e)
                i = pos[key] = pos[key] + 1
                s = steps[key]
                nxt_K[k] = s[i] if i < len(s) else INF
                if rs.use(key, now):
                    continue
                reads += is_decode
                full = not rs.has_room(key)
                if full:
                    cands = [c for c in rs._recency if rs.pool_of(c) == rs.pool_of(key)]
                    far = max(nxt_K[c[0] * E + c[1]] for c in cands)
                placed = rs.place(key, now)
                if full and placed.victim is not None:
                    evictions += 1
                    v = placed.victim
                    good += nxt_K[v[0] * E + v[1]] >= far
                if label and full and learner.log:
                    x_CX, keys = learner.log.pop()
                    labelled += 1
                    if max_labels is None or len(decisions) < max_labels:
                        slot = len(decisions)
                        decisions.append(None)
                    else:  # reservoir: keep this one with probability max_labels / labelled
                        slot = int(rng.integers(labelled))
                        if slot >= max_labels:
                            continue
                    y_C = np.array([nxt_K[c[0] * E + c[1]] - now for c in keys])
                    decisions[slot] = (x_CX.astype(np.float32), y_C)
        decode += is_decode
        if fc_F2K is not None:
            policy.set_forecast(f, fc_F2K[f, 0], fc_F2K[f, 1])
    out = {"experts_per_token": reads / max(decode, 1), "evictions": rs.evictions,
           "good_decisions": good / evictions if evictions else None}  # fmt: skip
    if isinstance(policy, ShadowGuard):
        out["guard"] = {"learner_windows": policy.learner_windows,
                        "lost_windows": policy.lost_windows, "switches": policy.switches}  # fmt: skip
    if label:
        out["decisions"], out["labelled"] = decisions, labelled
    return out


def fit_model(decisions: list, groups: tuple[str, ...], num_layers: int, hidden: int = 16,
              steps: int = 200, batch: int = 512, seed: int = 0,
              tau: float | None = 1.0) -> EvictorModel:  # fmt: skip
    """Listwise imitation of Belady's farthest candidates (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    N, C = len(decisions), max(len(y) for _, y in decisions)
    X = decisions[0][0].shape[1]
    x_NCX = torch.zeros(N, C, X)
    t_NC = torch.zeros(N, C)
    mask_NC = torch.zeros(N, C, dtype=torch.bool)
    for n, (x_CX, y_C) in enumerate(decisions):
        c = len(y_C)
        x_NCX[n, :c] = torch.from_numpy(x_CX)
        if tau is None:
            far = y_C == y_C.max()
            t_NC[n, :c] = torch.from_numpy(far / far.sum())
        else:  # soft: the farther the next use, the more of the target
            a_C = np.log1p(np.minimum(y_C, DIST_CAP)) / tau
            t_NC[n, :c] = torch.softmax(torch.from_numpy(a_C), 0)
        mask_NC[n, :c] = True
    flat = x_NCX[mask_NC]
    mean_X, std_X = flat.mean(0), flat.std(0).clamp(min=1e-3)
    z_NCX = (x_NCX - mean_X) / std_X
    w0 = torch.zeros(X, requires_grad=True)
    W1 = (torch.randn(X, hidden, generator=g) / X**0.5).requires_grad_()
    b1 = torch.zeros(hidden, requires_grad=True)
    w2 = (torch.randn(hidden, generator=g) / hidden**0.5).requires_grad_()
    opt = torch.optim.Adam([w0, W1, b1, w2], lr=1e-2)
    for _ in range(steps):
        i = torch.randint(N, (min(batch, N),), generator=g)
        z = z_NCX[i]
        s = z @ w0 + torch.relu(z @ W1 + b1) @ w2
        s = s.masked_fill(~mask_NC[i], -1e9)
        loss = -(t_NC[i] * torch.log_softmax(s, -1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    d = lambda t: t.detach().double().numpy()  # noqa: E731
    return EvictorModel(tuple(groups), num_layers, d(mean_X), d(std_X), d(w0), d(W1), d(b1),
                        d(w2), meta={"decisions": N, "loss": float(loss.detach())})  # fmt: skip


def fit_evictor(train: Requests, val: Requests, cache_frac: float = 0.25, rounds: int = 3,
                groups: tuple[str, ...] = GROUPS, max_decisions: int = 40000,
                seed: int = 0) -> tuple[EvictorModel, list[dict]]:  # fmt: skip
    """DAgger (module docstring): the kept model and a log line per round."""
    L, E = train.L, train.E
    slots = round(cache_frac * L * E)
    prior = train.prior_K()
    rng = np.random.default_rng(seed)
    pool, model, log, best = [], None, [], None
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        out = replay(train, Evictor(L, E, model, prior, groups), slots, admission="policy",
                     label=True, max_labels=max_decisions // (rounds + 1),
                     seed=int(rng.integers(2**31)))  # fmt: skip
        pool += out["decisions"]
        model = fit_model(pool, groups, L, seed=seed + r)
        v = replay(val, Evictor(L, E, model, prior), slots, admission="policy")
        log.append({"round": r, "train_experts_per_token": out["experts_per_token"],
                    "train_good_decisions": out["good_decisions"], "decisions": len(pool),
                    "labelled": out["labelled"],
                    "val_experts_per_token": v["experts_per_token"],
                    "seconds": time.perf_counter() - t0})  # fmt: skip
        if best is None or v["experts_per_token"] < best[0]:
            best = (v["experts_per_token"], model)
    model = best[1]
    model.meta.update(prior_K=prior, cache_frac=cache_frac, rounds=rounds)
    return model, log


def evaluate_evictor(models: dict, test: Requests, cache_frac: float, guard_window: int = 48,
                     baselines: bool = True) -> dict:  # fmt: skip
    """Experts read per decode token on `test` for the no-prediction caches (`prefetch:none`
    included: Predicted eviction fed nothing, as everywhere the best cache is chosen), Belady, each model
    (with and without the shadow guard for those named `evictor` and `evictor+forecast`); gap closed against the
    best no-prediction cache and full Belady (the better of with/without bypass)."""
    L, E = test.L, test.E
    slots = round(cache_frac * L * E)
    rows = {}
    if baselines:
        for name, make in NO_PREDICTION.items():
            for pool in ("global", "per_layer"):
                for adm in ("all", "frequency"):
                    rows[f"{name}/{pool}/{adm}"] = replay(test, make(L), slots, pool, adm)
        steps = test.steps_by_key()
        rows["belady/all"] = replay(test, NextUse(steps, L), slots, admission="all")
        rows["belady/bypass"] = replay(test, NextUse(steps, L), slots, admission="predicted")
    for name, model in models.items():
        prior = model.meta["prior_K"]
        rows[name] = replay(test, Evictor(L, E, model, prior), slots, admission="policy")
        if name in ("evictor", "evictor+forecast"):
            g = ShadowGuard(Evictor(L, E, model, prior), slots, L, window=guard_window)
            rows[f"{name}+shadow"] = replay(test, g, slots, admission="policy")
    return summarize(rows, cache_frac, slots)


def summarize(rows: dict, cache_frac: float, slots: int) -> dict:
    """Best no-prediction row, full oracle row, gap closed per row."""
    nopred = [n for n in rows if n.split("/")[0] in NO_PREDICTION]
    best = min(nopred, key=lambda n: rows[n]["experts_per_token"]) if nopred else None
    full = min((n for n in rows if n.startswith("belady")),
               key=lambda n: rows[n]["experts_per_token"], default=None)  # fmt: skip
    if best is not None and full is not None:
        b, o = rows[best]["experts_per_token"], rows[full]["experts_per_token"]
        for r in rows.values():
            r["gap_closed"] = (b - r["experts_per_token"]) / (b - o) if b > o else None
    return {"cache_frac": cache_frac, "cache_slots": slots, "best_no_prediction": best,
            "full_oracle": full, "replay": rows}  # fmt: skip


def model_features(model: EvictorModel) -> list[str]:
    return feature_names(model.groups, model.num_layers)
