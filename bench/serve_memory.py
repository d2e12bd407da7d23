"""Serve a model several times larger than its memory budget: peak RSS and decode tok/s per
policy, `tensorbend generate` in a fresh process per run, median of interleaved repeats.

Usage:
    python -m bench.serve_memory --factor 184 --max-memory 1GB --repeats 5 \
        --predictor runs/bench/default/ours_d1.safetensors \
        --horizon runs/bench/default/horizon_routing_hidden.safetensors \
        --json docs/bench/serve_memory.json --doc docs/serve_memory.md

The model is zoo:default with every expert widened `--factor` times by zero rows
(`tensorbend.zoo.inflate`: the same routers, routing and text; 184x gives 3.5 GB of routed
experts), so the predictors trained on zoo:default load on it (same fingerprint). Each run is
`tensorbend generate` on the held-out test prompts (greedy), with `--io direct` so every
expert read comes from the disk, not the page cache; its peak RSS (mapped file pages
included) is its own high-water mark (`offload.handle.peak_rss_bytes`). The import baseline
is the peak RSS of a process that imports torch, transformers' modeling and generation code
and tensorbend (`serving.IMPORT_BASELINE`). Policies run in interleaved order,
repeat after repeat; the table gives the median decode tok/s with its range. Rows ending
`/jit=0` run with TENSORBEND_JIT=0 (numpy paths, no numba: its memory goes to the cache);
`+d1+d2+...` rows: `--predictor-group` (within-token members fired together from every
n-th router: fewer prediction call sites per token);
`/extra=-2`, `/extra=-3`: `--prefetch-extra` (a decode call prefetches its top-(K + extra)
predictions: fewer than the K routed).
Nothing else should run on the machine meanwhile.
The page is rendered from the JSON by `tensorbend.results.serve_memory_page`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tensorbend.atomic import write_generated
from tensorbend.placement import parse_bytes
from tensorbend.results.serve_memory_page import markdown
from tensorbend.zoo import resolve_model
from tensorbend.zoo.inflate import inflate

NO_PREDICTION = {
    "lru": [],
    "lfu": ["--policy", "lfu"],
    "lfru": ["--policy", "lfru"],
    "lfru/adm=frequency": ["--policy", "lfru", "--admission", "frequency"],
    "lru/per_layer": ["--pool", "per_layer"],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--factor", type=int, default=184)
    ap.add_argument("--max-memory", default="1GB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=3, help="test prompts per run")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--predictor", type=Path, help="zoo:default within-token checkpoint")
    ap.add_argument("--horizon", type=Path, help="zoo:default horizon checkpoint")
    ap.add_argument("--predictor-group", type=Path, nargs="+", default=None,
                    help="zoo:default within-token checkpoints d1, d2, ... (predictors.group): "
                         "with --horizon, one more row: --predictor's evict-only row with this "
                         "group in its place (and its /jit=0 twin)")  # fmt: skip
    ap.add_argument("--workdir", type=Path, default=Path("runs/bench/serve"))
    ap.add_argument("--json", type=Path, default=Path("docs/bench/serve_memory.json"))
    ap.add_argument("--doc", type=Path, default=Path("docs/serve_memory.md"))
    ap.add_argument("--only", default=None,
                    help="regex: run only the rows whose name it finds (at least one row "
                         "without prediction: the best of those is the reference)")  # fmt: skip
    args = ap.parse_args(argv)
    ckpt = inflate(resolve_model("zoo:default"), args.workdir / f"ckpt-x{args.factor}",
                   args.factor)  # fmt: skip
    prompts = _test_prompts(args.workdir / "prompts.jsonl", args.prompts)
    policies = dict(NO_PREDICTION)
    if args.horizon:  # the forecast as eviction alone: no prefetch, no within-token predictor
        evict = ["--policy", "prefetch", "--horizon", str(args.horizon),
                 "--token-ahead-layers", "0"]  # fmt: skip
        policies["ours: horizon(evict only)"] = evict
        policies["ours: horizon(evict only)/per_layer"] = evict + ["--pool", "per_layer"]
        if args.predictor:  # + within-token prefetches, in the best cache's pool
            policies["ours: horizon(evict only)+d1/per_layer/adm=predicted"] = evict + [
                "--pool", "per_layer", "--predictor", str(args.predictor),
                "--admission", "predicted"]  # fmt: skip
        if args.predictor_group:  # the same, the group's members fired together
            label = "+".join(f"d{i + 1}" for i in range(len(args.predictor_group)))
            policies[f"ours: horizon(evict only)+{label}/per_layer/adm=predicted"] = evict + [
                "--pool", "per_layer", "--predictor-group",
                *map(str, args.predictor_group), "--admission", "predicted"]  # fmt: skip
    if args.horizon or args.predictor:
        ours = ["--policy", "prefetch", "--admission", "predicted"]
        ours += ["--horizon", str(args.horizon)] if args.horizon else []
        ours += ["--predictor", str(args.predictor)] if args.predictor else []
        label = "+".join(x for x, p in (("horizon", args.horizon), ("d1", args.predictor)) if p)
        policies[f"ours: {label}/adm=predicted"] = ours
    envs = {}  # rows run with TENSORBEND_JIT=0: numpy paths, numba's memory goes to the cache
    jit_off = ("ours: horizon(evict only)/per_layer", "ours: horizon(evict only)+")
    for name in [n for n in policies if n.startswith(jit_off)]:
        policies[name + "/jit=0"] = policies[name]
        envs[name + "/jit=0"] = {"TENSORBEND_JIT": "0"}
    narrow = "ours: horizon(evict only)+d1/per_layer/adm=predicted"
    for extra in (-2, -3) if narrow in policies else ():  # fewer prefetches than the K routed
        name = f"{narrow}/extra={extra}/jit=0"
        policies[name] = policies[narrow] + ["--prefetch-extra", str(extra)]
        envs[name] = {"TENSORBEND_JIT": "0"}
    if args.only:
        policies = {k: v for k, v in policies.items() if re.search(args.only, k)}
        if not any(k in NO_PREDICTION for k in policies):
            raise SystemExit(f"--only {args.only!r}: expected it to keep a row without "
                             f"prediction (one of {', '.join(NO_PREDICTION)})")  # fmt: skip
    store = args.workdir / "store"
    base = [sys.executable, "-m", "tensorbend", "generate", "--model", str(ckpt), "--prompts",
            str(prompts), "--max-new-tokens", str(args.max_new_tokens), "--max-memory",
            args.max_memory, "--io", "direct", "--store-dir", str(store), "--quiet"]  # fmt: skip
    _run(base + ["--max-new-tokens", "1"])  # builds the store once, outside the timed runs
    baseline = _import_rss()
    runs: dict[str, list[dict]] = {name: [] for name in policies}
    for r in range(args.repeats):
        for name, flags in policies.items():
            runs[name].append(_run(base + flags, envs.get(name)))
            print(f"repeat {r}: {name}: {runs[name][-1]['decode_tok_s']:.2f} tok/s",
                  file=sys.stderr)  # fmt: skip
    result = _aggregate(runs, args, ckpt, baseline, envs)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_generated(args.json, json.dumps(result, indent=1) + "\n")
    write_generated(args.doc, markdown(json.loads(args.json.read_text())))
    print(markdown(result))
    return 0


def _aggregate(runs: dict, args, ckpt: Path, baseline: int, envs: dict) -> dict:
    experts = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    rows = []
    for name, rs in runs.items():
        tok_s = [r["decode_tok_s"] for r in rs]  # in repeat order
        rows.append({
            "policy": name,
            "decode_tok_s": statistics.median(tok_s),
            "decode_tok_s_range": [min(tok_s), max(tok_s)],
            "decode_tok_s_repeats": tok_s,
            "bytes_read_per_token": statistics.median(r["bytes_read_per_token"] for r in rs),
            "demand_hit_rate": statistics.median(r["demand_hit_rate"] for r in rs),
            "stall_s_per_token": statistics.median(r["stall_s_per_token"] for r in rs),
            "no_stall_ceiling": statistics.median(  # per repeat: tok/s with every wait hidden
                1 / (1 - r["stall_s_per_token"] * r["decode_tok_s"]) for r in rs
            ),
            "predict_s_per_token": statistics.median(r["predict_s_per_token"] or 0 for r in rs),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs),
            "cache_slots": rs[0]["cache_slots"],
            "decode_tokens": rs[0]["decode_tokens"],
            "env": envs.get(name, {}),
        })  # fmt: skip
    best = max((r for r in rows if r["policy"] in NO_PREDICTION), key=lambda r: r["decode_tok_s"])
    every = [r for rs in runs.values() for r in rs]
    first = every[0]
    plan = _split(first)
    grown = [r["memory_plan"]["measured"] for r in every if "measured" in r["memory_plan"]]
    for r in rows:  # per repeat: this policy's tok/s over the best cache's in the same repeat
        ratios = [x / b for x, b in zip(r["decode_tok_s_repeats"], best["decode_tok_s_repeats"],
                                        strict=True)]  # fmt: skip
        r["vs_best_cache"] = statistics.median(ratios)
        r["vs_best_cache_range"] = [min(ratios), max(ratios)]
    return {
        "model": f"zoo:default with experts x{args.factor} (tensorbend.zoo.inflate)",
        "checkpoint_bytes": experts,
        "expert_bytes": runs[next(iter(runs))][0]["expert_bytes"],
        "max_memory_bytes": parse_bytes(args.max_memory),
        "import_baseline_rss_bytes": baseline,
        "io": "direct",
        "decode": "greedy",
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "best_no_prediction": best["policy"],
        "memory_plan": plan,  # serving.memory_plan's split, bytes (first run)
        "same_plan_every_run": all(_split(r) == _split(first) for r in every),
        "measured_model_bytes_range": [min(grown), max(grown)] if grown else None,
        "results": rows,
    }


def _split(run: dict) -> dict:
    """A run's memory plan without its raw measurement (which varies; the split must not)."""
    return {k: v for k, v in run["memory_plan"].items() if k != "measured"}


def _run(cmd: list[str], env: dict | None = None) -> dict:
    env = {**os.environ, **env} if env else None
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        out = subprocess.run(cmd + ["--json", f.name], capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr}")
        return json.loads(Path(f.name).read_text())


def _import_rss() -> int:
    from tensorbend.serving import IMPORT_BASELINE as code

    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout)  # fmt: skip


def _test_prompts(path: Path, n: int) -> Path:
    from tensorbend.prompts import load_prompts

    rows = [{"id": p.id, "text": p.text} for p in load_prompts(None, "test")[:n]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


if __name__ == "__main__":
    raise SystemExit(main())
