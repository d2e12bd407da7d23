"""The routing-realism card of every bundled model's trace, beside a real MoE's figures.

Usage:
    python -m bench.zoo_card runs/bench/default/trace runs/bench/qwen/trace \
        --json docs/results/zoo_card.json --doc docs/results/zoo_card.md

Statistics and their definitions: `tensorbend.zoo.realism` (`tensorbend zoo card` prints the
same table for any traces). Deterministic: no timing.
The page is rendered from the JSON by `bench.pages.zoo_card`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.pages.zoo_card import TITLE, markdown
from tensorbend.atomic import write_generated
from tensorbend.capture.trace import Trace
from tensorbend.zoo.realism import routing_card


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, default=Path("docs/results/zoo_card.json"))
    ap.add_argument("--doc", type=Path, default=Path("docs/results/zoo_card.md"))
    ap.add_argument("--title", default=TITLE, help="the page's title (its JSON keeps it)")
    args = ap.parse_args(argv)
    cards = {}
    for d in args.traces:
        trace = Trace.open(d)
        cards[trace.manifest["model"]["name"]] = routing_card(trace)
    if args.title != TITLE:
        cards = {"title": args.title, **cards}
    write_generated(args.json, json.dumps(cards, indent=1) + "\n")
    write_generated(args.doc, markdown(json.loads(args.json.read_text())))
    print(markdown(cards))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
