"""The optional compiler: numba's `njit` when numba is installed, else a decorator that leaves
functions as they are (and `AVAILABLE` False, so callers take their numpy/Python path).

Usage:
    from tensorbend.jit import AVAILABLE, njit

    @njit(cache=True, nogil=True)
    def kernel(x):  # compiled at its first call; cached on disk by numba between runs
        ...

    path = kernel if AVAILABLE else python_path

`TENSORBEND_JIT=0` in the environment turns it off (AVAILABLE False) with numba installed:
numba and its compiled kernels add to a process's resident set what a tight `--max-memory`
budget may rather give to the expert cache (the reference paths cost more CPU per token
instead; `tensorbend generate` prints the plan's split either way).

`AVAILABLE` is known without importing numba (which takes ~1.5 s): a module that defines
kernels imports it when it is imported, so the modules that use kernels import those lazily
(prefetch.py, predictors/residual_fast.py, predictors/horizon_fast.py load
predictors/decode_kernels.py only when they first need a kernel). Every compiled path has a
reference path that tests compare it with: predictors/decode_kernels.py (the runtime's
one-token scoring). THE cache replay (cache/kernel.py) imports numba itself: it has no
Python path to fall back to (its test oracle is the runtime's index, bench/index_replay.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

AVAILABLE = (
    os.environ.get("TENSORBEND_JIT", "1") != "0" and importlib.util.find_spec("numba") is not None
)


def njit(*args, **kw):
    """numba.njit(*args, **kw) when numba is installed; else the function itself."""
    if AVAILABLE:
        from numba import njit as numba_njit

        return numba_njit(*args, **kw)
    if len(args) == 1 and callable(args[0]) and not kw:
        return args[0]
    return lambda fn: fn


def kernels():
    """predictors/decode_kernels.py, imported at the first call (and numba with it)."""
    name = "tensorbend.predictors.decode_kernels"
    return sys.modules.get(name) or importlib.import_module(name)


__all__ = ["AVAILABLE", "kernels", "njit"]
