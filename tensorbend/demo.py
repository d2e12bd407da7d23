"""`tensorbend demo`: the whole chain on the bundled model, in one command, with a report.

Usage:
    tensorbend demo [--quick] [--out runs/demo]
    from tensorbend.demo import DemoConfig, demo
    summary = demo(DemoConfig(quick=True, out=Path("runs/demo_quick")))
    print(summary.text)                  # the compact summary the CLI prints

Steps, each skipped when its output already exists (a re-run resumes; --overwrite redoes all):
 1. collect  teacher-forced routing of the shipped prompts on `model` (train/val/test split)
 2. train    ours within the token (`tensorbend`, d1), ours across tokens (`horizon`), and
             the seed's MLP with its recipe (d1), on the train split (val: early stopping)
 3. eval     every predictor and every peer at d1 on the held-out test prompts; the horizon's
             foresight metrics and cache replay
 4. run      offloaded generation of test prompts at 25% cache over the `h100-pcie5-kimi` link:
             caches without prediction (lru, lfru with TinyLFU-style admission, and the
             Predicted eviction fed no predictions, `prefetch:none`), the peers that predict
             (spec_gate and the seed's MLP as d1 prefetchers, with ours' predicted admission),
             ours (horizon + d1, predicted admission) and the oracle; outputs checked
             bit-identical; each row's `vs_best_cache` against the fastest of those caches
             (`cache.report.compare`), and ours' `vs_best_peer` against the fastest row that
             is neither ours nor the oracle (`cache.report.best_peer`), per repeat.
             The link is scaled to the fastest resident decode forward (a busy machine only
             slows forwards down: the median stretched the link, and the demo to 32 minutes);
             repeats stop after the step's time budget; a busy reference or forwards varying
             more than SPREAD x are warned about, before the runs and in the summary
 5. project  the same policies and peers simulated on Kimi-K2.5 on a DGX Spark (`tensorbend
             simulate`; each prediction call charged its modelled cost there: kernel launches
             + the predictor's weights read once, `offload.time_model.PredictorCost`)
and writes OUT/report/: summary.md (`demo_summary.py`), the eval plots, and every step's
JSON. The summary's timings are this machine's, each step's wall time among them, and it
states the sizes used (`DemoConfig.size`: the full demo collects 168 of the 336 shipped
prompts, every split kept, and trains the seed's MLP on a 4,000-row sample, to stay under 10
minutes beside a busy process on 2 cores); torch runs one thread per core other processes
leave free. `--quick` (fewer
prompts and tokens) is for the test suite.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tensorbend.atomic import atomic_write_text
from tensorbend.errors import TensorbendError
from tensorbend.report.demo_summary import DemoSummary


@dataclass(frozen=True)
class DemoConfig:
    out: Path = Path("runs/demo")
    """Directory for the trace, checkpoints and report/ (steps whose outputs exist are reused)."""
    quick: bool = False
    """A minute-long version (fewer prompts, tokens and training epochs): the test suite's."""
    model: str = "zoo:default"
    """Bundled or local MoE model."""
    overwrite: bool = False
    """Redo every step, even those whose outputs exist."""
    progress: bool = field(default=True, metadata={"cli": False})
    """Progress bars on stderr."""

    def __post_init__(self) -> None:
        if self.out.exists() and not self.out.is_dir():
            raise TensorbendError(f"--out {self.out}: expected a directory, found a file")

    @property
    def size(self) -> dict:
        """Prompts, tokens and run sizes of the two presets."""
        if self.quick:
            return {
                "prompts": 48,
                "tokens": 8,
                "seed_mlp_rows": None,
                "run_prompts": 2,
                "run_tokens": 8,
                "run_repeats": 1,
                "run_budget_s": 120,
                "epochs": 3,
                "sim_prompts": 3,
            }
        return {
            "prompts": 168,
            "tokens": 24,
            "seed_mlp_rows": 4000,
            "run_prompts": 4,
            "run_tokens": 32,
            "run_repeats": 3,
            "run_budget_s": 150,
            "epochs": None,
            "sim_prompts": 8,
        }


def demo(cfg: DemoConfig) -> DemoSummary:
    import torch

    from tensorbend.capture.trace import Trace

    t0 = time.perf_counter()
    out = Path(cfg.out)
    report = out / "report"
    report.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(_free_cores(threads))
    steps: dict[str, float] = {}  # step -> wall seconds, said as each step ends
    try:
        trace = _timed(cfg, steps, "collect", _collect, cfg, out)
        ckpts = _train(cfg, out, trace, steps)
        ev = _timed(cfg, steps, "eval", _eval, cfg, out, trace, ckpts, report)
        runs = _timed(cfg, steps, "run", _run, cfg, out, trace, ckpts)
        proj = _timed(cfg, steps, "project", _project, cfg, out, trace, ckpts)
        sizes = {
            **cfg.size,
            "splits": Trace.open(trace).info()["splits"],
            "torch_threads": torch.get_num_threads(),
        }
    finally:
        torch.set_num_threads(threads)
    summary = DemoSummary.of(out, round(time.perf_counter() - t0, 1), steps, sizes, ev, runs, proj)
    summary.text = summary.render(cfg.model, cfg.quick)
    atomic_write_text(report / "summary.md", summary.text + "\n")
    atomic_write_text(report / "summary.json", json.dumps(summary.to_json(), indent=1))
    return summary


# ---------------------------------------------------------------- steps


def _done(path: Path, cfg: DemoConfig, what: str, current=None) -> bool:
    """Whether the step's output exists and is reused; `current(path)` False: the output of an
    older demo that lacks what this one reports, so the step runs again."""
    if path.exists() and not cfg.overwrite:
        if current is None or current(path):
            _say(cfg, f"{what}: reusing {path}")
            return True
        _say(cfg, f"{what}: {path} predates the peers that predict; running it again")
    _say(cfg, f"{what} ...")
    return False


def _free_cores(threads: int) -> int:
    """The cores other processes leave free over a second (1 to `threads`): beside a busy process
    on 2 cores, collecting 6 prompts took 18.6 and 102.6 s on 2 threads, 9.3 and 8.6 s on 1."""
    from tensorbend.host_load import CpuMeter

    meter = CpuMeter()
    time.sleep(1.0)
    load = meter.stop()
    return max(1, min(threads, round(load.cpus - (load.other_cores or 0.0))))


def _timed(cfg: DemoConfig, steps: dict, name: str, fn, *args):
    t0 = time.perf_counter()
    result = fn(*args)
    steps[name] = round(time.perf_counter() - t0, 1)
    _say(cfg, f"{name}: {steps[name]:.0f} s")
    return result


def _say(cfg: DemoConfig, msg: str) -> None:
    if cfg.progress:
        print(f"[demo] {msg}", file=sys.stderr)


def _collect(cfg: DemoConfig, out: Path) -> Path:
    from tensorbend.capture.collect import CollectConfig, collect
    from tensorbend.capture.hf import DecodeConfig

    trace = out / "trace"
    if not _done(trace / "manifest.json", cfg, "collect"):
        size = cfg.size
        collect(
            CollectConfig(
                model=cfg.model,
                out=trace,
                max_prompts=size["prompts"],
                decode=DecodeConfig(decode="teacher", max_new_tokens=size["tokens"]),
                features=("ids", "weights", "gate_input"),
                overwrite=True,
            ),
            progress=cfg.progress,
        )
    return trace


def _train(cfg: DemoConfig, out: Path, trace: Path, steps: dict) -> dict[str, Path]:
    from tensorbend.predictors.train import TrainConfig, train

    jobs = {
        "tensorbend": dict(predictor="tensorbend", lookahead="d1"),
        "horizon": dict(predictor="horizon"),
        "seed_mlp": dict(
            predictor="seed_mlp", lookahead="d1", max_train_rows=cfg.size["seed_mlp_rows"]
        ),
    }
    ckpts = {}
    for name, kw in jobs.items():
        path = out / f"{name}.safetensors"
        if not _done(path, cfg, f"train {name}"):
            tc = TrainConfig(trace=trace, out=path, epochs=cfg.size["epochs"], **kw)
            _timed(cfg, steps, f"train {name}", train, tc, cfg.progress)
        steps.setdefault(f"train {name}", 0.0)  # reused
        ckpts[name] = path
    return ckpts


def _eval(cfg: DemoConfig, out: Path, trace: Path, ckpts: dict, report: Path) -> dict:
    from tensorbend.predictors.evaluate import EvalConfig, evaluate
    from tensorbend.predictors.plots import plot_eval

    path = report / "eval.json"
    if not _done(path, cfg, "eval (held-out test prompts)"):
        rep = evaluate(
            EvalConfig(
                trace=trace, predictors=tuple(ckpts.values()), lookaheads=("d1",), timing_rows=0
            )
        ).to_json()
        atomic_write_text(path, json.dumps(rep, indent=1))
        plot_eval(rep, report / "plots")
    return json.loads(path.read_text())


def _run(cfg: DemoConfig, out: Path, trace: Path, ckpts: dict) -> list[dict]:
    from tensorbend.cache.config import PolicyConfig
    from tensorbend.cache.report import (
        compare,
        format_ratio,
        is_ours,
        median_row,
        run_label,
        what_ran,
    )
    from tensorbend.capture.hf import DecodeConfig, load_model
    from tensorbend.capture.prompts import load_prompts
    from tensorbend.host_load import warning
    from tensorbend.offload.hooks import NoPredictor
    from tensorbend.offload.runner import build_predictor
    from tensorbend.offload.session import OffloadSession, SessionConfig
    from tensorbend.predictors.base import get_lookahead

    path = out / "report" / "run.json"
    if _done(path, cfg, "offloaded generation (25% cache, h100-pcie5-kimi link)", _has_peers):
        return json.loads(path.read_text())
    size = cfg.size
    model, tok = load_model(cfg.model)
    prompts = [p for p in load_prompts(split="test") if p.continuation][: size["run_prompts"]]
    dc = DecodeConfig(decode="teacher", max_new_tokens=size["run_tokens"])
    sc = SessionConfig(decode=dc, layer_time="best")  # the link: the undisturbed forward's
    sess = OffloadSession(model, tok, prompts, sc, model_name=cfg.model)
    ref = sess.reference.host_load
    times = sorted(sess.reference.decode_times)
    spread = times[len(times) // 2] / times[0] if times else 1.0
    notes = []
    if ref is not None and ref.busy or spread > SPREAD:  # said before the wait
        why = (
            warning({"resident reference": ref.other_cores}, ref.cpus)
            if ref is not None and ref.busy
            else f"resident decode forwards varied {spread:.1f}x (median / best)"
        )
        notes.append(f"timing disturbed: {why}")
        _say(
            cfg,
            f"warning: {notes[-1]}; the link is scaled to the fastest forward, and this "
            "step stops repeating after its time budget",
        )
    ours = build_predictor(model, ckpts["tensorbend"], None, "d1", None, sess.spec)
    horizon = build_predictor(model, ckpts["horizon"], None, "d1", None, sess.spec)
    none = NoPredictor(sess.spec.num_experts, get_lookahead("d1"))
    spec_gate = build_predictor(model, None, "spec_gate", "d1", None, sess.spec)
    seed_mlp = build_predictor(model, ckpts["seed_mlp"], None, "d1", None, sess.spec)
    predicted = PolicyConfig("prefetch", admission="predicted")
    plan = [
        (PolicyConfig("lru"), None, None),
        (PolicyConfig("lfru", admission="frequency"), None, None),
        (PolicyConfig("prefetch"), none, None),  # Predicted eviction fed no predictions
        (predicted, spec_gate, None),  # the peers that predict, with ours' admission
        (predicted, seed_mlp, None),
        (predicted, ours, horizon),
        (PolicyConfig("oracle", admission="predicted"), None, None),
    ]
    reps: dict[str, list[dict]] = {}  # what ran -> one row per repeat, interleaved
    try:
        link = sess.link("h100-pcie5-kimi")
        t0 = time.perf_counter()
        for rep in range(size["run_repeats"]):
            if rep and time.perf_counter() - t0 > size["run_budget_s"]:
                notes.append(
                    f"{rep} of {size['run_repeats']} repeats within the step's "
                    f"{size['run_budget_s']} s budget: the rest skipped"
                )
                _say(cfg, f"warning: {notes[-1]}")
                break
            for pc, pred, hz in plan:
                r = sess.run_policy(pc, pred, link, hz).to_json()
                reps.setdefault(what_ran(r), []).append(r)
    finally:
        sess.close()
    full = [median_row(rs) for rs in reps.values()]
    (c,) = compare(full).values()
    rows = []
    for r in full:
        one = c["runs"][run_label(r)]
        rows.append(
            {
                "label": run_label(r),
                "vs_best_cache": one["vs_best_cache"],
                "ratio": format_ratio(one),
                "repeats": len(r.get("decode_tok_s_repeats", [1])),
                "host_other_cores_repeats": r.get("host_other_cores_repeats"),
                "policy": r["policy"],
                "timing_note": "; ".join(notes) or None,
                "ours": is_ours(r),
                **{k: r.get(k) for k in _RUN_KEYS},
            }
        )
    atomic_write_text(path, json.dumps(rows, indent=1))
    return rows


_RUN_KEYS = (
    "decode_tok_s",
    "decode_tok_s_repeats",
    "stall_s_per_token",
    "bytes_read_per_token",
    "demand_hit_rate",
    "output_matches_resident",
    "link",
    "host_load",
    "host_busy",
    "time_model",
)
SPREAD = 1.5  # median / fastest resident decode forward above this: timing was disturbed


def _project(cfg: DemoConfig, out: Path, trace: Path, ckpts: dict) -> list[dict]:
    from tensorbend.cache.report import is_ours
    from tensorbend.predictors.spec import PredictorSpec
    from tensorbend.simulate import SimulateConfig, simulate, simulate_peers
    from tensorbend.simulate.runs import relative

    path = out / "report" / "simulate.json"
    if not _done(path, cfg, "project onto Kimi-K2.5 on a DGX Spark (simulated)", _has_peers):
        base = SimulateConfig(
            trace=trace,
            hardware="dgx-spark",
            geometry="kimi-k2.5",
            progress=False,
            policies=("lru", "lfru", "prefetch", "oracle"),
            predictors=("none", str(ckpts["tensorbend"])),
            prediction=PredictorSpec(horizon=ckpts["horizon"]),
            max_prompts=cfg.size["sim_prompts"],
        )
        res = simulate(base).to_json()
        res["results"] += simulate_peers(base, ("spec_gate", str(ckpts["seed_mlp"])))
        res["results"].sort(key=lambda r: r["policy"] == "oracle")  # the oracle last
        relative(res["results"])  # vs_best_cache over the best cache of all the rows
        atomic_write_text(path, json.dumps(res, indent=1))
    res = json.loads(path.read_text())
    return [
        {
            **{
                k: r.get(k)
                for k in (
                    "label",
                    "policy",
                    "decode_tok_s",
                    "vs_best_cache",
                    "predictor",
                    "time_model",
                )
            },
            "ours": is_ours(r),
        }
        for r in res["results"]
    ]


def _has_peers(path: Path) -> bool:
    """A run or projection JSON written since the demo runs the peers that predict."""
    res = json.loads(path.read_text())
    if isinstance(res, dict):  # simulate.json: the peers' rows are marked
        return any(r.get("peer") for r in res["results"])
    return all("ours" in r for r in res)  # run.json: every row says whether it is ours
