"""The optional compiler: numba's `njit` when numba is installed, else a decorator that leaves
functions as they are (and `AVAILABLE` False, so callers take their numpy/Python path).

Usage:
    from tensorbend.jit import AVAILABLE, njit

    @njit(cache=True, nogil=True)
    def kernel(x):  # compiled at its first call; cached on disk by numba between runs
        ...

    path = kernel if AVAILABLE else python_path

`TENSORBEND_JIT=0` in the environment turns it off (AVAILABLE False) with numba installed.
`AVAILABLE` is known without importing numba (which takes ~1.5 s): a module that defines
kernels imports it when it is imported, so the modules that use kernels import those lazily.
`pip install tensorbend[fast]` installs numba. Every compiled path has a reference path that
tests compare it with: cache/compiled.py (the demand replay). Serving never imports numba: the
predictors decode in numpy (numba's > 60 MB would come out of the expert cache under a memory
budget, and measured slower there: docs/serve_memory.md).
"""

from __future__ import annotations

import importlib.util
import os

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


__all__ = ["AVAILABLE", "njit"]
