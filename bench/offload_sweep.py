"""Offload sweep: policies x cache fractions on one model, same prompts, same link cap.

Usage:
    python bench/offload_sweep.py --model zoo:default --trace runs/offload/trace \\
        [--predictor PRED.safetensors]... [--baselines prev_token,spec_gate,transition,frequency,random] \\
        [--fracs 0.125,0.25,0.5] [--link h100-pcie5-kimi] --out runs/offload/sweep

Writes OUT.json (every run's `run --json` dict plus the session: link, threads, prompts) and
OUT.png (decode tok/s and stall per token by policy, one group per cache fraction), and prints
the table at cache 25%. `--trace` is a trace of the same model whose train split fits the table
baselines (frequency, prev_token, transition); with `--prepare`, a missing trace is collected
(`--split all`) and our predictor trained on it (`tensorbend` kind, `--lookahead`) first.

The link is calibrated once from the resident run (`h100-pcie5-kimi`: one expert transfer
takes the real system's ratio of a resident MoE layer's compute) and then fixed for every run.
Compute uses one intra-op thread (the machine is shared; I/O threads emulate the link).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tensorbend.collect import load_model
from tensorbend.models import describe_model
from tensorbend.offload.prefetch import NoPredictor
from tensorbend.offload.runner import build_predictor
from tensorbend.offload.runtime import OffloadSession, PolicyConfig, SessionConfig
from tensorbend.predictors.base import get_lookahead
from tensorbend.prompts import load_prompts


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    trace = Path(a.trace) if a.trace else None
    preds = [Path(p) for p in a.predictor]
    if a.prepare:
        preds += _prepare(a, trace)
    model, tok = load_model(a.model)
    prompts = load_prompts(Path(a.prompts) if a.prompts else None, a.split)[: a.max_prompts]
    predictors = [build_predictor(model, p, None, a.lookahead, None) for p in preds]
    for name in filter(None, a.baselines.split(",")):
        needs_rows = name in ("frequency", "prev_token", "transition")
        if needs_rows and trace is None:
            print(f"skip {name}: needs --trace", file=sys.stderr)
            continue
        predictors.append(build_predictor(model, None, name, a.lookahead, trace))
    t0 = time.perf_counter()
    cfg = SessionConfig(
        max_new_tokens=a.max_new_tokens, io=a.io, io_threads=a.io_threads, decode=a.decode
    )
    sess = OffloadSession(model, tok, prompts, cfg, model_name=a.model)
    link = sess.link(a.link)
    E = sess.spec.num_experts
    runs = [sess.resident_result()]
    print(f"link: {link.to_dict()}", file=sys.stderr)
    try:
        for frac in (float(f) for f in a.fracs.split(",")):
            plan = [("on_demand", None), ("lru", None), ("lfu", None)]
            plan += [("prefetch", NoPredictor(E, get_lookahead(a.lookahead)))]  # eviction only
            plan += [("prefetch", p) for p in predictors] + [("oracle", None)]
            for policy, p in plan:
                pc = PolicyConfig(
                    policy,
                    cache_frac=frac,
                    lookahead=a.lookahead,
                    prefetch_extra=a.extra,
                    prefetch_backlog=None if a.backlog < 0 else a.backlog,
                )
                r = sess.run_policy(pc, p, link)
                runs.append(r)
                print(_row(r), file=sys.stderr)
    finally:
        sess.close()
    report = {
        "model": a.model,
        "spec": describe_model(model).to_dict(),
        "link": link.to_dict(),
        "resident_layer_ms": sess.layer_seconds() * 1e3,
        "threads": a.threads,
        "io": a.io,
        "prompts": len(prompts),
        "split": a.split,
        "max_new_tokens": a.max_new_tokens,
        "decode": a.decode,
        "lookahead": a.lookahead,
        "seconds": round(time.perf_counter() - t0, 1),
        "all_outputs_match_resident": all(r["output_matches_resident"] for r in runs),
        "runs": runs,
    }
    report["goals_at_25"] = goals(report, 0.25)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    _plot(report, out.with_suffix(".png"))
    print(format_table(report, 0.25))
    print(json.dumps(report["goals_at_25"], indent=1))
    return 0


def format_table(report: dict, frac: float) -> str:
    """Markdown table of the runs at one cache fraction (plus resident)."""
    head = "| policy | predictor | decode tok/s | stall ms/token | KB read/token | demand hit rate | wasted KB | matches |"
    lines = [head, "|" + "---|" * 8]
    for r in report["runs"]:
        if r["policy"] != "resident" and abs(r["cache_frac"] - frac) > 0.01:
            continue
        lines.append(
            f"| {r['policy']} | {_pred(r)} | {r['decode_tok_s']:.1f} | "
            f"{r['stall_s_per_token'] * 1e3:.2f} | {r['bytes_read_per_token'] / 1e3:.1f} | "
            f"{r['demand_hit_rate']:.3f} | {r['wasted_prefetch_bytes'] / 1e3:.0f} | "
            f"{r['output_matches_resident']} |"
        )
    return "\n".join(lines)


def goals(report: dict, frac: float) -> dict:
    """Per predictor at one cache fraction: speed vs the best cache without prediction and vs
    the oracle, bytes vs the oracle (issue goals: >= 1.3x, >= 0.9x, <= 1.2x)."""
    at = [r for r in report["runs"] if abs(r["cache_frac"] - frac) < 0.01]
    caches = [r for r in at if r["policy"] in ("lru", "lfu")]
    oracle = next((r for r in at if r["policy"] == "oracle"), None)
    if not caches or oracle is None:
        return {}
    best = max(caches, key=lambda r: r["decode_tok_s"])
    out = {"best_cache": best["policy"], "oracle_decode_tok_s": oracle["decode_tok_s"]}
    for r in at:
        if r["policy"] == "prefetch":
            out[_label(r)] = {
                "speed_vs_best_cache": r["decode_tok_s"] / best["decode_tok_s"],
                "stall_vs_best_cache": r["stall_s_per_token"]
                / max(best["stall_s_per_token"], 1e-12),
                "speed_vs_oracle": r["decode_tok_s"] / oracle["decode_tok_s"],
                "bytes_vs_oracle": r["bytes_read_per_token"]
                / max(oracle["bytes_read_per_token"], 1e-12),
            }
    return out


def _label(r: dict) -> str:
    if r["policy"] != "prefetch":
        return r["policy"]
    return f"prefetch:{r['predictor']}" + (f"@{r['lookahead']}" if r["lookahead"] else "")


def _pred(r: dict) -> str:
    if not r["predictor"]:
        return "-"
    return f"{r['predictor']} @{r['lookahead']}" if r["policy"] == "prefetch" else r["predictor"]


def _row(r: dict) -> str:
    return (
        f"{_label(r):<24} frac={r['cache_frac']:.3f} tok/s={r['decode_tok_s']:.1f} "
        f"stall/tok={r['stall_s_per_token'] * 1e3:.2f}ms KB/tok={r['bytes_read_per_token'] / 1e3:.1f} "
        f"hit={r['demand_hit_rate']:.3f} match={r['output_matches_resident']}"
    )


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report["runs"] if r["policy"] != "resident"]
    labels = list(dict.fromkeys(_label(r) for r in runs))
    fracs = sorted({r["cache_frac"] for r in runs})
    resident = next(r for r in report["runs"] if r["policy"] == "resident")
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / len(fracs)
    for j, frac in enumerate(fracs):
        by = {_label(r): r for r in runs if r["cache_frac"] == frac}
        xs = [i + j * width for i in range(len(labels))]
        axes[0].bar(
            xs,
            [by[k]["decode_tok_s"] if k in by else 0 for k in labels],
            width,
            label=f"cache {frac * 100:g}%",
        )
        axes[1].bar(
            xs,
            [by[k]["stall_s_per_token"] * 1e3 if k in by else 0 for k in labels],
            width,
            label=f"cache {frac * 100:g}%",
        )
    axes[0].axhline(resident["decode_tok_s"], color="k", ls="--", lw=1, label="resident")
    axes[0].set_ylabel("decode tokens/s")
    axes[1].set_ylabel("stall ms per decode token")
    for ax in axes:
        ax.set_xticks(
            [i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=35, ha="right"
        )
        ax.legend(fontsize=8)
    link = report["link"]
    fig.suptitle(
        f"{report['model']}: offloaded decode, link {link['name']} "
        f"({link['bandwidth_MBps']} MB/s, {link['latency_us']} us)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _prepare(a, trace: Path | None) -> list[Path]:
    """Collect the trace if missing; train our predictor on it if missing."""
    from tensorbend.collect import CollectConfig, collect
    from tensorbend.train import TrainConfig, train

    assert trace is not None, "--prepare needs --trace DIR"
    if not (trace / "manifest.json").is_file():
        collect(
            CollectConfig(
                model=a.model,
                out=trace,
                split="all",
                max_new_tokens=16,
                features=("ids", "gate_input"),
                decode="teacher",
                max_prompts=a.prepare_prompts,
            ),
            progress=True,
        )
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
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--decode", default="teacher", help="teacher (feed continuations) or greedy")
    p.add_argument("--trace", default=None, help="trace of this model (train split fits tables)")
    p.add_argument(
        "--predictor", action="append", default=[], help="trained checkpoint (repeatable)"
    )
    p.add_argument("--baselines", default="prev_token,spec_gate,transition,frequency,random")
    p.add_argument("--lookahead", default="d1", help="lookahead of baselines and the oracle")
    p.add_argument("--extra", type=int, default=0, help="prefetch top-(K + extra) at decode")
    p.add_argument("--backlog", type=float, default=0.5, help="prefetch link backlog (-1: none)")
    p.add_argument("--fracs", default="0.125,0.25,0.5")
    p.add_argument("--link", default="h100-pcie5-kimi")
    p.add_argument("--io", default="buffered")
    p.add_argument("--io-threads", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    p.add_argument(
        "--prepare", action="store_true", help="collect --trace and train ours if missing"
    )
    p.add_argument("--prepare-prompts", type=int, default=150, help="prompts to collect")
    p.add_argument("--out", default="runs/offload/sweep")
    return p


if __name__ == "__main__":
    sys.exit(main())
