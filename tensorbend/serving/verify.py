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

import torch
from tqdm import tqdm

from tensorbend.errors import StoreError
from tensorbend.offload.store import ExpertStore, StoreConfig


def verify_store(model: str, cfg, progress: bool = True) -> list[tuple[int, int]]:
    """The (layer, expert) pairs whose stored bytes differ from the checkpoint's (`cfg`: a
    ServeConfig naming the store: dtype, store dtype, store dir). StoreError when the
    checkpoint has no store there."""
    from tensorbend.serving.offloaded import plan_store
    from tensorbend.zoo import resolve_model

    _, spec, layout, plan, store = plan_store(resolve_model(model), cfg)
    if not store.is_file():
        raise StoreError(
            f"store verify {model}: expected a store at {store}, found none; `tensorbend store "
            f"build --model {model}` builds it (with the same --dtype and --store-dtype)"
        )
    st = ExpertStore.open(store, StoreConfig("buffered"))
    quantized = layout.block is not None
    want = torch.empty(
        layout.stored_nbytes if quantized else layout.numel,
        dtype=torch.uint8 if quantized else layout.dtype,
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
