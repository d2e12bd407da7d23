"""`ImportConfig`: what `tensorbend trace import` reads (source, path, sizes) and where it writes.

Usage:
    >>> from pathlib import Path
    >>> ImportConfig(source="csv", path=Path("routing.csv"), out=Path("runs/t")).num_experts is None
    True

Each field is a `trace import` flag (cli.add_config_flags; `source` is `--from`). Sizes left
None are inferred from the file (importer.py records which); stated, a mismatch is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from tensorbend.capture.trace import MAX_EXPERTS
from tensorbend.errors import TraceError

Source = Literal["csv", "vllm", "sglang"]
SOURCES = get_args(Source)


@dataclass(frozen=True)
class ImportConfig:
    source: Source = field(metadata={"flags": ("--from",)})
    """Format of `path`: csv (prompt_id,layer,position,expert_ids[,phase]), vllm (routed-experts
    responses), sglang (expert-distribution recorder per_token dumps); see docs/guide/import.md."""
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
