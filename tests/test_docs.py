"""Docs that cannot drift: every `>>>` usage block in the package runs as a doctest."""

import doctest
import importlib
import pkgutil

import pytest

import tensorbend


def _root():
    return pkgutil.ModuleInfo(None, "tensorbend", True)


def _modules_with_examples() -> list[str]:
    names = []
    for info in [*pkgutil.walk_packages(tensorbend.__path__, "tensorbend."), _root()]:
        if info.name == "tensorbend.__main__":
            continue
        mod = importlib.import_module(info.name)
        if ">>>" in (mod.__doc__ or "") or any(
            ">>>" in (getattr(obj, "__doc__", None) or "") for obj in vars(mod).values()
        ):
            names.append(info.name)
    return names


@pytest.mark.parametrize("name", _modules_with_examples())
def test_usage_examples_run(name):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(importlib.import_module(name), optionflags=flags, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"


def test_every_public_name_resolves():
    assert 20 <= len(tensorbend.__all__) <= 30
    for name in tensorbend.__all__:
        assert getattr(tensorbend, name) is not None, name
