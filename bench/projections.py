"""Projections (simulated, not measured): what each policy and predictor buys on large models and
real hardware, from a zoo trace's held-out routing.

Usage:
    python -m bench.projections --trace runs/bench/default/trace \\
        --predictor runs/bench/default/ours_d1.safetensors \\
        --horizon runs/bench/default/horizon_routing_hidden.safetensors \\
        --json docs/results/projections.json --doc docs/results/projections.md

For each (hardware, geometry) pair of `--pairs` it runs `tensorbend simulate` on the test split:
every cache without prediction (lru, lfu, lfru and prefetch with no predictor, x admission all /
frequency, x pool global, or also per_layer with `--pools global,per_layer`), prefetch with
transition / ours (each also driven by the horizon's forecasts; admission all and predicted,
Belady's bypass), each `--peer` (spec_gate, the seed's MLP: prefetchers with ours' admission,
without the horizon), and the oracle; the cache is the largest that fits beside the resident
weights. Per pair it reports decode tok/s, stall, GB read per token and hit rate, and each
run's speed over the best no-prediction cache of the same pair (`cache.report.compare`: every
cache that reads no predictor, `prefetch:none` included). Every number is a projection;
each prediction call is charged its modelled cost on the hardware profile (kernel launches +
the predictor's weights read once, `offload.time_model.PredictorCost`; the predictor as
trained on zoo:default's trace: a horizon predictor's work grows with MoE layers x experts,
about 120x zoo:default's on Kimi-K2.5, which the model does not scale).
The page is rendered from the JSON by `bench.pages.projections`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.pages.projections import markdown
from bench.record import bench_args, command, emit
from tensorbend.atomic import atomic_write_text
from tensorbend.cache.config import POLICIES, no_prediction
from tensorbend.cache.report import compare, run_label, vs_best_cache
from tensorbend.predictors.spec import PredictorSpec
from tensorbend.simulate import SimulateConfig, simulate, simulate_peers

NO_PREDICTION = no_prediction()


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    t0 = time.perf_counter()
    out = {"trace": a.trace, "command": command("projections", argv), "pairs": [],
           "pools": _names(a.pools)}  # fmt: skip
    for pair in a.pairs.split(","):
        hardware, geometry = pair.split(":")
        base = SimulateConfig(
            trace=Path(a.trace), hardware=hardware, geometry=geometry, progress=False,
            policies=("resident", "on_demand", *NO_PREDICTION, "prefetch", "oracle"),
            predictors=("none", "transition", *a.predictor),
            prediction=PredictorSpec(horizon=Path(a.horizon) if a.horizon else None),
        )  # fmt: skip
        caches = dict(policies=NO_PREDICTION)
        blind = dict(policies=("prefetch",), predictors=("none",), prediction=PredictorSpec())
        passes = [  # (pool, admission, what runs): every cache without prediction (prefetch:none
            ("global", "all", {}),  # included) x pool x admission; ours and the oracle with
            ("global", "frequency", caches),  # predicted admission (bypass a miss predicted
            ("global", "frequency", blind),  # back later than its victim)
            ("global", "predicted", dict(policies=("prefetch", "oracle"))),
        ]
        passes += [(pool, adm, what) for pool in _names(a.pools) if pool != "global"
                   for adm in ("all", "frequency") for what in (caches, blind)]  # fmt: skip
        passes += [("global", adm, None) for adm in ("all", "predicted") if a.peer]  # peers
        old = _previous(a, hardware, geometry)
        rows, head = [], old and {k: old[k] for k in _HEAD}
        for pool, adm, what in passes:
            offload = replace(base.offload, lookahead="d1", pool=pool, admission=adm)
            if what is None:  # the peers, simulated every time (prefetch:none: passes above)
                only = replace(base, offload=offload, policies=("prefetch",))
                rows += simulate_peers(only, tuple(a.peer))
                continue
            cfg = replace(base, offload=offload, **what)
            kept = [r for r in (old or {}).get("results", []) if r["pool"] == pool
                    and r["admission"] == adm and r["policy"] in cfg.policies
                    and not r.get("peer")]  # fmt: skip
            if {r["policy"] for r in kept} == set(cfg.policies):
                rows += kept  # the same simulation, already in --reuse's JSON
                continue
            res = simulate(cfg).to_json()
            rows += res["results"]
            head = {k: res[k] for k in _HEAD}
        (c,) = compare(rows).values()  # one cache size per pair
        best = next(r for r in rows if r["label"] == c["best_no_prediction_cache"])
        for r in rows:
            r["vs_best_cache"] = vs_best_cache(r, best)
        out["pairs"].append({**head, "results": rows, "best_no_prediction":
                             c["best_no_prediction_cache"], "full_oracle": _full(rows)})  # fmt: skip
        print(f"{pair}: done", file=sys.stderr)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if a.doc:
        atomic_write_text(Path(a.doc), markdown(out))
    return emit(out, a.json)


_HEAD = ("hardware", "geometry", "mapping", "batch", "tokens")


def _previous(a, hardware: str, geometry: str) -> dict | None:
    """The pair's results in `--reuse JSON` (the same trace, predictors and horizon), its rows
    in today's keys (the simulator is deterministic: a pass simulated there is not redone)."""
    if not a.reuse:
        return None
    prev = json.loads(Path(a.reuse).read_text())
    was = _parser().parse_args(bench_args(prev["command"]))
    if (was.trace, was.predictor, was.horizon) != (a.trace, a.predictor, a.horizon):
        raise SystemExit(f"--reuse {a.reuse}: another trace, predictor or horizon")
    pair = next(
        (p for p in prev["pairs"] if (p["hardware"], p["geometry"]) == (hardware, geometry)), None
    )
    for r in (pair or {}).get("results", []):
        if r["predictor"] and r["predictor"].endswith("+horizon"):  # before labels said what ran
            r["predictor"] = r["predictor"].removesuffix("+horizon")
        r.setdefault("token_ahead_layers", 1 if r.get("horizon") else None)
        r.setdefault("oracle_beyond", "lru" if POLICIES[r["policy"]].recorded_routing else None)
        r["label"] = run_label(r)
    return pair


def _names(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def _full(rows: list[dict]) -> str:
    """The fastest full-foresight oracle's label."""
    return max(
        (r for r in rows if POLICIES[r["policy"]].recorded_routing), key=lambda r: r["decode_tok_s"]
    )["label"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--predictor", action="append", default=[], help="within-token checkpoint")
    p.add_argument("--horizon", default=None, help="cross-token checkpoint")
    p.add_argument("--peer", action="append", default=[],
                   help="a peer that predicts (a name, e.g. spec_gate, or a checkpoint, e.g. the "
                   "seed's MLP), run as a prefetcher without the horizon, admission all and "
                   "predicted; simulated every time (its rows carry peer: true)")  # fmt: skip
    p.add_argument("--pairs", default="dgx-spark:kimi-k2.5,h100-pcie5:deepseek-v3")
    p.add_argument(
        "--pools",
        default="global",
        help="cache pools of the no-prediction "
        "caches: global, or global,per_layer (per_layer: about 12 more minutes "
        "per pair on this machine)",
    )
    p.add_argument(
        "--reuse",
        default=None,
        help="a previous JSON of the same trace, "
        "predictors and horizon: passes it holds are not simulated again",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--doc", default=None)
    return p


if __name__ == "__main__":
    sys.exit(main())
