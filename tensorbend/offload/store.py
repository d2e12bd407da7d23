"""On-disk expert store: one safetensors file, one contiguous tensor per (MoE layer, expert).

Usage:
    layout = ExpertLayout.of(experts_by_layer[0])     # the experts module of each MoE layer
    path = write_store(experts_by_layer, layout, Path("runs/store/experts.safetensors"), meta)
    store = ExpertStore.open(path, StoreConfig(io="fadvise"), link=Link(100e6, 20e-6))
    store.read_into(m, e, slot_flat)        # positional read into a preallocated buffer

Every routed expert of every MoE layer is packed into one flat tensor named
`layers.{m:03d}.experts.{e:04d}` (its parts, e.g. gate_up_proj then down_proj, back to back),
so loading an expert is one `os.preadv` straight into a cache slot. The file is a standard
safetensors file (`safe_open` reads it); its metadata carries `format_version`, the model
fingerprint and the part layout. Every expert starts on a 4096-byte boundary of the file (the
header is padded, and a `pad.{m:03d}.{e:04d}` tensor of zeros fills an expert out to
`stride(nbytes)` bytes), so an O_DIRECT read needs no bounce buffer for the expert's body.
A quantized store (`ExpertLayout.block`) keeps each expert as fp8 weights + block scales,
mxfp4 blocks + scales, or int4 nibbles + scales (U8; offload/int4.py). An int4 store in the
kernel's packing is read into int4 slots (the slot's start, then its scales spread); the others
are dequantized into dense slots.
Reads release the GIL, so I/O threads overlap compute.

A `cache.transfers.Link` caps the transfer: every read is booked on one `Wire` (the one the
simulator books in event time; here with the wall clock, serialised over all I/O threads) and
returns when the booking ends, so a CPU machine reproduces the transfer/compute ratio of a real
system. `io` chooses how to read past the page cache: `buffered` (plain reads),
`fadvise` (drop the pages after each read) or `direct` (O_DIRECT, offload/blocks.py: into a
4096-aligned buffer, as the cache's slots are, with no copy; `bounced_reads` counts the others).
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal, get_args

import torch

from tensorbend.atomic import atomic_write
from tensorbend.cache.transfers import Link, Wire
from tensorbend.errors import StoreError
from tensorbend.offload import int4
from tensorbend.offload.blocks import ALIGN, DirectReader, aligned_empty, stride
from tensorbend.offload.layout import ExpertLayout
from tensorbend.offload.precision import block_meta, block_of_meta, dequantize_expert

FORMAT_VERSION = "2"  # 2: experts on 4096-byte boundaries (1 had no padding)
IOMode = Literal["buffered", "fadvise", "direct"]
IO_MODES: tuple[str, ...] = get_args(IOMode)
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_FORMAT_KEYS = ("fp8_block", "mxfp4", "int4_group", "int4_packing", "int4_cpu_probe")
"""Metadata naming a quantized store's format (`precision.block_meta`'s keys)."""


@dataclass(frozen=True)
class StoreConfig:
    io: IOMode = "buffered"
    """How expert reads treat the page cache: buffered, fadvise (drop the pages after each
    read) or direct (O_DIRECT: straight into an aligned buffer)."""

    def __post_init__(self) -> None:
        if self.io not in IO_MODES:
            raise StoreError(f"store io {self.io!r}: expected one of {', '.join(IO_MODES)}")


def expert_offset(header_len: int, m: int, e: int, num_experts: int, nbytes: int) -> int:
    """Where expert e of MoE layer m starts in the store file (header_len: `store_header`'s)."""
    return header_len + (m * num_experts + e) * stride(nbytes)


def store_header(num_layers: int, num_experts: int, layout: ExpertLayout, meta: dict) -> bytes:
    """The store's safetensors header (length prefix included, padded to a multiple of 4096
    bytes) for experts in (m, e) order, each followed by its pad to `stride(nbytes)`."""
    header, at = {}, 0
    nbytes, pad = layout.stored_nbytes, stride(layout.stored_nbytes) - layout.stored_nbytes
    quant = layout.block is not None
    for m in range(num_layers):
        for e in range(num_experts):
            header[_name(m, e)] = {
                "dtype": "U8" if quant else _DTYPES[layout.dtype],
                "shape": [nbytes if quant else layout.numel],
                "data_offsets": [at, at + nbytes],
            }
            at += nbytes
            if pad:  # (safetensors allows no holes: the padding is a tensor of its own)
                header[f"pad.{m:03d}.{e:04d}"] = {
                    "dtype": "U8",
                    "shape": [pad],
                    "data_offsets": [at, at + pad],
                }
                at += pad
    header["__metadata__"] = {
        **meta,
        "format_version": FORMAT_VERSION,
        "num_layers": str(num_layers),
        "num_experts": str(num_experts),
        "layout": json.dumps(layout.parts),
        **block_meta(layout.block),
    }
    blob = json.dumps(header).encode()
    blob += b" " * (-(8 + len(blob)) % ALIGN)  # (spaces: safetensors' own header padding)
    return struct.pack("<Q", len(blob)) + blob


def write_store(
    experts_by_layer: list[torch.nn.Module], layout: ExpertLayout, path: Path, meta: dict[str, str]
) -> Path:
    """Stream every expert of modules in memory to `path` atomically (`atomic.py`: never
    half-written). A checkpoint on disk goes through `expert_plan.build_store` instead."""
    E = experts_by_layer[0].gate_up_proj.shape[0]
    header = store_header(len(experts_by_layer), E, layout, meta)
    pad = bytes(stride(layout.nbytes) - layout.nbytes)

    def write(f: BinaryIO) -> None:
        f.write(header)
        for mod in experts_by_layer:
            for e in range(E):
                flat = torch.cat([getattr(mod, n)[e].detach().reshape(-1) for n, _ in layout.parts])
                f.write(flat.contiguous().cpu().view(torch.uint8).numpy().tobytes())
                f.write(pad)

    return atomic_write(path, write)


class ExpertStore:
    """Read-only handle on a store file; `read_into` is thread-safe (positional reads)."""

    def __init__(
        self,
        path: Path,
        header: dict,
        data_start: int,
        cfg: StoreConfig,
        link: Link,
        slots: ExpertLayout | None = None,
    ):
        self.path, self.cfg, self.link, self.slots = Path(path), cfg, link, slots
        self.meta = header.pop("__metadata__", {})
        self._offsets = {
            k: tuple(v["data_offsets"]) for k, v in header.items() if not k.startswith("pad.")
        }
        self.num_layers = int(self.meta["num_layers"])
        self.num_experts = int(self.meta["num_experts"])
        block = block_of_meta(self.meta)
        self.layout = block and ExpertLayout(
            tuple((n, tuple(s)) for n, s in json.loads(self.meta["layout"])),
            torch.float32,  # (unused: read_into dequantizes into the buffer's dtype)
            block,
        )
        self._data_start = data_start
        flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if cfg.io == "direct" else 0)
        try:
            self._fd = os.open(self.path, flags)
        except OSError as e:
            raise StoreError(
                f"expert store {self.path}: cannot open ({e}); for io=direct the "
                f"filesystem must support O_DIRECT (try --io fadvise)"
            ) from e
        self._wire_lock = threading.Lock()
        self._wire = Wire(link)
        self._local = threading.local()
        self._direct = DirectReader(self._fd) if cfg.io == "direct" else None

    @classmethod
    def open(
        cls,
        path: Path,
        cfg: StoreConfig | None = None,
        link: Link | None = None,
        slots: ExpertLayout | None = None,
    ) -> ExpertStore:
        """slots: the layout of the cache slots `read_into` fills (needed for int4 slots)."""
        path = Path(path)
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                (hlen,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(hlen)) if hlen <= size - 8 else None
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise StoreError(
                f"expert store {path}: unreadable header ({e}); rebuild it (delete the "
                f"file and rerun)"
            ) from e
        found = header.get("__metadata__", {}).get("format_version") if header else None
        if found != FORMAT_VERSION:
            what = (
                f"a store of format_version {found} (an older tensorbend's)"
                if found
                else "another file"
            )
            raise StoreError(
                f"expert store {path}: expected a tensorbend store (format_version "
                f"{FORMAT_VERSION}), found {what}; delete it and rerun to rebuild it"
            )
        need = (
            8 + hlen + max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        )
        if size < need:
            raise StoreError(
                f"expert store {path} is truncated: expected {need} bytes, found {size}; "
                f"delete it and rerun to rebuild it from the model"
            )
        return cls(path, header, 8 + hlen, cfg or StoreConfig(), link or Link(), slots)

    @property
    def expert_nbytes(self) -> int:
        start, end = self._offsets[_name(0, 0)]
        return end - start

    def check(
        self, identity: dict[str, str], num_layers: int, num_experts: int, layout: ExpertLayout
    ) -> None:
        """The one check of a store's identity: StoreError (closing the store) unless it holds
        `num_layers` x `num_experts` experts of `layout` (parts and dtype) and carries every
        `identity` item (the model fingerprint, the checkpoint's identity) in its metadata."""

        def parts(p):
            return [[n, list(shape)] for n, shape in p]

        fmt = block_meta(layout.block)
        want = {
            **identity,
            "experts": f"{num_layers} x {num_experts}",
            "layout": parts(layout.parts),
            "expert bytes": f"{layout.stored_nbytes}",
            "format": fmt,
        }
        found = {k: self.meta.get(k) for k in identity}
        found |= {
            "experts": f"{self.num_layers} x {self.num_experts}",
            "layout": parts(json.loads(self.meta.get("layout", "[]"))),
            "expert bytes": f"{self.expert_nbytes}",
            "format": {k: v for k, v in self.meta.items() if k in _FORMAT_KEYS},
        }
        diff = [k for k in want if want[k] != found[k]]
        if diff:
            self.close()
            raise StoreError(
                f"expert store {self.path}: expected {_items(want, diff)} (this model, "
                f"{layout.dtype}), found {_items(found, diff)}: it was built for another model, "
                f"checkpoint or dtype; delete it or pass another --store-dir"
            )

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def read_into(self, m: int, e: int, out_flat: torch.Tensor, pause=None) -> int:
        """Read expert e of MoE layer m into the contiguous CPU tensor `out_flat`; returns bytes.
        With io=direct, into a 4096-aligned `out_flat` (`blocks.aligned_empty`) it is no copy.
        A quantized store's expert is read into a staging buffer and dequantized into
        `out_flat`. pause: called between `blocks.PAUSE_CHUNK`-byte parts of a direct read (a
        prefetch's: it returns once no demand read is in flight, so a prefetch never shares the
        disk with one for more than a part). Into an int4 slot (`slots.int4_slots`): the stored
        expert into the slot's start, then its scales spread (`int4.expand_scales`)."""
        if self.slots is not None and self.slots.int4_slots:
            got = self._read(m, e, out_flat[: self.expert_nbytes], pause)
            scratch = getattr(self._local, "scales", None)
            if scratch is None:
                scratch = self._local.scales = torch.empty(
                    self.expert_nbytes // 8, dtype=torch.uint8
                )
            int4.expand_scales(self.slots, out_flat, scratch)
            return got
        if self.layout and out_flat.dtype != torch.uint8:
            raw = getattr(self._local, "raw", None)
            if raw is None:  # (this I/O thread's torch ops on one core, the model's threads
                torch.set_num_threads(1)  # keep theirs: fp8 decode 106 -> 150 tok/s, 2 cores)
                raw = self._local.raw = aligned_empty(1, self.expert_nbytes, torch.uint8)[0]
            got = self._read(m, e, raw, pause)
            dequantize_expert(self.layout, raw, out_flat)
            return got
        return self._read(m, e, out_flat, pause)

    def read_parts_into(self, m: int, e: int, outs: list[torch.Tensor], pause=None) -> int:
        """Expert e of MoE layer m's stored bytes split over `outs` (contiguous tensors whose
        bytes add up to the expert's, in order: an engine's pools, one per part); each part
        after the first must start on a 4096-byte block of the file. Returns bytes read."""
        return self._read(m, e, outs, pause)

    def _read(self, m: int, e: int, out_flat, pause=None) -> int:
        """Expert e of MoE layer m's stored bytes into `out_flat` (see `read_into`), or into a
        list of tensors in turn (`read_parts_into`)."""
        start, end = self._offsets[_name(m, e)]
        nbytes = end - start
        outs = out_flat if isinstance(out_flat, list) else [out_flat]
        sizes = [o.numel() * o.element_size() for o in outs]
        assert all(o.is_contiguous() for o in outs) and sum(sizes) == nbytes
        done_at = self._reserve_wire(nbytes)
        offset = self._data_start + start
        try:
            if self._direct is not None:
                got, at = 0, offset
                for o, n in zip(outs, sizes, strict=True):
                    got += self._direct.read(o, at, n, pause)
                    at += n
            else:  # (the kernel copies, with the interpreter lock released)
                views = [memoryview(o.view(torch.uint8).numpy()) for o in outs]
                got = os.preadv(self._fd, views, offset)
                if self.cfg.io == "fadvise":
                    os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise StoreError(
                f"expert store {self.path}: read of layer {m} expert {e} failed ({e}); "
                f"check the disk, or delete the store and rerun"
            ) from e
        if got != nbytes:
            raise StoreError(
                f"expert store {self.path}: short read of layer {m} expert {e} "
                f"(expected {nbytes} bytes, got {got}): the file is truncated or "
                f"changed; delete it and rerun"
            )
        wait = done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)  # the emulated link is still busy with these bytes
        return nbytes

    @property
    def bounced_reads(self) -> int:
        """Direct reads that went through a bounce buffer and a copy (0 unless io=direct)."""
        return self._direct.bounced_reads if self._direct else 0

    def backlog_s(self) -> float:
        """Seconds until the emulated wire is free (0 when uncapped or idle)."""
        return self._wire.backlog(time.perf_counter())

    def _reserve_wire(self, nbytes: int) -> float:
        """Book the emulated wire for nbytes; returns when the transfer completes."""
        if not self.link.capped:
            return 0.0
        with self._wire_lock:
            return self._wire.book(time.perf_counter(), nbytes)


def _items(d: dict, keys: list[str]) -> str:
    return ", ".join(f"{k} {d[k]}" for k in keys)


def _name(m: int, e: int) -> str:
    return f"layers.{m:03d}.experts.{e:04d}"


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
