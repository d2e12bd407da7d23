"""`tensorbend trace import`: routing recorded by an inference engine -> a normal tensorbend trace.

Usage:
    >>> import tempfile
    >>> from tensorbend.engines.importers.csv import write_csv
    >>> d = Path(tempfile.mkdtemp())
    >>> rows = [("p0", m, t, [m, m + 1], "decode") for t in range(3) for m in range(2)]
    >>> res = import_trace(ImportConfig(source="csv", path=write_csv(d / "r.csv", rows),
    ...                                 out=d / "t", progress=False))
    >>> res.num_moe_layers, res.top_k, res.num_experts, res.tokens
    (2, 2, 3, {'prefill': 0, 'decode': 3})

The readers (csv.py, vllm.py, sglang.py) yield one `ImportedPrompt` (reader.py) at a time;
the sink (sink.py) checks each against the sizes seen so far (or stated), writes it through
`TraceWriter` (shards as they fill: the source is never held in memory), and finally records
the routing spec.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from tensorbend.capture.trace import MANIFEST
from tensorbend.engines.importers import csv as csv_reader
from tensorbend.engines.importers import sglang as sglang_reader
from tensorbend.engines.importers import vllm as vllm_reader
from tensorbend.engines.importers.sink import Sink
from tensorbend.engines.importers.source import ImportConfig
from tensorbend.errors import TraceError

READERS = {"csv": csv_reader, "vllm": vllm_reader, "sglang": sglang_reader}


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
    t0 = time.perf_counter()
    reader = READERS[cfg.source]
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
