"""A checkpoint's safetensors shards read tensor by tensor, with positional reads (no memory map).

Usage:
    ckpt = Checkpoint.open(Path("my-moe"))              # config.json + *.safetensors
    ref = ckpt.refs["model.layers.3.mlp.experts.7.up_proj.weight"]
    t = ckpt.read(ref)                                   # a fresh tensor in its own dtype
    ckpt.read_into(ref, out_flat, row=None, staging=buf)  # into a buffer, converting dtype
    ckpt.identity()                                      # the shards' headers, 16 hex
    with ckpt.hashing() as digests: ...                  # blake2b of every range read, per shard

Only the bytes asked for are read (a row of a fused [E, ...] tensor is one contiguous range),
so reading a 100 GB checkpoint an expert at a time keeps memory at one expert. A truncated
shard, a header that is not safetensors, or a quantized dtype is refused with the shard named;
an fp8 block checkpoint's `weight_scale_inv` tensors are kept apart (`scales`, by weight key)
and `read` dequantizes a weight with its scales; an mxfp4 checkpoint's `{proj}_blocks` are
indexed as `{proj}` (the model's key; the ref keeps its own) and their `{proj}_scales` kept
apart the same way (offload/mxfp4.py reads them); a compressed-tensors int4 checkpoint's
`X.weight_packed` is indexed as `X.weight`, its `X.weight_scale` kept apart (offload/int4.py
reads them; `read` dequantizes a packed weight) and its `X.weight_shape` dropped (K is the
scales' groups times the group size).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from tensorbend.errors import StoreError, UnsupportedModelError
from tensorbend.offload.int4 import Int4
from tensorbend.offload.mxfp4 import MXFP4
from tensorbend.offload.precision import SERVED, dequantize_into, quant_block

ST_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # (fp8 block checkpoints: with a `weight_scale_inv` each)
}


@dataclass(frozen=True)
class TensorRef:
    """One tensor of one shard: absolute byte offset, dtype and shape."""

    shard: Path
    key: str
    dtype: str  # safetensors dtype string (F32, BF16, ...)
    shape: tuple[int, ...]
    start: int
    nbytes: int


class Checkpoint:
    """The safetensors shards of a local HF checkpoint directory, indexed by key."""

    def __init__(self, directory: Path, refs: dict[str, TensorRef], block=None):
        self.directory, self.block = directory, block  # fp8's weight_block_size, MXFP4 or Int4
        if isinstance(block, Int4):  # `X.weight_packed` indexed as `X.weight`, scales apart
            packed = {k.removesuffix("_packed") for k in refs if k.endswith(".weight_packed")}
            self.scales = {k: refs[k + "_scale"] for k in packed if k + "_scale" in refs}
            drop = {k + s for k in packed for s in ("_packed", "_scale", "_shape")}
            refs = {
                **{k: r for k, r in refs.items() if k not in drop},
                **{k: refs[k + "_packed"] for k in packed},
            }
        elif block == MXFP4:  # `{proj}_blocks` indexed as `{proj}`, their `{proj}_scales` apart
            self.scales = {
                k.removesuffix("_scales"): r
                for k, r in refs.items()
                if k.endswith("_scales") and k[:-7] + "_blocks" in refs
            }
            refs = {
                k[:-7] if k.endswith("_blocks") and k[:-7] in self.scales else k: r
                for k, r in refs.items()
                if not (k.endswith("_scales") and k[:-7] in self.scales)
            }
        else:
            self.scales = {
                k.removesuffix("_scale_inv"): r
                for k, r in refs.items()
                if k.endswith(".weight_scale_inv")
            }
            refs = {k: r for k, r in refs.items() if not k.endswith(".weight_scale_inv")}
        self.refs = refs
        self._digests: dict[Path, hashlib.blake2b] | None = None  # while `hashing`
        self._only: set[Path] | None = None  # hashing only these: reads of others are skipped

    @classmethod
    def open(cls, directory: Path) -> Checkpoint:
        directory = Path(directory)
        if not (directory / "config.json").is_file():
            raise StoreError(
                f"{directory}: expected a transformers checkpoint directory (config.json and "
                f"*.safetensors), found no config.json"
            )
        _check_index(directory)
        shards = sorted(directory.glob("*.safetensors"))
        if not shards:
            raise StoreError(
                f"{directory}: expected *.safetensors weight shards, found none (.bin "
                f"checkpoints are not read: convert them with save_pretrained)"
            )
        refs: dict[str, TensorRef] = {}
        block = quant_block(directory)  # (refuses any quantization but fp8 blocks, mxfp4)
        for shard in shards:
            refs.update(_read_header(shard))
        return cls(directory, refs, block)

    def identity(self) -> str:
        """sha256 (16 hex) of every shard's name and header: changes when any tensor's name,
        shape, dtype or place changes (the bytes of an expert store's sources are covered by
        the digests `hashing` takes while the store is built: `stores.stale_sources`)."""
        h = hashlib.sha256()
        for shard in sorted({r.shard for r in self.refs.values()}):
            with open(shard, "rb", buffering=0) as f:
                (hlen,) = struct.unpack("<Q", f.read(8))
                h.update(shard.name.encode() + f.read(hlen))
        return h.hexdigest()[:16]

    @contextmanager
    def hashing(self, shards: set[Path] | None = None) -> Iterator[dict[Path, hashlib.blake2b]]:
        """While inside, every `read_into` feeds the bytes it reads to its shard's blake2b (in
        the dict yielded: shards read from). With `shards`, only those are hashed and reads of
        others are skipped (re-hashing one shard's ranges without reading the rest)."""
        assert self._digests is None, "hashing is not reentrant"
        self._digests, self._only = {}, shards
        try:
            yield self._digests
        finally:
            self._digests, self._only = None, None

    def stats(self, shards) -> dict[str, dict[str, int]]:
        """{shard name: {size, mtime_ns, ino, ctime_ns}} of `shards` (paths of this
        checkpoint). The inode and the change time are what no copy (`cp -p`, `rsync -a`,
        `tar`) or `touch -r` restores: an edit with its mtime put back still shows."""
        out = {}
        for shard in sorted(shards):
            st = shard.stat()
            out[shard.name] = {
                "size": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "ino": st.st_ino,
                "ctime_ns": st.st_ctime_ns,
            }
        return out

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.refs.values())

    def read(self, ref: TensorRef, row: int | None = None) -> torch.Tensor:
        """The tensor (a fresh CPU tensor in its own dtype), or only row `row` of its leading dim;
        an fp8 weight dequantized by its `weight_scale_inv` (to float32)."""
        if isinstance(self.block, Int4) and ref.key.endswith(".weight_packed"):
            return self._dequantized_int4(ref, row)
        shape = ref.shape if row is None else ref.shape[1:]
        out = torch.empty(shape, dtype=_dtype(ref))
        self.read_into(ref, out.reshape(-1), row)
        if out.dtype != torch.float8_e4m3fn:
            return out
        scale = self.scales.get(ref.key)
        if scale is None or self.block is None or row is not None or out.dim() != 2:
            raise UnsupportedModelError(
                f"{ref.shard.name}: tensor {ref.key} is float8 without a 2-D weight_scale_inv "
                f"and the quantization_config's weight_block_size; expected {SERVED}"
            )
        full = torch.empty(shape, dtype=torch.float32)
        dequantize_into(out, self.read(scale), self.block, full)
        return full

    def _dequantized_int4(self, ref: TensorRef, row: int | None) -> torch.Tensor:
        """A compressed-tensors int4 weight (not a routed expert's: e.g. a quantized attention
        projection) dequantized as transformers does, in its scale's dtype."""
        from tensorbend.offload.int4 import dequantize_weight

        scale = self.scales.get(ref.key.removesuffix("_packed"))
        if scale is None or len(ref.shape) - (row is not None) != 2:
            raise UnsupportedModelError(
                f"{ref.shard.name}: tensor {ref.key} is int4 without a 2-D weight_scale; "
                f"expected {SERVED}"
            )
        packed = torch.empty(ref.shape if row is None else ref.shape[1:], dtype=torch.int32)
        self.read_into(ref, packed.reshape(-1), row)
        return dequantize_weight(packed, self.read(scale, row), self.block.group)

    def read_into(
        self, ref: TensorRef, out: torch.Tensor, row: int | None = None, staging=None
    ) -> None:
        """Read the tensor (or row `row`) into the contiguous 1-D CPU tensor `out`, converting
        to out's dtype through `staging` (a uint8 buffer, grown as needed) when they differ.
        While `hashing`, the bytes read go into their shard's digest."""
        digest = None
        if self._digests is not None:
            if self._only is not None and ref.shard not in self._only:
                return
            digest = self._digests.get(ref.shard)
            if digest is None:
                digest = self._digests[ref.shard] = hashlib.blake2b(digest_size=16)
        start, nbytes = ref.start, ref.nbytes
        if row is not None:
            nbytes //= ref.shape[0]
            start += row * nbytes
        dtype = _dtype(ref)
        assert out.is_contiguous() and out.numel() * dtype.itemsize == nbytes, (ref.key, out.shape)
        if nbytes == 0:
            return
        assert dtype != torch.float8_e4m3fn or out.dtype == dtype, f"{ref.key}: fp8 without scales"
        if dtype == out.dtype:
            dst = out.view(torch.uint8)
        else:
            if staging is None or staging.numel() < nbytes:
                staging = torch.empty(nbytes, dtype=torch.uint8)
            dst = staging[:nbytes]
        with open(ref.shard, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [memoryview(dst.numpy())], start)
        if got != nbytes:
            raise StoreError(
                f"{ref.shard}: short read of {ref.key} (expected {nbytes} bytes, got {got}): "
                f"the shard is truncated; download or save the checkpoint again"
            )
        if digest is not None:
            digest.update(dst.numpy())
        if dst.data_ptr() != out.data_ptr():
            out.copy_(dst.view(dtype))


# ------------------------------------------------------------ helpers


def _check_index(directory: Path) -> None:
    """StoreError naming the first shard that an index (*.safetensors.index.json) lists but
    the directory lacks."""
    for index in sorted(directory.glob("*.safetensors.index.json")):
        try:
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
        except (OSError, ValueError, AttributeError) as e:
            raise StoreError(
                f"{index}: expected a safetensors index (JSON), cannot read it ({e})"
            ) from e
        by_file: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            by_file.setdefault(name, []).append(key)
        for name, keys in sorted(by_file.items()):
            if not (directory / name).is_file():
                raise StoreError(
                    f"{directory}: expected shard {name}, named in {index.name} for "
                    f"{len(keys)} tensors (e.g. {keys[0]}), found no such file; download or "
                    f"copy the missing shard"
                )


def _read_header(shard: Path) -> dict[str, TensorRef]:
    try:
        size = shard.stat().st_size
        with open(shard, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
            if hlen > size - 8:
                raise ValueError(f"header of {hlen} bytes in a file of {size}")
            header = json.loads(f.read(hlen))
    except PermissionError:
        raise  # (not a bad file: the CLI says whose access is missing)
    except (OSError, ValueError, struct.error) as e:
        raise StoreError(
            f"{shard}: expected a safetensors file, cannot read its header ({e}); the shard "
            f"is truncated or not safetensors"
        ) from e
    header.pop("__metadata__", None)
    refs = {}
    for key, v in header.items():
        a, b = v["data_offsets"]
        if 8 + hlen + b > size:
            raise StoreError(
                f"{shard} is truncated: tensor {key} ends at byte {8 + hlen + b}, the file "
                f"has {size}; download or save the checkpoint again"
            )
        refs[key] = TensorRef(shard, key, v["dtype"], tuple(v["shape"]), 8 + hlen + a, b - a)
    return refs


def _dtype(ref: TensorRef) -> torch.dtype:
    dtype = ST_DTYPES.get(ref.dtype)
    if dtype is None:
        raise UnsupportedModelError(
            f"{ref.shard.name}: tensor {ref.key} has dtype {ref.dtype}: expected one of "
            f"{', '.join(ST_DTYPES)}; quantized: expected {SERVED}"
        )
    return dtype
