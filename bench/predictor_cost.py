"""The prediction stack's cost next to the model: isolated, and inside the offload runtime.

Usage:
    python -m bench.predictor_cost --model zoo:default --predictor OURS_D1.safetensors \\
        --horizon HORIZON.safetensors [--threads 1] [--repeats 3] [--json OUT]

Side by side in one run, all on `--threads` threads (bench/prediction_cost.py):
(a) isolated: one batch-1 decode forward of the resident model with a KV cache, interleaved
per step with one token's `prefetch.Prefetcher.observe` calls for the within-token predictor
alone, the horizon alone, and both (`results`, each one's ratio to the forward); (b) in the
runtime (`in_runtime`): `OffloadSession.run_policy` with the cache holding every expert and
no link cap, lru and each stack interleaved `--repeats` times: `predict_s_per_token` as a
share of the resident decode step and of lru's, decode tok/s over lru's (median and
range), and decode's calls split into scoring (beside the same scoring timed in isolation,
`score_us_per_token` in (a)), queueing and glue (`decode_score_us_per_token`,
`decode_queue_us_per_token`, `decode_glue_us_per_token`).
Issue target for the whole stack: <= 5% of a resident decode step (goal 2%).
Timing numbers need a quiet machine (the lead reruns this alone).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench.prediction_cost import (
    TARGET_RATIO,
    isolated_cost,
    prediction_stacks,
    runtime_cost,
    whole_stacks,
)
from bench.record import command, emit
from tensorbend.capture.hf import DecodeConfig, load_model
from tensorbend.capture.prompts import load_prompts
from tensorbend.models import describe_model
from tensorbend.offload.runner import build_predictor
from tensorbend.offload.session import OffloadSession, SessionConfig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="zoo:default")
    ap.add_argument("--predictor", default=None, help="within-token checkpoint")
    ap.add_argument("--horizon", default=None, help="cross-token checkpoint")
    ap.add_argument("--steps", type=int, default=64, help="isolated: decode steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="runtime: interleaved repeats")
    ap.add_argument("--max-prompts", type=int, default=2, help="runtime: test-split prompts")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="runtime: per prompt")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    spec = describe_model(model)
    load = lambda path: build_predictor(model, Path(path), None, "d1", None) if path else None  # noqa: E731
    stacks = prediction_stacks(load(args.predictor), load(args.horizon))
    iso = isolated_cost(model, spec, stacks, args.steps)  # first: the session frees the experts
    prompts = load_prompts(None, "test")[: args.max_prompts]
    cfg = SessionConfig(DecodeConfig(max_new_tokens=args.max_new_tokens))
    sess = OffloadSession(model, tok, prompts, cfg, model_name=args.model)
    try:
        rt = runtime_cost(sess, stacks, args.repeats, say=lambda s: print(s, file=sys.stderr))
    finally:
        sess.close()
    res = {
        "bench": "predictor_cost",
        "command": command("predictor_cost", argv),
        "model": args.model,
        "predictor": args.predictor,
        "horizon": args.horizon,
        "threads": args.threads,
        **iso,
        "stack_ratio": next(  # the whole stack given
            r["ratio_to_decode_forward"]
            for r in iso["results"]
            if r["stack"] == whole_stacks(stacks)[0]
        ),
        "target_ratio": TARGET_RATIO,
        "in_runtime": rt,
        "loadavg": _loadavg(),
    }
    return emit(res, args.json)


def _loadavg() -> str | None:
    """/proc/loadavg beside the numbers (timings on a loaded machine are noisy)."""
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
