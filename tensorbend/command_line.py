"""The command line's words before argparse reads them: every verb's flags (the table
`tools/cli_reference.py` writes to tensorbend/data/cli_flags.json), the check of a command line
against it that needs no import of torch or transformers, sizes that start with '-', and a
`--json` path that could not be written.

Usage:
    quick_check(["generate", "--bogus"], table)     # UsageError: unrecognized arguments: --bogus
    joined_sizes(["--max-memory", "-1GB"])          # ["--max-memory=-1GB"]
    flag_table(build_parser(funcs))                 # {"generate": ["--chat", ...], ...}
    check_json_path("out/")                         # TensorbendError: expected a file path
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tensorbend.errors import TensorbendError


class UsageError(Exception):
    """A bad command line: one line, exit 2 (cli.main prints it)."""


SIZE_FLAGS = ("--max-memory", "--reserve", "--cache-bytes")
"""Flags whose value may start with '-' (a negative size, which their own check refuses in
words; argparse would take '-1GB' for a flag and say only 'expected one argument')."""


def joined_sizes(args):
    """`--max-memory -1GB` as `--max-memory=-1GB`."""
    if args is None:
        return None
    args, out, i = list(args), [], 0
    while i < len(args):
        a = args[i]
        nxt = args[i + 1] if i + 1 < len(args) else ""
        if a in SIZE_FLAGS and nxt[:1] == "-" and nxt[1:2].isdigit():
            out.append(f"{a}={nxt}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def flag_table(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """{verb words (aliases too; "" for the bare command): its --flags}, what `cli.main`
    checks a command line against before the heavy imports (tensorbend/data/cli_flags.json,
    written by tools/cli_reference.py)."""
    out: dict[str, list[str]] = {}

    def walk(p: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        flags = {o for a in p._actions for o in a.option_strings if o.startswith("--")}
        out[" ".join(path)] = sorted(flags)
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, child in a.choices.items():
                    walk(child, (*path, name))

    walk(parser, ())
    return out


def quick_check(argv: list[str], table: dict[str, list[str]]) -> None:
    """Refuse a verb or --flag that `table` (flag_table's) does not have: the errors that
    need no import of torch or transformers. What it lets through, argparse checks."""
    path: tuple[str, ...] = ()
    i = 0
    while i < len(argv) and not argv[i].startswith("-"):
        nxt = " ".join((*path, argv[i]))
        if nxt not in table:
            subs = sorted({k.split(" ")[len(path)] for k in table if _under(k, path)})
            if not subs:
                break  # (a positional argument of this verb)
            prog = " ".join(("tensorbend", *path))
            raise UsageError(
                f"{prog}: argument VERB: invalid choice: {argv[i]!r} (choose from "
                f"{', '.join(subs)}) (see `{prog} --help`)"
            )
        path, i = (*path, argv[i]), i + 1
    flags = table[" ".join(path)]
    for a in argv[i:]:
        if a == "--":
            return
        name = a.split("=", 1)[0]
        if name.startswith("--") and not any(f.startswith(name) for f in flags):
            prog = " ".join(("tensorbend", *path))
            raise UsageError(f"{prog}: unrecognized arguments: {a} (see `{prog} --help`)")


def _under(key: str, path: tuple[str, ...]) -> bool:
    words = key.split(" ") if key else []
    return len(words) == len(path) + 1 and tuple(words[: len(path)]) == path


def check_json_path(path) -> None:
    """Refuse a `--json` path that cannot be written before any work (a directory, a missing
    or read-only folder), so a run's summary is never lost at its end."""
    if not isinstance(path, str) or not path:
        return
    p = Path(path)
    if p.is_dir():
        raise TensorbendError(
            f"--json {path}: expected a file path, found a directory; pass a file name such "
            f"as {p / 'summary.json'}"
        )
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise TensorbendError(
            f"--json {path}: expected an existing folder, found no {folder}; create it first"
        )
    if not os.access(folder, os.W_OK):
        raise TensorbendError(f"--json {path}: the folder {folder} is not writable by this user")
