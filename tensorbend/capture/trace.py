"""On-disk routing traces: the format, and reading rows back (writing: `trace_writer.py`).

Usage (a runnable example that writes and reads a trace is in `trace_writer.py`):
    tr = Trace.open("runs/trace")
    tr.info()["tokens"]                                   # {"prefill": n, "decode": n}
    rows = tr.load(("ids", "gate_input"), split="test", phase="decode")
    rows["expert_ids_TLK"].shape                          # [T, L, K]

Layout of a trace directory (format_version 2; docs/guide/formats.md has every key):
    manifest.json             format_version, model, routing spec, features, collection,
                              prompts done (in row order), shards (file, tokens, bytes, sha256)
    router.safetensors        router weights per MoE layer (spec_gate reruns the routers)
    shard-00000.safetensors   rows of whole prompts: the features below, plus token_ids_T,
    part-000123.safetensors   positions_T, prompt_index_T (int32), phase_T (int8: 0 prefill,
                              1 decode). A `part-` shard holds one prompt written the moment it
                              finished; parts are merged into `shard-` files as they accumulate.

Rows are whole prompts in manifest order; within a prompt, prefill tokens then decode steps.
A shard's bytes are checked against the manifest (size on open, sha256 on load), so a
truncated or altered shard is named, not read as garbage.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_bytes

from tensorbend.errors import TraceError
from tensorbend.models import RoutingSpec

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: no shard checksums
MANIFEST = "manifest.json"
ROUTER_FILE = "router.safetensors"
PHASES = ("prefill", "decode")  # phase_T codes 0, 1
SPLITS = ("train", "val", "test")
ROW_TENSORS = ("token_ids_T", "positions_T", "prompt_index_T", "phase_T")
# Feature name (what `collect --features` records) -> tensor name in a shard.
FEATURE_TENSORS = {
    "ids": "expert_ids_TLK",  # int16 [T, L, K]: the router's own selection
    "weights": "weights_TLK",  # [T, L, K]: the router's combine weights
    "logits": "logits_TLE",  # [T, L, E]: raw router logits
    "gate_input": "gate_input_TLD",  # [T, L, D]: the exact tensor each router received
    "layer_input": "layer_input_TLD",  # [T, L, D]: residual stream entering the decoder layer
}
FEATURES = tuple(FEATURE_TENSORS)
MAX_EXPERTS = 2**15  # expert ids are stored as int16: ids 0..32767


class Trace:
    """A trace directory opened for reading. Cheap to open; shards load on demand."""

    def __init__(self, root: Path, manifest: dict):
        self.root, self.manifest = Path(root), manifest
        self.spec = RoutingSpec.from_dict(manifest["routing"])

    @classmethod
    def open(cls, root: str | Path) -> Trace:
        root = Path(root)
        tr = cls(root, read_manifest(root))
        for sh in tr.manifest["shards"]:
            path = root / sh["file"]
            if not path.is_file():
                raise TraceError(
                    f"trace {root}: shard {path.name} listed in the manifest is missing; "
                    "recollect with `tensorbend collect --overwrite`"
                )
            size = path.stat().st_size
            if size != sh["bytes"]:
                raise _damaged(path, f"expected {sh['bytes']} bytes, found {size}")
        return tr

    # ------------------------------------------------------------ metadata

    @property
    def prompts(self) -> list[dict]:
        """Prompts done, in row order: {id, split, topic, prefill, decode, shard}."""
        return self.manifest["prompts"]

    @property
    def features(self) -> list[str]:
        return list(self.manifest["features"])

    def info(self) -> dict:
        """Summary with the keys of `trace info --json` (docs/guide/formats.md)."""
        m, spec = self.manifest, self.spec
        return {
            "format_version": m["format_version"],
            "model": m["model"]["name"],
            "num_moe_layers": spec.num_moe_layers,
            "num_experts": spec.num_experts,
            "top_k": spec.top_k,
            "hidden_size": spec.hidden_size,
            "tokens": {ph: sum(p[ph] for p in m["prompts"]) for ph in PHASES},
            "prompts": len(m["prompts"]),
            "features": self.features,
            "shards": len(m["shards"]),
            "family": spec.family,
            "router_kind": spec.router_kind,
            "decode_mode": m["collection"]["decode"],
            "splits": {s: sum(p["split"] == s for p in m["prompts"]) for s in SPLITS},
            "fingerprint": m["model"]["fingerprint"],
            "complete": m.get("complete", False),
        }

    def router_params(self) -> dict[str, torch.Tensor]:
        return _read_tensors(self.root / ROUTER_FILE)

    # ------------------------------------------------------------ rows

    def load_shard(self, i: int) -> dict[str, torch.Tensor]:
        """Shard i's tensors, after checking its size and (format 2) its sha256."""
        sh = self.manifest["shards"][i]
        return _read_tensors(self.root / sh["file"], sh.get("bytes"), sh.get("sha256"))

    def load(
        self,
        features=("ids",),
        split: str | None = None,
        phase: str | None = None,
        skip_bad: bool = False,
        keep_T: torch.Tensor | None = None,
        shards: tuple[int, ...] | None = None,
        prev_ids: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Concatenate rows of all shards, filtered by prompt split and phase.

        Returns the feature tensors ([T, L, ...]) plus token_ids_T, positions_T,
        prompt_index_T (index into `self.prompts`), phase_T (0 prefill, 1 decode) and
        prev_row_T: the row of the previous token of the same prompt within the returned
        rows, -1 at a prompt's first token (or when that row was filtered out).
        With skip_bad, unreadable shards are skipped (their prompts are missing).
        keep_T: a bool mask over the rows the call returns without it; only those rows are
        kept, shard by shard, so the features of the others are never held together
        (`rows.load_selected` streams a row sample out of a trace larger than memory).
        shards: read only these shards (`iter_shards`); prompt_index_T stays global.
        prev_ids: also return each row's previous token's routing, taken before keep_T drops
        rows (prev_expert_ids_TLK, prev_phase_T: what `rows.previous_token` gives on the rows
        without keep_T; a shard holds whole prompts, so the previous token is in it).
        """
        assert keep_T is None or not skip_bad, "a row mask needs every shard"
        assert not (prev_ids and phase), "previous tokens of a phase-filtered load: not needed"
        names = [self._tensor_name(f) for f in features]
        split_ok = None
        if split not in (None, "all"):
            split_ok = torch.tensor([p["split"] == split for p in self.prompts], dtype=torch.bool)
        extra = ("prev_expert_ids_TLK", "prev_phase_T") if prev_ids else ()
        parts: dict[str, list[torch.Tensor]] = {
            n: [] for n in (*names, *ROW_TENSORS, "row_T", *extra)
        }
        offset = seen = 0  # rows of the shards so far; of them, rows passing the filters
        first_ids = None  # the first returned row's routing (previous_token's filler)
        for i, sh_meta in enumerate(self.manifest["shards"]):
            if shards is not None and i not in shards:
                offset += sh_meta["tokens"]
                continue
            try:
                sh = self.load_shard(i)
            except TraceError:
                if not skip_bad:
                    raise
                offset += sh_meta["tokens"]
                continue
            keep = torch.ones(sh["phase_T"].shape[0], dtype=torch.bool)
            if split_ok is not None:
                keep &= split_ok[sh["prompt_index_T"].long()]
            if phase is not None:
                keep &= sh["phase_T"] == PHASES.index(phase)
            sub = slice(None)  # which of the filtered rows keep_T keeps
            if prev_ids:
                first_ids = _shard_previous(sh, keep, first_ids, parts)
            if keep_T is not None:
                idx = keep.nonzero().flatten()
                sub = keep_T[seen : seen + idx.numel()]
                keep = torch.zeros_like(keep)
                keep[idx[sub]] = True
                seen += idx.numel()
            for n in extra:
                parts[n][-1] = parts[n][-1][sub]
            for n in (*names, *ROW_TENSORS):
                parts[n].append(sh[n][keep])
            parts["row_T"].append(torch.arange(offset, offset + keep.shape[0])[keep])
            offset += keep.shape[0]
        if keep_T is not None and seen != keep_T.numel():
            raise TraceError(
                f"row mask of {keep_T.numel()} rows for {seen} rows in {self.root}: the trace "
                "changed between the two passes over it; rerun"
            )
        out = {n: torch.cat(v) if v else torch.empty(0) for n, v in parts.items()}
        out["prev_row_T"] = _prev_rows(out["row_T"], out["prompt_index_T"], out["positions_T"])
        del out["row_T"]
        return out

    def iter_shards(self, features=("ids",), split: str | None = None):
        """`load`, one shard at a time (each holds whole prompts; shards without rows of the
        split are skipped): what a pass over a trace larger than memory reads."""
        for i in range(len(self.manifest["shards"])):
            rows = self.load(features, split=split, shards=(i,))
            if rows["phase_T"].numel():
                yield rows

    def _tensor_name(self, feature: str) -> str:
        if feature in self.manifest["features"]:
            return FEATURE_TENSORS[feature]
        imported = "imported" in str(self.manifest["collection"].get("decode", ""))
        fix = (
            "this trace was imported with routing only: use a routing-only predictor "
            "(frequency, transition, prev_token)"
            if imported
            else "recollect with `tensorbend collect --features "
            f"{' '.join(sorted({*self.features, feature}))}`"
        )
        raise TraceError(
            f"trace {self.root} has no feature {feature!r}: found {self.features}; {fix}"
        )


def read_manifest(root: Path) -> dict:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise TraceError(
            f"{root}: no trace here (expected {MANIFEST}); create one with "
            f"`tensorbend collect --out {root}`"
        )
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: corrupt manifest ({e}); recollect the trace") from e
    if not isinstance(m, dict) or m.get("format_version") not in READABLE_VERSIONS:
        found = m.get("format_version") if isinstance(m, dict) else type(m).__name__
        raise TraceError(
            f"{path}: expected trace format_version {' or '.join(map(str, READABLE_VERSIONS))}, "
            f"found {found!r}; recollect the trace or use the matching tensorbend version"
        )
    return m


def file_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_tensors(
    path: Path, nbytes: int | None = None, sha256: str | None = None
) -> dict[str, torch.Tensor]:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise _damaged(path, f"cannot read it ({e})") from e
    if nbytes is not None and len(data) != nbytes:
        raise _damaged(path, f"expected {nbytes} bytes, found {len(data)}")
    if sha256 is not None and file_sha256(data) != sha256:
        raise _damaged(path, f"expected sha256 {sha256[:16]}..., found {file_sha256(data)[:16]}...")
    try:
        return load_bytes(data)
    except (SafetensorError, ValueError) as e:
        raise _damaged(path, f"unreadable safetensors ({e})") from e


def _damaged(path: Path, what: str) -> TraceError:
    return TraceError(
        f"shard {path}: {what} (truncated or overwritten); other shards are intact: "
        "`Trace.load(..., skip_bad=True)` reads them, or delete the trace directory and "
        "recollect"
    )


def _shard_previous(sh: dict, keep: torch.Tensor, first_ids, parts: dict):
    """Append the previous token's routing of a shard's filtered rows to parts (rows without
    one get the first returned row's ids, as `rows.previous_token` does, and phase -1);
    returns the first returned row's ids."""
    ids_TLK = sh["expert_ids_TLK"][keep]
    if first_ids is None and ids_TLK.shape[0]:
        first_ids = ids_TLK[0]
    T = ids_TLK.shape[0]
    prev_T = _prev_rows(torch.arange(T), sh["prompt_index_T"][keep], sh["positions_T"][keep])
    has_T, idx_T = prev_T >= 0, prev_T.clamp(min=0)
    filler = first_ids if first_ids is not None else ids_TLK.new_zeros(ids_TLK.shape[1:])
    parts["prev_expert_ids_TLK"].append(torch.where(has_T[:, None, None], ids_TLK[idx_T], filler))
    parts["prev_phase_T"].append(torch.where(has_T, sh["phase_T"][keep].long()[idx_T], -1))
    return first_ids


def _prev_rows(row_T: torch.Tensor, prompt_T: torch.Tensor, pos_T: torch.Tensor) -> torch.Tensor:
    """Index (into the returned rows) of the previous token of the same prompt, or -1."""
    T = row_T.shape[0]
    prev = torch.full((T,), -1, dtype=torch.long)
    if T > 1:
        same = (prompt_T[1:] == prompt_T[:-1]) & (pos_T[1:] == pos_T[:-1] + 1)
        prev[1:] = torch.where(same, torch.arange(T - 1), torch.full((T - 1,), -1))
    return prev
