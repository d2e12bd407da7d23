"""The simulator validated against the runtime out of sample: calibrate on val, judge on test.

Usage (what `python -m bench.simulate_validate` runs; a timing bench: alone on the machine):
    report = validate(ValidateConfig(model="zoo:default", predictors=(Path("ours_d1.st"),),
                                     horizon=Path("horizon.st"), baselines=("transition",)))
    report["bias"]["decode_tok_s"]        # mean signed error (simulated - run) / run
    markdown(report)                      # docs/results/simulate_validation.md

Out of sample: the costs are calibrated (`simulate.calibration.calibrate`, from the runtime's
own counters) on `calibrate_split` prompts (val) and the simulator is judged on
`validate_split` prompts (test), which the calibration never saw. Both sides run the same
configurations: every policy, and those the projections rest on (frequency and predicted
admission, the per-layer pool, `prefetch:none`, the horizon alone and with a within-token
predictor); each is paired with its simulated twin by `cache.report.what_ran`. The link is
the session's `--link`, calibrated once on the calibration prompts and used unchanged for the
validation runs.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.sim_calibration import calibrate
from tensorbend.cache.config import PolicyConfig
from tensorbend.cache.report import run_label, what_ran
from tensorbend.cache.transfers import Link
from tensorbend.capture.collect import CollectConfig, collect
from tensorbend.capture.hf import DecodeConfig, load_model
from tensorbend.capture.prompts import load_prompts
from tensorbend.capture.trace import Trace
from tensorbend.errors import TensorbendError
from tensorbend.models import describe_model
from tensorbend.offload.hooks import NoPredictor
from tensorbend.offload.runner import build_predictor
from tensorbend.offload.session import OffloadSession, SessionConfig
from tensorbend.predictors import get_lookahead
from tensorbend.predictors.spec import PredictorSpec
from tensorbend.simulate.simulator import SimulateConfig, simulate

METRICS = ("decode_tok_s", "stall_s_per_token", "bytes_read_per_token")
BAR = 0.15  # the validation bar: every configuration within 15% on each metric


@dataclass(frozen=True)
class ValidateConfig:
    model: str = "zoo:default"
    """Model directory or zoo:NAME."""
    prompts: Path | None = None
    """Prompt file (JSONL); default: the bundled prompts."""
    calibrate_split: str = "val"
    """Prompts the costs are measured on."""
    validate_split: str = "test"
    """Prompts the simulator is judged on (never the calibration's)."""
    max_prompts: int = 5
    """Prompts of each split."""
    max_new_tokens: int = 32
    max_prompt_tokens: int = 128
    decode: str = "teacher"
    predictors: tuple[Path, ...] = ()
    """Within-token checkpoints (the first also runs with the horizon)."""
    baselines: tuple[str, ...] = ()
    """Named peers run as prefetch predictors (transition, random, ...)."""
    train_trace: Path | None = None
    """Trace whose train split fits table peers."""
    horizon: Path | None = None
    """Cross-token checkpoint: horizon alone and horizon + the first predictor."""
    lookahead: str = "d1"
    cache_frac: float = 0.25
    link: str = "h100-pcie5-kimi"
    io_threads: int = 2
    threads: int = 1
    """torch compute threads."""

    def __post_init__(self):
        if self.calibrate_split == self.validate_split and self.calibrate_split != "all":
            raise TensorbendError(
                f"--calibrate-split and --validate-split are both {self.calibrate_split}: "
                "expected two splits (validation out of sample), e.g. val and test"
            )
        if self.max_prompts < 1:
            raise TensorbendError(f"--max-prompts {self.max_prompts}: expected a count >= 1")


@dataclass(frozen=True)
class Check:
    """One configuration run both ways; `predictor` indexes the session's predictors (None:
    none; "none": `Predicted` eviction fed no predictions)."""

    policy: str
    predictor: int | str | None = None
    horizon: bool = False
    pool: str = "global"
    admission: str = "all"


def checks(n_predictors: int, horizon: bool) -> list[Check]:
    """Every policy, and every configuration the projections rest on."""
    out = [Check(p) for p in ("on_demand", "lru", "lfu", "lfru")]
    out += [Check("prefetch", "none"), *(Check("prefetch", i) for i in range(n_predictors))]
    if horizon:
        out += [
            Check("prefetch", "none", True),
            Check("prefetch", "none", True, "global", "predicted"),
        ]
        if n_predictors:
            out += [Check("prefetch", 0, True), Check("prefetch", 0, True, "global", "predicted")]
    out += [Check("oracle"), Check("oracle", admission="predicted")]
    out += [Check(p, admission="frequency") for p in ("lru", "lfru")]
    out += [Check("prefetch", "none", admission="frequency")]
    out += [Check(p, pool="per_layer", admission=a) for a in ("all", "frequency") for p in ("lru", "lfru")]  # fmt: skip
    return out


def validate(cfg: ValidateConfig, log=None) -> dict:
    """Calibrate on one split, run every check on the other, simulate the same: both sides."""
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    say = log or (lambda msg: None)
    cal_prompts = _prompts(cfg, cfg.calibrate_split)
    val_prompts = _prompts(cfg, cfg.validate_split)
    shared = {p.id for p in cal_prompts} & {p.id for p in val_prompts}
    if shared:
        raise TensorbendError(f"calibration and validation prompts overlap ({sorted(shared)[:3]})")
    decode = DecodeConfig(decode=cfg.decode, max_new_tokens=cfg.max_new_tokens,
                          max_prompt_tokens=cfg.max_prompt_tokens)  # fmt: skip
    scfg = SessionConfig(decode=decode, io_threads=cfg.io_threads)
    work = Path(tempfile.mkdtemp(prefix="tb-validate-"))
    # a session strips the experts it stores from its model: one fresh model per session
    sess, preds, horizon = _session(cfg, cal_prompts, scfg)
    try:
        link = sess.link(cfg.link)
        cal = calibrate(
            sess, link, preds[0] if preds else None, horizon, cfg.cache_frac, cfg.lookahead, say
        )
    finally:
        sess.close()
    cal_path = cal.save(work / "calibration.json")
    sess, preds, horizon = _session(cfg, val_prompts, scfg)
    todo = checks(len(preds), horizon is not None)
    try:
        runs = [_run(sess, c, preds, horizon, link, cfg) for c in todo]
        for r in runs:
            say(f"runtime {run_label(r):<36} {r['decode_tok_s']:.2f} tok/s")
        trace = _trace_of(sess, val_prompts, cfg, work)
    finally:
        sess.close()
    sims = _simulated(cfg, todo, trace, cal_path)
    rows = _compare(runs, sims)
    return {
        "model": cfg.model, "config": _json(asdict(cfg)), "prompts": {
            cfg.calibrate_split: [p.id for p in cal_prompts],
            cfg.validate_split: [p.id for p in val_prompts]},
        "link": link.to_dict(), "calibration": asdict(cal), "rows": rows,
        "bias": _bias(rows), "max_error": _max_error(rows), "bar": BAR,
        "seconds": round(time.perf_counter() - t0, 1),
    }  # fmt: skip


def markdown(out: dict) -> str:
    """docs/results/simulate_validation.md: both sides per configuration, signed errors, the bias."""
    c, link, cf = out["calibration"], out["link"], out["config"]
    splits = list(out["prompts"])
    lines = [
        "# Simulator vs runtime, out of sample",
        "",
        f"Generated by `{out['command']}` ({out['seconds']} s). Costs calibrated on "
        f"{len(out['prompts'][splits[0]])} {splits[0]} prompts; both sides then run the same "
        f"configurations on {len(out['prompts'][splits[-1]])} {splits[-1]} prompts the "
        f"calibration never saw. {cf['decode']} decode, {cf['max_new_tokens']} new tokens, cache "
        f"{cf['cache_frac']}, link {link['name']} ({link['bandwidth_MBps']} MB/s, "
        f"{link['latency_us']} us), {cf['io_threads']} I/O threads, {cf['threads']} compute "
        f"thread(s). Calibration: {c['attn_s'] * 1e3:.3f} ms per MoE layer outside the experts and "
        f"{c['expert_s'] * 1e3:.3f} ms per expert (decode), {c['predict_s'] * 1e6:.0f} us per "
        f"within-token prediction, {c['forecast_s'] * 1e6:.0f} us per cross-token forecast, "
        f"{c['miss_s'] * 1e6:.0f} us of compute-thread time per miss.",
        "",
        "Errors are signed: (simulated - run) / run; a positive tok/s error means the simulator "
        "is optimistic.",
        "",
        "| configuration | tok/s run | sim | err | stall ms/tok run | sim | err | KB/tok run | sim | err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        cells = []
        for k, scale in (("decode_tok_s", 1), ("stall_s_per_token", 1e3),
                         ("bytes_read_per_token", 1e-3)):  # fmt: skip
            e = r[f"error_{k}"]
            cells += [f"{r[f'runtime_{k}'] * scale:.2f}", f"{r[f'simulated_{k}'] * scale:.2f}",
                      "-" if e is None else f"{e:+.1%}"]  # fmt: skip
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    b = out["bias"]
    lines += ["", "| metric | mean signed error | range | simulated above run / configurations |",
              "|---|---|---|---|"]  # fmt: skip
    for k in METRICS:
        s = b[k]
        lines.append(f"| {k} | {s['mean']:+.1%} | [{s['min']:+.1%}, {s['max']:+.1%}] | "
                     f"{s['over']} / {s['n']} |")  # fmt: skip
    within = out["max_error"] is not None and out["max_error"] <= out["bar"]
    lines += ["", f"Largest error in magnitude: {out['max_error']:.1%} (bar: {out['bar']:.0%}; "
              f"{'met' if within else 'not met'})."]  # fmt: skip
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------ helpers


def _prompts(cfg: ValidateConfig, split: str):
    got = load_prompts(cfg.prompts, split)[: cfg.max_prompts]
    if not got:
        raise TensorbendError(f"no {split} prompts in {cfg.prompts or 'the bundled prompts'}")
    return got


def _session(cfg: ValidateConfig, prompts, scfg: SessionConfig):
    model, tok = load_model(cfg.model)
    la, train, spec = cfg.lookahead, cfg.train_trace, describe_model(model)
    preds = [build_predictor(model, Path(p), None, la, train, spec) for p in cfg.predictors]
    preds += [build_predictor(model, None, b, la, train, spec) for b in cfg.baselines]
    horizon = build_predictor(model, cfg.horizon, None, la, None, spec) if cfg.horizon else None
    sess = OffloadSession(model, tok, prompts, scfg, model_name=cfg.model, spec=spec)
    return sess, preds, horizon


def _run(sess, c: Check, preds, horizon, link: Link, cfg: ValidateConfig) -> dict:
    pc = PolicyConfig(c.policy, cache_frac=cfg.cache_frac, lookahead=cfg.lookahead,
                      pool=c.pool, admission=c.admission)  # fmt: skip
    none = NoPredictor(sess.spec.num_experts, get_lookahead(cfg.lookahead))
    p = none if c.predictor == "none" else None if c.predictor is None else preds[c.predictor]
    r = sess.run_policy(pc, p, link, horizon if c.horizon else None).to_json()
    assert r["output_matches_resident"], run_label(r)
    return r


def _simulated(cfg: ValidateConfig, todo: list[Check], trace: Path, cal: Path) -> list[dict]:
    """The simulator on the validation prompts: one pass per (pool, admission)."""
    names = [str(p) for p in cfg.predictors] + list(cfg.baselines)
    rows = []
    for pool, adm in dict.fromkeys((c.pool, c.admission) for c in todo):
        group = [c for c in todo if (c.pool, c.admission) == (pool, adm)]
        want = [names[c.predictor] for c in group if isinstance(c.predictor, int)]
        sc = SimulateConfig(
            trace=trace, hardware="h100-pcie5", geometry="from-trace", calibration=cal,
            policies=tuple(dict.fromkeys(c.policy for c in group)),
            predictors=tuple(dict.fromkeys(want)) or ("none",), cache_fracs=(cfg.cache_frac,),
            split="all", train_trace=cfg.train_trace,
            prediction=PredictorSpec(horizon=cfg.horizon if any(c.horizon for c in group)
                                     else None),
            offload=PolicyConfig("oracle", lookahead=cfg.lookahead, pool=pool, admission=adm),
            progress=False,
        )  # fmt: skip
        rows += simulate(sc).to_json()["results"]
    return rows


def _trace_of(sess, prompts, cfg: ValidateConfig, work: Path) -> Path:
    """The validation prompts collected to a trace; its routing must be the session's."""
    pfile = work / "prompts.jsonl"
    pfile.write_text("".join(json.dumps({"id": p.id, "text": p.text,
                                         "continuation": p.continuation}) + "\n"
                             for p in prompts))  # fmt: skip
    out = work / "trace"
    decode = DecodeConfig(decode=cfg.decode, max_new_tokens=cfg.max_new_tokens,
                          max_prompt_tokens=cfg.max_prompt_tokens)  # fmt: skip
    collect(CollectConfig(model=cfg.model, out=out, prompts=pfile, decode=decode,
                          features=("ids", "gate_input", "layer_input")), progress=False)  # fmt: skip
    rows = Trace.open(out).load(("ids",))
    ref = torch.cat([f.reshape(-1, *f.shape[1:]) for f in sess.reference.ids]).to(torch.int16)
    if not torch.equal(rows["expert_ids_TLK"], ref):
        raise TensorbendError(
            "the collected trace's routing differs from the session's: not the same workload"
        )
    return out


def _compare(runs: list[dict], sims: list[dict]) -> list[dict]:
    rows = []
    for r in runs:
        [s] = [x for x in sims if what_ran(x) == what_ran(r)]
        row = {"label": what_ran(r), "policy": r["policy"], "predictor": r["predictor"],
               "pool": r["pool"], "admission": r["admission"], "horizon": bool(r["horizon"])}  # fmt: skip
        for k in METRICS:
            row[f"runtime_{k}"], row[f"simulated_{k}"] = r[k], s[k]
            row[f"error_{k}"] = (s[k] - r[k]) / r[k] if r[k] else None
        rows.append(row)
    return rows


def _bias(rows: list[dict]) -> dict:
    out = {}
    for k in METRICS:
        errs = [r[f"error_{k}"] for r in rows if r[f"error_{k}"] is not None]
        out[k] = {"mean": statistics.fmean(errs) if errs else 0.0, "min": min(errs, default=0.0),
                  "max": max(errs, default=0.0), "over": sum(e > 0 for e in errs), "n": len(errs)}  # fmt: skip
    return out


def _max_error(rows) -> float | None:
    errs = [abs(r[f"error_{k}"]) for r in rows for k in METRICS if r[f"error_{k}"] is not None]
    return max(errs) if errs else None


def _json(d: dict) -> dict:
    return {k: (str(v) if isinstance(v, Path) else [str(x) for x in v]
                if isinstance(v, tuple) else v) for k, v in d.items()}  # fmt: skip
