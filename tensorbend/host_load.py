"""How much of this machine other processes used while something was timed.

Usage:
    >>> meter = CpuMeter()                  # a snapshot of the machine's and our CPU seconds
    >>> _ = sum(i * i for i in range(10**5))  # the timed work
    >>> load = meter.stop()
    >>> load.wall_s > 0 and load.cpus >= 1
    True
    >>> load.other_cores is None or load.other_cores >= 0
    True
    >>> HostLoad(wall_s=10.0, own_cores=1.0, other_cores=1.3, cpus=2).busy
    True
    >>> HostLoad(10.0, 1.0, None, 2).busy      # not measurable here: no warning
    False

Why it matters: every tok/s the runtime reports is a ratio between runs timed side by side,
and the `h100-pcie5-kimi` link is scaled to the resident reference's own measured layer time.
A process sharing the cores during any of those runs breaks both (the quick demo under a
two-thread matmul loop on this repo's 2-core machine put the full oracle at 0.28x of LRU), so
each timed pass records the cores others used and the callers warn (`warning`) when it is
`busy`.

On Linux the machine's busy CPU seconds are read from /proc/stat (user, nice, system, irq,
softirq, steal: a hypervisor lending our cores to another guest slows us like a local process
does) and ours from `os.times()` (every thread, and children we waited for);
other cores = (machine busy - ours) / wall seconds. Both clocks tick at 100 Hz, so a pass of a
second or more is measured to a few hundredths of a core. Where /proc/stat does not exist
`other_cores` is None.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

BUSY_CORES = 0.3
"""Other processes' average cores above which timings are reported as disturbed. An idle
machine reads 0.00 over a sleep; an offloaded run alone on this repo's 2-core machine reads
0.11-0.14 (its I/O threads wake thousands of times a second, and the kernel's tick-sampled busy
time and the process's exact run time then differ); a second process on one core reads 1.0."""

_PROC_STAT = Path("/proc/stat")
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system [idle iowait] irq softirq steal


@dataclass(frozen=True)
class HostLoad:
    """Average CPU cores in use over `wall_s` seconds: ours and everyone else's."""

    wall_s: float
    own_cores: float
    other_cores: float | None  # None: not measurable on this OS
    cpus: int

    @property
    def busy(self) -> bool:
        return self.other_cores is not None and self.other_cores > BUSY_CORES

    def to_json(self) -> dict:
        r = None if self.other_cores is None else round(self.other_cores, 3)
        return {
            "wall_s": round(self.wall_s, 3),
            "own_cores": round(self.own_cores, 3),
            "other_cores": r,
            "cpus": self.cpus,
        }


class CpuMeter:
    """Started on creation; `stop()` gives the `HostLoad` since then (and may be called again)."""

    def __init__(self):
        self._t0, self._own0, self._busy0 = time.perf_counter(), _own_s(), _machine_busy_s()

    def stop(self) -> HostLoad:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        own = (_own_s() - self._own0) / wall
        busy1 = _machine_busy_s()
        other = None
        if busy1 is not None and self._busy0 is not None:
            other = max(0.0, (busy1 - self._busy0) / wall - own)
        return HostLoad(wall, own, other, os.cpu_count() or 1)


def warning(other_cores: dict[str, float | None], cpus: int) -> str | None:
    """One line naming the passes (label -> their `other_cores`) that others disturbed, worst
    first, or None when none was above `BUSY_CORES`.

    >>> print(warning({"lru": 0.02, "oracle": 1.31, "reference": 0.4}, cpus=2))  # doctest: +ELLIPSIS
    other processes used CPU while this was timed (average cores of 2: oracle 1.31, reference 0.40...
    >>> warning({"lru": 0.02, "x": None}, cpus=2) is None
    True
    """
    hit = sorted(
        ((x, k) for k, x in other_cores.items() if x is not None and x > BUSY_CORES), reverse=True
    )
    if not hit:
        return None
    shown = ", ".join(f"{k} {x:.2f}" for x, k in hit[:3])
    more = f" and {len(hit) - 3} more" if len(hit) > 3 else ""
    return (
        f"other processes used CPU while this was timed (average cores of {cpus}: {shown}{more}; "
        f"above {BUSY_CORES} disturbs timing): tok/s and their ratios are not reliable, and the "
        "emulated link is scaled to the resident run's layer time, slowed too; rerun on an idle "
        "machine"
    )


# ------------------------------------------------------------ helpers


def _own_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _machine_busy_s() -> float | None:
    try:
        line = _PROC_STAT.read_text().split("\n", 1)[0]
    except OSError:
        return None
    fields = line.split()
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    return sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks)) / os.sysconf("SC_CLK_TCK")
