"""One checkpoint served from a bf16 and an int4 store at one memory budget, on the real disk:
what fewer bytes per weight buy, int4 slots against int4 dequantized into bf16 slots.

Usage:
    python -m bench.serve_precision --factor 184 --max-memory 360MB --repeats 5 --prompts 4 \\
        [--predictor D1.safetensors --horizon H.safetensors] [--memory-cap] \\
        --json docs/results/bench/serve_precision.json --doc docs/results/serve_precision.md

The model is zoo:default with experts widened `--factor` times (`bench.inflate`, as
bench/serve_memory.py serves); the budget is chosen so the int4 store is still >= 2x the
cache (the JSON records both; the float32 store, 2x the bf16 one's bytes, is serve_memory.md's
ablation at 1 GB: it does not fit this budget). Stores (each built once before the timed runs):
- `bf16 store`: `--dtype bf16` (what users' checkpoints are);
- `int4 store, bf16 slots`: `--dtype bf16 --store-dtype int4 --slots dense` (round to nearest,
  symmetric, a bf16 scale per 32, in compressed-tensors' format; dequantized as it loads);
- `int4 store, int4 slots`: `--dtype bf16 --store-dtype int4 --slots int4` (the kernel's
  packing; torch's int4 kernel computes from the slots).
Caches: lfru with frequency admission (the serving default, the best cache on this disk in
serve_memory.md) on every store, lru (every miss kept) on bf16 and int4/int4; on int4/int4
also the peer that predicts, spec_gate (`--baseline spec_gate`, ours' cache and admission), and
ours (`--predictor`/`--horizon`, when given). Every row is `tensorbend generate --io direct`
in a fresh process, the rows interleaved and each repeat's order rotated by one; per row the
median decode tok/s [range], the per-repeat ratio to the bf16 store's best cache
(`vs_bf16_best`) and to the best peer of the same store (`vs_best_peer`: int4/int4's best row
that is not ours), MB from disk per decode token, hit rate, slots, stall share, and the
time to first token of one >= `--prefill-tokens` prompt (a second pass after all decode runs).
Greedy text is compared within a store's rows (a different precision gives other text).
Needs the machine to itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench import llama_cpp_serve, memory_cap
from bench.inflate import inflate
from bench.pages.serve_precision import markdown
from bench.serve_memory import _import_rss, _rotated, _run, _test_prompts
from bench.serve_rows import prefill_prompt
from tensorbend.atomic import write_generated
from tensorbend.host_load import CpuMeter
from tensorbend.memory import parse_bytes
from tensorbend.zoo import resolve_model

STORES = {
    "bf16 store": ["--dtype", "bf16"],
    "int4 store, bf16 slots": ["--dtype", "bf16", "--store-dtype", "int4", "--slots", "dense"],
    "int4 store, int4 slots": ["--dtype", "bf16", "--store-dtype", "int4", "--slots", "int4"],
}
BEST_CACHE = ["--policy", "lfru", "--admission", "frequency"]
LRU = ["--policy", "lru", "--admission", "all"]
PREFETCH = ["--policy", "prefetch", "--admission", "predicted"]
INT4 = "int4 store, int4 slots"
LLAMA = "llama.cpp"
SAME_PRECISION = {"bf16": "bf16 store"}  # llama.cpp kind -> the store whose text it should give
TAGS = {"bf16 store": "bfloat16", "int4 store, bf16 slots": "int4", INT4: "int4-cpu"}


def rows(predictor: Path | None, horizon: Path | None) -> dict[str, tuple[str, list[str]]]:
    """Row name -> (its store, its `generate` flags beside the shared ones)."""
    out = {f"{s}: lfru/adm=frequency": (s, STORES[s] + BEST_CACHE) for s in STORES}
    for s in ("bf16 store", INT4):
        out[f"{s}: lru"] = (s, STORES[s] + LRU)
    out[f"{INT4}: spec_gate/adm=predicted"] = (
        INT4,
        STORES[INT4] + PREFETCH + ["--baseline", "spec_gate"],
    )
    if predictor or horizon:
        ours = PREFETCH + (["--horizon", str(horizon)] if horizon else [])
        ours += ["--predictor", str(predictor)] if predictor else []
        label = "+".join(x for x, p in (("horizon", horizon), ("d1", predictor)) if p)
        out[f"{INT4}: ours {label}/adm=predicted"] = (INT4, STORES[INT4] + ours)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        default="zoo:default",
        help="bundled model to inflate (zoo:qwen3moe-tiny: the one llama.cpp loads)",
    )
    ap.add_argument("--factor", type=int, default=184)
    ap.add_argument(
        "--llama-cpp",
        nargs="*",
        default=(),
        choices=llama_cpp_serve.KINDS,
        help="add llama.cpp rows (bench.llama_cpp_serve: a warm process per row, "
        "the GGUF of the same checkpoint in these precisions; needs `make "
        "llama-cpp`)",
    )
    ap.add_argument("--max-memory", default="360MB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4, help="test prompts per run")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--predictor", type=Path, help="zoo:default within-token checkpoint")
    ap.add_argument("--horizon", type=Path, help="zoo:default horizon checkpoint")
    ap.add_argument(
        "--memory-cap",
        action="store_true",
        help="every run in a memory cgroup of import baseline + budget + 64 MB",
    )
    ap.add_argument("--workdir", type=Path, default=Path("runs/bench/serve"))
    ap.add_argument("--json", type=Path, default=Path("docs/results/bench/serve_precision.json"))
    ap.add_argument("--doc", type=Path, default=Path("docs/results/serve_precision.md"))
    args = ap.parse_args(argv)
    tag = args.model.removeprefix("zoo:")
    ckpt = inflate(
        resolve_model(args.model),
        args.workdir / (f"ckpt-x{args.factor}" if tag == "default" else f"{tag}-x{args.factor}"),
        args.factor,
    )
    prompts = _test_prompts(args.workdir / "prompts.jsonl", args.prompts)
    long = args.workdir / "prefill.jsonl"
    prefill = prefill_prompt(long, ckpt, args.prefill_tokens)
    store = args.workdir / ("store" if tag == "default" else f"store-{tag}")
    base = [
        sys.executable,
        "-m",
        "tensorbend",
        "generate",
        "--model",
        str(ckpt),
        "--max-memory",
        args.max_memory,
        "--quiet",
        "--io",
        "direct",
        "--store-dir",
        str(store),
    ]
    table = rows(args.predictor, args.horizon)
    ggufs = llama_cpp_serve.ggufs(ckpt, args.llama_cpp)
    for kind, (_, repack) in ggufs.items():  # (each at the same cap, and at its own baseline
        for cap_kind in ("same cap", "own baseline + budget"):  # + the budget: see the page)
            table[llama_cpp_serve.row_name(kind, repack, cap_kind)] = (LLAMA, [kind, cap_kind])
    for s in STORES:  # every store built before any timed run
        _run(base + STORES[s] + ["--prompts", str(prompts), "--max-new-tokens", "1"])
    cap = None
    if args.memory_cap:
        if why := memory_cap.unavailable():
            raise SystemExit(f"--memory-cap: {why}")
        cap = _import_rss() + parse_bytes(args.max_memory) + parse_bytes("64MB")
    own_cap = None
    if cap is not None and ggufs:
        own_cap = llama_cpp_serve.import_rss() + parse_bytes(args.max_memory) + parse_bytes("64MB")
    decode = ["--prompts", str(prompts), "--max-new-tokens", str(args.max_new_tokens)]
    first = ["--prompts", str(long), "--max-new-tokens", "1"]
    ctx = {
        "prompts": prompts,
        "prefill_prompt": long,
        "max_new_tokens": args.max_new_tokens,
        "memory_cap_bytes": cap,
    }

    def one(name: str, ttft: bool) -> dict:
        store_name, flags = table[name]
        if store_name == LLAMA:
            path, repack = ggufs[flags[0]]
            own = flags[1] != "same cap"
            got = llama_cpp_serve.warm_row(
                path,
                {**ctx, "memory_cap_bytes": own_cap if own else cap},
                prefill=ttft,
                repack=repack,
            )
            return {**got, "prefill_s": got["prefill_s"]}
        return _run(base + (first if ttft else decode) + flags, cap)

    names, runs = list(table), {n: [] for n in table}
    meter = CpuMeter()
    for r in range(args.repeats):
        for name in _rotated(names, r):
            got = one(name, ttft=False)
            runs[name].append(got)
            print(
                f"repeat {r}: {name}: {got['decode_tok_s']:.2f} tok/s, "
                f"{got['bytes_read_per_token'] / 1e6:.1f} MB/token",
                file=sys.stderr,
            )
    for r in range(args.repeats):  # (a run the cap kills is recorded, not fatal: its reason)
        for name in _rotated(names, r):
            try:
                runs[name][r]["ttft_s"] = one(name, ttft=True)["prefill_s"]
            except SystemExit as e:
                runs[name][r]["ttft_s"], runs[name][r]["ttft_failed"] = None, str(e)[-300:]
    result = _aggregate(runs, table, args, ckpt, store)
    result.update(
        memory_cap_bytes=cap,
        llama_cpp_own_cap_bytes=own_cap,
        prefill_prompt=prefill,
        host_load=meter.stop().to_json(),
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_generated(args.json, json.dumps(result, indent=1) + "\n")
    write_generated(args.doc, markdown(json.loads(args.json.read_text())))
    print(markdown(result))
    return 0


def _aggregate(runs: dict, table: dict, args, ckpt: Path, store: Path) -> dict:
    rows_out = []
    for name, rs in runs.items():
        tok_s = [r["decode_tok_s"] for r in rs]
        first = rs[0]
        stall = [
            None if r["stall_s_per_token"] is None else r["stall_s_per_token"] * r["decode_tok_s"]
            for r in rs
        ]
        rows_out.append(
            {
                "row": name,
                "store": table[name][0],
                "flags": table[name][1],
                "engine": first.get("engine", "tensorbend"),
                "decode_tok_s": statistics.median(tok_s),
                "decode_tok_s_range": [min(tok_s), max(tok_s)],
                "decode_tok_s_repeats": tok_s,
                "disk_read_bytes_per_token": _median(rs, "disk_read_bytes_per_token"),
                "bytes_read_per_token": _median(rs, "bytes_read_per_token"),
                "demand_hit_rate": _median(rs, "demand_hit_rate"),
                "stall_share": None if None in stall else statistics.median(stall),
                "predict_s_per_token": statistics.median(r["predict_s_per_token"] or 0 for r in rs),
                **_ttft(rs),
                "cache_slots": first["cache_slots"],
                "expert_stored_bytes": first["expert_stored_bytes"],
                "slot_bytes": first["expert_bytes"],
                "expert_dtype": first["expert_dtype"],
                "slot_dtype": first.get("slot_dtype"),
                "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs),
                "cap_max_usage_bytes": max((r.get("cap_max_usage_bytes") or 0) for r in rs) or None,
                "oom_kills": sum(r.get("oom_kills", 0) for r in rs),
                "decode_tokens": first["decode_tokens"],
                "text": first["text"],
                "same_text_every_repeat": all(r["text"] == first["text"] for r in rs),
                "host_other_cores_repeats": [
                    (r.get("host_load") or {}).get("other_cores") for r in rs
                ],
            }
        )
    bf16_best = max(
        (r for r in rows_out if r["store"] == "bf16 store"), key=lambda r: r["decode_tok_s"]
    )
    peer = max((r for r in rows_out if " ours " not in r["row"]), key=lambda r: r["decode_tok_s"])
    for r in rows_out:
        for key, ref in (("vs_bf16_best", bf16_best), ("vs_best_peer", peer)):
            ratios = [
                a / b
                for a, b in zip(r["decode_tok_s_repeats"], ref["decode_tok_s_repeats"], strict=True)
            ]
            r[key], r[f"{key}_range"] = statistics.median(ratios), [min(ratios), max(ratios)]
        same = SAME_PRECISION.get(r["flags"][0]) if r["store"] == LLAMA else r["store"]
        want = next((x["text"] for x in rows_out if x["store"] == same), None)
        r["text_equal_to_store_first_row"] = None if want is None else r["text"] == want
    stores = {
        s: sum(f.stat().st_size for f in store.glob(f"*/experts-{t}.safetensors"))
        for s, t in TAGS.items()
    }
    caches = {
        s: by["cache_slots"] * by["slot_bytes"]
        for s in TAGS
        for by in rows_out
        if by["row"] == f"{s}: lfru/adm=frequency"
    }
    return {
        "bench": "serve_precision",
        "model": f"{args.model} with experts x{args.factor} (bench.inflate)",
        "checkpoint_bytes": sum(p.stat().st_size for p in ckpt.glob("*.safetensors")),
        "max_memory_bytes": parse_bytes(args.max_memory),
        "store_bytes": stores,
        "cache_bytes": caches,
        "io": "direct",
        "decode": "greedy",
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "order": "rotated",
        "regime": "real disk: real compute, O_DIRECT reads (llama.cpp: mmap, its page cache "
        "inside the same memory cap)",
        "bf16_best_cache": bf16_best["row"],
        "best_peer": peer["row"],
        "results": rows_out,
    }


def _median(rs: list[dict], key: str):
    vals = [r.get(key) for r in rs]
    return None if None in vals else statistics.median(vals)


def _ttft(rs: list[dict]) -> dict:
    """The time-to-first-token runs' median [range], or why they failed (e.g. the memory cap
    killed a long prefill: the budget's reserve did not hold its activations)."""
    done = [r["ttft_s"] for r in rs if r.get("ttft_s") is not None]
    failed = [r["ttft_failed"] for r in rs if r.get("ttft_failed")]
    return {
        "ttft_s": statistics.median(done) if done else None,
        "ttft_s_range": [min(done), max(done)] if done else None,
        "ttft_failed_runs": len(failed),
        "ttft_failure": failed[0].strip().splitlines()[-1] if failed else None,
    }


if __name__ == "__main__":
    raise SystemExit(main())
