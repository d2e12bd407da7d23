"""Predictor cost relative to the model: scoring every layer for one decode token vs that token's forward.

Usage:
    python bench/predictor_cost.py --model zoo:default --predictor runs/eval_default/tensorbend_d1.safetensors [--json OUT]

Side by side in one run, interleaved: (a) one batch-1 decode forward of the model with a KV
cache (the model's own thread count), (b) scoring all target layers of the predictor for one
token (one thread). Reports the median ratio b / a; issue target: < 2%.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from report import emit

from tensorbend.collect import cache_kwarg, cache_of, load_model
from tensorbend.predictors import load_predictor
from tensorbend.predictors.base import SourceBatch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="zoo:default")
    ap.add_argument("--predictor", action="append", required=True)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model, _ = load_model(args.model)
    preds = [load_predictor(p) for p in args.predictor]
    kw = cache_kwarg(model)
    threads = torch.get_num_threads()
    D, E, K = preds[0].spec.hidden_size, preds[0].spec.num_experts, preds[0].spec.top_k
    g = torch.Generator().manual_seed(0)
    src = SourceBatch(
        torch.randn(1, D, generator=g),
        torch.randperm(E, generator=g)[:K][None],
        torch.randperm(E, generator=g)[:K][None],
        torch.tensor([True]),
        0,
    )
    fwd, cost = [], {p.checkpoint: [] for p in preds}
    with torch.inference_mode():
        out = model(
            input_ids=torch.randint(0, model.config.vocab_size, (1, 64), generator=g),
            use_cache=True,
        )
        for _ in range(args.steps):
            torch.set_num_threads(threads)
            nxt = out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            out = model(input_ids=nxt, use_cache=True, **{kw: cache_of(out)})
            fwd.append(time.perf_counter() - t0)
            torch.set_num_threads(1)
            for p in preds:
                t0 = time.perf_counter()
                for m in p.lookahead.targets(p.spec.num_moe_layers):
                    p.scores(m, src)
                cost[p.checkpoint].append(time.perf_counter() - t0)
    torch.set_num_threads(threads)
    f = statistics.median(fwd[4:])
    rows = [
        {
            "predictor": p.kind,
            "checkpoint": p.checkpoint,
            "lookahead": p.lookahead.name,
            "all_layers_us": statistics.median(cost[p.checkpoint][4:]) * 1e6,
            "ratio_to_decode_forward": statistics.median(cost[p.checkpoint][4:]) / f,
        }
        for p in preds
    ]
    res = {
        "bench": "predictor_cost",
        "model": args.model,
        "decode_forward_ms": f * 1e3,
        "model_threads": threads,
        "predictor_threads": 1,
        "results": rows,
        "target_ratio": 0.02,
    }
    return emit(res, args.json)


if __name__ == "__main__":
    sys.exit(main())
