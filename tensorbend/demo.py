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
and writes OUT/report/: summary.md, the eval plots, and every step's JSON. The summary's
timings are this machine's, each step's wall time among them, and it states the sizes used
(`DemoConfig.size`: the full demo collects 168 of the 336 shipped prompts, every split kept,
and trains the seed's MLP on a 4,000-row sample, to stay under 10 minutes beside a busy process
on 2 cores); torch runs one thread per core other processes leave free. `--quick` (fewer
prompts and tokens) is for the test suite.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tensorbend.atomic import atomic_write_text
from tensorbend.errors import TensorbendError


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
            return {"prompts": 48, "tokens": 8, "seed_mlp_rows": None, "run_prompts": 2,
                    "run_tokens": 8, "run_repeats": 1, "run_budget_s": 120, "epochs": 3,
                    "sim_prompts": 3}  # fmt: skip
        return {"prompts": 168, "tokens": 24, "seed_mlp_rows": 4000, "run_prompts": 4,
                "run_tokens": 32, "run_repeats": 3, "run_budget_s": 150, "epochs": None,
                "sim_prompts": 8}  # fmt: skip


@dataclass
class DemoSummary:
    """What the demo measured; `text` is what the CLI prints, `to_json()` the report's JSON."""

    out: str
    seconds: float
    recall_d1: dict  # predictor -> held-out decode recall@k at d1
    foresight: dict  # gap closed, best cache and ours' experts per token (replay)
    runs: list  # per offloaded run: label, decode tok/s, bytes/token, hit rate, matches
    projection: list  # per simulated run: label, decode tok/s
    peers: dict = field(default_factory=dict)  # "run"/"project" -> ours against the best peer
    step_seconds: dict = field(default_factory=dict)  # step -> wall seconds (reused: ~0)
    sizes: dict = field(default_factory=dict)  # DemoConfig.size and the trace's prompts per split
    host_warning: str | None = None  # other processes disturbed the timed runs (host_load.py)
    text: str = ""

    def to_json(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "text"}


def demo(cfg: DemoConfig) -> DemoSummary:
    import torch

    from tensorbend.cache.report import host_warning
    from tensorbend.trace import Trace

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
        sizes = {**cfg.size, "splits": Trace.open(trace).info()["splits"],
                 "torch_threads": torch.get_num_threads()}  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    summary = DemoSummary(
        out=str(out), seconds=round(time.perf_counter() - t0, 1), step_seconds=steps,
        sizes=sizes,
        recall_d1=_recalls(ev), foresight=_foresight(ev), runs=runs, projection=proj,
        peers={"run": _against_peer(runs), "project": _against_peer(proj)},
        host_warning=host_warning(runs) or next((r["timing_note"] for r in runs
                                                  if r.get("timing_note")), None),
    )  # fmt: skip
    summary.text = _text(summary, cfg)
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
    from tensorbend.collect import CollectConfig, collect
    from tensorbend.hf import DecodeConfig

    trace = out / "trace"
    if not _done(trace / "manifest.json", cfg, "collect"):
        size = cfg.size
        collect(
            CollectConfig(model=cfg.model, out=trace, max_prompts=size["prompts"],
                          decode=DecodeConfig(decode="teacher", max_new_tokens=size["tokens"]),
                          features=("ids", "weights", "gate_input"), overwrite=True),
            progress=cfg.progress,
        )  # fmt: skip
    return trace


def _train(cfg: DemoConfig, out: Path, trace: Path, steps: dict) -> dict[str, Path]:
    from tensorbend.train import TrainConfig, train

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
    from tensorbend.evaluate import EvalConfig, evaluate
    from tensorbend.plots import plot_eval

    path = report / "eval.json"
    if not _done(path, cfg, "eval (held-out test prompts)"):
        rep = evaluate(EvalConfig(trace=trace, predictors=tuple(ckpts.values()), lookaheads=("d1",),
                                  timing_rows=0)).to_json()  # fmt: skip
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
    from tensorbend.hf import DecodeConfig, load_model
    from tensorbend.host_load import warning
    from tensorbend.offload.hooks import NoPredictor
    from tensorbend.offload.runner import build_predictor
    from tensorbend.offload.session import OffloadSession, SessionConfig
    from tensorbend.predictors.base import get_lookahead
    from tensorbend.prompts import load_prompts

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
        _say(cfg, f"warning: {notes[-1]}; the link is scaled to the fastest forward, and this "
                  "step stops repeating after its time budget")  # fmt: skip
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
                notes.append(f"{rep} of {size['run_repeats']} repeats within the step's "
                             f"{size['run_budget_s']} s budget: the rest skipped")  # fmt: skip
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
        rows.append({"label": run_label(r), "vs_best_cache": one["vs_best_cache"],
                     "ratio": format_ratio(one), "repeats": len(r.get("decode_tok_s_repeats", [1])),
                     "host_other_cores_repeats": r.get("host_other_cores_repeats"),
                     "policy": r["policy"], "timing_note": "; ".join(notes) or None,
                     "ours": is_ours(r), **{k: r.get(k) for k in _RUN_KEYS}})  # fmt: skip
    atomic_write_text(path, json.dumps(rows, indent=1))
    return rows


_RUN_KEYS = ("decode_tok_s", "decode_tok_s_repeats", "stall_s_per_token", "bytes_read_per_token",
             "demand_hit_rate", "output_matches_resident", "link", "host_load", "host_busy",
             "time_model")  # fmt: skip
SPREAD = 1.5  # median / fastest resident decode forward above this: timing was disturbed


def _project(cfg: DemoConfig, out: Path, trace: Path, ckpts: dict) -> list[dict]:
    from dataclasses import replace

    from tensorbend.cache.report import compare, is_ours, vs_best_cache
    from tensorbend.predictors.spec import PredictorSpec
    from tensorbend.simulate import SimulateConfig, simulate

    path = out / "report" / "simulate.json"
    if not _done(path, cfg, "project onto Kimi-K2.5 on a DGX Spark (simulated)", _has_peers):
        base = SimulateConfig(
            trace=trace, hardware="dgx-spark", geometry="kimi-k2.5", progress=False,
            policies=("lru", "lfru", "prefetch", "oracle"),
            predictors=("none", str(ckpts["tensorbend"])),
            prediction=PredictorSpec(horizon=ckpts["horizon"]),
            max_prompts=cfg.size["sim_prompts"],
        )  # fmt: skip
        res = simulate(base).to_json()
        peers = replace(base, policies=("prefetch",), prediction=PredictorSpec(),
                        predictors=("spec_gate", str(ckpts["seed_mlp"])))  # fmt: skip
        res["results"] += [{**r, "peer": True} for r in simulate(peers).to_json()["results"]
                           if r["predictor"] not in (None, "none")]  # fmt: skip
        res["results"].sort(key=lambda r: r["policy"] == "oracle")  # the oracle last
        (c,) = compare(res["results"]).values()
        best = next(r for r in res["results"] if r["label"] == c["best_no_prediction_cache"])
        for r in res["results"]:
            r["vs_best_cache"] = vs_best_cache(r, best)
        atomic_write_text(path, json.dumps(res, indent=1))
    res = json.loads(path.read_text())
    return [{**{k: r.get(k) for k in ("label", "policy", "decode_tok_s", "vs_best_cache",
                                      "predictor", "time_model")}, "ours": is_ours(r)}
            for r in res["results"]]  # fmt: skip


def _has_peers(path: Path) -> bool:
    """A run or projection JSON written since the demo runs the peers that predict."""
    res = json.loads(path.read_text())
    if isinstance(res, dict):  # simulate.json: the peers' rows are marked
        return any(r.get("peer") for r in res["results"])
    return all("ours" in r for r in res)  # run.json: every row says whether it is ours


def _against_peer(rows: list[dict]) -> dict | None:
    """Ours' fastest row over the best peer (`cache.report.best_peer`) of the same run: the
    median of the repeats' ratios [range] where the run repeated, else the single ratio."""
    from tensorbend.cache.report import best_peer, repeat_ratios

    peer = best_peer([r for r in rows if not r["ours"]])
    mine = [r for r in rows if r["ours"] and r.get("decode_tok_s")]
    if peer is None or not mine:
        return None
    top = max(mine, key=lambda r: r["decode_tok_s"])
    xs = repeat_ratios(top, peer)
    return {"ours": top["label"], "best_peer": peer["label"],
            "best_peer_tok_s": peer["decode_tok_s"],
            "vs_best_peer": statistics.median(xs) if xs else top["decode_tok_s"] / peer["decode_tok_s"],
            "repeats": xs}  # fmt: skip


# ---------------------------------------------------------------- summary


def _recalls(ev: dict) -> dict:
    return {r["predictor"]: r["recall_at_k"] for r in ev["results"]
            if r["phase"] == "decode" and r["lookahead"] == "d1"}  # fmt: skip


def _foresight(ev: dict) -> dict:
    f = ev["foresight"][0]
    rp = f["replay"]
    return {
        "best_no_prediction": f["best_no_prediction"],
        "best_no_prediction_experts_per_token": rp[f["best_no_prediction"]]["experts_per_token"],
        "ours_experts_per_token": rp[f["best_reuse"]]["experts_per_token"],
        "full_oracle_experts_per_token": rp[f["full_oracle"]]["experts_per_token"],
        "gap_closed": f["gap_closed"],
    }


def _text(s: DemoSummary, cfg: DemoConfig) -> str:
    from tensorbend.offload.time_model import label, regime_line

    lines = [
        f"tensorbend demo on {cfg.model}{' (quick)' if cfg.quick else ''}: {s.seconds:.0f} s, "
        f"report in {s.out}/report",
        _sizes_line(s.sizes),
        "Step wall times (s, 0 = reused): "
        + ", ".join(f"{k} {v:.0f}" for k, v in s.step_seconds.items()),
        "",
        "Held-out decode recall@k at d1 (one MoE layer ahead):",
    ]
    for kind, x in sorted(s.recall_d1.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:<12} {x:.3f}")
    f = s.foresight
    gap = "-" if f["gap_closed"] is None else f"{f['gap_closed']:.0%}"
    lines += [
        "",
        "Across tokens (replay at 25% cache, experts read per decode token): best cache "
        f"{f['best_no_prediction']} {f['best_no_prediction_experts_per_token']:.2f}, ours "
        f"{f['ours_experts_per_token']:.2f}, full oracle {f['full_oracle_experts_per_token']:.2f} "
        f"(gap closed {gap})",
        "",
        "Offloaded generation, 25% cache, h100-pcie5-kimi link (measured here):",
        f"  {regime_line(s.runs)}",
    ]
    for r in s.runs:
        lines.append(
            f"  {r['label']:<40} {r['decode_tok_s']:7.1f} tok/s ({r.get('ratio') or _x(r['vs_best_cache'])} best cache)  "
            f"{r['bytes_read_per_token'] / 1e3:7.1f} "
            f"KB/token  hit {r['demand_hit_rate']:.2f}  identical output: {r['output_matches_resident']}"
        )
    lines += _peer_line(s.peers.get("run"))
    if s.host_warning:
        lines.append(f"  WARNING: {s.host_warning}")
    pred = [r for r in s.projection if r.get("predictor") not in (None, "none")]
    lines += ["", "Projected on Kimi-K2.5 / DGX Spark (simulated, not measured):",
              "  regime: " + label((pred or [{}])[0].get("time_model"))]  # fmt: skip
    for r in s.projection:
        lines.append(
            f"  {r['label']:<40} {r['decode_tok_s']:6.2f} tok/s ({_x(r['vs_best_cache'])} best cache)"
        )
    lines += _peer_line(s.peers.get("project"))
    n = max((r.get("repeats", 1) for r in s.runs), default=1)
    lines.append(
        "  (measured ratios: over the fastest cache without prediction, "
        + (
            f"medians of {n} interleaved repeats [range]; a range holding 1.00 is no gain)"
            if n > 1
            else "one run each, no repeats: within 0.95-1.05x is a tie)"
        )  # fmt: skip
        + "\n  (projected ratios: one simulation each)"
    )
    return "\n".join(lines)


def _peer_line(p: dict | None) -> list[str]:
    if p is None:
        return []
    xs = p["repeats"]
    rng = f" [{xs[0]:.2f}, {xs[-1]:.2f}]" if xs else ""
    return [f"  ours ({p['ours']}) over the best peer, the fastest row neither ours nor the "
            f"oracle ({p['best_peer']}): {p['vs_best_peer']:.2f}x{rng}"]  # fmt: skip


def _sizes_line(z: dict) -> str:
    sp = z.get("splits", {})
    rows = "" if z.get("seed_mlp_rows") is None else f", seed_mlp on {z['seed_mlp_rows']} rows"
    return (
        f"Sizes: {sum(sp.values())} prompts collected (train/val/test "
        f"{sp.get('train')}/{sp.get('val')}/{sp.get('test')}), {z['tokens']} decode tokens each"
        f"{rows}; run: {z['run_prompts']} test prompts x {z['run_tokens']} tokens, up to "
        f"{z['run_repeats']} repeats within {z['run_budget_s']} s; projection: "
        f"{z['sim_prompts']} prompts; {z.get('torch_threads')} torch thread(s) (the free cores)"
    )


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"
