"""`tensorbend simulate`: what prediction buys on a model geometry and hardware, from a trace.

Usage:
    from tensorbend.simulate import SimulateConfig, simulate
    res = simulate(SimulateConfig(trace=Path("runs/t"), hardware="dgx-spark",
                                  geometry="kimi-k2.5", predictors=("transition",)))
    print(format_table(res))                     # mapping first, then one row per run
    res.to_json()["results"][0]["decode_tok_s"]
    simulate_peers(cfg, ("spec_gate",))          # a peer's prefetch rows, marked peer

For each policy x predictor (prefetch only) x cache fraction: the trace's `split` prompts are
replayed as the runtime would run them (trace.forwards), their routing mapped onto the geometry
(mapping.py), with costs from the hardware x geometry profiles or a measured calibration
(costs.py), through the runtime's own cache mechanism and policies (events.py). Policies (one
implementation with `tensorbend measure`): resident (every expert in fast memory), on_demand,
lru, lfu, lfru (no prediction), prefetch (a predictor's prefetches + `Predicted` eviction),
oracle (the exact routing prefetched at `lookahead`, Belady eviction knowing `foresight`
forwards ahead, all by default). Per-result JSON keys are those of `run --json`.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from tensorbend.cache.config import POLICIES as POLICY_TABLE
from tensorbend.cache.config import PolicyConfig, PolicyName
from tensorbend.cache.report import best_rule
from tensorbend.capture.rows import RowSelection, forwards, select_rows
from tensorbend.capture.trace import Trace
from tensorbend.errors import TensorbendError
from tensorbend.predictors import get_lookahead
from tensorbend.predictors.checkpoint import check_held_out, is_peer_name, read_metadata
from tensorbend.predictors.spec import PredictorSpec, prefetch_width
from tensorbend.simulate import plan
from tensorbend.simulate.costs import Calibration, Costs
from tensorbend.simulate.ep import EPConfig, ep_report
from tensorbend.simulate.geometry import (
    ExpertDtype,
    GeometryName,
    geometry_from_trace,
    get_geometry,
)
from tensorbend.simulate.mapping import make_mapping
from tensorbend.simulate.predictions import rank_all, routing_rows
from tensorbend.simulate.runs import fitting_frac, relative, run_one
from tensorbend.timing.hardware import HardwareName, get_hardware
from tensorbend.timing.time_model import PredictorCost

POLICIES: tuple[str, ...] = tuple(POLICY_TABLE)


@dataclass(frozen=True)
class SimulateConfig:
    trace: Path
    """Trace directory (collected, or imported with `trace import`)."""
    hardware: HardwareName
    """Hardware profile (docs/guide/simulate.md lists each number and its source)."""
    geometry: GeometryName
    """Model geometry the trace's routing is replayed on; from-trace keeps the trace's own
    sizes (needs --calibration for bytes and compute)."""
    policies: tuple[PolicyName, ...] = field(
        default=("resident", "on_demand", "lru", "lfu", "lfru", "prefetch", "oracle"),
        metadata={"flags": ("--policy",)},
    )
    """Policies to simulate (prefetch runs once per predictor)."""
    predictors: tuple[str, ...] = field(
        default=("transition",), metadata={"flags": ("--predictor",)}
    )
    """For prefetch: checkpoints (tensorbend train) and/or peer names (frequency, transition,
    prev_token, spec_gate, random, oracle); none (no predictions: the eviction alone, a cache
    without prediction) always runs beside them."""
    prediction: PredictorSpec = field(default_factory=PredictorSpec)
    """--horizon (each prefetch run is also simulated with its forecasts driving eviction and
    next-forward prefetches, batch 1) and --prefetch-extra; its within-token `predictor` stays
    None: the ones compared are `predictors`."""
    train_trace: Path | None = None
    """Trace whose train split fits the table peers (frequency, prev_token, transition);
    default: the simulated trace."""
    cache_fracs: tuple[float, ...] = field(default=(), metadata={"flags": ("--cache-frac",)})
    """Cache sizes as fractions of each layer's experts; empty: the largest that fits the
    hardware's fast memory beside the resident weights (0.25 with a calibration)."""
    split: Literal["test", "val", "train", "all"] = "test"
    """Prompts replayed (test: learned predictors are judged on prompts they never saw)."""
    batch: int = 1
    """Sequences decoded together (static batching; prompts prefilled together)."""
    max_prompts: int | None = None
    """Replay at most this many prompts of the split (row order)."""
    dtype: ExpertDtype = "native"
    """Storage of the geometry's routed experts (native: as released)."""
    offload: PolicyConfig = field(
        default_factory=lambda: PolicyConfig("oracle"),
        metadata={"skip": ("policy", "cache_frac", "cache_bytes", "oracle_beyond")},
    )
    """The cache options of `tensorbend measure` (--pool, --admission, --foresight, --lookahead,
    ...), each applied to the policies it concerns; its policy is not read (--policy lists the
    simulated ones; oracle, the default, accepts every option)."""
    oracle_beyond: Literal["best", "lru", "lfu", "lfru", "predicted"] = "best"
    """How the oracle with --foresight ranks what it cannot see: best (the rule of the
    no-prediction cache that read the fewest bytes at the same cache size in this run) or a
    rule."""
    allow_seen_split: bool = False
    """Replay a checkpoint on prompts it was trained or early-stopped on (not held out)."""
    calibration: Path | None = None
    """Measured costs (JSON; python -m bench.simulate_validate writes one) replacing the profiles'."""
    ep_degree: int | None = None
    """Expert-parallel ranks for the dispatch pre-staging statistics (None: skip)."""
    ep_placement: Literal["contiguous", "round_robin"] = "contiguous"
    """Expert-to-rank placement for those statistics."""
    plots: Path | None = None
    """Directory for plots (tok/s and stall per policy)."""
    progress: bool = True
    """tqdm progress on stderr."""

    def __post_init__(self) -> None:
        bad = [p for p in self.policies if p not in POLICIES]
        if bad or not self.policies:
            raise TensorbendError(
                f"--policies {bad or '(none)'}: expected some of {', '.join(POLICIES)}"
            )
        if any(not 0 < f <= 1 for f in self.cache_fracs):
            raise TensorbendError(
                f"--cache-fracs {list(self.cache_fracs)}: expected fractions in (0, 1]"
            )
        if self.prediction.predictor is not None or self.prediction.baseline is not None:
            raise TensorbendError(
                "SimulateConfig.prediction.predictor/baseline: expected None; name the "
                "within-token predictors and peers to compare in `predictors` (--predictor, "
                "repeatable)"
            )
        if self.prediction.horizon is not None and self.batch != 1:
            raise TensorbendError(
                f"--horizon with --batch {self.batch}: expected --batch 1 (its forecasts are "
                "per request; batched forecasts are not simulated)"
            )
        if self.batch < 1:
            raise TensorbendError(f"--batch {self.batch}: expected a count >= 1")
        blind = [p for p in self.policies if not POLICY_TABLE[p].uses_prediction]
        if self.offload.admission == "predicted" and [p for p in blind if p != "resident"]:
            raise TensorbendError(
                "--admission predicted needs a policy that predicts (prefetch, oracle): drop "
                f"{[p for p in blind if p != 'resident']} from --policies"
            )
        if self.geometry == "from-trace" and self.calibration is None:
            raise TensorbendError(
                "--geometry from-trace has no bytes or compute of its own: pass --calibration FILE "
                "(python -m bench.simulate_validate measures one) or name a geometry"
            )
        if self.max_prompts is not None and self.max_prompts < 1:
            raise TensorbendError(
                f"--max-prompts {self.max_prompts}: expected a count >= 1 (or leave it out to "
                "replay every prompt of the split)"
            )
        if self.calibration is not None:
            Calibration.load(self.calibration)  # a bad file fails before the trace is read
        get_hardware(self.hardware)
        if self.ep_degree is not None:
            EPConfig(self.ep_degree, self.ep_placement)


@dataclass
class SimulateResult:
    hardware: str
    geometry: str
    mapping: dict
    results: list[dict]
    hardware_profile: dict
    geometry_profile: dict
    costs: dict
    trace: str
    split: str
    batch: int
    tokens: dict[str, int]
    ep: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return dict(vars(self))


def simulate(cfg: SimulateConfig) -> SimulateResult:
    """Every policy x predictor x cache fraction of `cfg` on the trace; see the module docstring."""
    t0 = time.perf_counter()
    tr = Trace.open(cfg.trace)
    _check_held_out(cfg, tr)
    hw, cal, geo, mapping, costs = _setup(cfg, tr)
    rows = _rows(cfg, tr)
    fwds = forwards(rows, cfg.batch)
    demand = plan.demand_lists(rows, fwds)
    train = Trace.open(cfg.train_trace) if cfg.train_trace else None
    specs = cfg.predictors if "prefetch" in cfg.policies or cfg.ep_degree else ()
    auto = "prefetch" in cfg.policies and "none" not in specs  # Predicted eviction fed
    specs = ("none", *specs) if auto else specs  # nothing: always in the comparison
    extra = cfg.prediction.prefetch_extra
    width = max(prefetch_width(tr.spec.top_k, extra), tr.spec.top_k)  # (several tokens: top-K)
    rankeds = rank_all(specs, tr, rows, cfg.offload.lookahead, width, train)
    fracs = cfg.cache_fracs or (fitting_frac(hw, geo, cfg.dtype, tr.spec) if cal is None else 0.25,)
    fcs = None
    if cfg.prediction.horizon is not None:
        fcs, fc_cost = _forecasts(cfg, tr, rows)
        if not costs.calibrated:  # a profile: the horizon's modelled cost per forward there
            costs = dataclasses.replace(costs, forecast_s=fc_cost.call_s(hw))
    variants = [(r, None) for r in rankeds] + ([(r, fcs) for r in rankeds] if fcs else [])
    jobs = [
        (p, r, f, fc)
        for f in fracs
        for p in sorted(cfg.policies, key=lambda p: POLICY_TABLE[p].recorded_routing)
        for r, fc in (variants if p == "prefetch" else [(None, None)])
    ]  # the oracle after the caches it must beat (oracle_beyond best)
    bar = tqdm(jobs, desc="simulate", unit="run", disable=not cfg.progress, file=sys.stderr)
    results = []
    for p, r, f, fc in bar:
        at = [x for x in results if x["cache_frac"] == f]
        beyond = best_rule(at) if cfg.oracle_beyond == "best" else cfg.oracle_beyond
        results.append(run_one(cfg, p, r, f, fwds, demand, mapping, costs, hw, geo, fc, beyond))
    relative(results)
    res = SimulateResult(
        hardware=cfg.hardware,
        geometry=cfg.geometry,
        mapping=mapping.to_json(),
        results=results,
        hardware_profile=hw.to_json(),
        geometry_profile=geo.to_json(cfg.dtype),
        costs=costs.to_json(),
        trace=str(cfg.trace),
        split=cfg.split,
        batch=cfg.batch,
        tokens={
            ph: int((rows["phase_T"] == i).sum()) for i, ph in enumerate(("prefill", "decode"))
        },
        notes=_notes(cfg, cal),
    )
    if cfg.ep_degree is not None:
        epc = EPConfig(cfg.ep_degree, cfg.ep_placement)
        res.ep = ep_report(rankeds[auto:], rows, fwds, tr.spec.num_experts, epc)
    if cfg.plots is not None:
        from tensorbend.simulate.figures import plot_results

        plot_results(res, cfg.plots)
    res.seconds = round(time.perf_counter() - t0, 2)
    return res


def simulate_peers(cfg: SimulateConfig, peers: tuple[str, ...]) -> list[dict]:
    """The peers that predict (`peers`: names such as spec_gate, or checkpoints such as the
    seed's MLP) simulated as prefetchers with cfg's cache and admission and no horizon: their
    rows only, each marked `peer` (the `prefetch:none` run beside them is left out)."""
    only = dataclasses.replace(
        cfg, policies=("prefetch",), predictors=tuple(peers), prediction=PredictorSpec()
    )
    return [
        {**r, "peer": True}
        for r in simulate(only).to_json()["results"]
        if r["predictor"] not in (None, "none")
    ]


def _forecasts(cfg: SimulateConfig, tr: Trace, rows: dict) -> tuple[list, PredictorCost]:
    """The horizon checkpoint's forecast after every forward of the replayed rows (run order),
    and its modelled cost per forward (one call)."""
    from tensorbend.predictors.checkpoint import load_predictor
    from tensorbend.predictors.foresight import forecasts

    path = cfg.prediction.horizon  # (PredictorSpec checked its kind)
    pred = load_predictor(path, spec=tr.spec, fingerprint=tr.manifest["model"]["fingerprint"])
    missing = [f for f in pred.cfg.features if f not in tr.features]
    if missing:
        raise TensorbendError(
            f"--horizon {path} reads trace features {list(pred.cfg.features)}, found "
            f"{tr.features}: train one with --inputs routing for this trace"
        )
    return forecasts(pred, rows), PredictorCost.of(pred, 1)


def _setup(cfg: SimulateConfig, tr: Trace):
    """(hardware, calibration | None, geometry, mapping, costs) of a run."""
    spec = tr.spec
    hw = get_hardware(cfg.hardware)
    cal = Calibration.load(cfg.calibration) if cfg.calibration else None
    if cfg.geometry == "from-trace":
        geo = geometry_from_trace(spec, cal.expert_bytes, f"{cfg.trace} + {cfg.calibration}")
    else:
        geo = get_geometry(cfg.geometry)
    mapping = make_mapping(
        spec.num_moe_layers,
        spec.num_experts,
        spec.top_k,
        geo.num_moe_layers,
        geo.num_experts,
        geo.top_k,
    )
    if cal is not None:
        costs = Costs.from_calibration(cal, mapping.unit_scale)
    else:
        costs = Costs.from_profiles(hw, geo, mapping.unit_scale, cfg.dtype)
    return hw, cal, geo, mapping, costs


def format_table(res: SimulateResult) -> str:
    """Terminal table; the mapping comes first so that it is never missed."""
    lines = [
        f"hardware {res.hardware}  geometry {res.geometry}  trace {res.trace} ({res.split} split, "
        f"batch {res.batch}, {res.tokens['decode']} decode + {res.tokens['prefill']} prefill tokens)"
    ]
    lines += [f"mapping: {x}" for x in res.mapping["notes"]]
    head = f"{'policy':<10} {'run':<20} {'cache':>6} {'tok/s':>9} {'stall ms/tok':>12} {'MB/tok':>9} {'hit':>6} {'wasted MB':>10}"
    lines += [head, "-" * len(head)]
    for r in res.results:
        tok_s = "-" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.2f}"
        lines.append(
            f"{r['policy']:<10} {r['label']:<20} {r['cache_frac']:>6.3f} {tok_s:>9} "
            f"{r['stall_s_per_token'] * 1e3:>12.3f} {r['bytes_read_per_token'] / 1e6:>9.2f} "
            f"{r['demand_hit_rate']:>6.3f} {r['wasted_prefetch_bytes'] / 1e6:>10.1f}"
        )
    lines += [f"note: {n}" for n in res.notes]
    return "\n".join(lines)


# ---------------------------------------------------------------- helpers


def _rows(cfg, tr: Trace):
    hidden = set()
    for p in cfg.predictors:
        if p == "none" or ("prefetch" not in cfg.policies and not cfg.ep_degree):
            continue
        hidden.add(get_lookahead(cfg.offload.lookahead).hidden)
        if Path(p).is_file():
            hidden.add(get_lookahead(read_metadata(p)["lookahead"]).hidden)
    horizon = cfg.prediction.horizon
    if horizon is not None and "prefetch" in cfg.policies:
        if not is_peer_name(horizon) and read_metadata(horizon)["config"].get("inputs") == (
            "routing+hidden"
        ):
            hidden.add("gate_input")
    rows = routing_rows(tr, None if cfg.split == "all" else cfg.split, ("ids", *sorted(hidden)))
    if rows["expert_ids_TLK"].shape[0] == 0:
        raise TensorbendError(f"trace {cfg.trace} has no {cfg.split} prompts to replay")
    if cfg.max_prompts is not None:
        rows = select_rows(rows, RowSelection(max_prompts=cfg.max_prompts))
    return rows


def _check_held_out(cfg: SimulateConfig, tr: Trace) -> None:
    """Refuse checkpoints on the prompts they saw (manifest only: before any row is read)."""
    if cfg.allow_seen_split:
        return
    paths = [Path(p) for p in cfg.predictors if Path(p).is_file()]
    paths += [cfg.prediction.horizon] if cfg.prediction.horizon is not None else []
    ids = [p["id"] for p in tr.prompts if cfg.split in ("all", p["split"])]
    for path in paths:  # the first max_prompts in row (= manifest) order are replayed
        check_held_out(path, ids[: cfg.max_prompts], cfg.split, tr.manifest["model"]["fingerprint"])


def _notes(cfg, cal) -> list[str]:
    notes = []
    if cal is None:
        notes.append(
            "each prediction call is charged its modelled cost on the hardware profile "
            "(timing/time_model.py: kernel launches + the predictor's weights read once; the "
            "predictor as trained on the trace's model, not scaled to the geometry)"
        )
    if cal is not None:
        notes.append(
            f"costs from calibration {cfg.calibration} ({cal.source}); hardware profile unused"
        )
    if not cfg.cache_fracs:
        notes.append(
            "cache fraction: the largest whose bytes fit fast memory beside the resident weights (KV cache not counted)"
            if cal is None
            else "cache fraction: 0.25 (calibrated run; no memory size known)"
        )
    return notes
