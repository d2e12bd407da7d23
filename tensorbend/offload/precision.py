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
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from tensorbend.errors import TensorbendError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ALIASES = {"fp32": "float32", "f32": "float32", "fp16": "float16", "half": "float16",
           "f16": "float16", "bf16": "bfloat16"}  # fmt: skip
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
