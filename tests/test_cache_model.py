"""Known answers for the one cache model: the simulator and the runtime's cache count, to the
last bit, what they counted before their slot tables, request queues and wires were made one.

tests/data/cache_model_known.json holds what main at 95caa0b computed (the simulator with its
own copy of the slot mechanism and link; the runtime's `ExpertCache` and `Loader` queue) on
the fixed work below:
- `simulate` on two planted routing traces: every policy, learned and random predictors,
  calibrated costs (I/O threads 1-3, latency, prediction and miss costs, per-token costs),
  hardware profiles on a large geometry, global and per-layer pools, all / frequency /
  predicted admission, bounded foresight, batches, backlog 0 / 0.5 / inf, lookaheads;
- the horizon's forecasts (random, fixed seed) steering `Reuse` through `runs.run_one`;
- the event run alone (`simulate.events.EventRun`) on planted work with noisy predictions
  before attention and at the router: five policies x I/O threads 1-3 x backlog 0 / 0.25 s /
  inf, an uncapped link (transfers completing at the instant they start) and a preloaded cache;
- the runtime's `ExpertCache` driven as its compute and I/O threads act (one thread, loads
  finishing at once or one layer late), with a counter reset half way.
Intended changes since: the horizon's rows (`horizon/...`) charge a cross-token forecast's
next-forward prefetches to `forecast_s` (0 here) instead of `predict_s` per list (seconds
only; every byte and count unchanged); a prefetch taken while the wire is booked more than the
backlog ahead waits in the queue instead of being dropped (`RequestQueue.deferral`): the rows
with prefetches, two or more I/O threads and a finite backlog changed (40 of 110), every other
row is as before; the file now also holds the `prefetch/none` rows (Predicted eviction fed
no predictions); on a hardware profile (no calibration) each within-token prediction call
costs the predictor's modelled cost there (`offload.time_model.PredictorCost.call_s`, was 0):
the three `sim/hw_*/prefetch/*` rows changed in seconds only (stall, tok/s; every byte and
count unchanged). Every counter, second and token count must stay equal
(floats compared exactly). Rewrite the
file only for an intended change of the model, and say which: `python tests/test_cache_model.py
> tests/data/cache_model_known.json` writes the current observations.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import tempfile
from pathlib import Path

import torch
from test_import import csv_rows, planted_routing
from test_simulate import sim_config

from tensorbend.cache.config import make_resident_set
from tensorbend.cache.replay import planted_trace
from tensorbend.cache.transfers import Link
from tensorbend.engines.importers import ImportConfig, import_trace
from tensorbend.engines.importers.csv import write_csv
from tensorbend.offload.cache import CacheConfig, ExpertCache
from tensorbend.predictors.spec import PredictorSpec
from tensorbend.simulate import simulate
from tensorbend.simulate.costs import Calibration
from tensorbend.simulate.events import EventRun, ForwardWork, IOThreads, LayerWork, Times

KNOWN = Path(__file__).parent / "data" / "cache_model_known.json"
ROW_KEYS = ("decode_tok_s", "prefill_tok_s", "stall_s_per_token", "bytes_read_per_token")
ALL = ("resident", "on_demand", "lru", "lfu", "lfru", "prefetch", "oracle")
CALIBRATIONS = {
    "plain": {},
    "busy": dict(link_bandwidth_Bps=1000 / 0.3, link_latency_s=0.05, attn_s=0.5, expert_s=0.05,
                 forward_s=0.2, attn_s_per_token=0.01, expert_s_per_token=0.02, predict_s=0.01,
                 miss_s=0.003, io_slots=3),
    "one": dict(link_bandwidth_Bps=1000 / 0.2, link_latency_s=0.02, attn_s=0.3, expert_s=0.04,
                io_slots=1, predict_s=0.002),
}  # fmt: skip
CASES = {  # name: (trace, calibration or None for profiles, SimulateConfig fields)
    "a_all": ("a", "plain", dict(policies=ALL, predictors=("transition", "none", "random",
              "frequency"), cache_fracs=(0.25, 0.5))),
    "a_busy": ("a", "busy", dict(policies=ALL[1:], predictors=("transition", "prev_token",
               "random"), cache_fracs=(0.25, 0.5), prediction=PredictorSpec(prefetch_extra=2))),
    "a_busy_b3": ("a", "busy", dict(policies=("lru", "lfru", "prefetch", "oracle"),
                  predictors=("transition", "random"), cache_fracs=(0.375,), batch=3)),
    "a_perlayer_freq": ("a", "one", dict(policies=ALL[2:], predictors=("random", "transition"),
                        cache_fracs=(0.5,), pool="per_layer", admission="frequency",
                        admission_window=3)),
    "a_predadm": ("a", "busy", dict(policies=("prefetch", "oracle"), predictors=("random",
                  "transition"), cache_fracs=(0.25,), admission="predicted", foresight=1)),
    "a_backlog0": ("a", "one", dict(policies=("prefetch", "oracle"), predictors=("random",
                   "frequency"), cache_fracs=(0.25,), prefetch_backlog=0.0, lookahead="pre_attn")),
    "a_inf_same": ("a", "busy", dict(policies=("prefetch", "oracle"), predictors=("random",),
                   cache_fracs=(0.5,), prefetch_backlog=float("inf"), lookahead="same_layer",
                   foresight=2)),
    "b_busy": ("b", "busy", dict(policies=ALL[1:], predictors=("transition", "random",
               "frequency"), cache_fracs=(0.2, 0.4), prediction=PredictorSpec(prefetch_extra=1))),
    "b_one_b2": ("b", "one", dict(policies=("lru", "prefetch", "oracle"), predictors=("random",
                 "transition"), cache_fracs=(0.3,), batch=2, lookahead="d2")),
    "hw_kimi": ("a", None, dict(hardware="dgx-spark", geometry="kimi-k2.5", policies=("lru",
                "lfru", "prefetch", "oracle"), predictors=("transition", "random"), max_prompts=3)),
    "hw_qwen": ("b", None, dict(hardware="h100-pcie5", geometry="qwen3-30b-a3b",
                policies=("on_demand", "lfu", "prefetch"), predictors=("random",), max_prompts=4,
                cache_fracs=(0.1,))),
}  # fmt: skip


def observe(root: Path) -> dict:
    """Every observation, keyed `case/policy/predictor/cache_frac` (simulated rows) or
    `runtime/policy/admission`."""
    return {**simulated(root), **horizon(root), **event_runs(), **runtime()}


def simulated(root: Path) -> dict:
    traces = {
        "a": _trace(root / "a", prompts=40, L=3, E=8, K=2, prefill=4, decode=6, seed=3),
        "b": _trace(root / "b", prompts=30, L=5, E=16, K=3, prefill=5, decode=8, seed=11),
    }
    out = {}
    for name, (trace, cal, kw) in CASES.items():
        base = dict(
            hardware="h100-pcie5",
            geometry="from-trace",
            split="all",
            max_prompts=10,
            oracle_beyond="lru",
        )  # the rule the recorded answers were made with
        cfg = sim_config(trace=traces[trace], calibration=_calibration(root, cal),
                             progress=False, **{**base, **kw})  # fmt: skip
        for r in simulate(cfg).results:
            out[f"sim/{name}/{r['policy']}/{r['predictor']}/{r['cache_frac']}"] = _row(r)
    return out


def horizon(root: Path) -> dict:
    """Random forecasts (fixed seed) handed to `Reuse` after every forward, next-forward
    prefetches of two layers."""
    from tensorbend.capture.rows import forwards
    from tensorbend.capture.trace import Trace
    from tensorbend.predictors.horizon import Forecast
    from tensorbend.simulate import plan, runs, simulator
    from tensorbend.simulate.predictions import rank_all

    trace = _trace(root / "a", prompts=40, L=3, E=8, K=2, prefill=4, decode=6, seed=3)
    cfg = sim_config(trace=trace, hardware="h100-pcie5", geometry="from-trace",
                         calibration=_calibration(root, "busy"), progress=False, split="all",
                         max_prompts=6, policies=("prefetch",), predictors=("transition", "none"),
                         cache_fracs=(0.5,), token_ahead_layers=2)  # fmt: skip
    tr = Trace.open(trace)
    hw, _, geo, mapping, costs = simulator._setup(cfg, tr)
    rows = simulator._rows(cfg, tr)
    fwds = forwards(rows, 1)
    demand = plan.demand_lists(rows, fwds)
    g = torch.Generator().manual_seed(0)
    fcs = [
        Forecast(
            torch.softmax(torch.randn(3, 8, 3, generator=g), -1), torch.rand(3, 8, generator=g)
        )
        for _ in fwds
    ]
    out = {}
    for ranked in rank_all(("transition", "none"), tr, rows, "d1", 2, None):
        r = runs.run_one(cfg, "prefetch", ranked, 0.5, fwds, demand, mapping, costs, hw, geo, fcs)
        out[f"horizon/prefetch/{ranked.kind}/0.5"] = _row(r)
    return out


def event_runs() -> dict:
    """EventRun on planted work: 8 bytes per expert, 64 B/s (0.125 s on the wire) + 0.0625 s
    latency, attention 0.25 s and 0.0625 s per expert token, 0.5 s per forward, 1/64 s per
    prediction, 1/128 s per miss (all exact in binary)."""
    times = Times(lambda n: 0.25 * n, lambda n: 0.0625 * n, lambda n: 0.5, 0.015625, 0.0078125)
    runs = [(p, threads, backlog, 64.0) for p in ("lru", "lfru", "prefetch", "oracle", "on_demand")
            for threads, backlog in ((1, float("inf")), (3, 0.25), (2, 0.0))]  # fmt: skip
    runs += [
        ("lru", 2, float("inf"), None),
        ("prefetch", 2, 0.25, None),
        ("resident", 2, 0.25, 64.0),
    ]
    planted = planted_work()
    out = {}
    for policy, threads, backlog, bandwidth in runs:
        work = [
            ForwardWork(
                phase=int(f % 12 != 0),  # each prompt's first forward: a 6-token prefill
                tokens=6 if f % 12 == 0 else 1,
                layers=[LayerWork(lw["demand"], lw["at_start"], lw["at_router"]) for lw in layers],
            )
            for f, layers in enumerate(planted)
        ]
        cap = 64 if policy == "resident" else 20
        rs = make_resident_set(policy, cap, 4, steps=_steps(planted))
        io = IOThreads(Link(bandwidth, 0.0625), threads, backlog)
        run = EventRun(rs, io, times, scratch=3, unit_bytes=8)
        if policy == "resident":
            run.preload([(m, e) for m in range(4) for e in range(16)])
        run.run(work)
        out[f"event/{policy}/{threads}/{backlog}/{bandwidth}"] = {
            "total": _sim_counters(run.total),
            "phases": [_sim_counters(run.stats[0]), _sim_counters(run.stats[1])],
            "seconds": [run.seconds[0], run.seconds[1]],
            "tokens": [run.tokens[0], run.tokens[1]],
        }
    return out


def runtime() -> dict:
    """The runtime's ExpertCache driven in the order its threads act: claims, hints, demand
    loads, prefetches by (step, rank) (some finishing one layer late), releases."""
    work = planted_work()
    out = {}
    for policy in ("lru", "lfu", "prefetch", "oracle"):
        for adm in ("all", "frequency"):
            pool = "per_layer" if adm == "frequency" else "global"
            rs = make_resident_set(policy, 14, 4, pool, adm, 4, _steps(work), None)
            victims = _victims_of(rs)
            cache = ExpertCache(CacheConfig(scratch=3), rs, 1, torch.float32, 8)
            for f, layers in enumerate(work):
                _runtime_forward(cache, f, layers)
                if f == len(work) // 2:
                    mid, mid_layers = _counters(cache.stats), cache.layer_counters()
                    cache.reset_counters()
            cache.finalize()
            out[f"runtime/{policy}/{adm}"] = {
                "stats": _counters(cache.stats),
                "layers": cache.layer_counters(),
                "mid": mid,
                "mid_layers": mid_layers,
                "victims": [len(victims), hashlib.sha256(str(victims).encode()).hexdigest()],
            }
    return out


def planted_work() -> list[list[dict]]:
    """[forward][layer] -> {"demand": [(expert, tokens)], "at_router": [(step, ids)],
    "at_start": [(step, ids)]}: planted reuse, predictions of the next layer's true experts
    with a wrong one in front and one behind, a random guess two layers ahead."""
    ids = planted_trace(prompts=6, tokens=12, layers=4, experts=16, top_k=3, seed=2)
    rng = random.Random(5)
    work = []
    for f, ids_LK in enumerate(ids):
        L = len(ids_LK)
        layers = [
            {"demand": [(e, 1 + e % 3) for e in ids_LK[m]], "at_router": [], "at_start": []}
            for m in range(L)
        ]
        for m in range(L):
            true = ids_LK[m + 1] if m + 1 < L else ids[f + 1][0] if f + 1 < len(ids) else None
            if true is None:
                continue
            wrong = [rng.randrange(16) for _ in range(2)]
            ranked = list(dict.fromkeys(wrong[:1] + true + wrong[1:]))
            layers[m]["at_router"].append((f * L + m + 1, ranked))
            if m + 2 < L:
                layers[m]["at_start"].append((f * L + m + 2, [rng.randrange(16)]))
        work.append(layers)
    return work


def test_simulated_runs_and_runtime_counters_match_the_recorded_answers(tmp_path):
    known = json.loads(KNOWN.read_text())
    seen = observe(tmp_path)
    missing = sorted(set(known) - set(seen))
    assert not missing, f"observations not made any more: {missing[:5]}"
    differ = [k for k in known if seen[k] != known[k]]
    for k in differ[:3]:
        print(k, "\n  known", known[k], "\n  seen ", seen[k])
    assert not differ, f"{len(differ)} of {len(known)} differ, e.g. {differ[:5]}"
    assert len(known) == 122


# ---------------------------------------------------------------- helpers


def _trace(d: Path, **kw) -> Path:
    if not (d / "t").exists():
        d.mkdir(parents=True, exist_ok=True)
        src = write_csv(d / "r.csv", csv_rows(planted_routing(**kw)))
        import_trace(ImportConfig(source="csv", path=src, out=d / "t", progress=False))
    return d / "t"


def _calibration(root: Path, name: str | None) -> Path | None:
    if name is None:
        return None
    base = dict(expert_bytes=1000, link_bandwidth_Bps=1000 / 0.1, link_latency_s=0.0, attn_s=1.0,
                expert_s=0.0, forward_s=0.0, source="known answers")  # fmt: skip
    return Calibration(**{**base, **CALIBRATIONS[name]}).save(root / f"{name}.json")


def _row(r: dict) -> dict:
    counters = {k: v for k, v in r["counters"].items() if v and k != "io_cpu_s"}  # zeros left
    # out: a shorter file; io_cpu_s is CPU time, as variable as the wall clock
    return {**{k: r[k] for k in ROW_KEYS}, "counters": counters, "tokens": r["tokens"]}


def _counters(stats) -> dict:
    return {k: v for k, v in _sim_counters(stats).items() if k != "stall_s"}  # stall: wall clock


def _sim_counters(stats) -> dict:
    """The counters but prefetch_paused, a real disk's: the simulator and the emulated link
    never pause (asserted); and io_cpu_s, the runtime's I/O-thread CPU time (the simulator
    has no threads: 0)."""
    assert stats.prefetch_paused == 0
    return {k: v for k, v in vars(stats).items() if k not in ("prefetch_paused", "io_cpu_s")}


def _steps(work: list[list[dict]]) -> dict:
    """Sorted steps at which each (layer, expert) is demanded (the oracle's future)."""
    out = {}
    for f, layers in enumerate(work):
        for m, lw in enumerate(layers):
            for e, _ in lw["demand"]:
                out.setdefault((m, e), []).append(f * len(layers) + m)
    return out


def _victims_of(rs) -> list:
    out, remove = [], rs.remove

    def record(key):
        out.append(key)
        remove(key)

    rs.remove = record
    return out


def _runtime_forward(cache: ExpertCache, f: int, layers: list[dict]) -> None:
    L = len(layers)
    for m, lw in enumerate(layers):
        cache.now = f * L + m
        keys = [(m, e) for e, _ in lw["demand"]]
        absent = [k for k in keys if cache.claim(k) == "absent"]
        queued = []
        for when, ids in lw["at_router"] + lw["at_start"]:
            for rank, e in enumerate(ids):
                key = (when % L, e)
                cache.hint(key, when)
                if key not in cache.entries and key not in [q[1] for q in queued]:
                    queued.append(((when, rank), key, when))
        for k in absent:
            if cache.start_load(k, demand=True, block=False) is not None:
                cache.finish_load(k, 8)
        late = []
        for _, k, when in sorted(queued, key=lambda q: q[0]):
            if cache.start_load(k, demand=False, block=False, when=when) is not None:
                if (k[1] + f) % 4:
                    cache.finish_load(k, 8)
                else:
                    late.append(k)
        for k in keys:
            if k in cache.entries:
                cache.release(k)
        for k in late:  # these reads return once the layer ran
            cache.finish_load(k, 8)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        obs = observe(Path(d))
    lines = [f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(obs.items())]
    sys.stdout.write("{\n" + ",\n".join(lines) + "\n}\n")
