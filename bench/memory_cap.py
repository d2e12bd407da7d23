"""Run a command as if the machine had only so much memory: a Linux memory cgroup caps what it
may hold, the page cache its reads fill included.

Usage:
    >>> run = run_capped([sys.executable, "-c", "print(1)"], 512 * 2**20)  # doctest: +SKIP
    >>> run.returncode, run.stdout, run.max_usage_bytes, run.oom_kills     # doctest: +SKIP

Why: a process's RSS does not count the page cache, and pages it maps from files are
reclaimable, so on a machine with RAM to spare a run that streams a checkpoint from disk can
be served from memory the budget never granted. Inside a cap of baseline + budget the kernel
evicts those pages as it would on a small machine, and a run that needs more anonymous
memory than the cap is killed (counted in `oom_kills`).

Needs root and a writable memory controller: cgroup v2 (`memory.max`, with `memory` in the
root's `cgroup.subtree_control`) or cgroup v1 (`/sys/fs/cgroup/memory`). `unavailable()`
says why not, when it cannot be used; `run_capped` raises `TensorbendError` with that reason.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from tensorbend.errors import TensorbendError

ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CappedRun:
    """What a command run under a memory cap did."""

    returncode: int
    stdout: str
    stderr: str
    limit_bytes: int
    max_usage_bytes: int | None
    """The cgroup's high-water mark (its page cache included); None where the kernel keeps none."""
    oom_kills: int
    """Processes the kernel killed for exceeding the cap."""


def unavailable(root: Path = ROOT) -> str | None:
    """Why no memory cap can be set here, or None when one can."""
    if _v2(root) is None and _v1(root) is None:
        return (
            f"expected a writable memory cgroup (v2: memory in {root}/cgroup.subtree_control; "
            f"v1: {root}/memory), found neither; run as root on Linux with the memory "
            f"controller mounted, or without a memory cap"
        )
    return None


def run_capped(cmd: list[str], limit_bytes: int, env: dict | None = None,
               root: Path = ROOT) -> CappedRun:  # fmt: skip
    """Run `cmd` (and its children) in a fresh memory cgroup capped at `limit_bytes`."""
    if why := unavailable(root):
        raise TensorbendError(f"memory cap: {why}")
    parent = _v2(root)
    v2 = parent is not None
    group = (parent if v2 else _v1(root)) / f"tensorbend-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit_bytes))
        procs = str(group / "cgroup.procs")

        def enter() -> None:  # in the child, before exec: its children inherit the group
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        out = subprocess.run(cmd, capture_output=True, text=True, env=env, preexec_fn=enter)
        peak = group / ("memory.peak" if v2 else "memory.max_usage_in_bytes")
        usage = int(peak.read_text()) if peak.exists() else None
        events = group / ("memory.events" if v2 else "memory.oom_control")
        kills = _field(events.read_text(), "oom_kill") if events.exists() else 0
        return CappedRun(out.returncode, out.stdout, out.stderr, limit_bytes, usage, kills)
    finally:
        group.rmdir()


# ------------------------------------------------------------ helpers


def _v2(root: Path) -> Path | None:
    """The cgroup v2 root whose children get a memory controller, if writable."""
    ctl = root / "cgroup.subtree_control"
    try:
        ok = "memory" in ctl.read_text().split() and os.access(root, os.W_OK)
    except OSError:
        return None
    return root if ok else None


def _v1(root: Path) -> Path | None:
    mem = root / "memory"
    ok = (mem / "memory.limit_in_bytes").exists() and os.access(mem, os.W_OK)
    return mem if ok else None


def _field(text: str, key: str) -> int:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return 0
