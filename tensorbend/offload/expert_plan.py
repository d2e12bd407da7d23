"""Where each routed expert's bytes are in a transformers checkpoint, and the expert store
built from them without ever holding the model in memory.

Usage:
    ckpt = Checkpoint.open(Path("my-moe"))                 # offload/shards.py
    plan = ExpertPlan.of(ckpt, model, spec, layout)        # model: built with experts on meta
    plan.other                                             # model key -> TensorRef (non-experts)
    build_store(plan, Path("store/experts.safetensors"), meta, dtype=torch.float32)

Shape legend: E experts of a MoE layer, I expert intermediate size, D hidden size.

Checkpoint keys are mapped to model keys with transformers' own conversion table (the
renamings and converters `from_pretrained` applies, e.g. Mixtral's `block_sparse_moe.` ->
`mlp.`), so a key means here what it means to transformers. Routed experts come in two layouts:
- per expert (what `save_pretrained` writes for DeepSeek-V3, Qwen3-MoE, Mixtral, ...):
  `...experts.{e}.gate_proj.weight` [I, D] and `up_proj` [I, D] become row e of the fused
  `gate_up_proj` [E, 2I, D] by concatenation in the converter's source order (gate, then up),
  and `down_proj` [D, I] row e of `down_proj` [E, D, I] (transformers' MergeModulelist +
  Concatenate; any other converter op is refused, not guessed);
- fused (GPT-OSS, Granite-MoE, checkpoints saved fused): `...experts.gate_up_proj` [E, ...],
  whose row e is one contiguous byte range, read alone.
Every read is a positional read of exactly the bytes needed, straight into one reused expert
buffer (`shards.Checkpoint.read_into`), so building the store keeps one expert in memory
whatever the model's size. The store is written
in place into `NAME.partial` (header first, then layer by layer, fsync'd) with a progress
file; an interrupted build resumes at the first unfinished layer and the finished file is
renamed into place, so nothing already written is lost and no half store is ever read. While
copying, each source shard's copied byte ranges are hashed per layer (blake2b, no extra read;
kept in the progress file, so a resumed build reads no finished layer again) into
`NAME.sources.json` with the shard's size and mtime: `stores.stale_sources` checks them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from tensorbend.atomic import atomic_write_text
from tensorbend.errors import StoreError, TensorbendError, UnsupportedModelError
from tensorbend.models import RoutingSpec, moe_block
from tensorbend.offload import int4, mxfp4
from tensorbend.offload.blocks import stride
from tensorbend.offload.int4 import Int4
from tensorbend.offload.layout import ExpertLayout
from tensorbend.offload.precision import block_grid
from tensorbend.offload.shards import ST_DTYPES, Checkpoint, TensorRef
from tensorbend.offload.store import expert_offset, store_header


@dataclass
class _Part:
    """Where one part (e.g. gate_up_proj) of one MoE layer's experts comes from."""

    fused: TensorRef | None = None  # [E, ...] in one tensor
    pieces: dict[int, dict[int, TensorRef]] = field(default_factory=dict)  # e -> order -> ref


@dataclass
class ExpertPlan:
    """Checkpoint tensors sorted into routed-expert parts and everything else."""

    ckpt: Checkpoint
    spec: RoutingSpec
    layout: ExpertLayout
    parts: list[dict[str, _Part]]  # per MoE layer m: part name -> sources
    other: dict[str, TensorRef]  # model state-dict key -> checkpoint tensor
    _buffers: dict = field(default_factory=dict, repr=False)  # reused scratch, by name

    @classmethod
    def of(cls, ckpt: Checkpoint, model, spec: RoutingSpec, layout: ExpertLayout) -> ExpertPlan:
        """Map every checkpoint key (model: built from the config, experts may be on meta)."""
        renamings, converters = _conversions(model)
        from transformers.core_model_loading import rename_source_key

        state = dict(model.state_dict(keep_vars=True))
        prefixes = {}
        for m in range(spec.num_moe_layers):
            block = moe_block(model, spec, m)
            experts = getattr(block, spec.experts_attr)
            name = next(n for n, mod in model.named_modules() if mod is experts)
            prefixes[name + "."] = m
        parts = [{n: _Part() for n, _ in layout.parts} for _ in range(spec.num_moe_layers)]
        other: dict[str, TensorRef] = {}
        for key, ref in ckpt.refs.items():
            new, src = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
            head, _, part = new.rpartition(".")
            m = prefixes.get(head + ".")
            if m is None or part not in parts[m]:
                if new in state:
                    other[new] = ref
                continue
            if src is None:
                parts[m][part].fused = ref
                continue
            order, e = _piece(key, src, converters)
            parts[m][part].pieces.setdefault(e, {})[order] = ref
        plan = cls(ckpt, spec, layout, parts, other)
        plan._check()
        return plan

    def expert(self, m: int, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e of MoE layer m packed as the store keeps it: flat, parts back to back."""
        out = torch.empty(self.layout.numel, dtype=dtype)
        self.expert_into(m, e, out)
        return out

    def expert_into(self, m: int, e: int, out: torch.Tensor, staging=None) -> None:
        """`expert` read straight into `out` (no intermediate copies when dtypes match); an fp8
        layout's as stored (`out`: uint8, per part its fp8 weights, then their block scales), an
        mxfp4 one's too (`mxfp4.read_expert`), an int4 one's in its packing (`_int4_expert_into`)."""
        if isinstance(self.layout.block, Int4):
            return self._int4_expert_into(m, e, out, staging)
        if self.layout.block == mxfp4.MXFP4:
            return mxfp4.read_expert(self, m, e, out, staging)
        if self.layout.block is not None:
            return self._fp8_expert_into(m, e, out)
        self._dense_into(self.layout, m, e, out, staging)

    def refs(self, m: int, e: int, name: str, shape) -> list[tuple[TensorRef, int | None]]:
        """(tensor, row or None) whose bytes make part `name` of expert e of layer m, in order;
        refused unless they stack to `shape` (an int4 checkpoint's packed words: 8 a word)."""
        src = self.parts[m][name]
        refs = (
            [(src.fused, e)]
            if src.fused is not None
            else [(src.pieces[e][i], None) for i in sorted(src.pieces[e])]
        )
        found = _stacked_shape([_logical(r, row is not None) for r, row in refs])
        if found != shape:
            raise StoreError(
                f"{self.ckpt.directory}: layer {m} expert {e} part {name}: expected shape "
                f"{list(shape)} (from config.json), found {list(found)} in the checkpoint"
            )
        return refs

    def _int4_expert_into(self, m: int, e: int, out: torch.Tensor, staging=None) -> None:
        """An int4 layout's expert: an int4 checkpoint's bytes as they are (`int4.read_expert`),
        or a float checkpoint's quantized round-to-nearest (`int4.quantize_expert`), in the
        "ct" packing; then, for int4 slots, repacked into the kernel's (`int4.to_kernel_packing`)."""
        fmt, layout = self.layout.block, self.layout
        ct = out if fmt.packing == "ct" else self._buffer("ct", out.numel(), torch.uint8)
        if isinstance(self.ckpt.block, Int4):
            int4.read_expert(self, m, e, ct)
        else:
            assert self.ckpt.block is None, "int4 stores quantize unquantized checkpoints only"
            ref = self.refs(m, e, *layout.parts[0])[0][0]  # (quantized in the checkpoint's dtype,
            dense = replace(layout, dtype=ST_DTYPES[ref.dtype], block=None)  # as the library does)
            flat = self._buffer("dense", dense.numel, dense.dtype)
            self._dense_into(dense, m, e, flat, staging)
            int4.quantize_expert(fmt, list(dense.views(flat).values()), ct)
        if fmt.packing == "cpu":
            int4.to_kernel_packing(layout.parts, ct, fmt.group, out)

    def _dense_into(self, layout, m: int, e: int, out: torch.Tensor, staging=None) -> None:
        at = 0
        for name, shape in layout.parts:
            for ref, row in self.refs(m, e, name, shape):
                n = _numel(ref.shape[1:] if row is not None else ref.shape)
                self.ckpt.read_into(ref, out[at : at + n], row, staging)
                at += n
        assert at == out.numel()

    def _buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype)
        return buf

    def _fp8_expert_into(self, m: int, e: int, out: torch.Tensor) -> None:
        at, block = 0, self.layout.block
        for name, shape in self.layout.parts:
            refs = self.refs(m, e, name, shape)
            for ref, row in refs:
                n = _numel(ref.shape[1:] if row is not None else ref.shape)
                self.ckpt.read_into(ref, out[at : at + n].view(torch.float8_e4m3fn), row)
                at += n
            for ref, row in refs:
                scale = self.ckpt.scales.get(ref.key)
                rows = ref.shape[1:] if row is not None else ref.shape
                if (
                    ref.dtype != "F8_E4M3"
                    or scale is None
                    or len(rows) != 2
                    or any(d % b for d, b in zip(rows, block, strict=True))
                ):
                    raise UnsupportedModelError(
                        f"{self.ckpt.directory}: {ref.key} ({ref.dtype}, shape {list(rows)}): "
                        f"expected fp8 (F8_E4M3) expert weights with a weight_scale_inv per "
                        f"{block[0]}x{block[1]} block, their dims multiples of it"
                    )
                n = 4 * _numel(block_grid(rows, block))
                self.ckpt.read_into(scale, out[at : at + n].view(torch.float32), row)
                at += n
        assert at == out.numel() == self.layout.stored_nbytes

    def _check(self) -> None:
        E = self.spec.num_experts
        for m, parts in enumerate(self.parts):
            for name, src in parts.items():
                if src.fused is None and sorted(src.pieces) != list(range(E)):
                    found = "none" if not src.pieces else f"{len(src.pieces)} of {E} experts"
                    if src.pieces:  # name them as the checkpoint does: its keys
                        missing = sorted(set(range(E)) - set(src.pieces))
                        some = next(iter(src.pieces[min(src.pieces)].values())).key
                        found += f" (missing experts {missing[:8]}; present: {some}, ...)"
                    raise StoreError(
                        f"{self.ckpt.directory}: decoder layer {self.spec.moe_layer_ids[m]} "
                        f"part {name}: expected the weights of {E} routed experts, found "
                        f"{found}; is a shard missing?"
                    )


def build_store(
    plan: ExpertPlan,
    path: Path,
    meta: dict[str, str],
    dtype: torch.dtype,
    progress: bool = True,
) -> Path:
    """Write every routed expert of `plan` to the store at `path`, resumably (see top)."""
    path = Path(path)
    L, E = plan.spec.num_moe_layers, plan.spec.num_experts
    layout = replace(plan.layout, dtype=dtype)
    header = store_header(L, E, layout, meta)
    partial, record = (
        path.with_name(path.name + ".partial"),
        path.with_name(path.name + ".progress"),
    )
    want = {"header_sha": _digest(header), "layers_done": 0}
    done, layers = 0, []  # layers: per finished layer, {shard name: digest of its ranges}
    if partial.is_file() and record.is_file():
        try:
            rec = json.loads(record.read_text())
            if rec.get("header_sha") == want["header_sha"]:
                done = int(rec["layers_done"])
                layers = list(rec["digests"])[:done]
                done = len(layers)
        except (ValueError, KeyError, TypeError):
            done, layers = 0, []
    path.parent.mkdir(parents=True, exist_ok=True)
    sources = sources_file(path)
    sources.unlink(missing_ok=True)  # (no record until the new store is in place)
    fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if done == 0:
            os.ftruncate(fd, 0)
            os.pwrite(fd, header, 0)
            os.ftruncate(fd, len(header) + L * E * stride(layout.stored_nbytes))  # (pads: 0)
        bar = tqdm(
            total=L * E,
            initial=done * E,
            desc="expert store",
            unit="expert",
            disable=not progress,
            file=_stderr(),
        )
        flat = _stored_buffer(layout)  # one expert as stored, reused: memory stays flat
        staging = torch.empty(max(layout.nbytes, 2 * layout.numel), dtype=torch.uint8)
        shards = {r.shard for r in plan.ckpt.refs.values()}
        stats = plan.ckpt.stats(shards)  # (before reading: a later edit shows in the mtime)
        for m in range(done, L):
            with plan.ckpt.hashing() as digests:
                for e in range(E):
                    try:
                        plan.expert_into(m, e, flat, staging)
                    except TensorbendError as err:  # (a rerun fails the same: say so)
                        rec = {**want, "layers_done": m, "digests": layers, "failed": str(err)}
                        atomic_write_text(record, json.dumps(rec))
                        raise
                    data = memoryview(flat.view(torch.uint8).numpy())
                    at = expert_offset(len(header), m, e, E, layout.stored_nbytes)
                    if os.pwrite(fd, data, at) != len(data):
                        raise StoreError(
                            f"{partial}: short write (disk full?); free space and rerun"
                        )
                    bar.update(1)
            layers.append({s.name: h.hexdigest() for s, h in digests.items()})
            os.fsync(fd)
            rec = {**want, "layers_done": m + 1, "digests": layers}
            atomic_write_text(record, json.dumps(rec))
        bar.close()
    finally:
        os.close(fd)
    os.replace(partial, path)
    record.unlink(missing_ok=True)
    record_sources(
        sources,
        {
            n: {**stats[n], "blake2b": combine_digests(layers, n)}
            for n in stats
            if any(n in d for d in layers)
        },
    )
    return path


def sources_file(store: Path) -> Path:
    """`NAME.sources.json` beside the store `NAME.safetensors`: per source shard its size,
    mtime_ns and the blake2b of the byte ranges the store copied from it, in copy order."""
    return store.with_name(store.name.removesuffix(".safetensors") + ".sources.json")


def layer_digests(plan: ExpertPlan, m: int, shards: set[Path] | None = None) -> dict[str, str]:
    """{shard name: blake2b of the ranges MoE layer m's experts read from it} (only `shards`,
    reading nothing else, when given): what `build_store` records per layer, hashed again."""
    flat = _stored_buffer(plan.layout)
    with plan.ckpt.hashing(shards) as digests:
        for e in range(plan.spec.num_experts):
            plan.expert_into(m, e, flat)
    return {s.name: h.hexdigest() for s, h in digests.items()}


def combine_digests(layers: list[dict[str, str]], shard: str) -> str:
    """One shard's digest over the store: blake2b of its per-layer digests, in layer order."""
    return hashlib.blake2b(
        "".join(d[shard] for d in layers if shard in d).encode(), digest_size=16
    ).hexdigest()


def record_sources(path: Path, shards: dict[str, dict]) -> None:
    atomic_write_text(path, json.dumps({"shards": shards}, indent=1))


# ------------------------------------------------------------ helpers


def _conversions(model) -> tuple[list, list]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    conv = get_model_conversion_mapping(model)
    return (
        [t for t in conv if isinstance(t, WeightRenaming)],
        [t for t in conv if isinstance(t, WeightConverter)],
    )


def _piece(key: str, src: str, converters) -> tuple[int, int]:
    """(position among the converter's sources, expert index) of a per-expert key."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    conv = next(c for c in converters if src in c.source_patterns)
    ops = tuple(type(op) for op in conv.operations)
    if ops not in ((MergeModulelist,), (MergeModulelist, Concatenate)) or any(
        getattr(op, "dim", 0) != want
        for op, want in zip(conv.operations, (0, 1)[: len(ops)], strict=True)
    ):
        raise UnsupportedModelError(
            f"checkpoint key {key}: transformers converts it with "
            f"{[type(op).__name__ for op in conv.operations]}; expected MergeModulelist(dim=0) "
            f"[+ Concatenate(dim=1)] (per-expert weights stacked and concatenated)"
        )
    match = re.search(r"experts\.(\d+)\.", key)
    assert match is not None, f"converter {src} matched {key} without an expert index"
    return conv.source_patterns.index(src), int(match.group(1))


def _stored_buffer(layout: ExpertLayout) -> torch.Tensor:
    """A buffer for one expert as the store keeps it: its values, or a quantized one's bytes."""
    if layout.block is None:
        return torch.empty(layout.numel, dtype=layout.dtype)
    return torch.empty(layout.stored_nbytes, dtype=torch.uint8)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _logical(ref: TensorRef, row: bool) -> tuple[int, ...]:
    """The shape a tensor (its row) holds in weights: an int4 `weight_packed` 8 a word."""
    shape = ref.shape[1:] if row else ref.shape
    if ref.key.endswith(".weight_packed") and ref.dtype == "I32":
        return (*shape[:-1], shape[-1] * 8)
    return shape


def _stacked_shape(shapes: list) -> tuple[int, ...]:
    """Shapes concatenated along dim 0 (per-expert pieces), or the one shape."""
    first = tuple(shapes[0])
    return (sum(s[0] for s in shapes), *first[1:]) if len(shapes) > 1 else first


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _stderr():
    import sys

    return sys.stderr
