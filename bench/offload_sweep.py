"""Offload sweep: every cache, predictor and bounded-foresight oracle per cache size and link.

Usage:
    python -m bench.offload_sweep --model zoo:default --trace runs/offload/trace \\
        [--predictor PRED.safetensors]... [--baselines prev_token,spec_gate,transition,frequency,random] \\
        [--fracs 0.125,0.25,0.5] [--link h100-pcie5-kimi] [--link-speedups 1,4] \\
        [--foresights 0,1,2,4,8,all] [--horizon HORIZON.safetensors] --out runs/offload/sweep

Per link (the calibrated `--link`, and the same link N times faster per `--link-speedups`) and
per cache fraction it runs: on_demand; every cache without prediction (lru, lfu, lfru x pool
global / per_layer x admission all / frequency); prefetch with no predictor (Predicted eviction
alone) and with each predictor; with `--horizon` (a cross-token checkpoint): its forecasts
driving eviction with no prefetch at all (eviction alone), plus next-forward prefetches
(admission all, and predicted), and with our within-token predictor (the first --predictor)
on top, with and without those next-forward prefetches (the ablation row
`horizon(evict only)+d1:...`); the training-free cross-token peer (`recency`: the request's
decayed routing as the forecast) the same way: eviction alone, with its next-forward
prefetches at predicted admission, and under each peer predictor's prefetches
(`recency+d1:spec_gate/adm=predicted`; `--no-peer-horizon` drops them); the oracle at every foresight h (tokens of exact routing it knows; `all` = the
whole run), run after the caches: past its sight it ranks like the no-prediction cache with
the fewest bytes at that size (`--oracle-beyond best`), with ours' predicted admission. With
`--horizon`, every other predictor (the peers: later --predictor checkpoints such as the seed's
MLP, and --baselines such as spec_gate) also runs at ours' predicted admission; the page
reports ours against the best of every row that is not ours nor an oracle, as run and with
prediction charged as the target would pay it (`time_model`). All runs share one resident reference, the same prompts and
the same calibrated link. It writes OUT.json (every run's `run --json` dict plus per link and
fraction: the best no-prediction cache by speed and by bytes, the full oracle, and per run
`vs_best_cache` (decode tok/s / the best no-prediction cache's), `gap_closed_bytes` = (best
no-prediction bytes/token - X) / (best no-prediction - full oracle), `gap_closed_seconds` (the
same with decode seconds per token)), OUT.png (tok/s and stall per run at the first link) and
OUT_foresight.png (bytes/token and decode tok/s against h, one line per cache size and link).

Timing numbers need a quiet machine (the lead runs this); stall, bytes and hit rates are the
robust columns. `--prepare` collects `--trace` and trains our predictor when missing.
The page is rendered from the JSON by `bench.pages.offload`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from bench.pages.offload import format_table, markdown, summarize
from bench.record import command
from tensorbend.atomic import atomic_write_text
from tensorbend.cache.config import POLICIES, PolicyConfig, no_prediction
from tensorbend.cache.report import best_rule, host_warning, median_row, run_label, what_ran
from tensorbend.cache.transfers import BUSY_LINK_PREFETCH
from tensorbend.capture.hf import DecodeConfig, load_model
from tensorbend.capture.prompts import load_prompts
from tensorbend.models import describe_model
from tensorbend.offload.hooks import NoPredictor
from tensorbend.offload.runner import build_predictor
from tensorbend.offload.session import OffloadSession, SessionConfig
from tensorbend.predictors.base import get_lookahead
from tensorbend.predictors.checkpoint import check_held_out
from tensorbend.predictors.recency import RecencyForecaster
from tensorbend.predictors.spec import NEEDS_TRACE


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    if a.render:  # the doc from an existing JSON, no runs
        report = json.loads(Path(a.render).read_text())
        atomic_write_text(Path(a.doc), markdown(report))
        return 0
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(Path(a.prompts) if a.prompts else None, a.split)
    if a.topics:  # held-out domains: these topics' prompts only (`trace resplit` fits the rest)
        topics = set(_names(a.topics))
        prompts = [p for p in prompts if p.topic in topics]
        if not prompts:
            raise SystemExit(f"--topics {a.topics}: no prompt of split {a.split} has these topics")
    prompts = prompts[: a.max_prompts]
    checkpoints = [*a.predictor, *([a.horizon] if a.horizon else [])]
    for path in () if a.allow_seen_split else checkpoints:  # as `tensorbend measure` does
        check_held_out(path, [p.id for p in prompts], a.split)
    model, tok = load_model(a.model)
    predictors = _predictors(a, model)
    horizon = (
        build_predictor(model, Path(a.horizon), None, a.lookahead, None) if a.horizon else None
    )
    peer = None if a.no_peer_horizon or not a.horizon else RecencyForecaster(describe_model(model))
    t0 = time.perf_counter()
    dc = DecodeConfig(decode=a.decode, max_new_tokens=a.max_new_tokens)
    cfg = SessionConfig(dc, io=a.io, io_threads=a.io_threads, batch=a.batch)
    sess = OffloadSession(model, tok, prompts, cfg, model_name=a.model)
    links = []
    try:
        resident = _tag(sess.resident_result().to_json(), 1.0)
        speedups = _floats(a.link_speedups)
        link_of = {sp: sess.link(a.link, sp) for sp in speedups}
        reps: dict[tuple, list[dict]] = {}  # (speedup, frac, what ran) -> one row per repeat
        for rep in range(a.repeats):  # interleaved: every configuration once per repeat
            for speedup in speedups:
                link = link_of[speedup]
                print(f"repeat {rep}, link: {link.to_dict()}", file=sys.stderr)
                done = []
                for frac in _floats(a.fracs):
                    plan = _rotated(
                        _plan(a, frac, predictors, sess.spec.num_experts, horizon, peer),
                        rep,
                        a.repeats,
                    )
                    for pc, p, hz in plan:
                        if POLICIES[pc.policy].recorded_routing and a.oracle_beyond == "best":
                            at = [r for r in done if abs(r["cache_frac"] - frac) < 0.01]
                            pc = dataclasses.replace(pc, oracle_beyond=best_rule(at))
                        r = _tag(sess.run_policy(pc, p, link, hz, a.extra).to_json(), speedup)
                        done.append(r)
                        reps.setdefault((speedup, frac, what_ran(r)), []).append(r)
                        print(_row(r), file=sys.stderr)
        for speedup in speedups:
            runs = [resident] + [median_row(rs) for (sp, _, _), rs in reps.items() if sp == speedup]
            links.append({"speedup": speedup, "link": link_of[speedup].to_dict(), "runs": runs})
    finally:
        sess.close()
    for entry in links:
        entry["by_frac"] = {str(f): summarize(entry["runs"], f) for f in _floats(a.fracs)}
    report = _report(a, model, sess, prompts, links, time.perf_counter() - t0)
    report["command"] = command("offload_sweep", argv)
    atomic_write_text(out.with_suffix(".json"), json.dumps(report, indent=1))
    if a.doc:
        atomic_write_text(Path(a.doc), markdown(report))
    _plot_runs(links[0], report, out.with_suffix(".png"))
    _plot_foresight(links, report, out.with_name(out.name + "_foresight.png"))
    print(format_table(links[0]["runs"], 0.25))
    print(json.dumps({e["link"]["name"]: e["by_frac"].get("0.25") for e in links}, indent=1))
    if report["host_warning"]:
        print(f"warning: {report['host_warning']}", file=sys.stderr)
    return 0


def _plan(a, frac: float, predictors: list, num_experts: int, horizon, peer=None) -> list[tuple]:
    """Every run at one cache fraction: (PolicyConfig, predictor or None, horizon or None);
    peer: the training-free cross-token forecast (`recency`), run as ours' horizon is."""
    common = dict(
        cache_frac=frac,
        lookahead=a.lookahead,
        prefetch_backlog=float("inf") if a.backlog < 0 else a.backlog,
    )
    plan = [(PolicyConfig("on_demand", **common), None, None)]
    for policy in _names(a.caches):
        for pool in _names(a.pools):
            for adm in _names(a.admissions):
                pc = PolicyConfig(policy, pool=pool, admission=adm, **common)
                plan.append((pc, None, None))
    none = NoPredictor(num_experts, get_lookahead(a.lookahead))  # Predicted eviction alone
    plan += [(PolicyConfig("prefetch", **common), p, None) for p in [none, *predictors]]
    if horizon is not None:  # the peers also at ours' admission (ours: the first predictor)
        pc = PolicyConfig("prefetch", admission="predicted", **common)
        plan += [(pc, p, None) for p in predictors[1:]]
        plan += [
            (PolicyConfig("prefetch", token_ahead_layers=0, **common), none, horizon),
            (PolicyConfig("prefetch", **common), none, horizon),
            (PolicyConfig("prefetch", admission="predicted", **common), none, horizon),
        ]
        for ours in predictors[:1]:
            pc = PolicyConfig("prefetch", admission="predicted", **common)
            plan.append((pc, ours, horizon))
            # the ablation: the same without the horizon's next-forward prefetches
            pc = PolicyConfig("prefetch", admission="predicted", token_ahead_layers=0, **common)
            plan.append((pc, ours, horizon))
    if peer is not None:  # the peer across tokens, alone and under each peer's prefetches
        plan += [
            (PolicyConfig("prefetch", token_ahead_layers=0, **common), none, peer),
            (PolicyConfig("prefetch", admission="predicted", **common), none, peer),
        ]
        pc = PolicyConfig("prefetch", admission="predicted", **common)
        plan += [(pc, p, peer) for p in predictors[1:]]
    for h in _names(a.foresights):  # the oracle after the caches: beyond its sight it ranks
        foresight = None if h == "all" else int(h)  # like the best of them (--oracle-beyond)
        for adm in ("all", "predicted") if foresight is None else ("predicted",):
            pc = PolicyConfig("oracle", foresight=foresight, admission=adm, **common)
            plan.append((pc, None, None))
    return plan


# ---------------------------------------------------------------- helpers

ORDER = (
    "rotated: repeat r of R starts at row r*n/R of the n runs that are not oracles; the "
    "oracles run last (they rank beyond their sight by the best cache of the same repeat)"
)


def _rotated(plan: list[tuple], rep: int, repeats: int) -> list[tuple]:
    """The plan in repeat `rep`'s order (ORDER), so no run always follows the same one."""
    head = [x for x in plan if not POLICIES[x[0].policy].recorded_routing]
    tail = [x for x in plan if POLICIES[x[0].policy].recorded_routing]
    k = rep * len(head) // max(repeats, 1)
    return head[k:] + head[:k] + tail


def _tag(r: dict, speedup: float) -> dict:
    return {**r, "label": run_label(r), "link_speedup": speedup}


def _names(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def _floats(text: str) -> list[float]:
    return [float(t) for t in _names(text)]


def _predictors(a, model) -> list:
    trace = Path(a.trace) if a.trace else None
    preds = [Path(p) for p in a.predictor]
    if a.prepare:
        preds += _prepare(a, trace)
    out = [build_predictor(model, p, None, a.lookahead, None) for p in preds]
    for name in _names(a.baselines):
        if name in NEEDS_TRACE and trace is None:
            print(f"skip {name}: needs --trace", file=sys.stderr)
            continue
        out.append(build_predictor(model, None, name, a.lookahead, trace))
    return out


def _report(a, model, sess, prompts, links, seconds: float) -> dict:
    runs = [r for e in links for r in e["runs"]]
    return {
        "model": a.model,
        "spec": describe_model(model).to_dict(),
        "links": links,
        "resident_layer_ms": sess.layer_seconds() * 1e3,
        "threads": a.threads,
        "io": a.io,
        "prompts": len(prompts),
        "split": a.split,
        "topics": _names(a.topics) if a.topics else None,
        "max_new_tokens": a.max_new_tokens,
        "repeats": a.repeats,
        "order": ORDER,
        "decode": a.decode,
        "batch": a.batch,
        "lookahead": a.lookahead,
        "busy_link_prefetch": BUSY_LINK_PREFETCH,
        "seconds": round(seconds, 1),
        "all_outputs_match_resident": all(
            r["output_matches_resident"] for r in runs if r["policy"] != "resident"
        ),
        "host_busy": any(r.get("host_busy") for r in runs),
        "host_warning": host_warning(runs),
    }


def _row(r: dict) -> str:
    return (
        f"{r['label']:<32} x{r['link_speedup']:g} frac={r['cache_frac']:.3f} "
        f"tok/s={r['decode_tok_s'] or 0:.1f} stall/tok={r['stall_s_per_token'] * 1e3:.2f}ms "
        f"KB/tok={r['bytes_read_per_token'] / 1e3:.1f} hit={r['demand_hit_rate']:.3f} "
        f"match={r['output_matches_resident']}"
    )


def _plot_runs(entry: dict, report: dict, path: Path) -> None:
    """Decode tok/s and stall per token by run, one bar group per cache fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in entry["runs"] if r["policy"] != "resident"]
    labels = list(dict.fromkeys(r["label"] for r in runs))
    fracs = sorted({r["cache_frac"] for r in runs})
    fig, axes = plt.subplots(2, 1, figsize=(max(10, len(labels) * 0.45), 9))
    width = 0.8 / len(fracs)
    for j, frac in enumerate(fracs):
        by = {r["label"]: r for r in runs if r["cache_frac"] == frac}
        xs = [i + j * width for i in range(len(labels))]
        for ax, key, scale in ((axes[0], "decode_tok_s", 1), (axes[1], "stall_s_per_token", 1e3)):
            ys = [(by[k][key] or 0) * scale if k in by else 0 for k in labels]
            ax.bar(xs, ys, width, label=f"cache {frac * 100:g}%")
    resident = next(r for r in entry["runs"] if r["policy"] == "resident")
    axes[0].axhline(resident["decode_tok_s"], color="k", ls="--", lw=1, label="resident")
    axes[0].set_ylabel("decode tokens/s")
    axes[1].set_ylabel("stall ms per decode token")
    for ax in axes:
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=60,
                      ha="right", fontsize=7)  # fmt: skip
        ax.legend(fontsize=8)
    link = entry["link"]
    fig.suptitle(f"{report['model']}: offloaded decode, link {link['name']} "
                 f"({link['bandwidth_MBps']} MB/s, {link['latency_us']} us)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_foresight(links: list[dict], report: dict, path: Path) -> None:
    """Bytes/token and decode tok/s against the oracle's foresight h, per cache size and link;
    dashed (dash-dot for the second link): the best no-prediction cache, same size and link."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for i, entry in enumerate(links):
        oracles = [r for r in entry["runs"] if POLICIES[r["policy"]].recorded_routing]
        hs = sorted(
            {r["foresight"] for r in oracles}, key=lambda h: float("inf") if h is None else h
        )
        ticks = ["all" if h is None else str(h) for h in hs]
        for j, frac in enumerate(sorted({r["cache_frac"] for r in oracles})):
            by = {r["foresight"]: r for r in oracles if r["cache_frac"] == frac}
            best = entry["by_frac"].get(str(frac)) or {}
            color, style = f"C{j}", "-o" if i == 0 else ":s"
            name = f"cache {frac * 100:g}%, {entry['link']['name']}"
            for ax, key, scale in ((axes[0], "bytes_read_per_token", 1e-3),
                                   (axes[1], "decode_tok_s", 1)):  # fmt: skip
                ys = [(by[h][key] or 0) * scale if h in by else float("nan") for h in hs]
                ax.plot(range(len(hs)), ys, style, color=color, label=name)
                ref = best.get("best_no_prediction_bytes_per_token" if key.startswith("bytes")
                               else "best_no_prediction_decode_tok_s")  # fmt: skip
                if ref:
                    ax.axhline(ref * scale, color=color, ls="--" if i == 0 else "-.", lw=0.8)
            for ax in axes:
                ax.set_xticks(range(len(hs)), ticks)
    axes[0].set_ylabel("KB read per decode token")
    axes[1].set_ylabel("decode tokens/s")
    for ax in axes:
        ax.set_xlabel("oracle foresight h (tokens of exact routing known)")
        ax.legend(fontsize=7)
    fig.suptitle(f"{report['model']}: bounded-foresight oracle (dashed: best cache without "
                 f"prediction, same size and link)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _prepare(a, trace: Path | None) -> list[Path]:
    """Collect the trace if missing; train our predictor on it if missing."""
    from tensorbend.capture.collect import CollectConfig, collect
    from tensorbend.predictors.train import TrainConfig, train

    assert trace is not None, "--prepare needs --trace DIR"
    if not (trace / "manifest.json").is_file():
        dc = DecodeConfig(decode="teacher", max_new_tokens=16)
        collect(
            CollectConfig(model=a.model, out=trace, split="all", features=("ids", "gate_input"),
                          decode=dc, max_prompts=a.prepare_prompts),
            progress=True,
        )  # fmt: skip
    ours = trace.parent / f"ours_{a.lookahead}.safetensors"
    if not ours.is_file():
        train(
            TrainConfig(trace=trace, out=ours, predictor="tensorbend", lookahead=a.lookahead),
            progress=True,
        )
    return [ours]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="zoo:default")
    p.add_argument("--prompts", default=None, help="prompts JSONL (default: the shipped prompts)")
    p.add_argument("--split", default="test", help="prompts split to run (default: test)")
    p.add_argument("--max-prompts", type=int, default=6)
    p.add_argument("--topics", default=None,
                   help="only prompts of these topics (comma-separated; with --split all and "
                   "checkpoints fitted on a `trace resplit` trace: held-out domains)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--decode", default="teacher", help="teacher (feed continuations) or greedy")
    p.add_argument("--trace", default=None, help="trace of this model (train split fits tables)")
    p.add_argument("--predictor", action="append", default=[], help="checkpoint (repeatable)")
    p.add_argument("--horizon", default=None, help="cross-token (horizon) checkpoint")
    p.add_argument(
        "--no-peer-horizon",
        action="store_true",
        help="without the training-free cross-token peer's rows (recency)",
    )
    p.add_argument("--allow-seen-split", action="store_true",
                   help="run checkpoints on prompts they were trained or early-stopped on")  # fmt: skip
    p.add_argument("--baselines", default="prev_token,spec_gate,transition,frequency,random")
    p.add_argument("--lookahead", default="d1", help="lookahead of baselines and the oracle")
    p.add_argument("--extra", type=int, default=0, help="prefetch top-(K + extra) at decode")
    p.add_argument("--backlog", type=float, default=0.5, help="prefetch link backlog (-1: none)")
    p.add_argument("--fracs", default="0.125,0.25,0.5")
    p.add_argument("--caches", default=",".join(no_prediction()))
    p.add_argument("--pools", default="global,per_layer")
    p.add_argument("--admissions", default="all,frequency")
    p.add_argument("--foresights", default="0,1,2,4,8,all", help="oracle foresights h")
    p.add_argument(
        "--oracle-beyond",
        default="best",
        help="the bounded oracle's rule past its "
        "sight: best (the fewest-bytes no-prediction cache's), lru, lfu, lfru, predicted",
    )
    p.add_argument("--repeats", type=int, default=1,
                   help="interleaved repeats of every run (tok/s: median and range)")  # fmt: skip
    p.add_argument("--link", default="h100-pcie5-kimi")
    p.add_argument("--link-speedups", default="1,4", help="the link, and N times faster")
    p.add_argument("--io", default="buffered")
    p.add_argument("--io-threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    p.add_argument("--prepare", action="store_true", help="collect --trace, train ours if missing")
    p.add_argument("--prepare-prompts", type=int, default=150, help="prompts to collect")
    p.add_argument("--out", default="runs/offload/sweep")
    p.add_argument("--doc", default=None, help="markdown doc of the results")
    p.add_argument("--render", default=None, help="write --doc from this JSON and stop")
    return p


if __name__ == "__main__":
    sys.exit(main())
