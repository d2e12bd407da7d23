"""llama.cpp with the whole GGUF in memory (no cap): how fast it decodes per precision and
thread count, against the bytes a token must touch and what this machine's memory gives.
Why the f32 GGUF decoded 1.56 tok/s resident in docs/guide/peers.md's cold measurement.

Usage:
    python -m bench.llama_cpp_resident --kinds f32 bf16 Q8_0 --threads 1 2 --repeats 5 \\
        --json docs/results/bench/llama_cpp_resident_warm.json

The model is zoo:qwen3moe-tiny with experts widened `--factor` times (`bench.inflate`, the
checkpoint the serving benches give llama.cpp; hidden size 128, so every expert's gate and up
projections are 64 x factor rows of 128 weights). Each kind's GGUF (`llama_cpp_serve.ggufs`) is
read once into the page cache before its runs; each run is one warm llama-cpp-python process
(`llama_cpp_serve.serve`, mmap on, no memory cap) decoding `--prompts` held-out prompts x
`--max-new-tokens` greedy tokens. Runs are interleaved (kind x threads), each repeat's order
rotated by one. Per row: median decode tok/s [range], the bytes one decode token must read
(every layer's K routed experts at the kind's bytes per weight, plus the non-expert weights),
and that times tok/s: the rate the row drew from memory. `--busy 1` runs each row again beside one process spinning on
a core (as on a shared machine). Beside them: this machine's memory
read rate (torch's sum over a 1 GB float32 tensor, at each thread count, median of repeats),
what a memory-bound decoder could reach. The host load over the whole run is `host_load`.
Needs the machine to itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench import llama_cpp_serve
from bench.demo_load import busy_cores
from bench.inflate import inflate
from bench.serve_memory import _rotated, _test_prompts
from tensorbend.atomic import write_generated
from tensorbend.host_load import CpuMeter
from tensorbend.zoo import resolve_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="zoo:qwen3moe-tiny")
    ap.add_argument("--factor", type=int, default=184)
    ap.add_argument("--kinds", nargs="+", default=["f32", "bf16", "Q8_0"],
                    choices=[k for k, b in llama_cpp_serve.BYTES_PER_WEIGHT.items() if b])  # fmt: skip
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1],
                    help="processes spinning on a core each beside a run (0: alone)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--workdir", type=Path, default=Path("runs/bench/serve"))
    ap.add_argument(
        "--json", type=Path, default=Path("docs/results/bench/llama_cpp_resident_warm.json")
    )
    args = ap.parse_args(argv)
    tag = args.model.removeprefix("zoo:")
    ckpt = inflate(resolve_model(args.model), args.workdir / f"{tag}-x{args.factor}", args.factor)
    files = llama_cpp_serve.ggufs(ckpt, args.kinds)
    prompts = _test_prompts(args.workdir / "prompts.jsonl", args.prompts)
    texts = [json.loads(x)["text"] for x in prompts.read_text().splitlines() if x]
    rows = [(k, t, b) for k in args.kinds for t in args.threads for b in args.busy]
    runs: dict[tuple, list[dict]] = {r: [] for r in rows}
    meter = CpuMeter()
    for r in range(args.repeats):
        for kind, threads, busy in _rotated(rows, r):
            path, repack = files[kind]
            _warm(path)
            with busy_cores(busy):
                got = _serve(path, texts, args.max_new_tokens, threads, repack)
            runs[(kind, threads, busy)].append(got)
            print(f"repeat {r}: {kind} x{threads}, {busy} busy: {got['decode_tok_s']:.2f} tok/s",
                  file=sys.stderr)  # fmt: skip
    memory = {t: _memory_read_rate(t, args.repeats) for t in args.threads}
    config = json.loads((ckpt / "config.json").read_text())
    weights = _weights_per_token(config, ckpt)
    out = []
    for (kind, threads, busy), rs in runs.items():
        tok_s = [x["decode_tok_s"] for x in rs]
        touched = weights * llama_cpp_serve.BYTES_PER_WEIGHT[kind]
        out.append({
            "kind": kind,
            "threads": threads,
            "busy_processes": busy,
            "repack": files[kind][1],
            "gguf_bytes": files[kind][0].stat().st_size,
            "decode_tok_s": statistics.median(tok_s),
            "decode_tok_s_range": [min(tok_s), max(tok_s)],
            "decode_tok_s_repeats": tok_s,
            "bytes_per_token": touched,
            "memory_rate_bytes_s": statistics.median(tok_s) * touched,
            "share_of_memory_rate": statistics.median(tok_s) * touched / memory[threads],
            "decode_disk_bytes_per_token": statistics.median(x["disk_per_token"] for x in rs),
            "text": rs[0]["text"],
        })  # fmt: skip
    result = {
        "bench": "llama_cpp_resident",
        "model": f"{args.model} with experts x{args.factor} (bench.inflate)",
        "hidden_size": config["hidden_size"],
        "moe_intermediate_size": config["moe_intermediate_size"],
        "experts_per_token": config["num_experts_per_tok"],
        "layers": config["num_hidden_layers"],
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "order": "rotated",
        "regime": "resident: the GGUF in the page cache, no memory cap, real compute",
        "memory_read_bytes_s": {str(t): v for t, v in memory.items()},
        "host_load": meter.stop().to_json(),
        "results": out,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_generated(args.json, json.dumps(result, indent=1) + "\n")
    for r in out:
        print(f"{r['kind']:>5} x{r['threads']}, {r['busy_processes']} busy: "
              f"{r['decode_tok_s']:8.2f} tok/s, "
              f"{r['bytes_per_token'] / 1e6:6.1f} MB/token, {r['memory_rate_bytes_s'] / 1e9:5.2f} "
              f"GB/s ({r['share_of_memory_rate']:.0%} of memory's "
              f"{memory[r['threads']] / 1e9:.1f} GB/s)")  # fmt: skip
    return 0


def _warm(path: Path) -> None:
    """Read the whole file once so its pages are cached (the resident case)."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def _serve(path: Path, texts: list[str], n: int, threads: int, repack: bool) -> dict:
    cmd = [sys.executable, "-m", "bench.llama_cpp_serve", "serve", str(path), "--threads",
           str(threads), "--max-new-tokens", str(n), "--texts", json.dumps(texts)]  # fmt: skip
    cmd += [] if repack else ["--no-repack"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} failed:\n{p.stderr[-2000:]}")
    ps = json.loads(p.stdout)["prompts"]
    steps = sum(x["decode_steps"] for x in ps)
    return {
        "decode_tok_s": steps / sum(x["decode_s"] for x in ps),
        "disk_per_token": sum(x["decode_disk_bytes"] for x in ps) / max(steps, 1),
        "text": "".join(x["text"] for x in ps),
    }


def _weights_per_token(config: dict, ckpt: Path) -> float:
    """Weights one decode token reads: every layer's K routed experts (3 matrices of hidden x
    intermediate) plus every weight that is not a routed expert (attention, norms, routers,
    the output head; of an untied embedding, one row). Times a kind's bytes per weight: bytes."""
    from safetensors import safe_open

    numel = {"expert": 0, "other": 0}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                numel["expert" if ".experts." in name else "other"] += n
    experts = config["num_local_experts"]
    routed = config["num_experts_per_tok"] * numel["expert"] / experts  # (every layer's K)
    embed = config["vocab_size"] * config["hidden_size"]  # an untied embedding: one row a token
    unread = 0 if config.get("tie_word_embeddings") else embed - config["hidden_size"]
    return routed + numel["other"] - unread


def _memory_read_rate(threads: int, repeats: int) -> float:
    """Bytes per second torch's sum reads from a 1 GB float32 tensor at `threads` threads."""
    code = (
        "import time, torch, statistics\n"
        f"torch.set_num_threads({threads}); x = torch.ones(1 << 28); x.sum()\n"
        "ts = []\n"
        f"for _ in range({repeats}):\n"
        "    t = time.perf_counter(); x.sum(); ts.append(time.perf_counter() - t)\n"
        "print(x.numel() * 4 / statistics.median(ts))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout)


if __name__ == "__main__":
    raise SystemExit(main())
