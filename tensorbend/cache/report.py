"""One result row, one run label, one headline comparison: what every run, replay and bench reports.

Usage:
    >>> rows = [
    ...     {"policy": "lru", "pool": "global", "admission": "all", "cache_frac": 0.25,
    ...      "decode_tok_s": 40.0, "bytes_read_per_token": 10.0},
    ...     {"policy": "prefetch", "predictor": "none", "lookahead": "d1", "pool": "global",
    ...      "admission": "all", "cache_frac": 0.25, "decode_tok_s": 42.0, "bytes_read_per_token": 9.0},
    ...     {"policy": "prefetch", "predictor": "tensorbend", "lookahead": "d1", "horizon": "h.st",
    ...      "token_ahead_layers": 1, "pool": "global", "admission": "predicted", "cache_frac": 0.25,
    ...      "decode_tok_s": 46.2, "bytes_read_per_token": 7.0, "counters": {"prefetch_loaded": 5}},
    ...     {"policy": "oracle", "foresight": None, "pool": "global", "admission": "all",
    ...      "cache_frac": 0.25, "decode_tok_s": 60.0, "bytes_read_per_token": 5.0},
    ... ]
    >>> [run_label(r) for r in rows]
    ['lru', 'prefetch:none', 'horizon+d1:tensorbend/adm=predicted', 'oracle@h=all']
    >>> best_no_prediction(rows)["policy"]          # Predicted eviction fed no predictions counts
    'prefetch'
    >>> run_label(best_peer(rows))                  # neither ours nor the oracle
    'prefetch:none'
    >>> c = compare(rows)[0.25]
    >>> round(c["runs"]["horizon+d1:tensorbend/adm=predicted"]["vs_best_cache"], 3), c["runs"][
    ...     "horizon+d1:tensorbend/adm=predicted"]["gap_closed_bytes"]
    (1.1, 0.5)

A row is a dict with the keys of `run --json` (offload/result.py); `tensorbend simulate` writes
the same keys for the same things (ROW_KEYS; tests/test_report.py checks both). Labels say what
ran, from the row's own fields, never from a field of an empty predictor:
  lru, lfu/per_layer, lfru/adm=frequency   caches without prediction (pool, admission)
  prefetch:none                            `Predicted` eviction fed no predictions
  d1:tensorbend                            a within-token predictor (lookahead:kind)
  horizon, horizon(evict only)             the cross-token forecast (with / without prefetches
                                           of the next forward's first layers)
  horizon+d1:tensorbend                    both
  recency, recency+d1:spec_gate            the training-free cross-token peer (a peer's row)
  oracle@h=2, oracle@h=2/beyond=lfru       the bounded-foresight oracle (its rule past its sight)
  ... [0 prefetches loaded]                a predictor ran and none of its prefetches loaded
The comparison, per cache fraction: the best no-prediction cache (every bounded policy that
reads no predictor, `prefetch` with none included) by decode tok/s and by bytes, the full
oracle (every future routing, fewest bytes), and per run `vs_best_cache` (tok/s over the best
cache's) and `gap_closed_bytes` / `gap_closed_seconds` ((best - run) / (best - full oracle),
bytes or decode seconds per token). What ours is claimed against: `best_peer`, the fastest row
that is neither ours (`is_ours`: our within-token predictor or our horizon) nor an oracle:
every cache, and the peers' predictors (spec_gate, the seed's MLP) used as prefetchers.
"""

from __future__ import annotations

import statistics

from tensorbend.cache.config import POLICIES
from tensorbend.host_load import warning

PEER_HORIZON = "recency"  # the training-free cross-token peer's row (predictors/recency.py)

ROW_KEYS = (
    "policy",
    "predictor",
    "lookahead",
    "horizon",
    "token_ahead_layers",
    "pool",
    "admission",
    "foresight",
    "oracle_beyond",
    "cache_frac",
    "decode_tok_s",
    "stall_s_per_token",
    "bytes_read_per_token",
    "demand_hit_rate",
    "wasted_prefetch_bytes",
    "counters",
)
"""Keys every result row carries, from the runtime (`run --json`) and the simulator alike."""

HIGHER_IS_BETTER = ("decode_tok_s", "prefill_tok_s")


def uses_prediction(row: dict) -> bool:
    """Whether the run read any predictor (prefetch with predictor none and no horizon: no)."""
    spec = POLICIES[row["policy"]]
    if not spec.uses_prediction:
        return False
    return spec.recorded_routing or _within(row) or bool(row.get("horizon"))


def is_no_prediction_cache(row: dict) -> bool:
    """A bounded cache that kept experts and read no predictor."""
    spec = POLICIES[row["policy"]]
    return spec.bounded and spec.keeps_experts and not uses_prediction(row)


def run_label(row: dict) -> str:
    """The run's name in every table and plot (see the module docstring)."""
    policy, spec = row["policy"], POLICIES[row["policy"]]
    if spec.recorded_routing:
        h = row.get("foresight")
        name = f"oracle@h={'all' if h is None else h}"
        beyond = row.get("oracle_beyond")
        if beyond not in (None, "lru") and h is not None:
            name += f"/beyond={beyond}"
    elif spec.uses_prediction:
        parts = []
        if row.get("horizon"):
            name = PEER_HORIZON if row["horizon"] == PEER_HORIZON else "horizon"
            parts.append(name if row.get("token_ahead_layers", 1) else f"{name}(evict only)")
        if _within(row):
            la = row.get("lookahead")
            parts.append(f"{la}:{row['predictor']}" if la else row["predictor"])
        name = "+".join(parts) or f"{policy}:none"
    else:
        name = policy
    if spec.bounded and spec.keeps_experts:
        name += "/per_layer" if row.get("pool") == "per_layer" else ""
        name += f"/adm={row['admission']}" if row.get("admission", "all") != "all" else ""
    if _prefetching(row) and row.get("counters", {}).get("prefetch_loaded", 1) == 0:
        name += " [0 prefetches loaded]"
    return name


def what_ran(row: dict) -> str:
    """The run's label without the timing-dependent " [0 prefetches loaded]" note: what pairs
    a configuration's repeats, and a runtime row with its simulated twin."""
    return run_label(row).split(" [")[0]


def best_no_prediction(rows: list[dict], metric: str = "decode_tok_s") -> dict | None:
    """The no-prediction cache best on `metric` (highest tok/s, fewest of anything else)."""
    peers = [r for r in rows if is_no_prediction_cache(r) and r.get(metric) is not None]
    if not peers:
        return None
    sign = 1 if metric in HIGHER_IS_BETTER else -1
    return max(peers, key=lambda r: sign * r[metric])


def is_ours(row: dict) -> bool:
    """A row of ours: our within-token predictor (kind tensorbend) or our horizon (not the
    training-free `recency` forecast, a peer)."""
    ours_horizon = bool(row.get("horizon")) and row["horizon"] != PEER_HORIZON
    return row.get("predictor") == "tensorbend" or ours_horizon


def best_peer(rows: list[dict]) -> dict | None:
    """The fastest row that is neither ours nor an oracle nor resident: a cache without
    prediction, `prefetch:none`, or a peer's predictor (spec_gate, the seed's MLP, ...) used
    as a prefetcher. What ours is claimed against; None when no such row has a tok/s."""
    peers = [
        r
        for r in rows
        if r.get("decode_tok_s")
        and not is_ours(r)
        and POLICIES[r["policy"]].bounded
        and not POLICIES[r["policy"]].recorded_routing
    ]
    return max(peers, key=lambda r: r["decode_tok_s"], default=None)


def best_rule(rows: list[dict], metric: str = "bytes_read_per_token") -> str:
    """The eviction rule (`--oracle-beyond`) of the best no-prediction cache on `metric`: the
    rule the bounded oracle ranks by beyond its sight (lru when there is none)."""
    best = best_no_prediction(rows, metric)
    if best is None:
        return "lru"
    return "predicted" if POLICIES[best["policy"]].uses_prediction else best["policy"]


def full_oracle(rows: list[dict]) -> dict | None:
    """The oracle knowing every future routing that read the fewest bytes."""
    full = [
        r for r in rows if POLICIES[r["policy"]].recorded_routing and r.get("foresight") is None
    ]
    return min(full, key=lambda r: r["bytes_read_per_token"]) if full else None


def vs_best_cache(row: dict, best: dict | None) -> float | None:
    """Decode tok/s of `row` over the best no-prediction cache's."""
    if best is None or not best.get("decode_tok_s") or row.get("decode_tok_s") is None:
        return None
    return row["decode_tok_s"] / best["decode_tok_s"]


def gap_closed(best: float, x: float, ceiling: float) -> float | None:
    """Share of the distance from the best no-prediction cache to the ceiling that x covers
    (lower is better for all three: bytes or seconds per token)."""
    return (best - x) / (best - ceiling) if best != ceiling else None


def compare(rows: list[dict]) -> dict[float, dict]:
    """The headline comparison per cache fraction (bounded runs only; see the docstring)."""
    out = {}
    for frac in sorted({r["cache_frac"] for r in rows if POLICIES[r["policy"]].bounded}):
        at = [
            r for r in rows if POLICIES[r["policy"]].bounded and abs(r["cache_frac"] - frac) < 1e-3
        ]
        fast, lean = best_no_prediction(at), best_no_prediction(at, "bytes_read_per_token")
        if fast is None:
            continue
        oracle = full_oracle(at)
        best_s = min(_s_per_token(r) for r in at if is_no_prediction_cache(r))
        runs = {}
        for r in at:
            one = {"vs_best_cache": vs_best_cache(r, fast)}
            ratios = repeat_ratios(r, fast)
            if ratios is not None:
                one["vs_best_cache_repeats"] = ratios
            if oracle is not None:
                one["gap_closed_bytes"] = gap_closed(
                    lean["bytes_read_per_token"],
                    r["bytes_read_per_token"],
                    oracle["bytes_read_per_token"],
                )
                one["gap_closed_seconds"] = gap_closed(
                    best_s, _s_per_token(r), _s_per_token(oracle)
                )
            runs[run_label(r)] = one
        out[frac] = {
            "best_no_prediction_cache": run_label(fast),
            "best_no_prediction_decode_tok_s": fast["decode_tok_s"],
            "best_no_prediction_by_bytes": run_label(lean),
            "best_no_prediction_bytes_per_token": lean["bytes_read_per_token"],
            "full_oracle": oracle
            and {k: oracle[k] for k in ("decode_tok_s", "bytes_read_per_token")},
            "runs": runs,
        }
    return out


def _within(row: dict) -> bool:
    return row.get("predictor") not in (None, "none", "oracle")


def _prefetching(row: dict) -> bool:
    """A predictor ran that was meant to prefetch (a within-token one, or the horizon with
    next-forward prefetches)."""
    if POLICIES[row["policy"]].recorded_routing or not POLICIES[row["policy"]].uses_prediction:
        return False
    return _within(row) or (bool(row.get("horizon")) and row.get("token_ahead_layers", 1) > 0)


def _s_per_token(r: dict) -> float:
    return 1.0 / r["decode_tok_s"] if r.get("decode_tok_s") else float("inf")


def median_row(rows: list[dict]) -> dict:
    """One configuration from its interleaved repeats (paired by `what_ran`): the first repeat's
    row (its counters, so its label's note) with every timing the median of the repeats, and
    the repeats kept (`decode_tok_s_repeats`, `host_other_cores_repeats`); `host_busy` if any
    repeat was."""
    out = dict(rows[0])
    if len(rows) == 1:
        return out
    for key in (
        "decode_tok_s",
        "prefill_tok_s",
        "stall_s_per_token",
        "predict_s_per_token",
        "bytes_read_per_token",
        "demand_hit_rate",
        "io_cpu_s_per_token",
    ):
        xs = [r[key] for r in rows if r.get(key) is not None]
        if xs:
            out[key] = statistics.median(xs)
    out["decode_tok_s_repeats"] = [r["decode_tok_s"] for r in rows]
    out["output_matches_resident"] = all(r.get("output_matches_resident") for r in rows)
    out["host_busy"] = any(r.get("host_busy") for r in rows)
    out["host_other_cores_repeats"] = [_other_cores(r) for r in rows]
    tms = [r.get("time_model") or {} for r in rows]
    if "slowdown" in tms[0]:  # an emulated link: s and the charged speed, per repeat
        charged = [t.get("decode_tok_s_charged") for t in tms]
        out["time_model"] = dict(
            tms[0],
            slowdown_repeats=[t.get("slowdown") for t in tms],
            slowdown_in_run_repeats=[t.get("slowdown_in_run") for t in tms],
            decode_tok_s_charged_repeats=charged,
            decode_tok_s_charged=statistics.median(x for x in charged if x is not None)
            if any(x is not None for x in charged)
            else None,
        )
    return out


def host_warning(rows: list[dict]) -> str | None:
    """`host_load.warning` over run rows (their passes and the resident reference), or None."""
    cores: dict[str, float | None] = {}
    cpus = 1
    for r in rows:
        name = r.get("label") or run_label(r)
        load = r.get("host_load") or {}
        for part, label in (("reference", "resident reference"), ("run", name)):
            x = (load.get(part) or {}).get("other_cores")
            cpus = max(cpus, (load.get(part) or {}).get("cpus") or 1)
            if x is not None:
                cores[label] = max(x, cores.get(label) or 0.0)
        for x in r.get("host_other_cores_repeats") or ():
            if x is not None:
                cores[name] = max(x, cores.get(name) or 0.0)
    return warning(cores, cpus)


def _other_cores(row: dict) -> float | None:
    return ((row.get("host_load") or {}).get("run") or {}).get("other_cores")


def repeat_ratios(row: dict, best: dict) -> list[float] | None:
    """Sorted per-repeat ratios of row's decode tok/s to the best cache's in the same repeat
    (None without repeats): a ratio is claimed only as their median with this range."""
    xs, bs = row.get("decode_tok_s_repeats"), best.get("decode_tok_s_repeats")
    if not xs or not bs or len(xs) != len(bs):
        return None
    return sorted(x / b for x, b in zip(xs, bs, strict=True))


def ratio_verdict(lo: float, hi: float) -> str:
    """A ratio's range [lo, hi] over repeats: a gain or a loss only in every repeat.

    >>> ratio_verdict(0.97, 1.16), ratio_verdict(1.04, 1.2), ratio_verdict(0.8, 0.99)
    ('a tie', 'faster', 'slower')
    """
    return "a tie" if lo <= 1 <= hi else "faster" if lo > 1 else "slower"


def shown_ratio(one: dict) -> float:
    """The ratio a page claims: the median of the repeats' ratios, else the single run's."""
    xs = one.get("vs_best_cache_repeats")
    return statistics.median(xs) if xs else (one.get("vs_best_cache") or 0.0)


def format_ratio(one: dict) -> str:
    """`vs_best_cache` as printed: median [range] with repeats, a single ratio without."""
    xs = one.get("vs_best_cache_repeats")
    if not xs:
        return f"{shown_ratio(one):.2f}x"
    return f"{shown_ratio(one):.2f}x [{xs[0]:.2f}, {xs[-1]:.2f}]"
