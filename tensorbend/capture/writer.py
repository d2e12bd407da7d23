"""Append whole prompts to a trace directory; every finished prompt is durable before the next.

Usage:
    >>> import tempfile, torch
    >>> from tensorbend.models import RoutingSpec
    >>> from tensorbend.capture.trace import Trace
    >>> spec = RoutingSpec("toy", "softmax", num_experts=8, top_k=2, hidden_size=4,
    ...                    num_decoder_layers=2, moe_layer_ids=(0, 1))
    >>> root = tempfile.mkdtemp()
    >>> w = TraceWriter(root, model_meta={"name": "toy", "fingerprint": "f" * 16}, spec=spec,
    ...                 features={"ids": "int16"}, collection={"decode": "greedy"})
    >>> for i in range(3):                     # a prompt of 2 prefill tokens + 1 decode step
    ...     w.add_prompt({"id": f"p{i}", "split": "test", "prefill": 2, "decode": 1},
    ...                  {"expert_ids_TLK": torch.zeros(3, 2, 2, dtype=torch.int16),
    ...                   "token_ids_T": torch.arange(3, dtype=torch.int32),
    ...                   "positions_T": torch.arange(3, dtype=torch.int32),
    ...                   "phase_T": torch.tensor([0, 0, 1], dtype=torch.int8)})
    >>> w.close()
    >>> tr = Trace.open(root)
    >>> tr.info()["tokens"], tr.info()["shards"]
    ({'prefill': 6, 'decode': 3}, 1)

Durability: `add_prompt` writes the prompt as its own `part-NNNNNN.safetensors` shard and then
the manifest that lists it (each file via atomic tmp + fsync + rename, shard first), so a
process killed at any instant leaves every finished prompt on disk and `resume` skips exactly
those. Once `shard_tokens` rows are in parts, they are merged into one `shard-NNNNN` file:
the merged shard is written, then the manifest that lists it instead of the parts, then the
parts are deleted; on resume, files the manifest does not list (left by a kill between those
steps) are removed. The cost of this per-prompt fsync is measured in bench/trace_io.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import save as save_bytes

from tensorbend.atomic import atomic_save_tensors, atomic_write_bytes, atomic_write_text
from tensorbend.capture.trace import (
    FORMAT_VERSION,
    MANIFEST,
    MAX_EXPERTS,
    ROUTER_FILE,
    Trace,
    file_sha256,
    read_manifest,
)
from tensorbend.errors import TraceError
from tensorbend.models import RoutingSpec


class TraceWriter:
    """Writes prompts to `root`; see the module docstring for the guarantees."""

    def __init__(
        self,
        root: str | Path,
        *,
        model_meta: dict,
        spec: RoutingSpec,
        features: dict[str, str],
        collection: dict,
        router_params: dict[str, torch.Tensor] | None = None,
        shard_tokens: int = 4096,
        resume: bool = False,
        overwrite: bool = False,
        first_prompt_index: int = 0,
    ):
        """first_prompt_index: the global index of this writer's first prompt (a rank's block in
        a distributed collection; its shards' prompt_index_T count from it)."""
        if spec.num_experts > MAX_EXPERTS:
            raise TraceError(
                f"{spec.num_experts} routed experts per layer: a trace stores expert ids as int16, "
                f"expected at most {MAX_EXPERTS}; a larger model is not supported"
            )
        self.root = Path(root)
        self.shard_tokens = shard_tokens
        self.first_prompt_index = first_prompt_index
        if (self.root / MANIFEST).is_file() and not overwrite:
            self.manifest = self._resume(model_meta, features, collection, resume)
        else:
            if overwrite and self.root.is_dir():
                _remove_trace_files(self.root, keep=None)
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
            atomic_save_tensors(
                router_params or {},
                self.root / ROUTER_FILE,
                {"format_version": str(FORMAT_VERSION)},
            )
            self._write_manifest()

    @property
    def done_ids(self) -> set[str]:
        return {p["id"] for p in self.manifest["prompts"]}

    def add_prompt(self, record: dict, rows: dict[str, torch.Tensor]) -> None:
        """Write one whole prompt durably: record {id, split, topic?, prefill, decode}, rows
        {tensor_name: [T, ...]} without prompt_index_T (it is assigned here)."""
        T = rows["phase_T"].shape[0]
        assert all(v.shape[0] == T for v in rows.values()), {k: v.shape for k, v in rows.items()}
        assert T == record["prefill"] + record["decode"]
        index = len(self.manifest["prompts"])
        global_index = self.first_prompt_index + index
        rows = {**rows, "prompt_index_T": torch.full((T,), global_index, dtype=torch.int32)}
        entry = self._write_shard(f"part-{index:06d}.safetensors", rows, [index, index])
        self.manifest["shards"].append(entry)
        self.manifest["prompts"].append({**record, "shard": len(self.manifest["shards"]) - 1})
        self._write_manifest()
        if sum(s["tokens"] for s in self._parts()) >= self.shard_tokens:
            self.compact()

    def compact(self) -> None:
        """Merge the trailing part shards into one shard (see the module docstring)."""
        parts = self._parts()
        if len(parts) < 2:
            return
        tr = Trace(self.root, self.manifest)
        first = len(self.manifest["shards"]) - len(parts)
        loaded = [tr.load_shard(first + j) for j in range(len(parts))]
        merged = {k: torch.cat([sh[k] for sh in loaded]) for k in loaded[0]}
        n_merged = sum(not s["file"].startswith("part-") for s in self.manifest["shards"])
        prompts = [parts[0]["prompts"][0], parts[-1]["prompts"][1]]
        entry = self._write_shard(f"shard-{n_merged:05d}.safetensors", merged, prompts)
        self.manifest["shards"][first:] = [entry]
        for p in self.manifest["prompts"][prompts[0] : prompts[1] + 1]:
            p["shard"] = first
        self._write_manifest()
        for s in parts:
            (self.root / s["file"]).unlink(missing_ok=True)

    def close(self, complete: bool = True) -> None:
        self.compact()
        self.manifest["complete"] = complete
        self._write_manifest()

    # ------------------------------------------------------------ helpers

    def _parts(self) -> list[dict]:
        shards = self.manifest["shards"]
        n = 0
        while n < len(shards) and shards[-1 - n]["file"].startswith("part-"):
            n += 1
        return shards[len(shards) - n :]

    def _write_shard(self, name: str, tensors: dict[str, torch.Tensor], prompts) -> dict:
        meta = {
            "format_version": str(FORMAT_VERSION),
            "fingerprint": self.manifest["model"]["fingerprint"],
        }
        blob = save_bytes({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)
        atomic_write_bytes(self.root / name, blob)
        return {
            "file": name,
            "tokens": int(tensors["phase_T"].shape[0]),
            "bytes": len(blob),
            "sha256": file_sha256(blob),
            "prompts": list(prompts),
        }

    def _write_manifest(self) -> None:
        atomic_write_text(self.root / MANIFEST, json.dumps(self.manifest, indent=1))

    def _resume(self, model_meta: dict, features: dict, collection: dict, resume: bool) -> dict:
        old = read_manifest(self.root)
        if old["model"]["fingerprint"] != model_meta["fingerprint"]:
            raise TraceError(
                f"{self.root} holds a trace of another model ({old['model']['name']}, "
                f"fingerprint {old['model']['fingerprint']}), not {model_meta['name']} "
                f"({model_meta['fingerprint']}): choose another --out or pass --overwrite"
            )
        if not resume:
            raise TraceError(
                f"{self.root} already holds a trace ({len(old['prompts'])} prompts): pass "
                "--resume to continue it or --overwrite to replace it"
            )
        if old["format_version"] != FORMAT_VERSION:
            raise TraceError(
                f"cannot resume {self.root}: it is trace format {old['format_version']}, this "
                f"tensorbend writes {FORMAT_VERSION}; pass --overwrite to recollect it"
            )
        for key, want in (("features", features), ("collection", collection)):
            if old[key] != want:
                raise TraceError(
                    f"cannot resume {self.root}: its {key} are {old[key]}, this run asks for "
                    f"{want}; rerun with the original options or pass --overwrite"
                )
        _remove_trace_files(self.root, keep={s["file"] for s in old["shards"]})
        old["complete"] = False
        return old


def merge_rank_traces(root: Path, rank_dirs: list[Path]) -> dict:
    """Index the rank sub-traces of a distributed collection as one trace at `root`.

    Each rank wrote whole prompts of a contiguous block into its own directory, its shards'
    prompt_index_T already global; the merged manifest lists their prompts and shards in rank
    order (shard files as `rank-NNN/shard-...`), so `Trace.load` returns the rows of a
    single-process collection of the same prompts, in the same order. Nothing is copied.
    """
    root = Path(root)
    parts = [read_manifest(d) for d in rank_dirs]
    first = parts[0]
    for d, m in zip(rank_dirs[1:], parts[1:], strict=True):
        for key in ("model", "routing", "features", "collection", "format_version"):
            if m[key] != first[key]:
                raise TraceError(
                    f"cannot merge {d}: its {key} differ from {rank_dirs[0]}'s ({m[key]} vs "
                    f"{first[key]}); recollect with --overwrite"
                )
    merged = {k: v for k, v in first.items() if k not in ("prompts", "shards", "complete")}
    merged.update(prompts=[], shards=[], complete=all(m.get("complete") for m in parts))
    merged["ranks"] = [d.name for d in rank_dirs]
    for d, m in zip(rank_dirs, parts, strict=True):
        p0, s0 = len(merged["prompts"]), len(merged["shards"])
        for p in m["prompts"]:
            merged["prompts"].append({**p, "shard": p["shard"] + s0})
        for s in m["shards"]:
            lo, hi = s["prompts"]
            merged["shards"].append(
                {**s, "file": f"{d.name}/{s['file']}", "prompts": [lo + p0, hi + p0]}
            )
    router = rank_dirs[0] / ROUTER_FILE
    atomic_write_bytes(root / ROUTER_FILE, router.read_bytes())
    atomic_write_text(root / MANIFEST, json.dumps(merged, indent=1))
    return merged


def _remove_trace_files(root: Path, keep: set[str] | None) -> None:
    """Delete shards and temporary files not in `keep`; keep=None deletes the whole trace
    (--overwrite), manifest and router weights included. Other files are never touched."""
    for p in root.iterdir():
        is_shard = p.name.startswith(("shard-", "part-")) and ".safetensors" in p.name
        if (is_shard or p.name.endswith(".tmp")) and (keep is None or p.name not in keep):
            p.unlink()
    if keep is None:
        for name in (MANIFEST, ROUTER_FILE):
            (root / name).unlink(missing_ok=True)
