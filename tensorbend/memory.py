"""Sizes and memory facts, one home each: byte sizes from the command line, this process's
resident set and bytes read from storage, the machine's physical memory, the KV cache's bytes per token, and the device check.

Usage:
    >>> parse_bytes("8GB"), parse_bytes("512MiB"), parse_bytes(" 1.5kb "), parse_bytes("100B")
    (8000000000, 536870912, 1500, 100)
    >>> parse_bytes(1.5e9), parse_bytes(4096)   # Python numbers are bytes
    (1500000000, 4096)
    >>> parse_bytes("lots", "--reserve")
    Traceback (most recent call last):
    ...
    tensorbend.errors.TensorbendError: --reserve 'lots': expected a size such as 8GB, 512MB, 4GiB or 1000B
    >>> parse_bytes("100")
    Traceback (most recent call last):
    ...
    tensorbend.errors.TensorbendError: --max-memory '100': expected a size with a unit, found a bare number; write 100GB, 100MiB, or 100B for bytes
    >>> check_device("cpu")
    >>> check_device("gpu")
    Traceback (most recent call last):
    ...
    tensorbend.errors.TensorbendError: --device 'gpu': expected cpu, cuda or cuda:N
    >>> peak_rss_bytes() >= (rss_bytes() or 0) > 0
    True

Sizes stay in bytes from the flag to the slot table: `cache.config.PolicyConfig.slots` is the
one place a byte budget becomes cache slots.
"""

from __future__ import annotations

import os
import re
import resource
import sys

import torch

from tensorbend.errors import TensorbendError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_bytes(text: str | int | float, flag: str = "--max-memory") -> int:
    """'8GB' / '512MB' / '64KiB' / '1000B' -> bytes (decimal GB/MB/KB, binary GiB/MiB/KiB); a
    string needs its unit (a bare '100' is refused: bytes or megabytes?), a Python int or
    integral float is bytes. `flag` names the option in the error."""
    if isinstance(text, float) and text.is_integer():
        text = int(text)
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 1:
            raise TensorbendError(f"{flag} {text}: expected a size of at least one byte")
        return text
    if not isinstance(text, str):
        raise TensorbendError(
            f"{flag} {text!r}: expected a size such as '8GB' or a whole number of bytes, "
            f"found {type(text).__name__}"
        )
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num) :].strip()
    try:
        value = float(num) * _UNITS[unit]
    except (ValueError, KeyError):
        raise TensorbendError(
            f"{flag} {text!r}: expected a size such as 8GB, 512MB, 4GiB or 1000B"
        ) from None
    if not 1 <= value < float("inf"):  # nan fails every comparison
        raise TensorbendError(
            f"{flag} {text!r}: expected a finite size of at least one byte, such as 8GB"
        )
    if not unit:
        n = num.strip()
        how = f"write {n}GB, {n}MiB, or {n}B for bytes"
        if value >= 1e4 or not n.replace(".", "").isdigit():  # 1e9, 100000: bytes, surely
            how = f"write {int(value)}B for {int(value):,} bytes ({_decimal(value)})"
        raise TensorbendError(
            f"{flag} {text!r}: expected a size with a unit, found a bare number; {how}"
        )
    return int(value)


def _decimal(n: float) -> str:
    """A byte count in the largest decimal unit it reaches: 1e9 -> '1GB'."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{n:g}B"


def physical_bytes(device: str) -> int | None:
    """The physical memory of `device` (cpu: the machine's RAM; cuda[:N]: the GPU's), or None
    where it cannot be read."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device).index or 0).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_device(device: str) -> None:
    """TensorbendError unless `device` is cpu, or cuda[:N] on a torch that has CUDA."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise TensorbendError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise TensorbendError(
            f"--device {device}: expected a CUDA device, found none (torch "
            f"{torch.__version__}); use --device cpu"
        )


def peak_rss_bytes() -> int:
    """This process's peak resident set (anonymous and mapped file pages), in bytes.

    Linux: VmHWM of /proc/self/status, this address space's own high-water mark. Not
    getrusage's ru_maxrss, which a process started by fork or vfork and exec inherits from its
    parent (the kernel carries the parent's peak across exec): a child of a large process
    reports the parent's peak. Elsewhere ru_maxrss (kilobytes on Linux, bytes on macOS)."""
    hwm = _proc_status_bytes(b"VmHWM:")
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def rss_bytes() -> int | None:
    """This process's resident set now (VmRSS of /proc/self/status), or None off Linux."""
    return _proc_status_bytes(b"VmRSS:")


def disk_read_bytes() -> int:
    """Bytes this process (all its threads) has read from storage so far: read_bytes of
    /proc/self/io (page-cache hits excluded, O_DIRECT reads included); 0 where unavailable."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """KV-cache bytes per token at batch 1: keys and values of every decoder layer."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(c, "num_attention_heads", 1)
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head = getattr(c, "head_dim", None) or c.hidden_size // heads
    k_dim = getattr(c, "qk_nope_head_dim", 0) + getattr(c, "qk_rope_head_dim", 0) or head
    v_dim = getattr(c, "v_head_dim", None) or head
    return c.num_hidden_layers * kv_heads * (k_dim + v_dim) * dtype.itemsize


def _proc_status_bytes(field: bytes) -> int | None:
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None
