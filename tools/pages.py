"""Every generated result page re-rendered from its committed JSON (no bench runs).

Usage:
    python -m tools.pages            # rewrites each page in PAGES from its JSON
    python -m tools.pages --check    # exit 1 if any page differs from its JSON's rendering

A bench writes its JSON and its page in one run (`make bench`); this re-renders the pages after a
renderer changed. tests/test_docs_results.py checks every page in PAGES.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from tensorbend.atomic import write_generated

ROOT = Path(__file__).resolve().parent.parent

# (renderer module with `markdown(json) -> str`, JSON, page), paths under docs/results/
_HEADLINES = ("headline_default", "headline_qwen", "headline_default_b4", "headline_deep",
              "headline_deep_x4", "headline_deep_b4", "headline_deep_domain",
              "headline_default_domain")  # fmt: skip
PAGES = (
    *[("bench.pages.foresight", f"foresight_{n}.json", f"foresight_{n}.md")
      for n in ("default", "qwen", "deep", "default_domain", "deep_domain", "deep_imported")],
    ("bench.pages.projections", "projections.json", "projections.md"),
    *[("bench.pages.offload", f"bench/{n}.json", f"{n}.md")
      for n in _HEADLINES],
    ("bench.pages.train_memory", "bench/train_memory.json", "bench/train_memory.md"),
    ("bench.replay_speed", "bench/replay_speed.json", "bench/replay_speed.md"),
    ("bench.prefetch_width", "bench/prefetch_width.json", "bench/prefetch_width.md"),
    ("bench.pages.zoo_card", "zoo_card.json", "zoo_card.md"),
    ("bench.pages.zoo_card", "zoo_probe.json", "zoo_probe.md"),
    *[("bench.pages.serve_memory", f"bench/{n}.json", f"{n}.md")
      for n in ("serve_memory", "serve_accelerate", "serve_llama_cpp",
                "serve_staging")],
    *[("bench.pages.serve_precision", f"bench/{n}.json", f"{n}.md")
      for n in ("serve_precision", "serve_precision_qwen")],
    ("bench.sim_validation", "simulate_validation.json", "simulate_validation.md"),
    ("bench.pages.vllm_offload", "bench/vllm_offload.json", "vllm_offload.md"),
)  # fmt: skip


def render(renderer: str, json_rel: str, root: Path = ROOT) -> str:
    """The page `renderer` makes of docs/results/`json_rel`."""
    rep = json.loads((root / "docs" / "results" / json_rel).read_text())
    return importlib.import_module(renderer).markdown(rep)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true")
    a = p.parse_args(argv)
    rc = 0
    for renderer, json_rel, page in PAGES:
        rc |= write_generated(ROOT / "docs" / "results" / page, render(renderer, json_rel), a.check)
    return rc


if __name__ == "__main__":
    sys.exit(main())
