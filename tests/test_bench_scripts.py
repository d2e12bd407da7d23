"""The bench harness stays runnable: every bench script imports against the package and its
`--help` parses (an import of a name the package no longer has broke `bench.offload_sweep`,
and with it every `make bench-headline*` sweep, unnoticed by any other test)."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(
    i.name for i in pkgutil.iter_modules([str(ROOT / "bench")]) if not i.name.startswith("_")
)


def test_the_bench_folder_is_found():
    assert {"offload_sweep", "serve_memory", "serve_rows"} <= set(SCRIPTS)


def test_every_bench_script_imports():
    code = "import importlib, sys\nfor n in sys.argv[1:]: importlib.import_module('bench.' + n)"
    out = subprocess.run([sys.executable, "-c", code, *SCRIPTS], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize("name", ["offload_sweep", "serve_memory"])
def test_headline_scripts_parse_help(name):
    out = subprocess.run([sys.executable, "-m", f"bench.{name}", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]
