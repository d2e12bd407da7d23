"""Expert stores on disk: one process builds a store at a time, the others wait and reuse it.

Usage:
    with store_lock(Path("stores/my-moe-1a2b3c4d/experts-float32.safetensors")):
        ...  # check the store, build it if needed: a second process waits here, then reuses it
    stale_sources(plan, store)      # None, or why the store no longer holds the checkpoint's bytes

The lock is `fcntl.flock` on `NAME.lock` beside the store (never deleted: removing a lock file
another process may hold would let a third one in). The kernel releases it when its holder
exits, so a killed build never leaves a stale lock. On a folder where no lock file can be
created (read-only), no lock is taken: nothing can be built there anyway.

A store's identity covers the bytes it serves: `build_store` records, per source shard, its
size, mtime and a blake2b of the byte ranges it copied (`NAME.sources.json`). A load compares
size and mtime (a stat per shard); a shard whose differ has its expert ranges hashed again,
and a changed digest makes the store stale (rebuilt by `serving`).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tensorbend.offload.expert_plan import (
    ExpertPlan,
    combine_digests,
    layer_digests,
    record_sources,
    sources_file,
)


@contextmanager
def store_lock(store: Path, progress: bool = True) -> Iterator[None]:
    """Hold the exclusive lock of `store` (waiting, with a line on stderr, while another
    process holds it)."""
    lock = store.with_name(store.name + ".lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        fd = None  # (a read-only folder: no build can happen there)
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if progress:
                    print(f"expert store {store}: another process is building it; waiting",
                          file=sys.stderr)  # fmt: skip
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # (closing releases the lock)


def stale_sources(plan: ExpertPlan, store: Path) -> str | None:
    """Why `store` no longer holds the expert bytes of `plan`'s checkpoint, or None when it
    does. Shards whose size and mtime match the record cost a stat; the others have their
    expert ranges hashed again (and, when unchanged, their new mtime recorded)."""
    try:
        rec = json.loads(sources_file(store).read_text())["shards"]
    except (OSError, ValueError, KeyError, TypeError):
        return "no record of its source shards"
    ckpt = plan.ckpt
    try:
        now = ckpt.stats(ckpt.directory / n for n in rec)
    except OSError:
        return "a source shard is gone"
    changed = {n for n in rec if (now[n]["size"], now[n]["mtime_ns"])
               != (rec[n].get("size"), rec[n].get("mtime_ns"))}  # fmt: skip
    if not changed:
        return None
    paths = {ckpt.directory / n for n in changed}
    layers = [layer_digests(plan, m, paths) for m in range(plan.spec.num_moe_layers)]
    edited = sorted(n for n in changed if combine_digests(layers, n) != rec[n].get("blake2b"))
    if edited:
        return f"the experts in {', '.join(edited)} changed since it was built"
    try:  # (same bytes, new mtime: record it, so the next load is a stat again)
        record_sources(sources_file(store), {n: {**rec[n], **now[n]} for n in rec})
    except OSError:
        pass
    return None
