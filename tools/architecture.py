"""docs/architecture.md's module map, generated from each module's first docstring line.

Usage:
    python -m tools.architecture            # rewrites the map between its markers
    python -m tools.architecture --check    # exit 1 if the map is not what the modules say

The map lists every module of tensorbend/, folder by folder in the order the import contract
layers them (tests/test_layering.py: lowest first), each with the first line of its docstring.
The prose around the markers is the document's own.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

from tensorbend.atomic import write_generated

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- modules:begin (python -m tools.architecture) -->", "<!-- modules:end -->"
BASICS = (
    "errors",
    "atomic",
    "version",
    "memory",
    "lookahead",
    "host_load",
    "flags",
    "models",
    "routers",
)
"""Root modules that are shared basics (the lowest layer)."""
ENTRY = ("__init__", "__main__", "cli", "command_line", "parser", "demo")
"""Root modules that are entry points (the top layer)."""
LAYERS = [
    {"<basics>"},
    {"cache", "timing"},
    {"zoo"},
    {"capture"},
    {"predictors"},
    {"offload", "simulate"},
    {"serving", "report"},
    {"engines"},  # (vLLM's offload builds its store as serving does)
    {"<entry>"},
]
"""The import contract's layers, lowest first (tests/test_layering.py checks the imports)."""
ORDER = [place for layer in LAYERS for place in sorted(layer)]
"""The map's folders: layer by layer, alphabetical within one."""


def module_map(root: Path = ROOT) -> str:
    pkg = root / "tensorbend"
    lines = []
    for place in ORDER:
        if place.startswith("<"):
            names = BASICS if place == "<basics>" else ENTRY
            files = [pkg / f"{n}.py" for n in names if (pkg / f"{n}.py").is_file()]
            title = "root: shared basics" if place == "<basics>" else "root: entry points"
        else:
            files = sorted((pkg / place).rglob("*.py"))
            title = f"{place}/"
        rows = [f"| `{f.relative_to(pkg)}` | {_first_line(f)} |" for f in files]
        n = sum(len(f.read_text().splitlines()) for f in files)
        lines += [
            f"### {title} ({len(files)} modules, {n} lines)",
            "",
            "| module | what it is |",
            "|---|---|",
            *rows,
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"


def render(text: str, root: Path = ROOT) -> str:
    """`text` (the document) with its map between the markers replaced."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{DOC}: expected the markers {BEGIN} ... {END}")
    return pattern.sub(lambda _: f"{BEGIN}\n{module_map(root)}{END}", text)


def _first_line(f: Path) -> str:
    doc = ast.get_docstring(ast.parse(f.read_text())) or ""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    return first.replace("|", "\\|") or "(no docstring)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true")
    a = p.parse_args(argv)
    return write_generated(DOC, render(DOC.read_text()), a.check)


if __name__ == "__main__":
    sys.exit(main())
