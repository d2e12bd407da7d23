"""docs/REPORT.md: the technical report, its numbers rendered from the benches' committed JSON.

Usage:
    python -m bench.report_doc            # rewrites docs/REPORT.md
    python -m bench.report_doc --check    # exit 1 if docs/REPORT.md differs from the JSON

The rendering is `tensorbend.results.report_page`; tests/test_docs_results.py runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tensorbend.atomic import write_generated
from tensorbend.results.report_page import report

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true")
    a = p.parse_args(argv)
    return write_generated(ROOT / "docs" / "REPORT.md", report(ROOT), a.check)


if __name__ == "__main__":
    sys.exit(main())
