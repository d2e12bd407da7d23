"""Placing a model larger than memory with transformers + accelerate: `device_map` within a
byte budget, and offloaded weights that compute exactly what the resident model computes.

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
(tests/test_placement.py). Used to collect traces of models larger than memory, and by the
serving baseline without tensorbend (`serving/accelerate_baseline.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from tensorbend.errors import TensorbendError
from tensorbend.memory import check_device, parse_bytes


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
