"""Cross-token foresight, measured: how well a `horizon` predictor sees the next forwards, and
what that buys a cache, against the strongest caches without prediction and bounded oracles.

Usage:
    report = evaluate_foresight(pred, rows, cache_frac=0.25)   # rows: Trace.load, test split
    report["replay"]["horizon(evict only)/adm=predicted"]["experts_per_token"], report["gap_closed"]

Shape legend: F forwards, L MoE layers, E experts, K top-k.

Every prediction is made after forward f from forwards <= f of its request only. Metrics, over
decode forwards of held-out requests:
  next_forward_recall   per layer, |top-K(P(next use at f+1)) ∩ experts of f+1| / K (f+1 a
                        decode forward of the same request)
  within_h_recall       per layer, |top-n(P(use within h)) ∩ S| / n, S = experts used in
                        forwards f+1..f+h of the request, n = |S| (R-precision)
  replay                the requests replayed one after another, demand loads only (no
                        prefetch, no timing: what a policy must read), through THE replay
                        (cache/replay.py: the runtime's victims, compiled; the experts of a
                        layer-step pinned while it runs), named by `cache.report.run_label`: experts
                        read per decode token of every cache without prediction (lru, lfu, lfru
                        and `prefetch:none`, the Predicted eviction fed no predictions, x pool
                        global/per_layer x admission all/frequency), the forecast-driven
                        `horizon(evict only)` (Reuse; global pool, admission all/predicted), and
                        the oracle knowing h = 0, 1, 2, 4, 8 forwards (the current one counts)
                        or the whole future: Belady within its sight, the best no-prediction
                        cache's rule, pool and admission beyond it (`oracle_beyond`; h = 0 is
                        that cache exactly), admitting as that cache or bypassing a miss it sees
                        used later
  oracle_ceiling        per h >= 1, the oracle run knowing at most h forwards that read the
                        fewest experts (`oracle_at`): a ceiling, never above the best cache
  best_no_prediction    the no-prediction cache that reads the fewest experts per token
  gap_closed            (best no-prediction - best horizon) / (best no-prediction - full
                        oracle), the full oracle being the best whole-future Belady
  good_decisions        share of horizon evictions whose victim is next used no sooner than the
                        candidate Belady would have evicted (ties count as good)
"""

from __future__ import annotations

import numpy as np
import torch

from tensorbend.cache import replay as demand
from tensorbend.cache.config import POLICIES, no_prediction
from tensorbend.cache.replay import Forecasts, ReplayConfig
from tensorbend.cache.report import best_no_prediction, best_rule, gap_closed, run_label
from tensorbend.predictors.horizon import Forecast, HorizonPredictor, request_forwards

ORACLE_FORESIGHTS = (0, 1, 2, 4, 8, None)  # None: all of the future; 0: the best cache itself
ADMISSION_WINDOW = 8  # forwards, the runtime's default
POOLS = ("global", "per_layer")


def evaluate_foresight(
    pred: HorizonPredictor,
    rows: dict[str, torch.Tensor],
    cache_frac: float = 0.25,
    replay: bool = True,
) -> dict:
    """The metrics of the module docstring (replay=False: the recalls only, for val)."""
    spec = pred.spec
    L, E, K, h = spec.num_moe_layers, spec.num_experts, spec.top_k, pred.cfg.foresight
    phases, used_FLE, fc, starts = _predict(pred, rows)
    next_FLE, within_FLE = fc.first_use_LEJ[..., 0], fc.within_LE()
    recalls = {
        "foresight": h,
        "inputs": pred.cfg.inputs,
        "requests": len(starts),
        "decode_forwards": sum(p == "decode" for p in phases),
        "next_forward_recall": _next_recall(phases, used_FLE, next_FLE, starts, K),
        "within_h_recall": _within_h_recall(phases, used_FLE, within_FLE, starts, h),
    }
    if not replay:
        return recalls
    slots = round(cache_frac * L * E)
    ids_FLK, n_FL = _padded(used_FLE)
    decode_F = np.array([p == "decode" for p in phases])
    forecasts = _forecast_arrays(fc, L)
    replays = {}

    def run(row: dict, forecast: Forecasts | None = None, fallback=None) -> None:
        spec = POLICIES[row["policy"]]  # prefetch: Reuse on a forecast, else Predicted alone
        evict = (
            "next_use"
            if spec.recorded_routing
            else "reuse"
            if forecast is not None
            else "predicted"
        )
        cfg = ReplayConfig(
            evict if spec.uses_prediction else row["policy"],
            slots,
            row["pool"],
            row["admission"],
            ADMISSION_WINDOW,
            fallback,
            row.get("foresight"),
            row.get("oracle_beyond") or "lru",
            judge=not spec.recorded_routing,
        )
        out = demand.replay(ids_FLK, cfg, E, forecasts=forecast, record=False)
        replays[run_label(row)] = {
            "experts_per_token": int(out.misses_F[decode_F].sum()) / max(int(decode_F.sum()), 1),
            "evictions": out.evictions,
            **(
                {"good_decisions": out.good / out.judged if out.judged else None}
                if cfg.judge
                else {}
            ),
            **row,
        }

    for policy in (*no_prediction(), "prefetch"):  # prefetch with none: Predicted alone
        for pool in POOLS:
            for adm in ("all", "frequency"):
                pred = "none" if POLICIES[policy].uses_prediction else None
                run({"policy": policy, "predictor": pred, "pool": pool, "admission": adm})
    best = best_no_prediction(list(replays.values()), "experts_per_token")
    best_name = run_label(best)
    ours = []
    for adm in ("all", "predicted"):
        row = {
            "policy": "prefetch",
            "horizon": "forecast",
            "token_ahead_layers": 0,
            "pool": "global",
            "admission": adm,
        }
        run(row, forecasts)
        ours.append(run_label(row))
    beyond = best_rule([best], "experts_per_token")
    for hz in ORACLE_FORESIGHTS:  # beyond its sight: the best cache's rule, pool and admission
        options = {(best["pool"], best["admission"]), (best["pool"], "predicted")}
        if hz is None:  # the full oracle: classic Belady's MIN too
            options |= {("global", "all"), ("global", "predicted")}
        for pool, adm in sorted(options):
            row = {
                "policy": "oracle",
                "foresight": hz,
                "oracle_beyond": beyond,
                "pool": pool,
                "admission": adm,
            }
            run(row, fallback=best["admission"] if adm == "predicted" else None)
    epf = lambda n: replays[n]["experts_per_token"]  # noqa: E731
    ours_name = min(ours, key=epf)
    full_name = min(
        (
            n
            for n, r in replays.items()
            if POLICIES[r["policy"]].recorded_routing and r["foresight"] is None
        ),
        key=epf,
    )
    out = {
        **recalls,
        "cache_frac": cache_frac,
        "cache_slots": slots,
        "replay": replays,
        "best_no_prediction": best_name,
        "oracle_beyond": beyond,
        "best_reuse": ours_name,
        "full_oracle": full_name,
        "gap_closed": gap_closed(epf(best_name), epf(ours_name), epf(full_name)),
        "oracle_ceiling": {},
        "good_decisions": replays[ours_name]["good_decisions"],
        "good_decisions_best_no_prediction": replays[best_name]["good_decisions"],
    }
    for hz in ORACLE_FORESIGHTS[1:]:
        out["oracle_ceiling"]["all" if hz is None else str(hz)] = oracle_at(out, hz)
    return out


def oracle_at(report: dict, h: int | None) -> str:
    """The ceiling knowing h forwards: the oracle run with foresight <= h that read the fewest
    experts per token (what it knows, it may ignore; h = 0 is the best cache itself). Belady
    within a short sight and a rule beyond it is no ceiling by itself: protecting an expert
    seen used later in the window can evict one the rule would keep (e.g. 5.63 against the
    best cache's 5.55 at h = 1 on tests/planted.py's router_trace at 25% cache)."""
    rp, top = report["replay"], float("inf") if h is None else h
    at = [
        n
        for n, r in rp.items()
        if POLICIES[r["policy"]].recorded_routing
        and (float("inf") if r["foresight"] is None else r["foresight"]) <= top
    ]
    return min(at, key=lambda n: rp[n]["experts_per_token"])


def dataset_recalls(pred: HorizonPredictor, ds: dict, chunk: int = 256) -> dict:
    """next_forward_recall and within_h_recall over the decode rows of `pred.dataset(...)`:
    the label Y of a row holds what both need (Y == 0: used at f + 1; Y < h: used within
    f + 1..f + h of its request), so a sample of rows is scored without its whole requests, in
    memory bounded by `chunk`. Equal to `evaluate_foresight(..., replay=False)` when every row
    of the requests is kept (tested)."""
    L, E, K, h = (
        pred.spec.num_moe_layers,
        pred.spec.num_experts,
        pred.spec.top_k,
        pred.cfg.foresight,
    )
    dec_N = ds["decode_N"][0]
    nxt_L, within_L, n = torch.zeros(L), torch.zeros(L), 0
    for i in range(0, dec_N.numel(), chunk):
        keep = dec_N[i : i + chunk]
        Y_NLE = ds["Y"][0][i : i + chunk][keep]
        h_ND = ds["H"][0][i : i + chunk][keep] if "H" in ds else None
        with torch.no_grad():
            p_NLEJ = torch.softmax(pred.net(ds["X"][0][i : i + chunk][keep], h_ND), dim=-1)
        top_NLK = p_NLEJ[..., 0].topk(K, -1).indices
        nxt_L += ((Y_NLE == 0).gather(-1, top_NLK).sum(-1) / K).sum(0)
        S_NLE = Y_NLE < h
        size_NL = S_NLE.sum(-1)
        order_NLE = (1 - p_NLEJ[..., h]).argsort(dim=-1, descending=True, stable=True)
        rank_NLE = torch.empty_like(order_NLE).scatter_(
            -1, order_NLE, torch.arange(E).expand_as(order_NLE)
        )
        hits_NL = (S_NLE & (rank_NLE < size_NL[..., None])).sum(-1)
        within_L += (hits_NL / size_NL.clamp(min=1)).sum(0)
        n += int(keep.sum())
    return {
        "foresight": h,
        "inputs": pred.cfg.inputs,
        "decode_rows": n,
        "next_forward_recall": (nxt_L / max(n, 1)).tolist(),
        "within_h_recall": (within_L / max(n, 1)).tolist(),
    }


def format_foresight(f: dict) -> str:
    """A horizon checkpoint: recalls per layer, then the replay (experts read per decode token)."""
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    lines = [
        f"{f['predictor']} ({f['inputs']}, foresight {f['foresight']} forwards) on "
        f"{f['requests']} requests, {f['decode_forwards']} decode forwards: next-forward "
        f"recall@k {mean(f['next_forward_recall']):.4f}, within-{f['foresight']} recall "
        f"{mean(f['within_h_recall']):.4f}",
        f"demand replay at cache {f['cache_frac']:.3f} ({f['cache_slots']} slots), experts read "
        "per decode token:",
    ]
    for name, r in sorted(f["replay"].items(), key=lambda kv: kv[1]["experts_per_token"]):
        lines.append(f"  {name:<48} {r['experts_per_token']:7.3f}")
    gap = f["gap_closed"]
    lines.append(
        f"best no-prediction cache: {f['best_no_prediction']}; gap to full Belady closed by "
        f"{f['best_reuse']}: {'-' if gap is None else f'{gap:.1%}'}"
    )
    lines.append(
        f"good decisions (evictions as good as Belady's): {_pct(f['good_decisions'])}, best "
        f"no-prediction cache: {_pct(f['good_decisions_best_no_prediction'])}"
    )
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def forecasts(pred: HorizonPredictor, rows: dict[str, torch.Tensor]) -> list[Forecast]:
    """The forecast after every forward of `rows` (batch 1, run order: `rows.forwards`)."""
    _, _, fc, _ = _predict(pred, rows)
    return [Forecast(p_LEJ, t_LE) for p_LEJ, t_LE in zip(fc.first_use_LEJ, fc.tail_LE, strict=True)]


def _predict(pred: HorizonPredictor, rows: dict[str, torch.Tensor]):
    """Forwards of every request in order: phases, used [F, L, E], the forecast after each
    (a Forecast stacked over F), and the index of each request's first forward."""
    phases, used, probs, tails, starts = [], [], [], [], []
    for request in request_forwards(rows, pred.spec):
        starts.append(len(phases))
        state = pred.new_state()
        for phase, used_LE, hidden_D in request:
            state.observe(used_LE, hidden_D)
            fc = pred.forecast(state)
            phases.append(phase)
            used.append(used_LE)
            probs.append(fc.first_use_LEJ)
            tails.append(fc.tail_LE)
    stacked = Forecast(torch.stack(probs), torch.stack(tails))
    return phases, torch.stack(used), stacked, starts


def _pairs(phases, starts, F: int, ahead: int = 1) -> list[int]:
    """Decode forwards f whose forward f + ahead is a decode forward of the same request."""
    ends = [*starts[1:], F]
    return [
        f
        for s, e in zip(starts, ends, strict=True)
        for f in range(s, e - ahead)
        if phases[f] == "decode"
    ]


def _next_recall(phases, used_FLE, reuse_FLE, starts, K: int) -> list[float]:
    fs = torch.tensor(_pairs(phases, starts, len(phases)), dtype=torch.long)
    top_NLK = reuse_FLE[fs].topk(K, -1).indices
    return (used_FLE[fs + 1].gather(-1, top_NLK).sum(-1) / K).mean(0).tolist()


def _within_h_recall(phases, used_FLE, reuse_FLE, starts, h: int) -> list[float]:
    ends = [*starts[1:], len(phases)]
    L = used_FLE.shape[1]
    hits, n = torch.zeros(L), torch.zeros(L)
    for s, e in zip(starts, ends, strict=True):
        for f in range(s, e - 1):
            if phases[f] != "decode":
                continue
            S_LE = used_FLE[f + 1 : min(f + 1 + h, e)].amax(0)
            for m in range(L):
                size = int(S_LE[m].sum())
                top = reuse_FLE[f, m].topk(size).indices
                hits[m] += S_LE[m, top].sum() / size
                n[m] += 1
    return (hits / n.clamp(min=1)).tolist()


def _padded(used_FLE: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The experts each layer-step uses, ascending, as THE replay takes them: ids [F, L, K]
    padded with -1 (K: the most any layer-step uses, a prefill's union), and n_FL."""
    used = used_FLE.bool().numpy()
    n_FL = used.sum(-1).astype(np.int64)
    K = max(int(n_FL.max(initial=0)), 1)
    ids_FLK = np.argsort(~used, axis=-1, kind="stable")[..., :K].astype(np.int64)
    ids_FLK[np.arange(K) >= n_FL[..., None]] = -1
    return ids_FLK, n_FL


def _forecast_arrays(fc: Forecast, L: int, chunk: int = 512) -> Forecasts:
    """The forecast after every forward as the expected next-use steps `Reuse` ranks by
    (`Forecast.next_use_tensors`), [F, L * E] float64, a chunk of forwards at a time."""
    F = fc.first_use_LEJ.shape[0]
    ahead, after = (np.empty((F, fc.tail_LE[0].numel())) for _ in range(2))
    for i in range(0, F, chunk):
        part = Forecast(fc.first_use_LEJ[i : i + chunk], fc.tail_LE[i : i + chunk])
        a, b = part.next_use_tensors(torch.arange(i, min(i + chunk, F)), L)
        ahead[i : i + chunk], after[i : i + chunk] = a.flatten(1).numpy(), b.flatten(1).numpy()
    return Forecasts(ahead, after)
