"""`cache/` decides and imports nothing above it (issue 40): every import statement of every
module under tensorbend/cache, at any depth (lazy imports inside functions too), parsed with ast.
And THE replay's numba (> 60 MB of a serving memory budget) loads only where a replay runs."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import tensorbend

ABOVE = ("foresight", "offload", "predictors", "prefetch", "serving", "simulate")
CACHE = Path(tensorbend.__file__).parent / "cache"


def _imported(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module == "tensorbend"  # (from tensorbend import foresight)
            names += [f"tensorbend.{a.name}" for a in node.names] if top else [node.module]
    return names


def _upward(name: str) -> bool:
    return any(name == f"tensorbend.{m}" or name.startswith(f"tensorbend.{m}.") for m in ABOVE)


def test_cache_imports_nothing_above_it():
    found = {
        f"{p.relative_to(CACHE.parent)}: {name}"
        for p in sorted(CACHE.rglob("*.py"))
        for name in _imported(p)
        if _upward(name)
    }
    assert not found, f"cache/ must not import {', '.join(ABOVE)}: {sorted(found)}"
    assert len(list(CACHE.rglob("*.py"))) > 10  # (the walk found the package)


def test_the_check_sees_lazy_and_from_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import tensorbend.errors\n"
        "def f():\n    from tensorbend import foresight\n"
        "    from tensorbend.predictors.base import LOOKAHEADS\n"
    )
    assert [n for n in _imported(src) if _upward(n)] == [
        "tensorbend.foresight",
        "tensorbend.predictors.base",
    ]


def test_serving_imports_no_numba_and_a_replay_loads_it():
    """Importing the serving path, the CLI and the replay's callers leaves numba out; the first
    replay brings it in (cache/replay.py imports its kernel lazily)."""
    code = (
        "import sys\n"
        "import tensorbend.cli, tensorbend.serving, tensorbend.generate, tensorbend.offload.build\n"
        "import tensorbend.foresight, tensorbend.zoo.realism, tensorbend.simulate.runs\n"
        "from tensorbend.cache.replay import ReplayConfig, replay\n"
        "before = 'numba' in sys.modules\n"
        "replay([[[0, 1]], [[1, 2]]], ReplayConfig('lru', 2))\n"
        "print(before, 'numba' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(CACHE.parent.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
