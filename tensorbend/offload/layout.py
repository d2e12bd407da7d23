"""One routed expert packed flat: its parts and shapes, the dtype it is computed in, how the
store keeps it (`block`: fp8, mxfp4, int4) and what its cache slot holds.

Usage:
    layout = ExpertLayout.of(experts_module)           # the experts module of a MoE layer
    layout.nbytes, layout.stored_nbytes                # one slot's bytes; what a load reads
    W = layout.views(slot_flat)                        # {part: view} (int4 slots: (packed, sz))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorbend.errors import StoreError
from tensorbend.offload import int4
from tensorbend.offload.precision import stored_nbytes


@dataclass(frozen=True)
class ExpertLayout:
    """Parts of one packed expert: (attribute name on the experts module, per-expert shape),
    the dtype its experts are computed in; `block`: stored as fp8 (e4m3) + a float32 scale per
    block, "mxfp4" (offload/mxfp4.py) or `int4.Int4`, dequantized to `dtype` on the way into
    the slot, except an int4 store in the kernel's packing, whose slots hold int4
    (`int4_slots`: the nibbles + scales-and-zeros in `dtype`)."""

    parts: tuple[tuple[str, tuple[int, ...]], ...]
    dtype: torch.dtype
    block: tuple[int, int] | str | int4.Int4 | None = None

    @classmethod
    def of(cls, experts_module: torch.nn.Module) -> ExpertLayout:
        names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        parts = []
        for n in names:
            p = getattr(experts_module, n, None)
            if isinstance(p, torch.Tensor):
                parts.append((n, tuple(p.shape[1:])))
        if not any(n == "gate_up_proj" for n, _ in parts) or not any(
            n == "down_proj" for n, _ in parts
        ):
            raise StoreError(
                f"experts module {type(experts_module).__name__}: expected fused `gate_up_proj` and "
                f"`down_proj` parameters [E, ...], found {[n for n, _ in parts]}"
            )
        return cls(tuple(parts), experts_module.gate_up_proj.dtype)

    @property
    def numel(self) -> int:
        return sum(_prod(s) for _, s in self.parts)

    @property
    def int4_slots(self) -> bool:
        """Slots hold the int4 expert (torch's int4 kernel computes from it)."""
        return isinstance(self.block, int4.Int4) and self.block.int4_slots

    @property
    def nbytes(self) -> int:
        """Bytes of one expert in its slot."""
        if self.int4_slots:
            return self.block.slot_nbytes(self.parts, self.dtype)
        return self.numel * self.dtype.itemsize

    @property
    def slot_shape(self) -> tuple[int, torch.dtype]:
        """(elements, dtype) of one slot's buffer: a dense slot's weights, an int4 slot's bytes."""
        return (self.nbytes, torch.uint8) if self.int4_slots else (self.numel, self.dtype)

    @property
    def stored_nbytes(self) -> int:
        """Bytes of one expert in the store (what a load reads)."""
        return stored_nbytes(self.parts, self.block, self.dtype)

    def views(self, flat: torch.Tensor) -> dict:
        """Split a flat expert buffer into its parts (views, no copy); an int4 slot's into
        (packed nibbles, scales-and-zeros) per part (`int4.slot_views`)."""
        if self.int4_slots:
            return int4.slot_views(self, flat)
        out, at = {}, 0
        for name, shape in self.parts:
            n = _prod(shape)
            out[name] = flat[at : at + n].view(shape)
            at += n
        return out


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
