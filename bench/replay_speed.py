"""Layer-steps per second of a pure-Python replay, per policy, before and after the victim index.

Usage:
    python -m bench.replay_speed [--prompts 60] [--tokens 64] [--before-prompts 6]
        [--json docs/results/bench/replay_speed.json] [--doc docs/results/bench/replay_speed.md]

What is measured and how: `tensorbend/cache/replay_speed.py`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.record import command, emit
from tensorbend.atomic import atomic_write_text
from tensorbend.cache.replay_speed import SpeedConfig, markdown, measure


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=SpeedConfig.prompts)
    ap.add_argument("--tokens", type=int, default=SpeedConfig.tokens)
    ap.add_argument("--before-prompts", type=int, default=SpeedConfig.before_prompts)
    ap.add_argument("--policies", default=",".join(SpeedConfig.policies))
    ap.add_argument("--json", default=None)
    ap.add_argument("--doc", default=None)
    a = ap.parse_args(argv)
    cfg = SpeedConfig(
        prompts=a.prompts,
        tokens=a.tokens,
        before_prompts=a.before_prompts,
        policies=tuple(a.policies.split(",")),
    )
    result = measure(cfg, command("replay_speed", argv))
    if a.doc:
        atomic_write_text(Path(a.doc), markdown(result))
    return emit(result, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
