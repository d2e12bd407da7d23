"""gpt-oss's MXFP4 experts: kept in the store as their checkpoint bytes (blocks + scales, about
0.53 byte a weight), dequantized into the cache slot's dtype on the way in.

Usage:
    ExpertLayout(parts, torch.bfloat16, MXFP4).stored_nbytes   # = mxfp4_nbytes(parts, dtype)
    read_expert(plan, m, e, raw)              # store build: one expert's checkpoint bytes
    dequantize_expert(layout, raw, slot)      # a load: those bytes into the bf16 slot
    dequantize(blocks, scales, out)           # one projection: [B, A/32, 16] + [B, A/32] -> [A, B]

The on-disk format (what transformers' `Mxfp4Dequantize` reads): a fused expert weight the model
holds as `{proj}` [E, A, B] (gate_up_proj [E, D, 2I], down_proj [E, I, D]) is stored as U8
`{proj}_blocks` [E, B, A / 32, 16] and `{proj}_scales` [E, B, A / 32], quantization_config
{"quant_method": "mxfp4"}. Row b of expert e holds column b of the weight in blocks of 32
values: each byte two fp4 e2m1 values (the even one in the low nibble; sign bit 8, magnitudes
`FP4_E2M1`), each block one e8m0 scale s meaning 2 ** (s - 127). A value is its magnitude times
its scale, computed in float32 and rounded once to the slot's dtype: bit for bit what
transformers' `convert_moe_packed_tensors` computes (its LUT in the dtype, then `ldexp`, which
multiplies in float32). The biases are stored as the slot's dtype, like an unquantized part.
A stored expert: per part of the layout, its blocks then its scales (a bias: its values).
"""

from __future__ import annotations

import torch

from tensorbend.errors import UnsupportedModelError

MXFP4 = "mxfp4"  # ExpertLayout.block / Checkpoint.block of an MXFP4 checkpoint
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4 = torch.tensor([*FP4_E2M1, *(-v for v in FP4_E2M1)])  # by nibble, float32
_POW2 = torch.pow(2.0, torch.arange(256) - 127)  # by e8m0 byte, float32 (255: inf, as ldexp's)


def mxfp4_nbytes(parts, dtype: torch.dtype) -> int:
    """Bytes of one stored expert: per weight half a byte and a scale byte per 32; a bias
    (1-D part) its values in `dtype`."""
    return sum(
        _numel(s) * dtype.itemsize if len(s) == 1 else _numel(s) * 17 // 32 for _, s in parts
    )


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """out [A, B] (any dtype, any strides) = the weight of `blocks` (uint8 [B, A / 32, 16]) and
    `scales` (uint8 [B, A / 32]), in chunks of rows of ~1M values."""
    B, G, _ = blocks.shape
    step = max(1, (1 << 20) // (G * 32))
    for r in range(0, B, step):
        b, s = blocks[r : r + step], scales[r : r + step]
        idx = torch.stack((b & 15, b >> 4), dim=-1).view(-1).int()  # (even value: low nibble)
        x = torch.index_select(_FP4, 0, idx).view(len(b), G, 32)
        x.mul_(torch.index_select(_POW2, 0, s.reshape(-1).int()).view(len(b), G, 1))
        out[:, r : r + step].copy_(x.view(len(b), G * 32).t())


def dequantize_expert(layout, raw: torch.Tensor, out_flat: torch.Tensor) -> None:
    """A stored expert (`raw`, uint8: see top) dequantized into the slot `out_flat`."""
    at, out = 0, layout.views(out_flat)
    for name, shape in layout.parts:
        if len(shape) == 1:  # a bias, stored in the slot's dtype
            n = _numel(shape) * out_flat.element_size()
            out[name].copy_(raw[at : at + n].view(out_flat.dtype))
            at += n
            continue
        (A, B), G = shape, shape[0] // 32
        blocks = raw[at : at + A * B // 2].view(B, G, 16)
        at += A * B // 2
        dequantize(blocks, raw[at : at + B * G].view(B, G), out[name])
        at += B * G
    assert at == raw.numel(), (at, raw.numel())


def read_expert(plan, m: int, e: int, out: torch.Tensor, staging=None) -> None:
    """Expert e of MoE layer m of an MXFP4 checkpoint as the store keeps it (`out`: uint8 of
    `stored_nbytes`; see top), read straight from its shards' rows."""
    at, layout, ckpt = 0, plan.layout, plan.ckpt
    for name, shape in layout.parts:
        ref = plan.parts[m][name].fused
        scales = ckpt.scales.get(ref.key.removesuffix("_blocks")) if ref is not None else None
        if len(shape) == 1 and ref is not None and tuple(ref.shape[1:]) == shape:
            n = _numel(shape) * layout.dtype.itemsize
            ckpt.read_into(ref, out[at : at + n].view(layout.dtype), e, staging)
            at += n
            continue
        want = (shape[1], shape[0] // 32, 16) if len(shape) == 2 else None
        if (
            want is None
            or scales is None
            or shape[0] % 32
            or (ref.dtype, scales.dtype) != ("U8", "U8")
            or tuple(ref.shape[1:]) != want
            or tuple(scales.shape[1:]) != want[:2]
        ):
            found = f"{ref.key} ({ref.dtype}, {list(ref.shape)})" if ref else "no fused tensor"
            raise UnsupportedModelError(
                f"{ckpt.directory}: MoE layer {m} part {name}: expected mxfp4 U8 "
                f"{name}_blocks [E, {', '.join(map(str, want or ['?']))}] and {name}_scales "
                f"(gpt-oss's format), found {found}"
            )
        n = _numel(want)
        ckpt.read_into(ref, out[at : at + n], e)
        ckpt.read_into(scales, out[at + n : at + n + n // 16], e)
        at += n + n // 16
    assert at == out.numel() == layout.stored_nbytes, (at, out.numel())


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
