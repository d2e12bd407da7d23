"""Placing a model larger than memory: transformers + accelerate `device_map` within a byte
budget, and offloaded weights that compute exactly what the resident model computes.

Usage:
    >>> sorted(placement_kwargs("cpu", "10MB", "/tmp/offload"))
    ['device_map', 'max_memory', 'offload_folder']

`hf.load_model(..., max_memory=, offload_dir=)` passes `placement_kwargs` to from_pretrained
(what fits stays on the device, the rest is offloaded to host memory from cuda, to disk from
cpu, and streamed in per forward), then calls `align_offloaded` on the model. Why that is
needed: on CPU a matmul's result depends on its weight's address alignment (another SIMD
path, the 7th digit differs). Weights kept as in the checkpoint are memory-mapped from the same
file offsets whether resident or offloaded; weights transformers converts at load (the fused
expert tensors) live in fresh, aligned memory when resident but come back from the offload
folder at unaligned offsets. `align_offloaded` copies exactly those to aligned memory per
forward, and the offloaded model's outputs equal the resident model's bit for bit
(tests/test_placement.py).

Experts left on disk (`serving.load_offloaded`): `build_without_experts` builds the CausalLM
from config.json with the routed experts' parameters on `meta` (their class's __init__ runs
under `torch.device("meta")`, so nothing is allocated), and `load_non_experts` copies every
other tensor from the checkpoint (`offload.expert_plan.ExpertPlan.other`) into it, refusing a
checkpoint that lacks one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tensorbend.errors import StoreError, TensorbendError
from tensorbend.memory import check_device, parse_bytes
from tensorbend.models import RoutingSpec, check_model_type, describe_model, moe_block

if TYPE_CHECKING:
    from tensorbend.offload.expert_plan import ExpertPlan


def placement_kwargs(device: str, max_memory: str | int, offload_dir) -> dict:
    """from_pretrained keywords that place the model within `max_memory` on `device`."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise TensorbendError(
            "--max-memory places the model with accelerate, which is not installed: "
            "pip install accelerate"
        ) from None
    budget = parse_bytes(max_memory)
    if device == "cpu":
        if offload_dir is None:
            raise TensorbendError("--max-memory on cpu offloads to disk: give --offload-dir DIR")
        return {
            "device_map": "auto",
            "max_memory": {"cpu": budget},
            "offload_folder": str(offload_dir),
        }
    check_device(device)
    index = torch.device(device).index or 0
    return {"device_map": "auto", "max_memory": {index: budget, "cpu": _host_memory()}}


def _host_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().available * 0.9)


def align_offloaded(model, offload_dir) -> None:
    """Give the weights streamed back from the offload folder the alignment the resident model
    holds them in (see `load_model`)."""
    folder = Path(offload_dir).resolve()
    realigned: dict[int, _Realigned] = {}
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for h in getattr(hook, "hooks", None) or (hook,):  # a SequentialHook holds several
            wm = getattr(h, "weights_map", None)
            loader = getattr(wm, "dataset", None)
            if getattr(loader, "index", None) is None or isinstance(loader, _Realigned):
                continue
            wm.dataset = realigned.setdefault(id(loader), _Realigned(loader, folder))


class _Realigned(Mapping):
    """accelerate's offloaded-weights loader, returning 64-byte-aligned copies of the tensors
    it maps from files in `folder` (weights transformers converted at load: fresh, aligned
    memory in the resident model). Tensors mapped from the checkpoint itself sit at the same
    offsets as in the resident model and pass through untouched."""

    def __init__(self, inner: Mapping, folder: Path):
        self.inner, self.folder = inner, folder

    def __getitem__(self, key):
        value = self.inner[key]
        source = (self.inner.index.get(key) or {}).get("safetensors_file")
        moved = source is not None and Path(source).resolve().is_relative_to(self.folder)
        if moved and torch.is_tensor(value) and value.data_ptr() % 64:
            return value.clone()
        return value

    def __iter__(self):
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name):  # index, state_dict, save_folder, ... of the loader
        return getattr(self.inner, name)


# ------------------------------------------------------------ experts left on disk


@contextlib.contextmanager
def _experts_on_meta(cls):
    """While active, instances of experts class `cls` allocate their parameters on meta."""
    orig = cls.__init__

    def init(self, *args, **kwargs):
        with torch.device("meta"):
            orig(self, *args, **kwargs)

    cls.__init__ = init
    try:
        yield
    finally:
        cls.__init__ = orig


def build_without_experts(path: Path, dtype: torch.dtype):
    """(CausalLM, spec, expert layout) from config.json: routed experts on meta (never
    allocated), every other weight randomly initialised until `load_non_experts`."""
    from transformers import AutoModelForCausalLM

    from tensorbend.models import read_config
    from tensorbend.offload.layer import check_supported
    from tensorbend.offload.store import ExpertLayout

    check_model_type(path)
    try:
        config = read_config(path)
    except (OSError, ValueError) as e:
        raise TensorbendError(f"{path}: cannot read config.json ({e})") from e
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=dtype)
    spec = describe_model(meta)
    check_supported(spec.family)
    experts_cls = type(getattr(moe_block(meta, spec, 0), spec.experts_attr))
    layout = ExpertLayout.of(getattr(moe_block(meta, spec, 0), spec.experts_attr))
    layout = ExpertLayout(layout.parts, dtype)
    with _experts_on_meta(experts_cls):
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (path / "generation_config.json").is_file():  # what from_pretrained would use
        from transformers import GenerationConfig

        lm.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    if hasattr(lm, "set_experts_implementation"):
        with contextlib.suppress(ValueError, TypeError):
            lm.set_experts_implementation("eager")
    return lm, spec, layout


def load_non_experts(lm, plan: ExpertPlan) -> None:
    """Copy every non-expert checkpoint tensor into the model; refuse if one is missing."""
    state = lm.state_dict(keep_vars=True)
    expert_ids = {id(p) for p in _expert_params(lm, plan.spec)}
    tied = {n for n, p in state.items() if id(p) in _tied_ids(lm)}
    with torch.no_grad():
        for key, ref in plan.other.items():
            t = plan.ckpt.read(ref)
            dst = state[key]
            if tuple(dst.shape) != tuple(t.shape):
                raise StoreError(
                    f"{plan.ckpt.directory}: {ref.key} has shape {list(t.shape)}, the model's "
                    f"{key} expects {list(dst.shape)} (config.json); is this the right config?"
                )
            dst.copy_(t.to(dst.dtype))
    persistent = {n for n, _ in lm.named_parameters()} | _persistent_buffers(lm)
    missing = [
        k
        for k in state
        if k in persistent
        and id(state[k]) not in expert_ids
        and k not in plan.other
        and k not in tied
    ]
    if missing:
        raise StoreError(
            f"{plan.ckpt.directory}: expected weights for {len(missing)} more tensors, e.g. "
            f"{missing[:3]}; the checkpoint is incomplete or of another architecture"
        )


def _expert_params(lm, spec: RoutingSpec):
    for m in range(spec.num_moe_layers):
        yield from getattr(moe_block(lm, spec, m), spec.experts_attr).parameters()


def _tied_ids(lm) -> set[int]:
    """Ids of parameters shared by several names (tied embeddings): loaded through one name."""
    seen, tied = {}, set()
    for _, p in lm.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(id(p))
        seen[id(p)] = True
    return tied


def _persistent_buffers(lm) -> set[str]:
    names = set()
    for mod_name, mod in lm.named_modules():
        for b in mod._buffers:
            if b not in mod._non_persistent_buffers_set:
                names.add(f"{mod_name}.{b}" if mod_name else b)
    return names
