"""THE replay's numba (> 60 MB of a serving memory budget) loads only where a replay runs. (That
`cache/` imports nothing above it is tests/test_layering.py's import contract.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_serving_imports_no_numba_and_a_replay_loads_it():
    """Importing the serving path, the CLI and the replay's callers leaves numba out; the first
    replay brings it in (cache/replay.py imports its kernel lazily)."""
    code = (
        "import sys\n"
        "import tensorbend.cli, tensorbend.serving.offloaded, tensorbend.serving.generate, tensorbend.offload.build\n"
        "import tensorbend.predictors.foresight, tensorbend.zoo.realism, tensorbend.simulate.runs\n"
        "from tensorbend.cache.replay import ReplayConfig, replay\n"
        "before = 'numba' in sys.modules\n"
        "replay([[[0, 1]], [[1, 2]]], ReplayConfig('lru', 2))\n"
        "print(before, 'numba' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
