"""Memory caps (bench/memory_cap.py): a real cgroup, real processes. Skipped where no writable memory
cgroup exists (not root, no Linux memory controller)."""

import sys
from pathlib import Path

import pytest

from bench import memory_cap
from tensorbend.errors import TensorbendError

needs_cgroup = pytest.mark.skipif(memory_cap.unavailable() is not None,
                                  reason="no writable memory cgroup here")  # fmt: skip
MB = 2**20


def _no_swap() -> bool:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("SwapTotal:"):
            return int(line.split()[1]) == 0
    return False


@needs_cgroup
def test_reads_through_the_page_cache_stay_within_the_cap(tmp_path):
    """Reading a 192 MB file (buffered) under a 96 MB cap succeeds: the page cache it fills is
    charged to the cap and evicted, so the group never holds more than the cap."""
    f = tmp_path / "blob"
    with open(f, "wb") as out:
        for _ in range(192):
            out.write(b"\1" * MB)
    code = f"f = open({str(f)!r}, 'rb')\nwhile f.read(1 << 20): pass\nprint('read')"
    run = memory_cap.run_capped([sys.executable, "-c", code], 96 * MB)
    assert run.returncode == 0 and run.stdout.strip() == "read", run.stderr
    assert run.oom_kills == 0
    assert run.max_usage_bytes is None or run.max_usage_bytes <= 96 * MB


@needs_cgroup
@pytest.mark.skipif(not _no_swap(), reason="with swap the kernel pages out instead of killing")
def test_anonymous_memory_beyond_the_cap_is_killed():
    code = "import numpy as np\nx = np.ones(160 * 2**20, dtype=np.uint8)\nprint(int(x.sum()))"
    run = memory_cap.run_capped([sys.executable, "-c", code], 96 * MB)
    assert run.returncode != 0 and run.oom_kills >= 1
    ok = memory_cap.run_capped([sys.executable, "-c", code], 512 * MB)
    assert ok.returncode == 0 and ok.stdout.strip() == str(160 * MB) and ok.oom_kills == 0
    assert ok.max_usage_bytes is None or ok.max_usage_bytes >= 160 * MB


def test_no_memory_controller_is_a_clear_error(tmp_path):
    assert "expected a writable memory cgroup" in memory_cap.unavailable(tmp_path)
    with pytest.raises(TensorbendError, match="run as root on Linux"):
        memory_cap.run_capped(["true"], 96 * MB, root=tmp_path)
