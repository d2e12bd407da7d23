"""Trace bytes per token and write throughput of TraceWriter, per feature set.

Usage:
    python bench/trace_io.py [--model zoo:default] [--tokens 20000] [--json OUT]

Rows have the model's real shapes (L MoE layers, K, E, D) and random contents; the writer
is the real one (safetensors shards, fsync, atomic rename). Throughput = bytes on disk /
wall time of add_prompt + flush + close.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from report import emit

from tensorbend.capture import FEATURE_TENSORS
from tensorbend.trace import TraceWriter

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
    ap.add_argument("--prompt-tokens", type=int, default=80)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from capture_overhead import build_model

    from tensorbend.models import describe_model, model_fingerprint, router_params

    model, name = build_model(args.model)
    spec = describe_model(model)
    L, K, E, D = spec.num_moe_layers, spec.top_k, spec.num_experts, spec.hidden_size
    shapes = {
        "ids": (L, K),
        "weights": (L, K),
        "logits": (L, E),
        "gate_input": (L, D),
        "layer_input": (L, D),
    }
    results = []
    for label, feats in FEATURE_SETS.items():
        with tempfile.TemporaryDirectory() as tmp:
            w = TraceWriter(
                Path(tmp) / "t",
                model_meta={"name": name, "fingerprint": model_fingerprint(model, spec)},
                spec=spec,
                features={f: "float16" for f in feats},
                collection={},
                router_params=router_params(model, spec),
            )
            n_prompts = args.tokens // args.prompt_tokens
            T = args.prompt_tokens
            t0 = time.perf_counter()
            for i in range(n_prompts):
                rows = {}
                for f in feats:
                    if f == "ids":
                        rows[FEATURE_TENSORS[f]] = torch.randint(
                            0, E, (T, *shapes[f]), dtype=torch.int16
                        )
                    else:
                        rows[FEATURE_TENSORS[f]] = torch.randn(T, *shapes[f]).half()
                rows["token_ids_T"] = torch.zeros(T, dtype=torch.int32)
                rows["positions_T"] = torch.arange(T, dtype=torch.int32)
                rows["phase_T"] = torch.zeros(T, dtype=torch.int8)
                w.add_prompt(
                    {"id": f"p{i}", "split": "train", "topic": None, "prefill": T, "decode": 0},
                    rows,
                )
            w.close()
            dt = time.perf_counter() - t0
            shard_bytes = sum(s["bytes"] for s in w.manifest["shards"])
            tokens = n_prompts * T
            results.append(
                {
                    "features": label,
                    "tokens": tokens,
                    "bytes_per_token": shard_bytes / tokens,
                    "write_mb_s": shard_bytes / dt / 1e6,
                    "tokens_per_s": tokens / dt,
                }
            )
            print(
                f"{label:<24} {shard_bytes / tokens:9.1f} B/token  {shard_bytes / dt / 1e6:7.1f} MB/s",
                file=sys.stderr,
            )
    out = {
        "bench": "trace_io",
        "model": name,
        "L": L,
        "K": K,
        "E": E,
        "D": D,
        "storage_dtype": "float16",
        "results": results,
    }
    return emit(out, args.json)


if __name__ == "__main__":
    sys.exit(main())
