"""vLLM serving a model larger than memory with tensorbend's store, cache and predictor, beside
tensorbend's transformers path and transformers + accelerate, on the real disk.

Usage (root, for the memory cgroups; .venv-vllm built by `make vllm-env`):
    python -m bench.vllm_offload --factor 184 --max-memory 1GB --repeats 5 --memory-cap \\
        --predictor runs/bench/qwen/ours_d1.safetensors \\
        --json docs/results/bench/vllm_offload.json --doc docs/results/vllm_offload.md
    python -m bench.vllm_offload --render docs/results/bench/vllm_offload.json --doc PAGE

Model: zoo:qwen3moe-tiny with every expert widened `--factor` times by zero rows
(`bench.inflate`: the same routers and text; 184x gives 3.4 GB of fp32 experts, 18 MB each),
so the predictor trained on zoo:qwen3moe-tiny loads on it. Every row is a fresh process in a
memory cgroup (`--memory-cap`) of its engine's baseline + the experts' budget + `--cap-margin`,
the page cache its reads fill included: generate's baseline is its import baseline (with
`--max-memory`, the whole model's budget); vLLM's is the peak RSS of vLLM serving
zoo:qwen3moe-tiny resident (the same non-expert weights and KV cache space, 18 MB of experts),
with TENSORBEND_MAX_MEMORY = what generate's plan gives its cache and staging (the same
slots). Every expert read goes past the page cache (`--io direct` / TENSORBEND_IO=direct).
Rows:
  vllm+tb lfru/adm=frequency           vLLM (CPU build, enforce_eager) + TENSORBEND_MAX_MEMORY
  vllm+tb ours d1/adm=predicted        ... + TENSORBEND_PREDICTOR (prefetch, Predicted eviction)
  generate lfru/adm=frequency          `tensorbend generate` (transformers' generate)
  generate ours d1/adm=predicted       ... --policy prefetch --predictor
  accelerate                           `tensorbend generate --engine accelerate`
(`--accelerate-tokens` new tokens per prompt: it reads every expert at every token, so its tok/s
does not depend on how many) at concurrency 1 (the prompts one after another) and, for the vLLM rows, 4 (the prompts at
once, continuous batching; `generate` and accelerate decode one sequence at a time).
A vLLM row's decode tok/s: tokens after each request's first / the seconds after the step that
made the first tokens (LLMEngine.step, one decode step per running request); its bytes and hit
rate are the offload counters' between the same two points. Rows run interleaved, repeat after
repeat, each repeat's order rotated by one row; ratios are the median [range] of per-repeat
ratios to the best row without prediction. The vLLM rows' tokens are checked against resident
vLLM (one uncapped run) and the generate rows' against each other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
KV_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE, whole GiB (the least it takes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    ch = sub.add_parser("child", help="(internal) one vLLM run, JSON out")
    ch.add_argument("--model", required=True)
    ch.add_argument("--prompts", type=Path, required=True)
    ch.add_argument("--max-new-tokens", type=int, default=32)
    ch.add_argument("--concurrency", type=int, default=1)
    ch.add_argument("--json", type=Path, required=True)
    ap.add_argument("--factor", type=int, default=184)
    ap.add_argument("--max-memory", default="1GB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4, help="test prompts per run")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--accelerate-tokens", type=int, default=8,
                    help="new tokens per prompt of the accelerate row (it reads every expert "
                         "at every token, so its tok/s does not depend on how many)")  # fmt: skip
    ap.add_argument("--predictor", type=Path, help="zoo:qwen3moe-tiny within-token checkpoint")
    ap.add_argument("--memory-cap", action="store_true", help="each row in a memory cgroup")
    ap.add_argument("--cap-margin", default="512MB", help="headroom of --memory-cap")
    ap.add_argument("--workdir", type=Path, default=Path("runs/bench/serve"))
    ap.add_argument("--json", type=Path, default=Path("docs/results/bench/vllm_offload.json"))
    ap.add_argument("--doc", type=Path, default=Path("docs/results/vllm_offload.md"))
    ap.add_argument("--render", type=Path, help="rewrite --doc from this JSON, run nothing")
    args = ap.parse_args(argv)
    if args.cmd == "child":
        return _child(args)
    from bench.pages.vllm_offload import markdown
    from tensorbend.atomic import write_generated

    if args.render:
        write_generated(args.doc, markdown(json.loads(args.render.read_text())))
        return 0
    result = _bench(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_generated(args.json, json.dumps(result, indent=1) + "\n")
    write_generated(args.doc, markdown(result))
    print(markdown(result))
    return 0


def _bench(args) -> dict:
    from bench import memory_cap
    from bench.inflate import inflate
    from bench.serve_memory import _import_rss, _rotated, _run, _test_prompts
    from tensorbend.host_load import CpuMeter
    from tensorbend.memory import parse_bytes
    from tensorbend.zoo import resolve_model

    ckpt = inflate(
        resolve_model("zoo:qwen3moe-tiny"), args.workdir / f"qwen3moe-tiny-x{args.factor}",
        args.factor,
    )  # fmt: skip
    prompts = _test_prompts(args.workdir / "vllm-prompts.jsonl", args.prompts)
    store = args.workdir / "store-vllm"
    budget = parse_bytes(args.max_memory)
    gen = [sys.executable, "-m", "tensorbend", "generate", "--model", str(ckpt), "--quiet",
           "--max-memory", args.max_memory, "--io", "direct", "--store-dir", str(store),
           "--prompts", str(prompts), "--max-new-tokens", str(args.max_new_tokens)]  # fmt: skip
    plan = _run(gen[:-1] + ["1"])["memory_plan"]  # (builds the store, for both engines)
    slots = plan["cache"] + plan["staging"]  # vLLM's slots get what generate's cache gets
    ours = ["--policy", "prefetch", "--predictor", str(args.predictor)] if args.predictor else None
    vllm_env = {"TENSORBEND_MAX_MEMORY": f"{slots}B", "TENSORBEND_IO": "direct",
                "TENSORBEND_STORE_DIR": str(store)}  # fmt: skip
    rows = {
        "vllm+tb lfru/adm=frequency c=1": ("vllm", vllm_env, 1),
        "vllm+tb lfru/adm=frequency c=4": ("vllm", vllm_env, 4),
        "generate lfru/adm=frequency c=1": ("generate", [], 1),
        "accelerate c=1": (
            "accelerate",
            ["--engine", "accelerate", "--max-new-tokens", str(args.accelerate_tokens)],
            1,
        ),
    }
    if ours:
        pred_env = {**vllm_env, "TENSORBEND_PREDICTOR": str(args.predictor)}
        rows["vllm+tb ours d1/adm=predicted c=1"] = ("vllm", pred_env, 1)
        rows["vllm+tb ours d1/adm=predicted c=4"] = ("vllm", pred_env, 4)
        rows["generate ours d1/adm=predicted c=1"] = ("generate", ours, 1)
    tiny = _vllm(resolve_model("zoo:qwen3moe-tiny"), prompts, 1, 1, {}, None)
    baselines = {"generate": _import_rss(), "vllm": tiny["peak_rss_bytes"]}
    margin = parse_bytes(args.cap_margin)
    kv = int(float(KV_GIB) * 2**30)
    caps = {
        "generate": baselines["generate"] + budget + margin,
        "vllm": baselines["vllm"] + slots + margin,
    }
    if args.memory_cap and (why := memory_cap.unavailable()):
        raise SystemExit(f"--memory-cap: {why}")

    def one(name: str) -> dict:
        engine, extra, conc = rows[name]
        cap = caps["vllm" if engine == "vllm" else "generate"] if args.memory_cap else None
        if engine == "vllm":
            return _vllm(ckpt, prompts, args.max_new_tokens, conc, extra, cap)
        return _generate_row(_run(gen + extra, cap))

    reference = _vllm(ckpt, prompts, args.max_new_tokens, 1, {}, None)  # resident, uncapped
    meter = CpuMeter()
    runs: dict[str, list[dict]] = {n: [] for n in rows}
    for r in range(args.repeats):
        for name in _rotated(list(rows), r):
            got = one(name)
            runs[name].append(got)
            print(f"repeat {r}: {name}: {got['decode_tok_s']:.2f} tok/s", file=sys.stderr)
    load = meter.stop()
    return {
        "bench": "vllm_offload",
        "command": "python -m bench.vllm_offload " + " ".join(sys.argv[1:]),
        "model": f"zoo:qwen3moe-tiny x{args.factor}",
        "checkpoint_bytes": sum(p.stat().st_size for p in ckpt.glob("*.safetensors")),
        "max_memory_bytes": budget,
        "slot_bytes_vllm": slots,
        "kv_cache_bytes": kv,
        "import_baseline_bytes": baselines,
        "memory_cap_bytes": caps if args.memory_cap else None,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "host_load": {"other_cores": load.other_cores, "cpus": load.cpus, "wall_s": load.wall_s},
        "reference_tokens": reference["tokens"],
        "rows": {n: _summary(rs, reference["tokens"]) for n, rs in runs.items()},
        "runs": runs,
    }


def _vllm(ckpt, prompts, max_new: int, conc: int, env: dict, cap) -> dict:
    from bench import memory_cap

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [str(VLLM_PY), "-m", "bench.vllm_offload", "child", "--model", str(ckpt),
               "--prompts", str(prompts), "--max-new-tokens", str(max_new),
               "--concurrency", str(conc), "--json", f.name]  # fmt: skip
        full = {**os.environ, **env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_KVCACHE_SPACE": KV_GIB, "PYTHONPATH": str(ROOT)}  # fmt: skip
        if cap is None:
            out = subprocess.run(cmd, capture_output=True, text=True, env=full)
            extra = {}
        else:
            out = memory_cap.run_capped(cmd, cap, env=full)
            extra = {"cap_max_usage_bytes": out.max_usage_bytes, "oom_kills": out.oom_kills}
        if out.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed {extra}:\n{out.stderr[-4000:]}")
        return {**json.loads(Path(f.name).read_text()), **extra}


def _child(args) -> int:
    """One vLLM process: every prompt, `concurrency` at a time, timed step by step."""
    from vllm import LLM, SamplingParams

    from tensorbend.memory import peak_rss_bytes

    texts = [json.loads(line)["text"] for line in args.prompts.read_text().splitlines()]
    llm = LLM(model=str(args.model), dtype="float32", enforce_eager=True, max_model_len=1024,
              seed=0, enable_prefix_caching=False)  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=args.max_new_tokens, ignore_eos=True)
    engine = llm.llm_engine

    def counters():
        got = llm.apply_model(
            lambda m: m.tensorbend_offload.counters() if hasattr(m, "tensorbend_offload") else None
        )
        return got[0]

    def totals():
        c = counters()
        return None if c is None else c["totals"]

    decode_s = prefill_s = 0.0
    decode_tokens = 0
    tokens: dict[int, list[int]] = {}
    said: dict[int, str] = {}
    before_decode, after = [], []
    for start in range(0, len(texts), args.concurrency):
        group = range(start, min(start + args.concurrency, len(texts)))
        for i in group:
            engine.add_request(str(i), texts[i], sp)
        t0 = time.perf_counter()
        first = True
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first:  # (the step that ran the prompts and made each request's first token)
                t1 = time.perf_counter()
                prefill_s += t1 - t0
                before_decode.append(totals())
                first = False
            for o in outs:
                if o.finished:
                    tokens[int(o.request_id)] = list(o.outputs[0].token_ids)
                    said[int(o.request_id)] = o.outputs[0].text
        decode_s += time.perf_counter() - t1
        after.append(totals())
        decode_tokens += sum(len(tokens[i]) - 1 for i in group)
    result = {
        "decode_tok_s": decode_tokens / decode_s,
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "prefill_s": prefill_s,
        "tokens": [tokens[i] for i in range(len(texts))],
        "text": [said[i] for i in range(len(texts))],
        "peak_rss_bytes": peak_rss_bytes(),
    }
    if after[0] is not None:
        result["cache_slots"] = counters()["cache_slots"]
        d = {k: sum(a[k] - b[k] for a, b in zip(after, before_decode, strict=True))
             for k in ("bytes_read", "hits", "misses", "late")}  # fmt: skip
        result["bytes_read_per_token"] = d["bytes_read"] / decode_tokens
        demands = d["hits"] + d["misses"] + d["late"]
        result["hit_rate"] = d["hits"] / demands if demands else None
    args.json.write_text(json.dumps(result))
    return 0


def _generate_row(run: dict) -> dict:
    return {
        "decode_tok_s": run["decode_tok_s"],
        "decode_tokens": run["decode_tokens"],
        "bytes_read_per_token": run["bytes_read_per_token"],
        "hit_rate": run["demand_hit_rate"],
        "cache_slots": run["cache_slots"],
        "peak_rss_bytes": run.get("peak_rss_bytes"),
        "cap_max_usage_bytes": run.get("cap_max_usage_bytes"),
        "oom_kills": run.get("oom_kills"),
        "text": run.get("text"),
    }


def _summary(rs: list[dict], reference: list[list[int]]) -> dict:
    med = statistics.median

    def m(key):
        vals = [r[key] for r in rs if r.get(key) is not None]
        return med(vals) if vals else None

    return {
        "decode_tok_s": m("decode_tok_s"),
        "decode_tok_s_repeats": [r["decode_tok_s"] for r in rs],
        "bytes_read_per_token": m("bytes_read_per_token"),
        "hit_rate": m("hit_rate"),
        "cache_slots": rs[0].get("cache_slots"),
        "peak_rss_bytes": max((r.get("peak_rss_bytes") or 0) for r in rs),
        "cap_max_usage_bytes": max((r.get("cap_max_usage_bytes") or 0) for r in rs) or None,
        "same_tokens_as_resident_vllm": (
            all(r["tokens"] == reference for r in rs) if "tokens" in rs[0] else None
        ),
        "same_text_every_repeat": len({r.get("text") for r in rs}) == 1
        if "text" in rs[0]
        else None,
    }


if __name__ == "__main__":
    raise SystemExit(main())
