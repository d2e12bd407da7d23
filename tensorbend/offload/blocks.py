"""4096-byte blocks: the alignment an O_DIRECT read needs, buffers that have it, and the read.

Usage:
    reader = DirectReader(os.open(path, os.O_RDONLY | os.O_DIRECT))
    reader.read(buf[0], offset, nbytes)                    # offset: a block boundary
    >>> buf = aligned_empty(2, 5, torch.float32)          # rows start on a block
    >>> [buf[i].data_ptr() % ALIGN for i in range(2)], stride(10)
    ([0, 0], 4096)

The expert store (offload/store.py) starts every expert on a block of its file and pads it to
`stride(nbytes)`, and the cache's CPU slots are rows of `aligned_empty`, so a direct read lands
in a slot with no copy: the expert's whole blocks go straight into it and its last partial
block through a one-block bounce buffer, in one `preadv`. Into any other buffer the read goes
through a bounce buffer of its size and a tensor copy (`bounced_reads` counts those), which
releases the interpreter lock (a memoryview copy would hold it: `python -m bench.copy_lock`).
A read given `pause` (a prefetch's) goes in `PAUSE_CHUNK`-byte parts and calls it between them.
"""

from __future__ import annotations

import mmap
import os
import threading

import torch

ALIGN = 4096
"""O_DIRECT alignment of offsets, sizes and buffers."""
PAUSE_CHUNK = 4 << 20
"""Bytes of a paused (prefetch) direct read between two `pause` calls: large enough that the
disk keeps its pace (a 4 MiB O_DIRECT read streams as a whole expert does), small enough that
a demand read arriving meanwhile waits for at most that much of a prefetch."""


def stride(nbytes: int) -> int:
    """nbytes rounded up to whole blocks (in the store: from one expert's start to the next's).

    >>> stride(4096), stride(4097), stride(10)
    (4096, 8192, 4096)
    """
    return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(rows: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, numel] of `dtype` whose every row starts on a 4096-byte boundary (rows are
    `stride` bytes apart): direct reads land in each row with no copy.

    >>> t = aligned_empty(3, 5, torch.float32)
    >>> t.shape, [t[i].data_ptr() % 4096 for i in range(3)], t[1].is_contiguous()
    (torch.Size([3, 5]), [0, 0, 0], True)
    """
    itemsize = dtype.itemsize
    assert ALIGN % itemsize == 0, dtype
    row = stride(numel * itemsize) // itemsize
    raw = torch.empty(rows * row + ALIGN // itemsize, dtype=dtype)
    skip = (-raw.data_ptr() % ALIGN) // itemsize
    return raw[skip : skip + rows * row].view(rows, row)[:, :numel]


class DirectReader:
    """Positional O_DIRECT reads from `fd` (opened with O_DIRECT); thread-safe, one bounce
    buffer per thread."""

    def __init__(self, fd: int):
        self.fd = fd
        self.bounced_reads = 0  # reads that went through a bounce buffer and a copy
        self._local = threading.local()

    def read(self, out_flat: torch.Tensor, offset: int, nbytes: int, pause=None) -> int:
        """Read nbytes at `offset` (a block boundary) into the contiguous `out_flat`; returns
        the bytes read. Into an aligned buffer: its whole blocks straight into it, the last
        partial block into a one-block bounce buffer, in one preadv, then that block's few
        bytes copied. Otherwise: the blocks into a bounce buffer, then a tensor copy (it
        releases the interpreter lock: a memoryview slice copy held it, and an 18 MB expert
        stalled the compute thread's Python for its ~3 ms copy)."""
        out = out_flat.view(torch.uint8)
        assert offset % ALIGN == 0, "every read starts on a block"
        if out.data_ptr() % ALIGN == 0:
            body = nbytes - nbytes % ALIGN
            if pause is not None and body > PAUSE_CHUNK:  # the leading parts, then the rest
                for at in range(0, body - PAUSE_CHUNK, PAUSE_CHUNK):
                    if at:
                        pause()
                    got = os.preadv(
                        self.fd, [memoryview(out[at : at + PAUSE_CHUNK].numpy())], offset + at
                    )
                    if got < PAUSE_CHUNK:
                        return at + got
                    done = at + PAUSE_CHUNK
                pause()
                return done + self.read(out[done:], offset + done, nbytes - done)
            iov = [memoryview(out[:body].numpy())] if body else []
            tail = nbytes - body
            if tail:
                mm, mm_t = self._bounce(ALIGN)
                iov.append(memoryview(mm)[:ALIGN])
            got = os.preadv(self.fd, iov, offset)
            if tail and got > body:
                out[body:nbytes].copy_(mm_t[: min(tail, got - body)])
            return min(got, nbytes)
        self.bounced_reads += 1
        mm, mm_t = self._bounce(stride(nbytes))
        got = min(nbytes, os.preadv(self.fd, [memoryview(mm)[: stride(nbytes)]], offset))
        out[:got].copy_(mm_t[:got])
        return got

    def _bounce(self, n: int) -> tuple[mmap.mmap, torch.Tensor]:
        """This thread's page-aligned bounce buffer of at least n bytes (and a tensor on it)."""
        bounce = getattr(self._local, "bounce", None)
        if bounce is None or len(bounce[0]) < n:
            mm = mmap.mmap(-1, n)  # page-aligned
            bounce = self._local.bounce = (mm, torch.frombuffer(mm, dtype=torch.uint8))
        return bounce
