"""The README's results section, built from the committed JSON of the benches (never typed).

Usage:
    python -m bench.summary            # rewrites the section between the README's markers
    python -m bench.summary --check    # exit 1 if the README differs from the JSON

The rendering is `tensorbend.results.readme_section`; tests/test_docs_results.py runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tensorbend.atomic import write_generated
from tensorbend.results.readme_section import render_readme

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true")
    a = p.parse_args(argv)
    readme = ROOT / "README.md"
    return write_generated(readme, render_readme(readme.read_text(), ROOT), a.check)


if __name__ == "__main__":
    sys.exit(main())
