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

import hashlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from tqdm import tqdm

from tensorbend.errors import TraceError
from tensorbend.models import RoutingSpec
from tensorbend.prompts import split_of
from tensorbend.trace import MANIFEST
from tensorbend.trace_writer import TraceWriter

Source = Literal["csv", "vllm", "sglang"]
IMPORTED_FAMILY = "imported"


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

    t0 = time.perf_counter()
    reader = {"csv": csv_reader, "vllm": vllm_reader, "sglang": sglang_reader}[cfg.source]
    files = reader.source_files(Path(cfg.path))
    if (Path(cfg.out) / MANIFEST).is_file() and not cfg.overwrite:
        raise TraceError(
            f"{cfg.out} already holds a trace: choose another --out or pass --overwrite to replace it"
        )
    notes: list[str] = []
    sink = _Sink(cfg, files)
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


def fingerprint(files: list[Path], cfg: ImportConfig) -> str:
    """Hash of the source bytes (streamed) and the stated sizes: the imported "model" identity."""
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    stated = {
        k: getattr(cfg, k)
        for k in (
            "source",
            "num_experts",
            "top_k",
            "num_layers",
            "moe_layer_ids",
            "rank",
            "all_ranks",
        )
    }
    h.update(json.dumps(stated, sort_keys=True, default=list).encode())
    return "imported-" + h.hexdigest()[:16]


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


# ---------------------------------------------------------------- the writer side


class _Sink:
    """Checks prompts against the sizes seen so far and appends them to a TraceWriter."""

    def __init__(self, cfg: ImportConfig, files: list[Path]):
        self.cfg = cfg
        self.fingerprint = fingerprint(files, cfg)
        self.files = files
        self.writer: TraceWriter | None = None
        self.L = cfg.num_layers or (len(cfg.moe_layer_ids) if cfg.moe_layer_ids else None)
        self.K = cfg.top_k
        self.layer_ids = cfg.moe_layer_ids or None
        self.max_id = -1
        self.seen: set[str] = set()
        self.n_prompts = 0
        self.tokens = {"prefill": 0, "decode": 0}
        self.splits = {"train": 0, "val": 0, "test": 0}

    def add(self, p: ImportedPrompt) -> None:
        ids_TLK = p.expert_ids_TLK
        T, L, K = ids_TLK.shape
        if self.L is None:
            self.L = L
        if self.K is None:
            self.K = K
        if self.layer_ids is None:
            self.layer_ids = p.layer_ids
        if L != self.L or K != self.K:
            raise TraceError(
                f"{p.where}: prompt {p.id!r} has {L} MoE layers x {K} experts per token, expected "
                f"{self.L} x {self.K} (as stated or as the first prompt had); fix the file or state "
                "--num-layers / --top-k"
            )
        if p.id in self.seen:
            raise TraceError(
                f"{p.where}: prompt id {p.id!r} appears twice (its rows must be contiguous and "
                "ids unique); sort the file by prompt"
            )
        _check_rows(p, self.cfg.num_experts)
        self.max_id = max(self.max_id, int(ids_TLK.max(initial=-1)))
        if self.writer is None:
            self.writer = self._open()
        n_pre = int((p.phase_T == 0).sum())
        split = split_of(p.id)
        self.writer.add_prompt(
            {"id": p.id, "split": split, "topic": None, "prefill": n_pre, "decode": T - n_pre},
            {
                "expert_ids_TLK": torch.from_numpy(ids_TLK.astype(np.int16)),
                "token_ids_T": torch.from_numpy(p.token_ids_T.astype(np.int32)),
                "positions_T": torch.from_numpy(p.positions_T.astype(np.int32)),
                "phase_T": torch.from_numpy(p.phase_T.astype(np.int8)),
            },
        )
        self.seen.add(p.id)
        self.n_prompts += 1
        self.tokens["prefill"] += n_pre
        self.tokens["decode"] += T - n_pre
        self.splits[split] += 1

    def close(self) -> RoutingSpec:
        if self.writer is None:
            raise TraceError(
                f"{', '.join(map(str, self.files[:3]))}: no routing rows found; check --from and "
                "the file format (docs/import.md)"
            )
        E = self.cfg.num_experts or self.max_id + 1
        spec = self._spec(E)
        self.writer.manifest["routing"] = spec.to_dict()  # sizes known only now
        self.writer.close()
        return spec

    def _spec(self, num_experts: int) -> RoutingSpec:
        ids = tuple(self.layer_ids or range(self.L))
        return RoutingSpec(
            family=IMPORTED_FAMILY,
            router_kind="unknown",
            num_experts=num_experts,
            top_k=self.K,
            hidden_size=0,
            num_decoder_layers=max(ids) + 1,
            moe_layer_ids=tuple(ids),
            num_shared_experts=self.cfg.num_shared_experts,
        )

    def _open(self) -> TraceWriter:
        cfg = self.cfg
        files = [str(f) for f in self.files]
        return TraceWriter(
            cfg.out,
            model_meta={
                "name": cfg.model or f"imported:{cfg.source}",
                "path": str(cfg.path),
                "fingerprint": self.fingerprint,
                "family": IMPORTED_FAMILY,
            },
            spec=self._spec(cfg.num_experts or 1),  # provisional until close()
            features={"ids": "int16"},
            collection={
                "decode": "imported",
                "imported_from": f"{cfg.source}: {files[0]}"
                + (f" (+{len(files) - 1} files)" if len(files) > 1 else ""),
                "source": cfg.source,
                "files": files,
            },
            router_params={},
            shard_tokens=cfg.shard_tokens,
            overwrite=cfg.overwrite,
        )


def _check_rows(p: ImportedPrompt, num_experts: int | None) -> None:
    ids_TLK = p.expert_ids_TLK
    if ids_TLK.shape[0] == 0:
        raise TraceError(f"{p.where}: prompt {p.id!r} has no rows")
    lo, hi = int(ids_TLK.min()), int(ids_TLK.max())
    if lo < 0 or (num_experts is not None and hi >= num_experts):
        raise TraceError(
            f"{p.where}: prompt {p.id!r} routes to expert {lo if lo < 0 else hi}, expected ids in "
            f"[0, {num_experts if num_experts is not None else 'E'}); fix the file or --num-experts"
        )
    srt = np.sort(ids_TLK, axis=-1)
    if ids_TLK.shape[-1] > 1 and bool((srt[..., 1:] == srt[..., :-1]).any()):
        t, m = np.argwhere((srt[..., 1:] == srt[..., :-1]).any(-1))[0]
        raise TraceError(
            f"{p.where}: prompt {p.id!r} position {int(p.positions_T[t])} layer {int(m)} lists an "
            f"expert twice ({ids_TLK[t, m].tolist()}); a router picks distinct experts"
        )
    pos = p.positions_T
    if bool((pos[1:] <= pos[:-1]).any()):
        raise TraceError(
            f"{p.where}: prompt {p.id!r} positions are not increasing ({pos[:8].tolist()}...): "
            "each position once per layer"
        )
    ph = p.phase_T
    if bool((ph[1:] < ph[:-1]).any()):
        raise TraceError(
            f"{p.where}: prompt {p.id!r} has prefill rows after decode rows; expected prefill "
            "(the prompt) first, then decode steps"
        )


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
