"""Serve a model several times larger than its memory budget: peak RSS and decode tok/s per
policy, `tensorbend generate` in a fresh process per run, median of interleaved repeats.

Usage:
    python -m bench.serve_memory --factor 184 --max-memory 1GB --repeats 5 \
        --predictor runs/bench/default/ours_d1.safetensors \
        --horizon runs/bench/default/horizon_routing_hidden.safetensors \
        --json docs/results/bench/serve_memory.json --doc docs/results/serve_memory.md

The model is zoo:default with every expert widened `--factor` times by zero rows
(`bench.inflate`: the same routers, routing and text; 184x gives 3.5 GB of routed
experts), so the predictors trained on zoo:default load on it (same fingerprint). Each run is
`tensorbend generate` on the held-out test prompts (greedy), with `--io direct` so every
expert read comes from the disk, not the page cache; its peak RSS (mapped file pages
included) is its own high-water mark (`memory.peak_rss_bytes`). The import baseline
is the peak RSS of a process that imports torch, transformers' modeling and generation code
and tensorbend (`serving.IMPORT_BASELINE`). Policies run interleaved, repeat after repeat, each
repeat's order rotated by one row (repeat r starts at row r); the table gives the median
decode tok/s with its range.
`/extra=-2`, `/extra=-3`: `--prefetch-extra` (a decode call prefetches its top-(K + extra)
predictions: fewer than the K routed).
The rows and what each does are `bench.serve_rows`'s (its docstring): the caches without
prediction, the peers that predict (`spec_gate`, and `seed_mlp` with `--seed-mlp CKPT`) with
the cache and admission ours uses, the page cache (`--policy on_demand --io buffered`: no
expert cache of tensorbend's, the kernel's page cache holds the experts), ours, and
`--accelerate`'s baseline without tensorbend: `tensorbend generate --engine accelerate`
(transformers + accelerate's `device_map="auto"` within the same budget, the rest streamed in
from disk every forward; `tensorbend.serving.accelerate_baseline`). `--llama-cpp KIND...` adds a
llama.cpp row per GGUF precision through `serve_rows.EXTERNAL` (`bench.llama_cpp_serve.warm_row`:
one warm process per row serving every prompt, the GGUF's pages dropped once before it, bytes
per token counted over decode only); each is set beside tensorbend's best row computing at its
precision (`vs_same_precision`; bf16 adds the best cache on a bf16 store, BF16_CACHE) and its
greedy text compared with that row's. `--memory-cap` runs every row in a memory
cgroup of import baseline + budget + `--cap-margin` (`bench.memory_cap`: the page cache
its reads fill counts too), as on a machine with only that much RAM; needs root.
Every row reports decode tok/s, bytes read per decode token (expert bytes it loaded, and of
them from the disk: /proc/self/io read_bytes), the demand hit rate, stall (the share of decode
time waiting on expert loads), peak RSS (and the cgroup's high-water mark, page cache
included); and prefill: the time to first token of one prompt of >= `--prefill-tokens` tokens
(held-out prose: the shipped test prompts from the last backwards, joined; their ids are in
the JSON), a second run per row and repeat with `--max-new-tokens 1`. Ours is set against the
best cache (`vs_best_cache`) and against the best of every row that is not ours
(`vs_best_peer`: caches, peers, page cache, accelerate, external rows, at ours'
precision), per repeat. The host load over every run is the JSON's `host_load`.
Nothing else should run on the machine meanwhile.
The page is rendered from the JSON by `bench.pages.serve_memory`.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

from bench import llama_cpp_serve, memory_cap
from bench.inflate import inflate
from bench.pages.serve_memory import markdown
from bench.serve_rows import (
    ACCELERATE,
    EXTERNAL,
    NO_PREDICTION,
    PAGE_CACHE,
    drop_page_cache,
    external_row,
    is_ours,
    policies,
    predicts_nothing,
    prefill_prompt,
)
from tensorbend.atomic import write_generated
from tensorbend.host_load import CpuMeter
from tensorbend.memory import parse_bytes
from tensorbend.zoo import resolve_model

BF16_CACHE = "lfru/adm=frequency/dtype=bf16"
"""The best cache on a bf16 store (`--dtype bf16`), beside llama.cpp's bf16 GGUF."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        default="zoo:default",
        help="bundled model to inflate (zoo:qwen3moe-tiny: the one llama.cpp loads)",
    )
    ap.add_argument("--factor", type=int, default=184)
    ap.add_argument("--max-memory", default="1GB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ttft-pass", choices=("after", "interleaved"), default="after",
                    help="time-to-first-token runs after every decode run (default: a 3.5 GB "
                         "prefill's reads cannot slow the decode run that comes next), or each "
                         "right after its row's decode run")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=3, help="test prompts per run")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--predictor", type=Path, help="zoo:default within-token checkpoint")
    ap.add_argument("--horizon", type=Path, help="zoo:default horizon checkpoint")
    ap.add_argument("--seed-mlp", type=Path,
                    help="zoo:default seed_mlp checkpoint (`tensorbend train --predictor "
                         "seed_mlp`): adds the seed_mlp prefetcher rows")  # fmt: skip
    ap.add_argument("--prefill-tokens", type=int, default=512,
                    help="the time-to-first-token prompt's least length, in tokens")  # fmt: skip
    ap.add_argument("--workdir", type=Path, default=Path("runs/bench/serve"))
    ap.add_argument("--json", type=Path, default=Path("docs/results/bench/serve_memory.json"))
    ap.add_argument("--doc", type=Path, default=Path("docs/results/serve_memory.md"))
    ap.add_argument("--accelerate", action="store_true",
                    help=f"add the row {ACCELERATE!r}: transformers + accelerate offloading "
                         "within the same budget, no tensorbend")  # fmt: skip
    ap.add_argument("--accelerate-tokens", type=int, default=None,
                    help="new tokens per prompt of the accelerate row (default: --max-new-tokens):"
                         " it streams every expert at every token, so its tok/s does not depend"
                         " on how many it decodes; its text is compared with a tensorbend row of"
                         " as many tokens")  # fmt: skip
    ap.add_argument("--memory-cap", action="store_true",
                    help="run every row in a memory cgroup of import baseline + budget + "
                         "--cap-margin (page cache included; needs root)")  # fmt: skip
    ap.add_argument("--cap-margin", default="64MB", help="headroom of --memory-cap")
    ap.add_argument("--llama-cpp", nargs="+", default=(), choices=llama_cpp_serve.KINDS,
                    metavar="KIND",
                    help="add a llama.cpp row per GGUF precision (f32, bf16, Q8_0, Q4_0, Q4_K_M: "
                         "bench.llama_cpp_serve, a warm process per row serving every prompt, "
                         "mmap on, in the same memory cap; needs `make llama-cpp`); bf16 adds "
                         "tensorbend's best cache on a bf16 store beside it")  # fmt: skip
    ap.add_argument("--staging-slots", type=int, nargs="+", default=(),
                    help="also run each tensorbend row that keeps experts with `generate "
                         "--staging-slots N`, for each N given (rows named .../staging=N)")  # fmt: skip
    ap.add_argument("--only", default=None,
                    help="regex: run only the rows whose name it finds (at least one row "
                         "without prediction: the best of those is the reference)")  # fmt: skip
    args = ap.parse_args(argv)
    tag = args.model.removeprefix("zoo:")
    ckpt = inflate(resolve_model(args.model), args.workdir / f"{tag}-x{args.factor}"
                   if args.model != "zoo:default" else args.workdir / f"ckpt-x{args.factor}",
                   args.factor)  # fmt: skip
    for kind, (gguf, repack) in llama_cpp_serve.ggufs(ckpt, args.llama_cpp).items():
        EXTERNAL[llama_cpp_serve.row_name(kind, repack)] = partial(_llama, gguf, repack)
    prompts = _test_prompts(args.workdir / "prompts.jsonl", args.prompts)
    long = args.workdir / "prefill.jsonl"
    prefill = prefill_prompt(long, ckpt, args.prefill_tokens)
    rows = policies(
        args.predictor, args.horizon, args.seed_mlp, args.accelerate, args.staging_slots
    )
    if args.only:
        rows = {k: v for k, v in rows.items() if re.search(args.only, k)}
        if not any(predicts_nothing(k) for k in rows):
            raise SystemExit(f"--only {args.only!r}: expected it to keep a row without "
                             f"prediction (one of {', '.join(NO_PREDICTION)})")  # fmt: skip
    if "bf16" in args.llama_cpp:  # (whatever --only keeps) tensorbend at llama.cpp bf16's bytes
        rows[BF16_CACHE] = NO_PREDICTION["lfru/adm=frequency"] + ["--dtype", "bf16"]
    store = args.workdir / ("store" if args.model == "zoo:default" else f"store-{tag}")
    generate = [sys.executable, "-m", "tensorbend", "generate", "--model", str(ckpt),
                "--max-memory", args.max_memory, "--quiet"]  # fmt: skip
    base = generate + ["--io", "direct", "--store-dir", str(store)]
    acc = generate + ["--store-dir", str(args.workdir / "accelerate")]  # its offload folder
    for dtype in [[]] + ([["--dtype", "bf16"]] if BF16_CACHE in rows else []):
        _run(base + dtype + ["--prompts", str(prompts), "--max-new-tokens", "1"])  # its store, once
    baseline = _import_rss()
    cap = None
    if args.memory_cap:
        if why := memory_cap.unavailable():
            raise SystemExit(f"--memory-cap: {why}")
        cap = baseline + parse_bytes(args.max_memory) + parse_bytes(args.cap_margin)
    ctx = {"checkpoint": ckpt, "prompts": prompts, "prefill_prompt": long,
           "max_new_tokens": args.max_new_tokens, "memory_cap_bytes": cap,
           "max_memory_bytes": parse_bytes(args.max_memory)}  # fmt: skip
    decode = ["--prompts", str(prompts), "--max-new-tokens", str(args.max_new_tokens)]
    acc_decode = ["--prompts", str(prompts), "--max-new-tokens",
                  str(args.accelerate_tokens or args.max_new_tokens)]  # fmt: skip
    first = ["--prompts", str(long), "--max-new-tokens", "1"]

    def one(name: str, flags: list[str], ttft: bool) -> dict:
        if name in EXTERNAL:
            return external_row(name, ctx, ttft)
        if name == PAGE_CACHE:
            drop_page_cache(store)  # a cold start, as the other rows' empty caches
        if name == ACCELERATE:
            return _run(acc + (first if ttft else acc_decode) + flags, cap)
        return _run(base + (first if ttft else decode) + flags, cap)

    runs: dict[str, list[dict]] = {name: [] for name in rows}
    names = list(rows)
    meter = CpuMeter()  # (this process and its children against the machine, every run)
    after = args.ttft_pass == "after"
    for r in range(args.repeats):
        for name in _rotated(names, r):  # (no row always runs at the same place in a repeat)
            flags = rows[name]
            got = one(name, flags, ttft=False)
            if not after:
                got["ttft_s"] = one(name, flags, ttft=True)["prefill_s"]
            runs[name].append(got)
            print(f"repeat {r}: {name}: {got['decode_tok_s']:.2f} tok/s", file=sys.stderr)
    for r in range(args.repeats if after else 0):  # every decode run done: the prefill pass
        for name in _rotated(names, r):
            runs[name][r]["ttft_s"] = one(name, rows[name], ttft=True)["prefill_s"]
            print(f"repeat {r}: {name}: time to first token {runs[name][r]['ttft_s']:.2f} s",
                  file=sys.stderr)  # fmt: skip
    ref = None  # the text accelerate's row must give, when it decodes fewer tokens
    if ACCELERATE in rows and args.accelerate_tokens not in (None, args.max_new_tokens):
        ref = _run(base + acc_decode, cap)["text"]  # tensorbend's plain cache, as many tokens
    result = _aggregate(runs, args, ckpt, baseline, ref)
    result["memory_cap_bytes"] = cap
    result["host_load"] = meter.stop().to_json()
    if args.llama_cpp:  # (its process's own baseline: the same cgroup leaves it more page cache)
        result["llama_cpp_import_rss_bytes"] = llama_cpp_serve.import_rss()
    result["prefill_prompt"] = prefill
    result["order"] = "rotated"  # repeat r starts at row r (older JSON: the same order each time)
    result["ttft_pass"] = args.ttft_pass  # (older JSON: each TTFT run right after its decode run)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_generated(args.json, json.dumps(result, indent=1) + "\n")
    write_generated(args.doc, markdown(json.loads(args.json.read_text())))
    print(markdown(result))
    return 0


def _llama(gguf: Path, repack: bool, name: str, ctx: dict, prefill: bool) -> dict:
    """A llama.cpp row's run (serve_rows.EXTERNAL's signature): warm, every prompt."""
    return llama_cpp_serve.warm_row(gguf, ctx, prefill, repack=repack)


def _rotated(names: list[str], r: int) -> list[str]:
    """Repeat r's order: the rows from the r-th on, then the first r (a disk or machine that
    slows down during a repeat then weighs on every row alike).

        >>> _rotated(["a", "b", "c"], 0), _rotated(["a", "b", "c"], 4)
        (['a', 'b', 'c'], ['b', 'c', 'a'])
    """
    k = r % len(names)
    return names[k:] + names[:k]


def _aggregate(runs: dict, args, ckpt: Path, baseline: int, acc_ref: str | None = None) -> dict:
    experts = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    rows = []
    for name, rs in runs.items():
        tok_s = [r["decode_tok_s"] for r in rs]  # in repeat order
        rows.append({
            "policy": name,
            "decode_tok_s": statistics.median(tok_s),
            "decode_tok_s_range": [min(tok_s), max(tok_s)],
            "decode_tok_s_repeats": tok_s,
            "host_other_cores_repeats": [(r.get("host_load") or {}).get("other_cores") for r in rs],
            "engine": rs[0].get("engine", "tensorbend"),
            "bytes_read_per_token": statistics.median(r["bytes_read_per_token"] for r in rs),
            "disk_read_bytes_per_token": _median(rs, "disk_read_bytes_per_token"),
            "demand_hit_rate": _median(rs, "demand_hit_rate"),
            "stall_s_per_token": _median(rs, "stall_s_per_token"),
            "stall_share": None if rs[0]["stall_s_per_token"] is None else statistics.median(
                r["stall_s_per_token"] * r["decode_tok_s"] for r in rs
            ),  # of decode's seconds, waiting on expert loads
            "ttft_s": statistics.median(r["ttft_s"] for r in rs),
            "ttft_s_range": [min(r["ttft_s"] for r in rs), max(r["ttft_s"] for r in rs)],
            "no_stall_ceiling": None if rs[0]["stall_s_per_token"] is None else statistics.median(
                1 / (1 - r["stall_s_per_token"] * r["decode_tok_s"]) for r in rs
            ),  # per repeat: tok/s with every wait hidden
            "predict_s_per_token": statistics.median(r["predict_s_per_token"] or 0 for r in rs),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs),
            "load_peak_rss_bytes": _max(rs, "load_peak_rss_bytes"),
            "cap_max_usage_bytes": _max(rs, "cap_max_usage_bytes"),
            "oom_kills": sum(r.get("oom_kills", 0) for r in rs),
            "text_equal_to_best": None,
            "precision": _precision(rs[0]),
            "cache_slots": rs[0]["cache_slots"],
            "decode_tokens": rs[0]["decode_tokens"],
        })  # fmt: skip
    best = max((r for r in rows if predicts_nothing(r["policy"])), key=lambda r: r["decode_tok_s"])
    for r in rows:
        r["precision"] = r["precision"] or best["precision"]
    same = _same_precision(rows, best)  # precision -> tensorbend's fastest row in it
    for r in rows:  # greedy text: every run's stdout against the best cache's first run's
        ref = best if r["precision"] == best["precision"] else same.get(r["precision"])
        if ref is None:  # (no tensorbend row computes at this precision)
            continue
        want = runs[ref["policy"]][0]["text"]  # (a reference row: its repeats against its first)
        if r["policy"] == ACCELERATE and acc_ref is not None:
            want = acc_ref  # (it decoded --accelerate-tokens per prompt)
        r["text_equal_to_best"] = all(x["text"] == want for x in runs[r["policy"]])
        if ref is not best and ref is not r or r["engine"] == "llama.cpp":
            r["text_reference"] = ref["policy"]
    every = [r for rs in runs.values() for r in rs if r.get("memory_plan")]
    first = every[0]
    plan = _split(first)
    grown = [r["memory_plan"]["measured"] for r in every if "measured" in r["memory_plan"]]
    peer = max((r for r in rows if not is_ours(r["policy"]) and r["precision"] == best["precision"]),
               key=lambda r: r["decode_tok_s"])  # (at ours' precision)  # fmt: skip
    for r in rows:  # per repeat: this row's tok/s over the best cache's (peer's) in the repeat
        refs = [("vs_best_cache", best), ("vs_best_peer", peer)]
        if r["engine"] == "llama.cpp" and same.get(r["precision"]):
            r["same_precision_row"] = same[r["precision"]]["policy"]
            refs.append(("vs_same_precision", same[r["precision"]]))
        for key, ref in refs:
            ratios = [x / b for x, b in zip(r["decode_tok_s_repeats"], ref["decode_tok_s_repeats"],
                                            strict=True)]  # fmt: skip
            r[key] = statistics.median(ratios)
            r[f"{key}_range"] = [min(ratios), max(ratios)]
    return {
        "model": f"{args.model} with experts x{args.factor} (bench.inflate)",
        "checkpoint_bytes": experts,
        "expert_bytes": first["expert_bytes"],
        "max_memory_bytes": parse_bytes(args.max_memory),
        "import_baseline_rss_bytes": baseline,
        "io": "direct",
        "decode": "greedy",
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "accelerate_tokens": args.accelerate_tokens or args.max_new_tokens,
        "repeats": args.repeats,
        "best_no_prediction": best["policy"],
        "best_peer": peer["policy"],
        "regime": "real disk: real compute, O_DIRECT reads (the page cache row: buffered reads "
        "through the page cache)",  # (+ the memory cgroup, when capped)
        "memory_plan": plan,  # serving.memory_plan's split, bytes (first run)
        "same_plan_every_run": all(_split(r) == _split(first) for r in every),
        "measured_model_bytes_range": [min(grown), max(grown)] if grown else None,
        "results": rows,
    }


def _precision(run: dict) -> str:
    """The bytes-per-weight kind a row's experts are computed from: llama.cpp's GGUF kind, or
    tensorbend's stored dtype (float32 -> f32, bfloat16 -> bf16)."""
    kind = run.get("expert_dtype")  # (None: accelerate, at the checkpoint's own precision)
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(kind, kind)


def _same_precision(rows: list[dict], best: dict) -> dict[str, dict]:
    """Precision -> tensorbend's fastest row computing at it (the best cache at the checkpoint's
    own precision): what a llama.cpp row of that precision is set beside."""
    out = {best["precision"]: best}
    for r in rows:
        if r["engine"] == "tensorbend" and r["precision"] != best["precision"]:
            if r["decode_tok_s"] > out.get(r["precision"], {"decode_tok_s": 0})["decode_tok_s"]:
                out[r["precision"]] = r
    return out


def _median(rs: list[dict], key: str):
    vals = [r.get(key) for r in rs]
    return None if any(v is None for v in vals) else statistics.median(vals)


def _max(rs: list[dict], key: str):
    vals = [r.get(key) for r in rs]
    return None if any(v is None for v in vals) else max(vals)


def _split(run: dict) -> dict:
    """A run's memory plan without its raw measurement (which varies; the split must not)."""
    return {k: v for k, v in run["memory_plan"].items() if k != "measured"}


def _run(cmd: list[str], cap: int | None = None) -> dict:
    """One `tensorbend generate` in a fresh process (under a memory cap when given): its JSON
    summary, its text (stdout) and, capped, the cgroup's high-water mark and OOM kills."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        argv = cmd + ["--json", f.name]
        if cap is None:
            out = subprocess.run(argv, capture_output=True, text=True)
            extra = {}
        else:
            out = memory_cap.run_capped(argv, cap)
            extra = {"cap_max_usage_bytes": out.max_usage_bytes, "oom_kills": out.oom_kills}
        if out.returncode != 0:
            killed = f" (killed by the memory cap: {extra['oom_kills']} OOM kills)" if extra.get(
                "oom_kills") else ""  # fmt: skip
            raise SystemExit(f"{' '.join(cmd)} failed{killed}:\n{out.stderr}")
        return {**json.loads(Path(f.name).read_text()), **extra, "text": out.stdout}


def _import_rss() -> int:
    from tensorbend.serving.offloaded import IMPORT_BASELINE as code

    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout)  # fmt: skip


def _test_prompts(path: Path, n: int) -> Path:
    from tensorbend.capture.prompts import load_prompts

    rows = [{"id": p.id, "text": p.text} for p in load_prompts(None, "test")[:n]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


if __name__ == "__main__":
    raise SystemExit(main())
