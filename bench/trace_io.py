"""Trace bytes per token, write throughput, and the cost of making every prompt durable.

Usage:
    python -m bench.trace_io [--model zoo:default] [--tokens 20000] [--json OUT]

Rows have the model's real shapes (L MoE layers, K, E, D) and random contents; the writer is
the real one: each prompt is written as its own fsynced part shard plus manifest before the
next starts, and parts are merged into shards of `--shard-tokens` rows. Throughput = bytes of
the final shards / wall time of every add_prompt + close. The durability cost is the writer's
time per prompt next to the time the model takes to produce that prompt's rows (one prefill of
--prompt-tokens and --decode-steps KV-cached decode steps, capturing the same features),
measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.record import emit
from bench.timing import build_model, run_once
from tensorbend.capture.trace import FEATURE_TENSORS
from tensorbend.capture.writer import TraceWriter
from tensorbend.models import describe_model

FEATURE_SETS = {
    "ids": ("ids",),
    "ids+weights": ("ids", "weights"),
    "ids+weights+gate_input": ("ids", "weights", "gate_input"),
    "+layer_input": ("ids", "weights", "gate_input", "layer_input"),
    "+logits": ("ids", "weights", "logits", "gate_input", "layer_input"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="zoo:default")
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--shard-tokens", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model, name = build_model(args.model)
    spec = describe_model(model)
    T = args.prompt_tokens + args.decode_steps
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens))
    results = []
    for label, feats in FEATURE_SETS.items():
        run_once(model, spec, feats, ids, 2)  # warm-up
        model_s = statistics.median(
            run_once(model, spec, feats, ids, args.decode_steps) for _ in range(5)
        )
        row = _write(spec, name, feats, args.tokens // T, T, args.shard_tokens)
        row.update(features=label, model_s_per_prompt=model_s)
        row["durable_write_vs_model"] = row["write_s_per_prompt"] / model_s
        results.append(row)
        print(
            f"{label:<24} {row['bytes_per_token']:9.1f} B/token  {row['write_mb_s']:7.1f} MB/s  "
            f"write {row['write_s_per_prompt'] * 1e3:6.2f} ms/prompt = "
            f"{row['durable_write_vs_model']:.3f} x the model's {model_s * 1e3:.1f} ms",
            file=sys.stderr,
        )
    out = {
        "bench": "trace_io",
        "model": name,
        "L": spec.num_moe_layers,
        "K": spec.top_k,
        "E": spec.num_experts,
        "D": spec.hidden_size,
        "storage_dtype": "float16",
        "tokens_per_prompt": T,
        "shard_tokens": args.shard_tokens,
        "threads": torch.get_num_threads(),
        "results": results,
    }
    return emit(out, args.json)


def _write(spec, name: str, feats, n_prompts: int, T: int, shard_tokens: int) -> dict:
    L, K, E, D = spec.num_moe_layers, spec.top_k, spec.num_experts, spec.hidden_size
    shapes = {"ids": (L, K), "weights": (L, K), "logits": (L, E), "gate_input": (L, D),
              "layer_input": (L, D)}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        w = TraceWriter(
            Path(tmp) / "t",
            model_meta={"name": name, "fingerprint": "0" * 16},
            spec=spec,
            features={f: "float16" for f in feats},
            collection={},
            shard_tokens=shard_tokens,
        )
        t0 = time.perf_counter()
        for i in range(n_prompts):
            rows = {
                FEATURE_TENSORS[f]: torch.randint(0, E, (T, *shapes[f]), dtype=torch.int16)
                if f == "ids"
                else torch.randn(T, *shapes[f]).half()
                for f in feats
            }
            rows["token_ids_T"] = torch.zeros(T, dtype=torch.int32)
            rows["positions_T"] = torch.arange(T, dtype=torch.int32)
            rows["phase_T"] = torch.zeros(T, dtype=torch.int8)
            record = {"id": f"p{i}", "split": "train", "topic": None, "prefill": T, "decode": 0}
            w.add_prompt(record, rows)
        w.close()
        dt = time.perf_counter() - t0
        shard_bytes = sum(s["bytes"] for s in w.manifest["shards"])
    tokens = n_prompts * T
    return {
        "tokens": tokens,
        "bytes_per_token": shard_bytes / tokens,
        "write_mb_s": shard_bytes / dt / 1e6,
        "write_s_per_prompt": dt / n_prompts,
    }


if __name__ == "__main__":
    sys.exit(main())
