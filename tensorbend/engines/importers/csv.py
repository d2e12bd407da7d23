"""The canonical routing CSV: one row per (prompt, MoE layer, position), read as a stream.

Usage:
    from tensorbend.engines.importers import ImportConfig, import_trace
    import_trace(ImportConfig(source="csv", path=Path("routing.csv"), out=Path("runs/t")))
    write_csv(Path("routing.csv"), trace_rows(Trace.open("runs/t")))  # a trace's routing out

Format (header required, extra columns ignored):

    prompt_id,layer,position,expert_ids,phase
    req-1,0,0,3 17 42 5 9 60,prefill
    req-1,1,0,12 7 33 1 50 2,prefill
    ...

`layer` counts MoE layers from 0, `position` is the token's position in its sequence,
`expert_ids` are space-separated in router order, `phase` (optional) is prefill/decode or 0/1
(absent: every row has `--default-phase`). A prompt's rows must be contiguous (any order inside);
every position needs a row for every layer. Blank lines are ignored.
"""

from __future__ import annotations

import csv
import io
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tensorbend.atomic import atomic_write
from tensorbend.engines.importers.reader import ImportedPrompt, by_prompt, iter_files
from tensorbend.engines.importers.source import ImportConfig
from tensorbend.errors import TraceError

COLUMNS = ("prompt_id", "layer", "position", "expert_ids")
_PHASES = {"prefill": 0, "0": 0, "decode": 1, "1": 1}
_PHASE_NAMES = ("prefill", "decode")


def source_files(path: Path) -> list[Path]:
    return iter_files(path, (".csv", ".csv.gz"), "a routing CSV (docs/guide/import.md)")


def read_prompts(
    files: list[Path], cfg: ImportConfig, notes: list[str]
) -> Iterator[ImportedPrompt]:
    if not cfg.moe_layer_ids:
        notes.append("csv: `layer` counts MoE layers; decoder-layer ids recorded as 0..L-1")
    for path in files:
        yield from _read_file(path, cfg)


def write_csv(path: Path, rows: Iterator[tuple[str, int, int, list[int], str]]) -> Path:
    """Write (prompt_id, layer, position, expert_ids, phase) rows in the canonical format
    (atomically: an interrupted write leaves no file under the name)."""

    def write(f) -> None:
        text = io.TextIOWrapper(f, encoding="utf-8", newline="")
        w = csv.writer(text)
        w.writerow((*COLUMNS, "phase"))
        for pid, m, pos, ids, phase in rows:
            w.writerow((pid, m, pos, " ".join(map(str, ids)), phase))
        text.flush()
        text.detach()  # (the binary file stays open for atomic_write's fsync)

    return atomic_write(path, write)


def trace_rows(trace) -> Iterator[tuple[str, int, int, list[int], str]]:
    """Every row of a trace (`tensorbend.capture.trace.Trace`) as `write_csv` takes it, prompt by
    prompt in row order, one shard at a time: its routing only (`tensorbend trace export`)."""
    prompts, L = trace.prompts, trace.spec.num_moe_layers
    for rows in trace.iter_shards(("ids",)):
        ids_TLK = rows["expert_ids_TLK"].tolist()
        index_T, pos_T = rows["prompt_index_T"].tolist(), rows["positions_T"].tolist()
        phase_T = rows["phase_T"].tolist()
        for ids_LK, i, pos, ph in zip(ids_TLK, index_T, pos_T, phase_T, strict=True):
            pid, phase = prompts[i]["id"], _PHASE_NAMES[ph]
            for m in range(L):
                yield pid, m, pos, ids_LK[m], phase


# ---------------------------------------------------------------- helpers


def _read_file(path: Path, cfg: ImportConfig) -> Iterator[ImportedPrompt]:
    """The prompts of one file; undecodable bytes (not UTF-8, a damaged .gz) are a TraceError."""
    try:
        yield from _read_text(path, cfg)
    except UnicodeDecodeError as e:
        raise TraceError(
            f"{path}: not UTF-8 text ({e}); expected a UTF-8 CSV: re-export it as UTF-8"
        ) from e
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise TraceError(
            f"{path}: unreadable ({type(e).__name__}: {e}); expected a CSV or a complete .csv.gz: "
            "check the file (gzip -t) or export it again"
        ) from e


def _read_text(path: Path, cfg: ImportConfig) -> Iterator[ImportedPrompt]:
    opener = _open_gz if path.name.endswith(".gz") else open
    with opener(path, "rt", newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise TraceError(
                f"{path}, line 1: header {header} lacks {missing}; expected "
                f"{','.join(COLUMNS)}[,phase]"
            )
        col = [header.index(c) for c in COLUMNS]
        ph_col = header.index("phase") if "phase" in header else None
        default = _PHASES[cfg.default_phase]

        def rows():
            for lineno, r in enumerate(reader, start=2):
                if not r or not any(x.strip() for x in r):
                    continue
                try:
                    pid = r[col[0]]
                    row = (
                        int(r[col[1]]),
                        int(r[col[2]]),
                        r[col[3]].split(),
                        default if ph_col is None else _PHASES[r[ph_col].strip().lower()],
                        lineno,
                    )
                except (IndexError, ValueError, KeyError) as e:
                    raise TraceError(
                        f"{path}, line {lineno}: expected prompt_id,layer,position,expert_ids"
                        f"[,phase] with integer layer/position, space-separated ids and phase "
                        f"prefill|decode; found {r} ({type(e).__name__}: {e})"
                    ) from e
                if not row[2]:
                    raise TraceError(
                        f"{path}, line {lineno}: prompt {pid!r} layer {row[0]} position {row[1]} "
                        "has no expert ids; expected the router's top-k ids, space-separated: "
                        "fix or drop the row"
                    )
                yield pid, row

        for pid, prompt_rows in by_prompt(rows()):
            yield _prompt(path, pid, prompt_rows)


def _prompt(path: Path, pid: str, rows: list) -> ImportedPrompt:
    first_line = rows[0][4]
    where = f"{path}, line {first_line}"
    layers = sorted({r[0] for r in rows})
    if layers[0] < 0 or layers != list(range(len(layers))):
        raise TraceError(
            f"{where}: prompt {pid!r} has MoE layers {layers[:8]}...; expected 0..L-1 (layer counts "
            "MoE layers from 0)"
        )
    positions = sorted({r[1] for r in rows})
    index = {p: i for i, p in enumerate(positions)}
    T, L, K = len(positions), len(layers), len(rows[0][2])
    ids_TLK = np.full((T, L, K), -1, dtype=np.int64)
    phase_T = np.full(T, -1, dtype=np.int64)
    filled = np.zeros((T, L), dtype=bool)
    for m, pos, ids, ph, lineno in rows:
        t = index[pos]
        if len(ids) != K:
            raise TraceError(
                f"{path}, line {lineno}: {len(ids)} expert ids, expected {K} like the prompt's "
                "first row (top-k is the same for every row)"
            )
        if filled[t, m]:
            raise TraceError(
                f"{path}, line {lineno}: prompt {pid!r} layer {m} position {pos} twice"
            )
        try:
            ids_TLK[t, m] = [int(x) for x in ids]
        except ValueError as e:
            raise TraceError(f"{path}, line {lineno}: expert ids {ids}: not integers") from e
        filled[t, m] = True
        if phase_T[t] not in (-1, ph):
            raise TraceError(f"{path}, line {lineno}: position {pos} has two phases across layers")
        phase_T[t] = ph
    if not filled.all():
        t, m = np.argwhere(~filled)[0]
        raise TraceError(
            f"{where}: prompt {pid!r} has no row for layer {int(m)} at position "
            f"{positions[t]}; every position needs all {L} layers"
        )
    return ImportedPrompt(
        id=pid,
        expert_ids_TLK=ids_TLK,
        positions_T=np.asarray(positions, dtype=np.int64),
        phase_T=phase_T,
        token_ids_T=np.full(T, -1, dtype=np.int64),
        where=where,
    )


def _open_gz(path, mode, newline=None, encoding=None):
    import gzip

    return gzip.open(path, mode, newline=newline, encoding=encoding)
