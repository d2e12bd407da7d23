"""SGLang's expert-distribution recorder, `per_token` mode dumps -> imported prompts.

Usage:
    import_trace(ImportConfig(source="sglang", path=Path("/tmp/sglang_dumps"), out=Path("runs/t")))

What SGLang writes (read from sglang 0.5.23, python/sglang/srt/eplb/expert_distribution.py:
`_DetailSinglePassGatherer.collect`, `_DetailAccumulator.dump`, `_dump_to_file`; run the server
with `--expert-distribution-recorder-mode per_token`, then POST /start_expert_distribution_record,
/stop_expert_distribution_record and /dump_expert_distribution_record): one
`expert_distribution_recorder_{time}_{rank}.pt` per rank under
SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, a `torch.save`d dict
  {"records": [{"forward_pass_id", "rank", "input_ids": [T], "positions": [T],
                "extend_seq_lens": [n per sequence] | None, "forward_mode": int,
                "topk_ids_of_layer": int32 [num_hidden_layers, T, 8], ...}, ...],
   "last_physical_to_logical_map": [num_hidden_layers, num_physical_experts]}
Ids are physical (after EPLB replication), -1 where unused (dense layers, padding, top-k < 8);
we map them to logical ids with the last map (EPLB rebalancing during the recording changes
the map: record without it). Loaded with `torch.load(weights_only=True)`.

The dump carries no request ids (rids are commented out in the gatherer), so sequences are
rebuilt from positions: a chunk at position 0 starts a sequence, a chunk at position p
continues the live sequence that ended at p - 1 (ties go to the one that was at the same
batch slot, else the oldest, counted in the notes); a sequence not continued for
`STALE_PASSES` forward passes is finished and written. Forward modes: EXTEND (1) chunks are
prefill, DECODE (2) tokens decode, MIXED (3) length-1 chunks that continue a sequence decode,
longer ones prefill; other modes (idle, speculative verify/draft) are skipped.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tensorbend.engines.importers.reader import ImportedPrompt, iter_files
from tensorbend.engines.importers.source import ImportConfig
from tensorbend.errors import TraceError

EXTEND, DECODE, MIXED = 1, 2, 3  # sglang ForwardMode values
STALE_PASSES = 8


def source_files(path: Path) -> list[Path]:
    return iter_files(path, (".pt",), "SGLang expert_distribution_recorder per_token dumps")


def read_prompts(
    files: list[Path], cfg: ImportConfig, notes: list[str]
) -> Iterator[ImportedPrompt]:
    seqs = _Sequences(cfg, notes)
    for path in files:
        dump = _load(path)
        p2l = np.asarray(dump["last_physical_to_logical_map"], dtype=np.int64)
        records = sorted(dump["records"], key=lambda r: r["forward_pass_id"])
        for rec in records:
            if not cfg.all_ranks and rec.get("rank", 0) != cfg.rank:
                continue
            yield from seqs.add_pass(rec, p2l, f"{path}, forward pass {rec['forward_pass_id']}")
        yield from seqs.flush_all()
    if seqs.skipped_modes:
        notes.append(f"sglang: skipped forward passes of modes {sorted(seqs.skipped_modes)}")
    if seqs.ambiguous:
        notes.append(f"sglang: {seqs.ambiguous} chunks matched one of several live sequences")
    if seqs.orphans:
        notes.append(f"sglang: {seqs.orphans} sequences started past position 0 (prefix cache)")


# ---------------------------------------------------------------- helpers


@dataclass
class _Seq:
    id: str
    slot: int
    last_pass: int
    rows: list = field(default_factory=list)  # (position, phase, token, ids [L, K])

    @property
    def next_pos(self) -> int:
        return self.rows[-1][0] + 1


class _Sequences:
    def __init__(self, cfg: ImportConfig, notes: list[str]):
        self.cfg, self.notes = cfg, notes
        self.live: list[_Seq] = []
        self.n = 0
        self.passes = 0
        self.layers: list[int] | None = list(cfg.moe_layer_ids) if cfg.moe_layer_ids else None
        self.K: int | None = None
        self.ambiguous = self.orphans = 0
        self.skipped_modes: set[int] = set()

    def add_pass(self, rec: dict, p2l: np.ndarray, where: str) -> Iterator[ImportedPrompt]:
        mode = int(rec["forward_mode"])
        if mode not in (EXTEND, DECODE, MIXED):
            self.skipped_modes.add(mode)
            return
        self.passes += 1
        ids_ATK = np.asarray(rec["topk_ids_of_layer"], dtype=np.int64)
        T = len(rec["input_ids"])
        ids_TLK = self._logical(ids_ATK[:, :T], p2l, where)
        lens = [1] * T if mode == DECODE else list(rec["extend_seq_lens"] or [T])
        if sum(lens) != T:
            raise TraceError(f"{where}: extend_seq_lens {lens} do not add up to {T} tokens")
        at = 0
        for slot, n in enumerate(lens):
            self._chunk(rec, ids_TLK, at, n, slot, mode, where)
            at += n
        yield from self._flush(lambda s: self.passes - s.last_pass >= STALE_PASSES)

    def flush_all(self) -> Iterator[ImportedPrompt]:
        yield from self._flush(lambda s: True)

    def _chunk(self, rec, ids_TLK, at: int, n: int, slot: int, mode: int, where: str) -> None:
        pos = [int(p) for p in rec["positions"][at : at + n]]
        seq = None if pos[0] == 0 else self._match(pos[0], slot)
        if seq is None:
            self.orphans += pos[0] != 0
            seq = _Seq(
                f"sglang-{'all' if self.cfg.all_ranks else self.cfg.rank}-{self.n:06d}",
                slot,
                self.passes,
            )
            self.n += 1
            self.live.append(seq)
        decode = mode == DECODE or (mode == MIXED and n == 1 and bool(seq.rows))
        for j in range(n):
            seq.rows.append((pos[j], int(decode), int(rec["input_ids"][at + j]), ids_TLK[at + j]))
        seq.slot, seq.last_pass = slot, self.passes

    def _match(self, p0: int, slot: int) -> _Seq | None:
        cands = [s for s in self.live if s.next_pos == p0 and s.last_pass < self.passes]
        if len(cands) > 1:
            self.ambiguous += 1
            same = [s for s in cands if s.slot == slot]
            return same[0] if same else cands[0]
        return cands[0] if cands else None

    def _logical(self, ids_ATK: np.ndarray, p2l: np.ndarray, where: str) -> np.ndarray:
        if self.layers is None:
            self.layers = np.flatnonzero((ids_ATK >= 0).any(axis=(1, 2))).tolist()
            self.notes.append(
                f"sglang: {ids_ATK.shape[0]} decoder layers, MoE layers {self.layers[:4]}.."
                f"{self.layers[-1:]} ({len(self.layers)}); the rest were never written (dense)"
            )
        ids = ids_ATK[self.layers]  # [L, T, K8]
        used = (ids >= 0).any(axis=(0, 1))
        if self.K is None:
            self.K = int(used.sum())
        ids = ids[:, :, : self.K]
        if bool((ids < 0).any()) or bool(used[self.K :].any()):
            raise TraceError(
                f"{where}: a MoE layer row has fewer than {self.K} experts (padding or a dense layer "
                "among --moe-layer-ids?)"
            )
        rows = np.arange(len(self.layers))[:, None, None]
        phys_layer = np.asarray(self.layers)[rows]
        return np.transpose(p2l[phys_layer, ids], (1, 0, 2))  # [T, L, K] logical

    def _flush(self, done) -> Iterator[ImportedPrompt]:
        keep = []
        for s in self.live:
            if not done(s):
                keep.append(s)
                continue
            pos = np.array([r[0] for r in s.rows])
            yield ImportedPrompt(
                id=s.id,
                expert_ids_TLK=np.stack([r[3] for r in s.rows]),
                positions_T=pos,
                phase_T=np.array([r[1] for r in s.rows]),
                token_ids_T=np.array([r[2] for r in s.rows]),
                where=f"sglang sequence {s.id}",
                layer_ids=tuple(self.layers),
            )
        self.live = keep


def _load(path: Path) -> dict:
    try:
        dump = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as e:
        raise TraceError(
            f"{path}: not a readable SGLang dump ({type(e).__name__}: {e}); expected "
            "expert_distribution_recorder_*.pt from per_token mode"
        ) from e
    if (
        not isinstance(dump, dict)
        or "records" not in dump
        or "last_physical_to_logical_map" not in dump
    ):
        raise TraceError(
            f"{path}: expected a per_token dump (keys records, last_physical_to_logical_map), "
            f"found {sorted(dump) if isinstance(dump, dict) else type(dump).__name__}; use "
            "--expert-distribution-recorder-mode per_token"
        )
    return dump
