"""What every bench writes: its JSON (printed and saved) and the command line that reruns it.

Usage (a bench script under bench/, run as `python -m bench.NAME`):
    out = {"command": command("foresight_eval", argv), ...}   # how to rerun it, recorded
    atomic_write_text(Path(a.doc), foresight.markdown(out))   # bench/pages/: every number from out
    return emit(out, a.json)                                  # JSON on stdout (+ the file)

The pages (bench/pages/) turn a bench's JSON into markdown and nothing else, so a committed page
is checked against its committed JSON without running the bench (tests/test_docs_results.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tensorbend.atomic import atomic_write_text


def emit(result: dict, path: str | None) -> int:
    """Print `result` as JSON and write it to `path` (parents created); returns exit code 0."""
    text = json.dumps(result, indent=2)
    if path:
        atomic_write_text(Path(path), text + "\n")
    print(text)
    return 0


def command(bench: str, argv: list[str] | None) -> str:
    """The command line that reruns bench `bench` with `argv` (default: this process's)."""
    return " ".join([f"python -m bench.{bench}", *(sys.argv[1:] if argv is None else argv)])


def bench_args(cmd: str) -> list[str]:
    """The arguments of a recorded `command` (`python -m bench.X ...` or `python bench/X.py ...`)."""
    words = cmd.split()
    return words[3:] if words[1:2] == ["-m"] else words[2:]
