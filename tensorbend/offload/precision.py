"""The precision a checkpoint is served in: `--dtype` / `dtype=` read, and "auto" resolved to
the checkpoint's own.

Usage:
    >>> dtype_name("bf16"), dtype_name(torch.float16), dtype_name("auto")
    ('bfloat16', 'float16', 'auto')
    >>> resolve_dtype("auto", Path("my-moe"), ckpt)         # doctest: +SKIP
    torch.bfloat16

"auto" (the default) keeps the checkpoint's precision: its config.json's `dtype` (or the older
`torch_dtype`), else the floating dtype most of its bytes are stored in. The store then keeps
the experts in that dtype, so a bf16 checkpoint's store is bf16: half the bytes of a float32
one, and a budget holds twice the cached experts.

The experts are computed in the dtype they are stored in (the cache's slots hold it): on this
project's CPU (AVX-512 BF16) one expert's forward at Qwen3-30B-A3B's size (D=2048, I=768) is
1.3x faster in bf16 than upcast to float32 for one token and 2x for eight
(docs/results/bench/expert_dtype.json, `python -m bench.expert_dtype`), upcasting would halve the
slots a budget holds, and only bf16 compute equals transformers' own bf16 model.

FP8 block checkpoints (DeepSeek-V3's format: float8_e4m3fn weights, a float32
`weight_scale_inv` per `weight_block_size` block, `quantization_config.quant_method` "fp8")
keep their experts in the store as fp8 + scales (1 byte a weight, `fp8_nbytes`), dequantized
into the compute dtype on the way into the slot (`dequantize_expert`: what transformers'
`Fp8Dequantize` computes); their other fp8 weights are dequantized at load. MXFP4 checkpoints
(gpt-oss: `quant_method` "mxfp4") keep their experts as fp4 blocks + e8m0 scales (offload/mxfp4.py),
likewise dequantized into the slot. compressed-tensors INT4 checkpoints (Kimi-K2-Thinking / K2.5's
pack-quantized W4A16) keep their experts 4-bit (offload/int4.py): dequantized into the slot, or
held 4-bit in int4 slots that torch's int4 kernel computes from. Any other quantization is
refused by name (`quant_block`).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import torch

from tensorbend.errors import TensorbendError, UnsupportedModelError
from tensorbend.offload import int4, mxfp4
from tensorbend.offload.int4 import Int4, int4_format

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ALIASES = {
    "fp32": "float32",
    "f32": "float32",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
}
SERVED = "an unquantized, fp8 (block), mxfp4 or compressed-tensors int4 (W4A16) checkpoint"
_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every value
ACCEPTED = "auto, float32 (fp32), float16 (fp16) or bfloat16 (bf16), as a name or a torch dtype"


def dtype_name(value) -> str:
    """The canonical name of a --dtype / dtype= value: auto, float32, float16 or bfloat16."""
    if isinstance(value, torch.dtype):
        found = next((n for n, d in DTYPES.items() if d == value), None)
    elif isinstance(value, str):
        v = value.strip().lower().removeprefix("torch.")
        found = v if v in DTYPES or v == "auto" else ALIASES.get(v)
    else:
        found = None
    if found is None:
        raise TensorbendError(f"--dtype {value!r}: expected {ACCEPTED}")
    return found


def resolve_dtype(name: str, path: Path, ckpt) -> torch.dtype:
    """The torch dtype for `name` (dtype_name's); "auto": the checkpoint's own (see top)."""
    if name != "auto":
        return DTYPES[name]
    config = json.loads((Path(path) / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        found = config.get(key)
        if isinstance(found, str) and found.removeprefix("torch.") in DTYPES:
            return DTYPES[found.removeprefix("torch.")]
    floats = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
    counts = Counter()
    for r in ckpt.refs.values():
        if r.dtype in floats:
            counts[floats[r.dtype]] += r.nbytes
    return DTYPES[counts.most_common(1)[0][0]] if counts else torch.float32


def quant_block(path: Path) -> tuple[int, int] | str | Int4 | None:
    """The FP8 weight block of a checkpoint's `quantization_config` (DeepSeek-V3's: fp8, e4m3,
    dynamic activations, `weight_block_size` [128, 128]), `mxfp4.MXFP4` for gpt-oss's mxfp4,
    `int4.Int4` for compressed-tensors' pack-quantized int4; None when it has none. Any other
    quantization is refused by name (its experts' bytes are not what the store can serve)."""
    config = json.loads((Path(path) / "config.json").read_text())
    q = config.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "unknown"))
    block = q.get("weight_block_size")
    fmt, act = q.get("fmt", "e4m3"), q.get("activation_scheme", "dynamic")
    if method == mxfp4.MXFP4:
        return mxfp4.MXFP4
    if method == "compressed-tensors":
        return int4_format(q)
    if method == "fp8" and block and len(block) == 2 and fmt == "e4m3" and act == "dynamic":
        return int(block[0]), int(block[1])
    if method == "fp8":
        method = f"fp8 ({fmt}, {act} activations, weight_block_size {block})"
    elif "bits" in q:
        method += f" int{q['bits']}"
    raise UnsupportedModelError(f"{method} is not supported yet; expected {SERVED}")


def dequantize_into(q: torch.Tensor, scales: torch.Tensor, block, out: torch.Tensor) -> None:
    """out [R, C] = q (float8_e4m3fn [R, C]) x its block's scale (float32 [ceil(R / b0),
        ceil(C / b1)]), multiplied in float32 and rounded once to out's dtype: what transformers'
        `Fp8Dequantize` computes. In chunks of block rows (~1M floats of scratch); fp8 to float32
        through a table of the 256 values, into this thread's reused scratch (fresh buffers cost
    their page faults): 5x faster than torch's own conversion on CPU."""
    R, C = q.shape
    b0, b1 = block
    step = max(1, (1 << 20) // (b0 * C))  # block rows per chunk
    for i in range(0, -(-R // b0), step):
        rows = slice(i * b0, min(R, (i + step) * b0))
        n, s = rows.stop - rows.start, scales[i : i + step]
        idx, x = _scratch(n * C)
        idx.copy_(q[rows].reshape(-1).view(torch.uint8))
        x = torch.index_select(_E4M3, 0, idx, out=x).view(n, C)
        if n % b0 == 0 and C % b1 == 0:
            x.view(n // b0, b0, C // b1, b1).mul_(s[:, None, :, None])
        else:  # (a partial last block: the scales spelled out)
            x.mul_(s.repeat_interleave(b1, 1)[:, :C].repeat_interleave(b0, 0)[:n])
        out[rows].copy_(x)


def block_grid(shape, block) -> tuple[int, int]:
    """The scale grid of a [R, C] weight in blocks of `block`: [ceil(R / b0), ceil(C / b1)]."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def stored_nbytes(parts, block, dtype: torch.dtype) -> int:
    """Bytes of one stored expert: fp8 (`block` a pair): per part its weights (1 byte each),
    then its scales; mxfp4: `mxfp4.mxfp4_nbytes`; int4: `Int4.stored_nbytes`; unquantized:
    its values in `dtype`."""
    if isinstance(block, Int4):
        return block.stored_nbytes(parts)
    if block == mxfp4.MXFP4:
        return mxfp4.mxfp4_nbytes(parts, dtype)
    if block is None:
        return sum(_numel(s) for _, s in parts) * dtype.itemsize
    return sum(_numel(s) + 4 * _numel(block_grid(s, block)) for _, s in parts)


def block_meta(block) -> dict[str, str]:
    """The store metadata naming a quantized store's format (`block_of_meta` reads it)."""
    if block is None:
        return {}
    if isinstance(block, Int4):
        return block.meta()
    return {"mxfp4": "32"} if block == mxfp4.MXFP4 else {"fp8_block": json.dumps(block)}


def block_of_meta(meta: dict):
    """The layout's `block` of a store from its metadata (`block_meta`'s): None unquantized."""
    if "mxfp4" in meta:
        return mxfp4.MXFP4
    if "int4_group" in meta:
        return Int4.of_meta(meta)
    block = json.loads(meta.get("fp8_block", "null"))
    return tuple(block) if block else None


def dequantize_expert(layout, raw: torch.Tensor, out_flat: torch.Tensor) -> None:
    """A stored fp8 expert (`raw`, uint8: per part of `layout`, its fp8 weights, then their
    float32 block scales) dequantized into the slot `out_flat` (its dtype); an mxfp4 one by
    `mxfp4.dequantize_expert`, an int4 one by `int4.dequantize_expert`."""
    if isinstance(layout.block, Int4):
        return int4.dequantize_expert(layout, raw, out_flat)
    if layout.block == mxfp4.MXFP4:
        return mxfp4.dequantize_expert(layout, raw, out_flat)
    at, out = 0, layout.views(out_flat)
    for name, shape in layout.parts:
        n, grid = _numel(shape), block_grid(shape, layout.block)
        q = raw[at : at + n].view(torch.float8_e4m3fn).view(shape)
        scales = raw[at + n : at + n + 4 * _numel(grid)].view(torch.float32).view(grid)
        dequantize_into(q, scales, layout.block, out[name])
        at += n + 4 * _numel(grid)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


_local = threading.local()


def _scratch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's (int32 table indices, float32 values) of n elements, grown as needed."""
    have = getattr(_local, "scratch", None)
    if have is None or have[0].numel() < n:
        have = _local.scratch = (torch.empty(n, dtype=torch.int32), torch.empty(n))
    return have[0][:n], have[1][:n]
