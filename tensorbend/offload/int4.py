"""INT4 experts: compressed-tensors' pack-quantized format (W4A16, symmetric, one bf16 scale per
group of inputs: how Kimi-K2-Thinking and Kimi-K2.5 ship their routed experts, and what
`--store-dtype int4` writes for a float checkpoint), kept 4-bit in the store and in the cache.

Usage:
    fmt = int4_format(config["quantization_config"])   # Int4(group=32), or a one-line refusal
    fmt.stored_nbytes(parts)                             # per part [N, K]: N*K/2 + 2*N*K/G bytes
    read_expert(plan, m, e, raw)         # store build: one expert as the checkpoint packs it
    quantize_expert(fmt, parts_NK, raw)  # store build from a float checkpoint (round to nearest)
    to_kernel_packing(layout, ct, raw)   # store build: those bytes in the kernel's layout
    dequantize_expert(layout, raw, slot) # a load into a dense (e.g. bf16) slot
    expand_scales(layout, slot)          # a load into an int4 slot: after the raw read
    int4_linear(x_TK, weight, group)     # y [T, N]: torch's int4 weight-only kernel

Shape legend: N output rows, K input columns (a weight [N, K] as F.linear takes it), G inputs
per scale, T tokens.

Two packings of the same nibbles (`Int4.packing`):
- "ct", the checkpoint's: per part `weight_packed` int32 [N, K/8] (8 nibbles a word, the
  lowest nibble the lowest column, nibble = q + 8), then `weight_scale` bf16 [N, K/G]; a fused
  part (gate_up_proj) holds its pieces' rows in the converter's order (gate, then up). A weight
  is q * scale as compressed-tensors' `dequantize` computes it (q in the scale's dtype times the
  scale, then the slot's dtype): what transformers' dequantized model holds. Loads dequantize
  it into dense slots.
- "cpu", torch's CPU int4 kernel's (`aten._convert_weight_to_int4pack_for_cpu`, the kernel
  gpt-fast and torchao use): every part's nibbles as that op lays them out ([N, K/2] bytes),
  then every part's scales transposed to [K/G, N] bf16. An int4 slot holds the packed nibbles
  and scales-and-zeros [K/G, N, 2] in the compute dtype (zero = 0: the kernel computes
  (nibble - 8) * scale + zero, the checkpoint's q * scale); a load reads the stored expert
  straight into the slot's start and spreads its scales (`expand_scales`). The nibbles are
  repacked once, when the store is built, because repacking on every load measured 2-3 ns a
  weight on one core against ~0.35 ns to read it from this disk (bench/int4_kernel.py). That
  layout depends on the CPU's vector width, so the store records a probe of it (`cpu_probe`)
  and is rebuilt when the probe changes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache

import torch

from tensorbend.errors import UnsupportedModelError

KERNEL_GROUPS = (32, 64, 128, 256)  # what aten._weight_int4pack_mm_for_cpu accepts
PACKINGS = ("ct", "cpu")
CHUNK = 1 << 20
"""Weights dequantized at a time on a load into a dense slot (its temporaries: ~8 bytes each)."""
SERVED = "compressed-tensors pack-quantized int4 (W4A16: symmetric, group-wise, no act-order)"


@dataclass(frozen=True)
class Int4:
    """An int4 expert store: symmetric, one bf16 scale per `group` inputs of a row, the nibbles
    in `packing` ("ct": the checkpoint's, dense slots; "cpu": the kernel's, int4 slots)."""

    group: int = 32
    packing: str = "ct"

    def __post_init__(self) -> None:
        assert self.group in KERNEL_GROUPS and self.packing in PACKINGS, self

    @property
    def int4_slots(self) -> bool:
        return self.packing == "cpu"

    def check_parts(self, parts) -> None:
        """UnsupportedModelError unless every part is a 2-D weight whose inputs split into
        groups (and, for the kernel, whose rows come in 16s)."""
        for name, shape in parts:
            rows = 16 if self.int4_slots else 1
            if len(shape) != 2 or shape[1] % self.group or shape[0] % rows:
                raise UnsupportedModelError(
                    f"int4 experts: part {name} of shape {list(shape)}: expected a 2-D weight "
                    f"[N, K] with K a multiple of the group size {self.group}"
                    + (" and N a multiple of 16 (the int4 kernel's)" if rows > 1 else "")
                    + "; serve it with --slots dense or without --store-dtype int4"
                )

    def stored_nbytes(self, parts) -> int:
        """Bytes of one stored expert: half a byte a weight and a bf16 scale per group."""
        return sum(_packed(s) + 2 * _groups(s, self.group) for _, s in parts)

    def slot_nbytes(self, parts, dtype: torch.dtype) -> int:
        """Bytes of one int4 slot: the packed nibbles and scales-and-zeros in `dtype`."""
        return sum(_packed(s) + 2 * dtype.itemsize * _groups(s, self.group) for _, s in parts)

    def describe(self) -> str:
        return f"int4 (compressed-tensors pack-quantized, a bf16 scale per {self.group})"

    def meta(self) -> dict[str, str]:
        """The store metadata naming this format (`of_meta` reads it back)."""
        out = {"int4_group": str(self.group), "int4_packing": self.packing}
        if self.int4_slots:
            out["int4_cpu_probe"] = cpu_probe()
        return out

    @classmethod
    def of_meta(cls, meta: dict) -> Int4 | None:
        if "int4_group" not in meta:
            return None
        return cls(int(meta["int4_group"]), meta.get("int4_packing", "ct"))


def int4_format(q: dict) -> Int4:
    """The Int4 of a config.json `quantization_config` whose quant_method is compressed-tensors,
    validated by the compressed-tensors library; one-line UnsupportedModelError for what the
    store cannot keep as int4 (other formats, bit widths, asymmetric, act-order, activations)."""
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        raise UnsupportedModelError(
            "a compressed-tensors checkpoint needs the compressed-tensors library to read its "
            "format: pip install compressed-tensors"
        ) from None
    try:
        qc = QuantizationConfig.model_validate(q)
    except ValueError as e:  # (pydantic's ValidationError: name the first field it names)
        errors = e.errors() if hasattr(e, "errors") else []
        first = str(e).strip().splitlines()[0]
        if errors:
            where = ".".join(str(p) for p in errors[0]["loc"] if "[" not in str(p))
            first = f"{where or 'config'}: {errors[0]['msg']}"
        raise UnsupportedModelError(
            f"compressed-tensors quantization_config: not valid ({first}); expected {SERVED}"
        ) from None
    fmt = str(getattr(qc.format, "value", qc.format))
    groups = set()
    for name, scheme in (qc.config_groups or {}).items():
        w, a = scheme.weights, scheme.input_activations
        found = _scheme_text(scheme)
        if (
            str(getattr(scheme.format, "value", scheme.format or fmt)) != "pack-quantized"
            or w is None
            or a is not None
            or (w.num_bits, str(w.type), str(w.strategy)) != (4, "int", "group")
            or not w.symmetric
            or w.dynamic
            or w.actorder is not None
            or w.group_size not in KERNEL_GROUPS
        ):
            raise UnsupportedModelError(
                f"compressed-tensors config group {name}: {found} is not supported yet; "
                f"expected {SERVED}, group size 32, 64, 128 or 256"
            )
        groups.add(w.group_size)
    if fmt != "pack-quantized" and not groups:
        raise UnsupportedModelError(
            f"compressed-tensors format {fmt} is not supported yet; expected {SERVED}"
        )
    if len(groups) != 1:
        raise UnsupportedModelError(
            f"compressed-tensors config groups with group sizes {sorted(groups)}: expected "
            f"one group size for every quantized weight ({SERVED})"
        )
    return Int4(groups.pop())


def read_expert(plan, m: int, e: int, out: torch.Tensor) -> None:
    """Expert e of MoE layer m of a compressed-tensors int4 checkpoint as the "ct" packing keeps
    it (`out`: uint8 of `stored_nbytes`; see top), read straight from its shards' rows."""
    at, fmt, ckpt = 0, plan.layout.block, plan.ckpt
    for name, shape in plan.layout.parts:
        refs = plan.refs(m, e, name, shape)
        for ref, row in refs:
            scale = ckpt.scales.get(ref.key.removesuffix("_packed"))
            rows = ref.shape[1:] if row is not None else ref.shape
            cols = rows[-1] * 8 if len(rows) == 2 else 0
            if (
                ref.dtype != "I32"
                or scale is None
                or scale.dtype != "BF16"
                or (scale.shape[1:] if row is not None else scale.shape)
                != (rows[0], cols // fmt.group)
            ):
                raise UnsupportedModelError(
                    f"{ckpt.directory}: {ref.key} ({ref.dtype}, shape {list(rows)}): expected "
                    f"compressed-tensors int4 expert weights: weight_packed I32 [N, K/8] and "
                    f"weight_scale BF16 [N, K/{fmt.group}]"
                )
            n = rows[0] * cols // 2
            ckpt.read_into(ref, out[at : at + n].view(torch.int32), row)
            at += n
        for ref, row in refs:
            scale = ckpt.scales[ref.key.removesuffix("_packed")]
            n = scale.nbytes // scale.shape[0] if row is not None else scale.nbytes
            ckpt.read_into(scale, out[at : at + n].view(torch.bfloat16), row)
            at += n
    assert at == out.numel() == fmt.stored_nbytes(plan.layout.parts), (at, out.numel())


def quantize_expert(fmt: Int4, parts_NK: list[torch.Tensor], out: torch.Tensor) -> None:
    """Float weights ([N, K] per part, in layout order) quantized round-to-nearest into the "ct"
    packing (`out`: uint8): compressed-tensors' own scale (absmax / 7.5, rounded to bf16) and its
    `PackedQuantizationCompressor`, so the bytes are what that library writes."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    scheme, at = _scheme(fmt.group), 0
    for w in parts_NK:
        scale, zero = compute_dynamic_scales_and_zp(w, scheme.weights, None)
        scale = scale.to(torch.bfloat16)
        sd = PackedQuantizationCompressor.compress(
            {"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme
        )
        for t in (sd["weight_packed"], scale):  # (per part: its packed words, then its scales)
            b = t.contiguous().view(-1).view(torch.uint8)
            out[at : at + b.numel()].copy_(b)
            at += b.numel()
    assert at == out.numel(), (at, out.numel())


def to_kernel_packing(parts, ct: torch.Tensor, group: int, out: torch.Tensor) -> None:
    """A "ct" expert (`ct`, uint8) in the "cpu" packing (`out`, uint8 of the same size): every
    part's nibbles repacked by `aten._convert_weight_to_int4pack_for_cpu`, then every part's
    scales transposed to [K/G, N]."""
    at, src, scales = 0, 0, []
    for _, (N, K) in parts:
        q_NK = _nibbles(ct[src : src + N * K // 2], N, K)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q_NK, 1)
        assert packed.dtype == torch.uint8 and packed.numel() == N * K // 2, packed.shape
        out[at : at + N * K // 2].copy_(packed.reshape(-1))
        at, src = at + N * K // 2, src + N * K // 2
        n = 2 * N * (K // group)
        scales.append(ct[src : src + n].view(torch.bfloat16).view(N, K // group))
        src += n
    for s in scales:
        n = 2 * s.numel()
        out[at : at + n].view(torch.bfloat16).view(s.shape[1], s.shape[0]).copy_(s.t())
        at += n
    assert at == src == out.numel(), (at, src, out.numel())


def dequantize_expert(layout, raw: torch.Tensor, out_flat: torch.Tensor) -> None:
    """A "ct" expert (`raw`, uint8) dequantized into the dense slot `out_flat` (its dtype) by
    compressed-tensors' own `unpack_from_int32` and `dequantize` (see top)."""
    assert layout.block.packing == "ct", "the kernel's packing is read into int4 slots"
    at, G, out = 0, layout.block.group, layout.views(out_flat)
    for name, (N, K) in layout.parts:
        packed = raw[at : at + N * K // 2].view(torch.int32).view(N, K // 8)
        at += N * K // 2
        scale = raw[at : at + 2 * N * (K // G)].view(torch.bfloat16).view(N, K // G)
        at += 2 * scale.numel()
        step = max(1, CHUNK // K)  # (rows at a time: the library's temporaries stay ~10 MB)
        for r in range(0, N, step):
            out[name][r : r + step].copy_(
                dequantize_weight(packed[r : r + step], scale[r : r + step], G)
            )
    assert at == raw.numel(), (at, raw.numel())


def dequantize_weight(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """One "ct" weight (int32 [N, K/8], bf16 scales [N, K/G]) dequantized by compressed-tensors
    (in the scale's dtype), as transformers' dequantized model holds it."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    N, K = packed.shape[0], scale.shape[1] * group
    q = unpack_from_int32(packed, 4, torch.Size((N, K)))
    return dequantize(q, scale, args=_scheme(group).weights)


def slot_views(layout, flat: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """An int4 slot (uint8 `flat`) as {part: (packed uint8 [N, K/2], scales-and-zeros
    [K/G, N, 2] in layout.dtype)}: every part's nibbles, then every part's scales-and-zeros."""
    out, at, G = {}, 0, layout.block.group
    for name, (N, K) in layout.parts:
        out[name] = (flat[at : at + N * K // 2].view(N, K // 2),)
        at += N * K // 2
    for name, (N, K) in layout.parts:
        n = 2 * N * (K // G) * layout.dtype.itemsize
        out[name] += (flat[at : at + n].view(layout.dtype).view(K // G, N, 2),)
        at += n
    return out


def expand_scales(layout, flat: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
    """After a "cpu" expert was read into the start of the int4 slot `flat`: its bf16 scales
    (where the slot's scales-and-zeros begin) spread into scales-and-zeros (zero = 0)."""
    nibbles = sum(N * K // 2 for _, (N, K) in layout.parts)
    n = 2 * sum(N * (K // layout.block.group) for _, (N, K) in layout.parts)
    if scratch is None or scratch.numel() < n:
        scratch = torch.empty(n, dtype=torch.uint8)
    stored = scratch[:n].copy_(flat[nibbles : nibbles + n]).view(torch.bfloat16)
    at = 0
    for _, sz in slot_views(layout, flat).values():
        k, N, _ = sz.shape
        sz[..., 0].copy_(stored[at : at + k * N].view(k, N))
        sz[..., 1].zero_()
        at += k * N


def int4_linear(x_TK: torch.Tensor, weight, group: int) -> torch.Tensor:
    """x @ Wᵀ for an int4 slot's (packed, scales-and-zeros) weight: torch's CPU int4 kernel."""
    packed, sz = weight
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x_TK.contiguous(), packed, group, sz)


@cache
def cpu_probe() -> str:
    """16 hex of how this torch build on this CPU packs nibbles for its int4 kernel (a few
    shapes, whole blocks and partial ones): a store in the "cpu" packing holds the layout of the
    probe it records."""
    h = hashlib.sha256()
    for n in (16, 32, 48, 64, 80, 128):
        q = torch.arange(n * 64, dtype=torch.int32).view(n, 64) % 16
        h.update(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1).numpy().tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------ helpers


@cache
def _scheme(group: int):
    """compressed-tensors' W4A16 scheme at `group` (symmetric int4, group strategy)."""
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights.group_size = group
    return scheme


def _nibbles(ct_packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """int32 [N, K] of 0..15 from "ct"-packed bytes (the kernel's input: nibble = q + 8)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    q = unpack_from_int32(ct_packed.view(torch.int32).view(N, K // 8), 4, torch.Size((N, K)))
    return q.to(torch.int32).add_(8)


def _scheme_text(scheme) -> str:
    w, a = scheme.weights, scheme.input_activations
    if w is None:
        return "no weight quantization"
    text = f"{'' if w.symmetric else 'a'}symmetric {w.type}{w.num_bits} {w.strategy}"
    text += f" {w.group_size}" if w.group_size else ""
    text += f", act-order {w.actorder}" if w.actorder else ""
    return text + (f", {a.type}{a.num_bits} activations" if a is not None else "")


def _packed(shape) -> int:
    return shape[0] * shape[1] // 2


def _groups(shape, group: int) -> int:
    return shape[0] * (shape[1] // group)
