"""Expert stores on disk: one process builds a store at a time, the others wait and reuse it.

Usage:
    path = store_path(None, Path("my-moe"), "float32")  # <root>/my-moe-<hash8>/experts-float32.safetensors
    with store_lock(Path("stores/my-moe-1a2b3c4d/experts-float32.safetensors")):
        ...  # check the store, build it if needed: a second process waits here, then reuses it
    stale_sources(plan, store)      # None, or why the store no longer holds the checkpoint's bytes
    check_room(store, nbytes)       # StoreError (one line) unless its folder is writable, with room

Every store lives in a root (`--store-dir`, else $TENSORBEND_STORE_DIR, else
~/.cache/tensorbend/stores), one folder per checkpoint inside (its name and a hash of its
resolved path), one store per dtype in it. The lock is `fcntl.flock` on `NAME.lock` beside the store (never deleted: removing a lock file
another process may hold would let a third one in). The kernel releases it when its holder
exits, so a killed build never leaves a stale lock. On a folder where no lock file can be
created (read-only), no lock is taken: nothing can be built there anyway.

A store's identity covers the bytes it serves: `build_store` records, per source shard, its
size, mtime and a blake2b of the byte ranges it copied (`NAME.sources.json`). A load compares
size and mtime (a stat per shard); a shard whose differ has its expert ranges hashed again,
and a changed digest makes the store stale (rebuilt by `serving`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tensorbend.errors import StoreError
from tensorbend.offload.expert_plan import (
    ExpertPlan,
    combine_digests,
    layer_digests,
    record_sources,
    sources_file,
)


def store_root(root: str | Path | None = None) -> Path:
    """The folder holding the stores: `root` (--store-dir), else $TENSORBEND_STORE_DIR, else
    ~/.cache/tensorbend/stores."""
    default = Path.home() / ".cache" / "tensorbend" / "stores"
    return Path(root or os.environ.get("TENSORBEND_STORE_DIR") or default)


def store_path(root: str | Path | None, checkpoint: Path, dtype: str) -> Path:
    """The store of `checkpoint` in `dtype`: ROOT/<name>-<hash of its path>/experts-<dtype>."""
    tag = hashlib.sha256(str(Path(checkpoint).resolve()).encode()).hexdigest()[:8]
    folder = store_root(root) / f"{Path(checkpoint).name}-{tag}"
    return folder / f"experts-{dtype}.safetensors"


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


def check_room(store: Path, nbytes: int | None) -> None:
    """Create the store's folder; with `nbytes` (the whole store), refuse unless its disk has
    that much free (less what an interrupted build of it already wrote). StoreError: one line
    with the size, the place and how to choose another."""
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"expert store folder {store.parent}: {unwritable(e)}") from e
    if nbytes is None:
        return
    if not os.access(store.parent, os.W_OK):
        raise StoreError(f"expert store folder {store.parent}: "
                         f"{unwritable(PermissionError(errno.EACCES, 'not writable'))}")  # fmt: skip
    partial = store.with_name(store.name + ".partial")
    done = partial.stat().st_blocks * 512 if partial.is_file() else 0
    free = shutil.disk_usage(store.parent).free
    if free < nbytes - done:
        raise StoreError(
            f"expert store {store}: needs {nbytes / 1e6:.1f} MB, its disk has "
            f"{free / 1e6:.1f} MB free; free space there, or pass --store-dir DIR (or set "
            f"TENSORBEND_STORE_DIR) to a folder on a disk with room"
        )


def unwritable(e: OSError) -> str:
    """The one-line reason a store cannot be written, with the fix."""
    what = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else e.strerror or e
    return (
        f"cannot write it ({what}); pass --store-dir DIR (or set TENSORBEND_STORE_DIR) to a "
        f"writable folder with room"
    )
