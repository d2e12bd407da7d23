"""Validate the simulator against the runtime out of sample: calibrate on val prompts, judge on test.

Usage (a timing bench: run it alone on the machine):
    python -m bench.simulate_validate --model zoo:default --max-prompts 5 --max-new-tokens 32 \\
        --predictor runs/bench/default/ours_d1.safetensors --baseline transition \\
        --horizon runs/bench/default/horizon_routing_hidden.safetensors \\
        --train-trace runs/bench/default/trace --json docs/results/simulate_validation.json \\
        --doc docs/results/simulate_validation.md

What is measured and how: `bench/sim_validation.py`. Writes JSON (both sides per
configuration, signed errors, the bias per metric, the calibration, the link) and a markdown
table. The bar: every configuration within 15% on tok/s, stall and bytes per token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.record import command, emit
from bench.sim_validation import ValidateConfig, markdown, validate
from tensorbend.atomic import atomic_write_text
from tensorbend.errors import TensorbendError

_DEFAULT = ValidateConfig()


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    try:
        cfg = ValidateConfig(
            model=a.model, prompts=Path(a.prompts) if a.prompts else None,
            calibrate_split=a.calibrate_split, validate_split=a.validate_split,
            max_prompts=a.max_prompts, max_new_tokens=a.max_new_tokens,
            max_prompt_tokens=a.max_prompt_tokens, decode=a.decode,
            predictors=tuple(Path(p) for p in a.predictor), baselines=tuple(a.baseline),
            train_trace=Path(a.train_trace) if a.train_trace else None,
            horizon=Path(a.horizon) if a.horizon else None, lookahead=a.lookahead,
            cache_frac=a.cache_frac, link=a.link, io_threads=a.io_threads, threads=a.threads,
        )  # fmt: skip
        out = validate(cfg, log=lambda msg: print(msg, file=sys.stderr))
    except TensorbendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out["command"] = command("simulate_validate", argv)
    if a.doc:
        atomic_write_text(Path(a.doc), markdown(out))
    return emit(out, a.json)


def _parser() -> argparse.ArgumentParser:
    d = _DEFAULT
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=d.model)
    p.add_argument("--prompts", default=None)
    p.add_argument("--calibrate-split", default=d.calibrate_split)
    p.add_argument("--validate-split", default=d.validate_split)
    p.add_argument("--max-prompts", type=int, default=d.max_prompts, help="per split")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    p.add_argument("--decode", default=d.decode, choices=("greedy", "teacher"))
    p.add_argument("--predictor", action="append", default=[], help="checkpoint (repeatable)")
    p.add_argument("--baseline", action="append", default=[], help="peer name (repeatable)")
    p.add_argument("--train-trace", default=None, help="trace whose train split fits table peers")
    p.add_argument("--horizon", default=None, help="cross-token checkpoint")
    p.add_argument("--lookahead", default=d.lookahead)
    p.add_argument("--cache-frac", type=float, default=d.cache_frac)
    p.add_argument("--link", default=d.link)
    p.add_argument("--io-threads", type=int, default=d.io_threads)
    p.add_argument("--threads", type=int, default=d.threads, help="torch compute threads")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--doc", default=None, help="markdown table (docs/results/simulate_validation.md)"
    )
    return p


if __name__ == "__main__":
    raise SystemExit(main())
