"""On-disk routing traces: a JSON manifest plus safetensors shards, append-only and resumable.

Usage:
    >>> tr = Trace.open("runs/trace")
    >>> tr.info()["tokens"]                        # {"prefill": n, "decode": n}
    >>> rows = tr.load(("ids", "gate_input"), split="test", phase="decode")
    >>> rows["expert_ids_TLK"].shape                # [T, L, K]

Layout of a trace directory:
    manifest.json             format_version, model, routing spec, features, prompts done, shards
    router.safetensors        router weights per MoE layer (spec_gate reruns the routers)
    shard-00000.safetensors   rows of whole prompts: expert_ids_TLK [T, L, K] int16, optional
                              weights_TLK, logits_TLE, gate_input_TLD, layer_input_TLD, and
                              token_ids_T, positions_T, prompt_index_T (int32), phase_T (int8)

Every file is written to a temporary name and renamed into place, shard first, manifest last,
so a killed collection leaves only whole prompts behind; `resume` skips them.
Row order: prompts in manifest order; within a prompt, prefill tokens then decode steps.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tensorbend.capture import FEATURE_TENSORS
from tensorbend.errors import TraceError
from tensorbend.models import RoutingSpec

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ROUTER_FILE = "router.safetensors"
PHASES = ("prefill", "decode")  # phase_T codes 0, 1
ROW_TENSORS = ("token_ids_T", "positions_T", "prompt_index_T", "phase_T")


class Trace:
    """A trace directory opened for reading. Cheap to open; shards load on demand."""

    def __init__(self, root: Path, manifest: dict):
        self.root, self.manifest = Path(root), manifest
        self.spec = RoutingSpec.from_dict(manifest["routing"])

    @classmethod
    def open(cls, root: str | Path) -> Trace:
        root = Path(root)
        manifest = _read_manifest(root)
        tr = cls(root, manifest)
        for sh in manifest["shards"]:
            path = root / sh["file"]
            if not path.is_file():
                raise TraceError(
                    f"trace {root}: shard {path.name} listed in the manifest is missing"
                )
            size = path.stat().st_size
            if size != sh["bytes"]:
                raise TraceError(
                    f"shard {path}: expected {sh['bytes']} bytes, found {size} (truncated or "
                    "overwritten); other shards are intact: `Trace.load(..., skip_bad=True)` reads them, "
                    "or recollect with `tensorbend collect --resume` after deleting its prompts"
                )
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
        """Summary with the keys of `trace info --json` (DESIGN.md)."""
        m, spec = self.manifest, self.spec
        return {
            "format_version": m["format_version"],
            "model": m["model"]["name"],
            "num_moe_layers": spec.num_moe_layers,
            "num_experts": spec.num_experts,
            "top_k": spec.top_k,
            "hidden_size": spec.hidden_size,
            "tokens": {
                "prefill": sum(p["prefill"] for p in m["prompts"]),
                "decode": sum(p["decode"] for p in m["prompts"]),
            },
            "prompts": len(m["prompts"]),
            "features": self.features,
            "shards": len(m["shards"]),
            "family": spec.family,
            "router_kind": spec.router_kind,
            "decode_mode": m["collection"]["decode"],
            "splits": {
                s: sum(p["split"] == s for p in m["prompts"]) for s in ("train", "val", "test")
            },
            "fingerprint": m["model"]["fingerprint"],
            "complete": m.get("complete", False),
        }

    def router_params(self) -> dict[str, torch.Tensor]:
        return _load_checked(self.root / ROUTER_FILE)

    # ------------------------------------------------------------ rows

    def load_shard(self, i: int) -> dict[str, torch.Tensor]:
        return _load_checked(self.root / self.manifest["shards"][i]["file"])

    def load(
        self,
        features=("ids",),
        split: str | None = None,
        phase: str | None = None,
        skip_bad: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Concatenate rows of all shards, filtered by prompt split and phase.

        Returns the feature tensors ([T, L, ...]) plus token_ids_T, positions_T,
        prompt_index_T (index into `self.prompts`), phase_T (0 prefill, 1 decode) and
        prev_row_T: the row of the previous token of the same prompt within the returned
        rows, -1 at a prompt's first token (or when that row was filtered out).
        """
        names = []
        for f in features:
            if f not in self.manifest["features"]:
                raise TraceError(
                    f"trace {self.root} has no feature {f!r}: found {self.features}; "
                    f"recollect with `tensorbend collect --features {' '.join(sorted({*self.features, f}))}`"
                )
            names.append(FEATURE_TENSORS[f])
        split_ok = (
            None
            if split in (None, "all")
            else torch.tensor([p["split"] == split for p in self.prompts])
        )
        parts: dict[str, list[torch.Tensor]] = {n: [] for n in (*names, *ROW_TENSORS, "row_T")}
        offset = 0
        for i in range(len(self.manifest["shards"])):
            try:
                sh = self.load_shard(i)
            except TraceError:
                if not skip_bad:
                    raise
                offset += self.manifest["shards"][i]["tokens"]
                continue
            keep = torch.ones(sh["phase_T"].shape[0], dtype=torch.bool)
            if split_ok is not None:
                keep &= split_ok[sh["prompt_index_T"].long()]
            if phase is not None:
                keep &= sh["phase_T"] == PHASES.index(phase)
            for n in (*names, *ROW_TENSORS):
                parts[n].append(sh[n][keep])
            parts["row_T"].append(torch.arange(offset, offset + keep.shape[0])[keep])
            offset += keep.shape[0]
        out = {n: torch.cat(v) if v else torch.empty(0) for n, v in parts.items()}
        out["prev_row_T"] = _prev_rows(out["row_T"], out["prompt_index_T"], out["positions_T"])
        del out["row_T"]
        return out


class TraceWriter:
    """Appends whole prompts to a trace directory; see module docstring for the guarantees."""

    def __init__(
        self,
        root: str | Path,
        *,
        model_meta: dict,
        spec: RoutingSpec,
        features: dict[str, str],
        collection: dict,
        router_params: dict[str, torch.Tensor],
        shard_tokens: int = 4096,
        resume: bool = False,
        overwrite: bool = False,
    ):
        self.root = Path(root)
        self.shard_tokens = shard_tokens
        self._buf: list[tuple[dict, dict[str, torch.Tensor]]] = []
        self._buf_tokens = 0
        existing = self.root / MANIFEST
        if existing.is_file() and not overwrite:
            old = _read_manifest(self.root)
            if old["model"]["fingerprint"] != model_meta["fingerprint"]:
                raise TraceError(
                    f"{self.root} holds a trace of another model ({old['model']['name']}, fingerprint "
                    f"{old['model']['fingerprint']}), not {model_meta['name']} ({model_meta['fingerprint']}): "
                    "choose another --out or pass --overwrite to replace it"
                )
            if not resume:
                raise TraceError(
                    f"{self.root} already holds a trace ({len(old['prompts'])} prompts): pass --resume to "
                    "continue it or --overwrite to replace it"
                )
            for key, want in (("features", features), ("collection", collection)):
                if old[key] != want:
                    raise TraceError(
                        f"cannot resume {self.root}: its {key} are {old[key]}, this run asks for {want}; "
                        "rerun with the original options or pass --overwrite"
                    )
            self.manifest = old
            self.manifest["complete"] = False
        else:
            if overwrite and self.root.is_dir():
                _remove_trace_files(self.root)
            self.root.mkdir(parents=True, exist_ok=True)
            self.manifest = {
                "format_version": FORMAT_VERSION,
                "model": model_meta,
                "routing": spec.to_dict(),
                "features": features,
                "collection": collection,
                "prompts": [],
                "shards": [],
                "complete": False,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            _atomic_save(
                router_params, self.root / ROUTER_FILE, {"format_version": str(FORMAT_VERSION)}
            )
            self._write_manifest()

    @property
    def done_ids(self) -> set[str]:
        return {p["id"] for p in self.manifest["prompts"]} | {rec["id"] for rec, _ in self._buf}

    def add_prompt(self, record: dict, rows: dict[str, torch.Tensor]) -> None:
        """Buffer one whole prompt: record {id, split, topic, prefill, decode}, rows [T, ...]."""
        T = rows["phase_T"].shape[0]
        assert all(v.shape[0] == T for v in rows.values()), {k: v.shape for k, v in rows.items()}
        assert T == record["prefill"] + record["decode"]
        self._buf.append((record, rows))
        self._buf_tokens += T
        if self._buf_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        """Write buffered prompts as one shard, then the manifest that lists it."""
        if not self._buf:
            return
        first = len(self.manifest["prompts"])
        shard_idx = len(self.manifest["shards"])
        tensors: dict[str, list[torch.Tensor]] = {}
        for j, (_rec, rows) in enumerate(self._buf):
            T = rows["phase_T"].shape[0]
            rows = {**rows, "prompt_index_T": torch.full((T,), first + j, dtype=torch.int32)}
            for k, v in rows.items():
                tensors.setdefault(k, []).append(v)
        cat = {k: torch.cat(v).contiguous() for k, v in tensors.items()}
        name = f"shard-{shard_idx:05d}.safetensors"
        meta = {
            "format_version": str(FORMAT_VERSION),
            "fingerprint": self.manifest["model"]["fingerprint"],
        }
        _atomic_save(cat, self.root / name, meta)
        self.manifest["shards"].append(
            {
                "file": name,
                "tokens": int(cat["phase_T"].shape[0]),
                "bytes": (self.root / name).stat().st_size,
                "prompts": [first, first + len(self._buf) - 1],
            }
        )
        for rec, _ in self._buf:
            self.manifest["prompts"].append({**rec, "shard": shard_idx})
        self._buf, self._buf_tokens = [], 0
        self._write_manifest()

    def close(self, complete: bool = True) -> None:
        self.flush()
        self.manifest["complete"] = complete
        self._write_manifest()

    def _write_manifest(self) -> None:
        _atomic_write_text(self.root / MANIFEST, json.dumps(self.manifest, indent=1))


# ---------------------------------------------------------------- helpers


def _read_manifest(root: Path) -> dict:
    path = root / MANIFEST
    if not path.is_file():
        raise TraceError(
            f"{root}: no trace here (expected {MANIFEST}); create one with `tensorbend collect --out {root}`"
        )
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: corrupt manifest ({e.msg} at line {e.lineno})") from e
    if m.get("format_version") != FORMAT_VERSION:
        raise TraceError(
            f"{path}: trace format_version {m.get('format_version')!r}, this tensorbend reads {FORMAT_VERSION}; "
            "recollect the trace or use the matching tensorbend version"
        )
    return m


def _load_checked(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise TraceError(
            f"{path}: unreadable safetensors file ({e}); it is truncated or corrupt"
        ) from e


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    _fsync_replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    _fsync_replace(tmp, path)


def _fsync_replace(tmp: Path, path: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove_trace_files(root: Path) -> None:
    for p in root.iterdir():
        if p.name in (MANIFEST, ROUTER_FILE) or (
            p.name.startswith("shard-") and ".safetensors" in p.name
        ):
            p.unlink()


def _prev_rows(row_T: torch.Tensor, prompt_T: torch.Tensor, pos_T: torch.Tensor) -> torch.Tensor:
    """Index (into the returned rows) of the previous token of the same prompt, or -1."""
    T = row_T.shape[0]
    prev = torch.full((T,), -1, dtype=torch.long)
    if T > 1:
        same = (prompt_T[1:] == prompt_T[:-1]) & (pos_T[1:] == pos_T[:-1] + 1)
        prev[1:] = torch.where(same, torch.arange(T - 1), torch.full((T - 1,), -1))
    return prev
