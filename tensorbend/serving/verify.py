"""`tensorbend store verify`: every expert of a store compared, byte for byte, with what the
checkpoint gives now.

Usage:
    bad = verify_store("my-moe", ServeConfig(store_dir="stores"))   # [(layer, expert), ...]

A load trusts a store whose record matches each shard's size, mtime, inode and change time
(serving/stores.py); this reads the whole store and the checkpoint's expert bytes instead, as
`build_store` would write them (the same precision, quantization and packing), so it finds what
no stat can: a store or a shard corrupted behind the filesystem's back.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from tqdm import tqdm

from tensorbend.errors import StoreError
from tensorbend.offload.expert_plan import ExpertPlan
from tensorbend.offload.precision import resolve_dtype
from tensorbend.offload.shards import Checkpoint
from tensorbend.offload.store import ExpertStore, StoreConfig
from tensorbend.serving.model_build import build_without_experts
from tensorbend.serving.stores import store_format, store_path, store_tag


def verify_store(model: str, cfg, progress: bool = True) -> list[tuple[int, int]]:
    """The (layer, expert) pairs whose stored bytes differ from the checkpoint's (`cfg`: a
    ServeConfig naming the store: dtype, store dtype, store dir). StoreError when the
    checkpoint has no store there."""
    from tensorbend.zoo import resolve_model

    path = resolve_model(model)
    ckpt = Checkpoint.open(path)
    dtype = resolve_dtype(cfg.dtype, path, ckpt)
    meta, spec, layout = build_without_experts(path, dtype)
    layout = replace(layout, block=store_format(cfg, ckpt.block))
    store = store_path(cfg.store_dir, path, store_tag(layout.block, dtype))
    if not store.is_file():
        raise StoreError(
            f"store verify {model}: expected a store at {store}, found none; `tensorbend store "
            f"build --model {model}` builds it (with the same --dtype and --store-dtype)"
        )
    plan = ExpertPlan.of(ckpt, meta, spec, layout)
    st = ExpertStore.open(store, StoreConfig("buffered"))
    quantized = layout.block is not None
    want = torch.empty(
        layout.stored_nbytes if quantized else layout.numel,
        dtype=torch.uint8 if quantized else dtype,
    )
    got = torch.empty(st.expert_nbytes, dtype=torch.uint8)
    bad = []
    keys = [(m, e) for m in range(spec.num_moe_layers) for e in range(spec.num_experts)]
    try:
        for m, e in tqdm(keys, desc="verifying experts", disable=not progress, leave=False):
            plan.expert_into(m, e, want)
            st.read_parts_into(m, e, [got])
            if not torch.equal(want.view(torch.uint8).reshape(-1), got):
                bad.append((m, e))
    finally:
        st.close()
    return bad
