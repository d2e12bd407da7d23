"""`tensorbend trace import`: routing recorded by an inference engine -> a normal tensorbend trace.

Usage:
    >>> import tempfile
    >>> from tensorbend.engines.csv import write_csv
    >>> d = Path(tempfile.mkdtemp())
    >>> rows = [("p0", m, t, [m, m + 1], "decode") for t in range(3) for m in range(2)]
    >>> res = import_trace(ImportConfig(source="csv", path=write_csv(d / "r.csv", rows),
    ...                                 out=d / "t", progress=False))
    >>> res.num_moe_layers, res.top_k, res.num_experts, res.tokens
    (2, 2, 3, {'prefill': 0, 'decode': 3})

The readers (csv.py, vllm.py, sglang.py) yield one `ImportedPrompt` at a time; this module
checks each against the sizes seen so far (or stated), writes it through `TraceWriter` (shards
as they fill: the source is never held in memory), and finally records the routing spec.
An imported trace is routing only: feature `ids`, no hidden states (`hidden_size` 0, family
`imported`, router kind `unknown`, no router weights). Predictors that read routing only
(frequency, transition, prev_token) work on it; those that need hidden states are refused.

Sizes: `num_experts` is the largest id seen + 1 unless stated (an expert never routed in the
file is then missed: state it), `top_k` the ids per row, the MoE layers those in the file.
Prompts are split train/val/test by a hash of their id, as for collected traces.

Shape legend: T tokens, L MoE layers, K top-k.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from tqdm import tqdm

from tensorbend.errors import TraceError
from tensorbend.trace import MANIFEST, MAX_EXPERTS

Source = Literal["csv", "vllm", "sglang"]


@dataclass(frozen=True)
class ImportConfig:
    source: Source = field(metadata={"flags": ("--from",)})
    """Format of `path`: csv (prompt_id,layer,position,expert_ids[,phase]), vllm (routed-experts
    responses), sglang (expert-distribution recorder per_token dumps); see docs/import.md."""
    path: Path
    """A file, or a directory whose files of that format are read in name order."""
    out: Path
    """Trace directory to create."""
    num_experts: int | None = None
    """Routed experts per MoE layer; None: the largest id in the file + 1."""
    top_k: int | None = None
    """Experts per token; None: the ids per row. Stated, a row of another width is an error."""
    num_layers: int | None = None
    """MoE layers; None: as many as the file holds. Stated, a mismatch is an error."""
    moe_layer_ids: tuple[int, ...] = ()
    """Decoder-layer id of each MoE layer. csv: recorded in the trace (default 0..L-1). vllm,
    sglang (whose dumps count every decoder layer): which layers are MoE; empty: the layers the
    engine wrote (dense layers stay empty there; state this for top-1 models)."""
    num_shared_experts: int = 0
    """Always-on experts per MoE layer (recorded; never predicted)."""
    model: str | None = None
    """Model name recorded in the trace (default imported:SOURCE)."""
    default_phase: Literal["decode", "prefill"] = "decode"
    """csv without a phase column: the phase of every row."""
    rank: int = 0
    """sglang: the rank whose dumps are read (under TP/EP every rank records the same tokens)."""
    all_ranks: bool = False
    """sglang: read every rank's dumps (DP attention, where ranks serve different requests)."""
    overwrite: bool = False
    """Replace a trace already at `out`."""
    shard_tokens: int = 4096
    """Rows per trace shard."""
    progress: bool = True
    """tqdm progress on stderr."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "num_layers"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise TraceError(f"--{name.replace('_', '-')} {v}: expected a positive integer")
        if self.num_experts is not None and self.num_experts > MAX_EXPERTS:
            raise TraceError(
                f"--num-experts {self.num_experts}: a trace stores expert ids as int16, expected "
                f"at most {MAX_EXPERTS}"
            )
        if self.num_shared_experts < 0 or self.shard_tokens < 1:
            raise TraceError("expected --num-shared-experts >= 0 and --shard-tokens >= 1")
        ids = self.moe_layer_ids
        if ids and (list(ids) != sorted(set(ids)) or min(ids) < 0):
            raise TraceError(
                f"--moe-layer-ids {list(ids)}: expected increasing non-negative decoder-layer ids"
            )
        if ids and self.num_layers is not None and len(ids) != self.num_layers:
            raise TraceError(
                f"--moe-layer-ids lists {len(ids)} layers but --num-layers is {self.num_layers}: "
                "make them agree (or drop one)"
            )


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


@dataclass
class ImportResult:
    """What `import_trace` wrote; `to_json()` is `trace import --json`."""

    trace: str
    source: str
    files: int
    prompts: int
    tokens: dict[str, int]
    num_moe_layers: int
    num_experts: int
    top_k: int
    moe_layer_ids: list[int]
    inferred: list[str]
    splits: dict[str, int]
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def import_trace(cfg: ImportConfig) -> ImportResult:
    """Read `cfg.path` with the engine's reader and write a routing-only trace to `cfg.out`."""
    from tensorbend.engines import csv as csv_reader
    from tensorbend.engines import sglang as sglang_reader
    from tensorbend.engines import vllm as vllm_reader
    from tensorbend.engines.sink import Sink

    t0 = time.perf_counter()
    reader = {"csv": csv_reader, "vllm": vllm_reader, "sglang": sglang_reader}[cfg.source]
    files = reader.source_files(Path(cfg.path))
    if (Path(cfg.out) / MANIFEST).is_file() and not cfg.overwrite:
        raise TraceError(
            f"{cfg.out} already holds a trace: choose another --out or pass --overwrite to replace it"
        )
    notes: list[str] = []
    sink = Sink(cfg, files)
    prompts = reader.read_prompts(files, cfg, notes)
    bar = tqdm(desc="import", unit="prompt", disable=not cfg.progress, file=sys.stderr)
    try:
        for p in prompts:
            sink.add(p)
            bar.update(1)
    finally:
        bar.close()
    spec = sink.close()
    return ImportResult(
        trace=str(cfg.out),
        source=cfg.source,
        files=len(files),
        prompts=sink.n_prompts,
        tokens=sink.tokens,
        num_moe_layers=spec.num_moe_layers,
        num_experts=spec.num_experts,
        top_k=spec.top_k,
        moe_layer_ids=list(spec.moe_layer_ids),
        inferred=[n for n in ("num_experts", "top_k", "num_layers") if getattr(cfg, n) is None],
        splits=sink.splits,
        notes=notes,
        seconds=round(time.perf_counter() - t0, 2),
    )


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
