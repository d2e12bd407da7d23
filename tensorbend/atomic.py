"""Atomic file writes: a temporary name in the same directory, fsync, then rename into place.

Usage:
    >>> from tensorbend.atomic import atomic_write_text, atomic_save_tensors
    >>> import tempfile, torch; d = Path(tempfile.mkdtemp())
    >>> _ = atomic_write_text(d / "manifest.json", "{}")
    >>> _ = atomic_save_tensors({"x_N": torch.zeros(3)}, d / "x.safetensors", {"format_version": "1"})
    >>> sorted(p.name for p in d.iterdir())
    ['manifest.json', 'x.safetensors']

A reader (or a process killed at any instant) sees either the old file or the whole new one,
never a prefix: `os.replace` is atomic on POSIX, and the fsync before it makes sure the bytes
reach the disk before the name does. Every artifact tensorbend writes (trace shards and
manifests, predictor checkpoints, the expert store, zoo checkpoints) goes through here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

import torch


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Call `write(f)` on a temporary file next to `path`, fsync it, rename it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | Path, data: bytes | Iterable[bytes]) -> Path:
    """Write bytes (or an iterable of byte chunks, streamed) atomically."""
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data

    def write(f: BinaryIO) -> None:
        for c in chunks:
            f.write(c)

    return atomic_write(path, write)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def write_generated(path: str | Path, text: str, check: bool = False) -> int:
    """Write a generated doc atomically, or with `check` only compare: 0 when equal, else 1.

    The exit status of every `--check` flag of the doc generators (tools/pages.py, tools/report.py, ...).
    """
    path = Path(path)
    if check:
        return 0 if path.is_file() and path.read_text() == text else 1
    atomic_write_text(path, text)
    return 0


def atomic_save_tensors(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> Path:
    """safetensors `save` of contiguous CPU tensors, atomically."""
    from safetensors.torch import save

    blob = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)
    return atomic_write_bytes(path, blob)


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (the directory entry), where the OS allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # e.g. a platform without directory fds: the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; atomicity does not depend on it
    finally:
        os.close(fd)
