"""What a reader yields (`ImportedPrompt`) and the helpers every reader uses to find its rows.

Usage (inside a reader: csv.py, vllm.py, sglang.py):
    files = iter_files(path, (".csv",), "routing CSV files")    # a file, or a directory's files
    for pid, rows in by_prompt((row[0], row) for row in stream):  # consecutive rows per prompt
        yield ImportedPrompt(pid, ids_TLK, positions_T, phase_T, token_ids_T, where=str(file))

Each reader module defines `source_files(path) -> list[Path]` and
`read_prompts(files, cfg, notes) -> Iterator[ImportedPrompt]`; importer.py picks one by
`ImportConfig.source` and hands its prompts to the sink.

Shape legend: T tokens, L MoE layers, K top-k.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tensorbend.errors import TraceError


@dataclass
class ImportedPrompt:
    """One prompt's routing as a reader found it (numpy, CPU)."""

    id: str
    expert_ids_TLK: np.ndarray
    positions_T: np.ndarray
    phase_T: np.ndarray  # 0 prefill, 1 decode
    token_ids_T: np.ndarray  # -1 where the engine did not record the token
    where: str  # file (and record) it came from, for error messages
    layer_ids: tuple[int, ...] | None = None  # decoder-layer id of each of the L layers, if known


def iter_files(path: Path, suffixes: tuple[str, ...], what: str) -> list[Path]:
    """`path` itself, or the files under it with one of `suffixes`, in name order."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise TraceError(f"{path}: no such file or directory (expected {what})")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(suffixes))
    if not files:
        raise TraceError(f"{path}: no {' / '.join(suffixes)} files in it (expected {what})")
    return files


def by_prompt(rows: Iterator[tuple[str, object]]) -> Iterator[tuple[str, list]]:
    """Group consecutive (prompt_id, row) pairs by prompt id."""
    cur, buf = None, []
    for pid, row in rows:
        if pid != cur and buf:
            yield cur, buf
            buf = []
        cur = pid
        buf.append(row)
    if buf:
        yield cur, buf
