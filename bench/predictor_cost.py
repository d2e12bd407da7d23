"""The prediction stack's cost next to the model: per decode token, every within-token
prediction plus the cross-token forecast, against that token's resident forward.

Usage:
    python bench/predictor_cost.py --model zoo:default --predictor OURS_D1.safetensors \\
        [--horizon HORIZON.safetensors] [--threads 1] [--json OUT]

Side by side in one run, interleaved per decode step, all on `--threads` threads: (a) one
batch-1 decode forward of the resident model with a KV cache, (b) for each within-token
predictor, scoring all its target layers for one token (what the runtime does at the source
points), (c) the horizon's per-forward work: updating the request's history, the forecast,
and turning it into the policy's lists. Reports medians and the ratio of (b) + (c) to (a);
issue target: <= 2%. Inputs are random (cost does not depend on values).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from report import emit

from tensorbend.hf import cache_kwarg, cache_of, load_model
from tensorbend.predictors import load_predictor
from tensorbend.predictors.base import SourceBatch
from tensorbend.predictors.horizon_fast import FastHorizon


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="zoo:default")
    ap.add_argument("--predictor", action="append", default=[])
    ap.add_argument("--horizon", default=None)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    preds = [load_predictor(p) for p in args.predictor]
    horizon = load_predictor(args.horizon) if args.horizon else None
    spec = (preds[0] if preds else horizon).spec
    g = torch.Generator().manual_seed(0)
    D, E, K, L = spec.hidden_size, spec.num_experts, spec.top_k, spec.num_moe_layers
    src = SourceBatch(
        torch.randn(1, D, generator=g),
        torch.randperm(E, generator=g)[:K][None],
        torch.randperm(E, generator=g)[:K][None],
        torch.tensor([True]),
        0,
    )
    fast = FastHorizon(horizon) if horizon else None  # the runtime's per-forward path
    state = fast.new_state() if horizon else None
    fwd, cost = [], {p.checkpoint: [] for p in preds}
    hz = []
    kw = cache_kwarg(model)
    with torch.inference_mode():
        ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=g)
        out = model(input_ids=ids, use_cache=True)
        for _ in range(args.steps):
            nxt = out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            out = model(input_ids=nxt, use_cache=True, **{kw: cache_of(out)})
            fwd.append(time.perf_counter() - t0)
            for p in preds:
                t0 = time.perf_counter()
                for m in p.lookahead.targets(L):
                    p.scores(m, src)
                cost[p.checkpoint].append(time.perf_counter() - t0)
            if horizon is not None:
                used_LE = torch.zeros(L, E).scatter_(1, torch.randint(0, E, (L, K), generator=g), 1)
                used, hidden = used_LE.numpy(), torch.randn(D, generator=g).numpy()
                t0 = time.perf_counter()
                fast.step(state, used, hidden, forward=len(hz))
                hz.append(time.perf_counter() - t0)
    return emit(_report(args, preds, horizon, fwd, cost, hz), args.json)


def _report(args, preds, horizon, fwd, cost, hz) -> dict:
    med = lambda xs: statistics.median(xs[4:])  # noqa: E731 - skip warm-up steps
    f = med(fwd)
    rows = [
        {
            "predictor": p.kind,
            "checkpoint": p.checkpoint,
            "lookahead": p.lookahead.name,
            "all_layers_us": med(cost[p.checkpoint]) * 1e6,
            "ratio_to_decode_forward": med(cost[p.checkpoint]) / f,
        }
        for p in preds
    ]
    if horizon is not None:
        rows.append(
            {
                "predictor": horizon.kind,
                "checkpoint": horizon.checkpoint,
                "lookahead": horizon.lookahead.name,
                "per_forward_us": med(hz) * 1e6,
                "ratio_to_decode_forward": med(hz) / f,
            }
        )
    stack = sum(r["ratio_to_decode_forward"] for r in rows)
    return {
        "bench": "predictor_cost",
        "model": args.model,
        "threads": args.threads,
        "decode_forward_ms": f * 1e3,
        "results": rows,
        "stack_ratio": stack,
        "target_ratio": 0.02,
    }


if __name__ == "__main__":
    sys.exit(main())
