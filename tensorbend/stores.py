"""Expert stores on disk: one process builds a store at a time, the others wait and reuse it.

Usage:
    with store_lock(Path("stores/my-moe-1a2b3c4d/experts-float32.safetensors")):
        ...  # check the store, build it if needed: a second process waits here, then reuses it

The lock is `fcntl.flock` on `NAME.lock` beside the store (never deleted: removing a lock file
another process may hold would let a third one in). The kernel releases it when its holder
exits, so a killed build never leaves a stale lock. On a folder where no lock file can be
created (read-only), no lock is taken: nothing can be built there anyway.
"""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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
