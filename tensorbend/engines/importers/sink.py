"""The writing side of an import: check each prompt against the sizes seen, append it to a trace.

Usage (importer.py does this):
    sink = Sink(cfg, files)          # the trace's fingerprint: source bytes + stated sizes
    for p in reader.read_prompts(files, cfg, notes):
        sink.add(p)                  # checks, then TraceWriter.add_prompt (durable per prompt)
    spec = sink.close()              # sizes known only now: recorded in the manifest

A prompt must have the sizes of the first (or the stated ones), distinct ids per row in
[0, num_experts), increasing positions, and prefill rows before decode rows; anything else is a
TraceError naming the file (and line) the prompt came from.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from tensorbend.capture.prompts import split_of
from tensorbend.capture.trace import MAX_EXPERTS
from tensorbend.capture.writer import TraceWriter
from tensorbend.errors import TraceError
from tensorbend.models import RoutingSpec

IMPORTED_FAMILY = "imported"


def fingerprint(files: list[Path], cfg) -> str:
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


class Sink:
    """Checks prompts against the sizes seen so far and appends them to a TraceWriter."""

    def __init__(self, cfg, files: list[Path]):
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

    def add(self, p) -> None:
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
        check_rows(p, self.cfg.num_experts)
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
                "the file format (docs/guide/import.md)"
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


def check_rows(p, num_experts: int | None) -> None:
    ids_TLK = p.expert_ids_TLK
    if ids_TLK.shape[0] == 0:
        raise TraceError(f"{p.where}: prompt {p.id!r} has no rows")
    lo, hi = int(ids_TLK.min()), int(ids_TLK.max())
    if hi >= MAX_EXPERTS:
        raise TraceError(
            f"{p.where}: prompt {p.id!r} routes to expert {hi}; a trace stores expert ids as "
            f"int16, expected ids below {MAX_EXPERTS}: check the expert id column (ids count "
            "one layer's routed experts from 0)"
        )
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
