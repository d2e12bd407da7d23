"""tensorbend's expert store in vLLM's CPU packing: packed once, so a miss is one read.

Usage (engines/vllm_offload.py):
    path = ensure_packed(plain, pack, layout, packed, ident, tag)    # built once, locked
    store.read_parts_into(m, e, [w13_C[slot].view(-1), w2_C[slot].view(-1)])

vLLM's CPU experts compute from weights padded and prepacked for the kernel
(`cpu_prepack_moe_weight`). Packing rewrites every byte of an expert on the CPU, the core
decode needs, so the experts are packed once: a second store beside the
plain one (`experts-<dtype>-vllm-<isa>-tp<rank>of<size>.safetensors`), each expert's packed
w13 then w2, read by a miss straight into its slot of the two pools (`ExpertStore.
read_parts_into`: two block-aligned reads with O_DIRECT, one preadv otherwise).

Its identity: the model fingerprint, the plain store's size and mtime (rebuilt from a rebuilt
store), the kernel's isa and a probe (a fixed tensor's packing, hashed: a CPU or vLLM that packs
differently rebuilds it), the tensor-parallel shard. One process builds it at a time
(`serving.stores.store_lock`); the others wait and reuse it.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from tensorbend.atomic import atomic_write
from tensorbend.errors import StoreError
from tensorbend.offload.blocks import stride
from tensorbend.offload.layout import ExpertLayout
from tensorbend.offload.store import ExpertStore, StoreConfig, store_header


def packed_path(plain: Path, tag: str) -> Path:
    """The packed store's file beside `plain` (experts-float32.safetensors ->
    experts-float32-<tag>.safetensors)."""
    return plain.with_name(f"{plain.name.removesuffix('.safetensors')}-{tag}.safetensors")


def probe(pack: Callable[[torch.Tensor], tuple], layout: ExpertLayout) -> str:
    """A hash of how `pack` lays out a fixed expert of `layout` (its elements i % 251 / 251)."""
    raw = (torch.arange(layout.numel) % 251 / 251).to(layout.dtype)
    h = hashlib.blake2b(digest_size=8)
    for t in pack(raw):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def ensure_packed(
    plain: Path,
    layout: ExpertLayout,
    packed: ExpertLayout,
    pack: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    identity: dict[str, str],
    tag: str,
    shape: tuple[int, int],
) -> Path:
    """The packed store of `plain` (`layout`: its experts; `packed`: the packed parts; `pack`:
    a flat plain expert -> (w13, w2)), reused when its identity matches, else (re)built."""
    from tensorbend.serving.stores import store_lock

    path = packed_path(plain, tag)
    st = plain.stat()
    ident = {**identity, "source": f"{st.st_size}:{st.st_mtime_ns}"}
    with store_lock(path, progress=False):
        if path.exists():
            try:
                ExpertStore.open(path).check(ident, *shape, packed)
                return path
            except StoreError:
                pass  # (another source, kernel or shard: packed again)
        _build(plain, path, layout, packed, pack, ident, shape)
    return path


def _build(plain, path, layout, packed, pack, ident, shape) -> None:
    L, E = shape
    print(
        f"tensorbend: packing {L * E} experts for vLLM's kernel into {path} (once)", file=sys.stderr
    )
    src = ExpertStore.open(plain, StoreConfig("buffered"))
    raw = torch.empty(layout.numel, dtype=layout.dtype)
    header = store_header(L, E, packed, ident)
    pad = bytes(stride(packed.nbytes) - packed.nbytes)

    def write(f) -> None:
        f.write(header)
        for m in range(L):
            for e in range(E):
                src.read_into(m, e, raw)
                for t in pack(raw):
                    f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
                f.write(pad)

    try:
        atomic_write(path, write)
    finally:
        src.close()
