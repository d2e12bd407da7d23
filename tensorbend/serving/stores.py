"""Expert stores on disk: one process builds a store at a time, the others wait and reuse it.

Usage:
    path = store_path(None, Path("my-moe"), "float32")  # <root>/my-moe-<hash8>/experts-float32.safetensors
    with store_lock(Path("stores/my-moe-1a2b3c4d/experts-float32.safetensors")):
        ...  # check the store, build it if needed: a second process waits here, then reuses it
    stale_sources(plan, store)      # None, or why the store no longer holds the checkpoint's bytes
    check_room(store, nbytes)       # StoreError (one line) unless its folder is writable, with room
    list_stores()                   # [{store, checkpoint, dtype, bytes, built, partial}]: `store list`
    remove_store("my-moe"); remove_partial(); remove_orphans()      # `store rm`, `store prune`
    block = store_format(cfg, ckpt.block)     # what a serving run's store keeps (--store-dtype)
    ensure_store(plan, path, fingerprint, layout, progress)   # reuse it, or build it (locked)

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
import struct
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from tensorbend.errors import StoreError, TensorbendError
from tensorbend.offload.expert_plan import (
    ExpertPlan,
    build_store,
    combine_digests,
    layer_digests,
    record_sources,
    sources_file,
)
from tensorbend.offload.handle import stored_dtype
from tensorbend.offload.int4 import Int4
from tensorbend.offload.layout import ExpertLayout
from tensorbend.offload.store import ExpertStore, store_header, stride


def store_root(root: str | Path | None = None) -> Path:
    """The folder holding the stores: `root` (--store-dir), else $TENSORBEND_STORE_DIR, else
    ~/.cache/tensorbend/stores."""
    default = Path.home() / ".cache" / "tensorbend" / "stores"
    return Path(root or os.environ.get("TENSORBEND_STORE_DIR") or default)


def store_path(root: str | Path | None, checkpoint: Path, dtype: str) -> Path:
    """The store of `checkpoint` in `dtype`: ROOT/<name>-<hash of its path>/experts-<dtype>,
    both of the resolved path: a symlink or another spelling of the same directory shares it."""
    resolved = Path(checkpoint).resolve()
    tag = hashlib.sha256(str(resolved).encode()).hexdigest()[:8]
    folder = store_root(root) / f"{resolved.name}-{tag}"
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
                    print(
                        f"expert store {store}: another process is building it; waiting",
                        file=sys.stderr,
                    )
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # (closing releases the lock)


def stale_sources(plan: ExpertPlan, store: Path) -> str | None:
    """Why `store` no longer holds the expert bytes of `plan`'s checkpoint, or None when it
    does. Shards whose size, mtime, inode and change time match the record cost a stat; the
    others have their expert ranges hashed again (and, when unchanged, their new stat
    recorded). A record without inode and change time (an older store) hashes once."""
    try:
        rec = json.loads(sources_file(store).read_text())["shards"]
    except (OSError, ValueError, KeyError, TypeError):
        return "no record of its source shards"
    ckpt = plan.ckpt
    try:
        now = ckpt.stats(ckpt.directory / n for n in rec)
    except OSError:
        return "a source shard is gone"
    keys = ("size", "mtime_ns", "ino", "ctime_ns")
    changed = {n for n in rec if any(now[n][k] != rec[n].get(k) for k in keys)}
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
        raise StoreError(
            f"expert store folder {store.parent}: "
            f"{unwritable(PermissionError(errno.EACCES, 'not writable'))}"
        )
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


def list_stores(root: str | Path | None = None) -> list[dict]:
    """Every store under the root, finished or interrupted: {store (its file), checkpoint (the
    source it was built from), dtype, bytes (on disk), built (finished: when; else None),
    partial (an interrupted build: layers done of all, else None), orphan (its checkpoint's
    directory is gone)}."""
    root = store_root(root)
    files = [*root.glob("*/experts-*.safetensors*"), *root.glob("experts-*.safetensors*")]
    out = []
    for f in sorted(files):
        partial = f.name.endswith(".safetensors.partial")
        if not (partial or f.name.endswith(".safetensors")):
            continue
        meta = _metadata(f)
        st = f.stat()
        done, failed = None, None
        if partial:
            try:
                rec = json.loads(f.with_name(f.name.replace(".partial", ".progress")).read_text())
                done, failed = int(rec["layers_done"]), rec.get("failed")
            except (OSError, ValueError, KeyError, TypeError):
                done = 0
        out.append(
            {
                "store": str(f),
                "checkpoint": meta.get("source", "?"),
                "dtype": f.name.removeprefix("experts-").split(".safetensors")[0],
                "bytes": st.st_blocks * 512 if partial else st.st_size,
                "built": None
                if partial
                else time.strftime("%Y-%m-%d %H:%M", time.localtime(st.st_mtime)),
                "partial": None
                if not partial
                else f"{done} of {meta.get('num_layers', '?')} layers",
                "orphan": "source" in meta and not Path(meta["source"]).is_dir(),
                "failed": failed,  # the build stopped on this error, not an interruption
            }
        )
    return out


def format_stores(stores: list[dict], root: Path) -> str:
    """`tensorbend store list`'s table."""
    if not stores:
        return f"no expert stores under {root}"
    lines = [f"{len(stores)} expert store(s) under {root}:"]
    for s in stores:
        when = s["built"] or f"interrupted ({s['partial']})"
        if s.get("failed"):
            when = f"failed ({s['partial']}: {s['failed']}; `tensorbend store rm --partial` removes it)"
        gone = " (gone: `tensorbend store prune` removes its stores)" if s.get("orphan") else ""
        lines.append(
            f"{s['store']}  {s['dtype']}  {s['bytes'] / 1e6:.1f} MB  {when}  "
            f"checkpoint {s['checkpoint']}{gone}"
        )
    return "\n".join(lines)


def remove_store(target: str | Path, root: str | Path | None = None) -> Path:
    """Remove the folder of a checkpoint's stores: `target` is the checkpoint's path or the
    store folder (a path, or its name under the root). Returns the folder removed."""
    root, target = store_root(root), Path(target)
    folders = [target, root / target.name, store_path(root, target, "x").parent]
    folder = next(
        (
            f
            for f in folders
            if f.is_dir()
            and f.resolve().parent == root.resolve()
            and any(f.glob("experts-*.safetensors*"))
        ),
        None,
    )  # (only a root's folder)
    if folder is None:
        raise StoreError(
            f"store rm {target}: expected a checkpoint path or a store folder under {root}, "
            f"found no store of it; `tensorbend store list` shows them"
        )
    for lock in folder.glob("*.lock"):
        _refuse_if_busy(lock)
    shutil.rmtree(folder)
    return folder


def remove_orphans(root: str | Path | None = None) -> list[Path]:
    """Remove the store folders whose every store's checkpoint is gone (none in use by a
    process now). Returns the folders removed."""
    by_folder: dict[Path, list[dict]] = {}
    for s in list_stores(root):
        by_folder.setdefault(Path(s["store"]).parent, []).append(s)
    removed = []
    for folder, stores in sorted(by_folder.items()):
        if folder != store_root(root) and all(s["orphan"] for s in stores):
            removed.append(remove_store(folder, root))
    return removed


def remove_partial(root: str | Path | None = None) -> list[Path]:
    """Remove every interrupted build under the root (`NAME.partial` and its progress file)
    that no process is building now. Returns the partial files removed."""
    removed = []
    for s in list_stores(root):
        if s["partial"] is None:
            continue
        f = Path(s["store"])
        lock = f.with_name(f.name.replace(".partial", ".lock"))
        if lock.is_file():
            _refuse_if_busy(lock)
        f.unlink()
        f.with_name(f.name.replace(".partial", ".progress")).unlink(missing_ok=True)
        removed.append(f)
    return removed


def _refuse_if_busy(lock: Path) -> None:
    with open(lock, "rb") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(
                f"{lock.parent}: a store there is being built by another process; wait for "
                f"it to finish (or stop it), then rerun"
            ) from None


def _metadata(store: Path) -> dict:
    """The safetensors header's metadata of a store file ({} when unreadable)."""
    try:
        with open(store, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
            return json.loads(f.read(min(hlen, 1 << 28))).get("__metadata__", {})
    except (OSError, ValueError, struct.error):
        return {}


# ------------------------------------------------------------ a serving run's store


def store_format(cfg, block):
    """The store's `ExpertLayout.block` (`cfg`: a ServeConfig) for a checkpoint whose own is `block` (None, fp8's, MXFP4
    or Int4): as it is, or Int4 for --store-dtype int4; an Int4 store in the kernel's packing
    when slots hold int4 (--slots), else in compressed-tensors'. Refuses what does not apply."""
    if cfg.store_dtype == "int4":
        if block is not None:
            raise TensorbendError(
                f"--store-dtype int4: expected an unquantized checkpoint, found experts stored in "
                f"{stored_dtype(block, None)}, which are served in their own format; drop "
                f"--store-dtype"
            )
        block = Int4(32)
    if not isinstance(block, Int4):
        if cfg.slots == "int4":
            raise TensorbendError(
                "--slots int4: expected an int4 store (a compressed-tensors int4 checkpoint, or "
                "--store-dtype int4), found none; add --store-dtype int4 or drop --slots"
            )
        return block
    cpu = torch.device(cfg.device).type == "cpu"
    if cfg.slots == "int4" and not cpu:
        raise TensorbendError(
            f"--slots int4 on {cfg.device}: expected --device cpu (torch's CPU int4 kernel); "
            f"use --slots dense on {cfg.device} (what --slots auto picks there)"
        )
    return replace(block, packing="cpu" if cpu and cfg.slots != "dense" else "ct")


def store_tag(block, dtype: torch.dtype) -> str:
    """What a store's file is named for: fp8, mxfp4 (its biases bf16; else -DTYPE), int4 (in
    compressed-tensors' packing) or int4-cpu (in the CPU kernel's), a dtype."""
    if isinstance(block, Int4):
        return "int4" if block.packing == "ct" else f"int4-{block.packing}"
    name = str(dtype).removeprefix("torch.")
    if block == "mxfp4":
        return "mxfp4" if dtype == torch.bfloat16 else f"mxfp4-{name}"
    return "fp8" if block else name


def ensure_store(plan, store: Path, fingerprint: str, layout: ExpertLayout, progress) -> None:
    """Reuse the store when it holds this checkpoint's experts as they are now (its model
    fingerprint, the checkpoint's headers, layout, and the expert bytes: `ExpertStore.check`,
    `stores.stale_sources`); otherwise build it (again), once its folder is writable and its
    disk has room (`stores.check_room`). One process at a time (`stores.store_lock`)."""
    check_room(store, None)
    with store_lock(store, progress):  # (a second process waits here, then reuses the store)
        _check_or_build(plan, store, fingerprint, layout, progress)


def _check_or_build(plan, store: Path, fingerprint: str, layout: ExpertLayout, progress) -> None:
    spec, ident = plan.spec, {"fingerprint": fingerprint, "checkpoint": plan.ckpt.identity()}
    why = None
    if store.is_file():
        try:
            found = ExpertStore.open(store)
            found.check(ident, spec.num_moe_layers, spec.num_experts, layout)  # (closes it)
        except StoreError:
            why = "it is unfinished, of an older format or of another model or checkpoint"
        else:
            found.close()
            why = stale_sources(plan, store)
            if why is None:
                return
        if progress:
            print(f"expert store {store}: building it again ({why})", file=sys.stderr)
    meta = {**ident, "family": spec.family, "source": str(plan.ckpt.directory)}
    L, E = spec.num_moe_layers, spec.num_experts
    check_room(store, len(store_header(L, E, layout, meta)) + L * E * stride(layout.stored_nbytes))
    try:
        build_store(plan, store, meta, layout.dtype, progress)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise StoreError(f"expert store {store}: {unwritable(e)}") from e
