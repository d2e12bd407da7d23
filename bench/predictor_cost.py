"""The prediction stack's cost next to the model, through the engine-neutral prefetch API.

Usage:
    python -m bench.predictor_cost --model zoo:default --predictor OURS_D1.safetensors \\
        --horizon HORIZON.safetensors [--threads 1] [--json OUT]

Side by side in one run, interleaved per decode step, all on `--threads` threads: (a) one
batch-1 decode forward of the resident model with a KV cache; (b) one token's calls to
`prefetch.Prefetcher.observe` (after every MoE layer's router, with that layer's
router input and ids), for the within-token predictor alone, the horizon alone, and both:
exactly what the runtime and an engine call per token. Reports medians and each one's ratio
to (a); issue target for the whole stack: <= 2%. Inputs are random (cost does not depend on
values).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from tensorbend.hf import cache_kwarg, cache_of, load_model
from tensorbend.predictors import load_predictor
from tensorbend.prefetch import Prefetcher
from tensorbend.results import emit


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="zoo:default")
    ap.add_argument("--predictor", default=None, help="within-token checkpoint")
    ap.add_argument("--horizon", default=None, help="cross-token checkpoint")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    pred = load_predictor(args.predictor) if args.predictor else None
    horizon = load_predictor(args.horizon) if args.horizon else None
    spec = (pred or horizon).spec
    stacks = {"within-token": (pred, None), "horizon": (None, horizon), "both": (pred, horizon)}
    stacks = {k: Prefetcher(spec, p, h) for k, (p, h) in stacks.items() if p or h}
    for pf in stacks.values():
        pf.begin_request()
    g = torch.Generator().manual_seed(0)
    fwd, cost = [], {k: [] for k in stacks}
    kw = cache_kwarg(model)
    with torch.inference_mode():
        ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=g)
        out = model(input_ids=ids, use_cache=True)
        for _ in range(args.steps):
            nxt = out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            out = model(input_ids=nxt, use_cache=True, **{kw: cache_of(out)})
            fwd.append(time.perf_counter() - t0)
            calls = _token_calls(spec, g)
            for name, pf in stacks.items():
                t0 = time.perf_counter()
                for m, hidden_TD, ids_TK in calls:
                    pf.observe(m, hidden_TD=hidden_TD, routed_ids_TK=ids_TK)
                pf.on_token_end()
                cost[name].append(time.perf_counter() - t0)
    med = lambda xs: statistics.median(xs[4:])  # noqa: E731 - skip warm-up steps
    f = med(fwd)
    rows = [
        {"stack": k, "us_per_token": med(v) * 1e6, "ratio_to_decode_forward": med(v) / f}
        for k, v in cost.items()
    ]
    res = {
        "bench": "predictor_cost",
        "model": args.model,
        "predictor": args.predictor,
        "horizon": args.horizon,
        "threads": args.threads,
        "decode_forward_ms": f * 1e3,
        "results": rows,
        "stack_ratio": rows[-1]["ratio_to_decode_forward"],
        "target_ratio": 0.02,
    }
    return emit(res, args.json)


def _token_calls(spec, g) -> list:
    """One decode token's router calls: (layer, router input [1, D], routed ids [1, K])."""
    D, E, K = spec.hidden_size, spec.num_experts, spec.top_k
    return [
        (m, torch.randn(1, D, generator=g), torch.randperm(E, generator=g)[:K][None])
        for m in range(spec.num_moe_layers)
    ]


if __name__ == "__main__":
    sys.exit(main())
