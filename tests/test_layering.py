"""The import contract: folders follow the pipeline and imports point downward. Every import
statement of every module (lazy ones inside functions too), parsed with ast.

Layers, lowest first; a module imports its own folder and lower layers only, never a folder
beside it in the same layer:
    root basics (errors, atomic, memory, lookahead, host_load, flags, models, routers)
    cache/, timing/        what decides, and the time models (below both clocks)
    zoo/                   bundled models (their paths, recipes, trainer)
    capture/               hooks -> rows -> trace
    predictors/            train, evaluate, prefetch lists
    offload/, simulate/    the wall clock and event time: never each other
    serving/, engines/, report/
    root entry points (__init__, __main__, cli, demo)
Plus: no cycle between modules, and no submodule imports its own package's __init__.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from tools import architecture

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "tensorbend"
BASICS, ENTRY = set(architecture.BASICS), set(architecture.ENTRY)
LAYERS = architecture.LAYERS


def modules(pkg: Path = PKG) -> dict[str, Path]:
    """Dotted module name -> file, every module of the package."""
    out = {}
    for f in pkg.rglob("*.py"):
        parts = list(f.relative_to(pkg.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports (a name resolved to the longest module prefix;
    `from X import name` counts X.name when that is a module, else X)."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = defaultdict(set)
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                         for a in node.names]  # fmt: skip
            for n in names:
                t = resolve(n) if n.startswith("tensorbend") else None
                if t and t != m:
                    edges[m].add(t)
    return edges


def home(m: str, pkg: Path = PKG) -> str:
    """A module's place: its folder under tensorbend/, or <basics> / <entry> at the root."""
    parts = m.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (pkg / parts[1]).is_dir()):
        return parts[1]
    name = parts[1] if len(parts) == 2 else "__init__"
    return "<basics>" if name in BASICS else "<entry>" if name in ENTRY else f"<root:{name}>"


def layer(place: str) -> int:
    return next((i for i, ls in enumerate(LAYERS) if place in ls), -1)


def violations(mods: dict[str, Path], pkg: Path = PKG) -> list[str]:
    out = []
    for m, targets in sorted(imports(mods).items()):
        a = home(m, pkg)
        for t in sorted(targets):
            b = home(t, pkg)
            if a == b:
                if t == f"tensorbend.{a}" and m != t:  # a submodule importing its package
                    out.append(f"{m} imports its own package's __init__ ({t})")
                continue
            if layer(a) < 0 or layer(b) < 0:
                out.append(f"{m} ({a}) -> {t} ({b}): a root module that is no basic or entry")
            elif layer(b) >= layer(a):
                out.append(f"{m} ({a}) imports {t} ({b}): "
                           + ("beside it" if layer(b) == layer(a) else "above it"))  # fmt: skip
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_imports_point_downward_and_no_module_cycle():
    mods = modules()
    assert len(mods) > 100  # (the walk found the package)
    bad = violations(mods)
    assert not bad, "imports against the layering:\n" + "\n".join(bad)
    assert cycles(imports(mods)) == []


def test_the_root_holds_only_basics_and_entry_points():
    root = {f.stem for f in PKG.glob("*.py")}
    assert root <= BASICS | ENTRY, sorted(root - BASICS - ENTRY)
    assert len(root) <= 15


@pytest.mark.parametrize(
    "where, source, expected",
    [
        ("predictors/x", "from tensorbend.offload.store import ExpertStore\n", "above it"),
        ("offload/y", "def f():\n    from tensorbend.simulate import events\n", "beside it"),
        ("predictors/x", "from tensorbend.cache import slots\n", None),
        ("predictors/x", "from tensorbend.predictors import prefetch\n", "own package's"),
    ],
)
def test_the_contract_sees_what_it_forbids(tmp_path, where, source, expected):
    """A planted package: a module importing upward, sideways (lazily), downward (allowed) and
    from its own package's __init__ (a name defined there)."""
    pkg = tmp_path / "tensorbend"
    for folder in ("cache", "offload", "simulate", "predictors"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("prefetch = 1\n")
    for name in ("cache/slots", "offload/store", "simulate/events"):
        (pkg / f"{name}.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / f"{where}.py").write_text(source)
    got = violations(modules(pkg), pkg)
    if expected is None:
        assert got == []
    else:
        assert len(got) == 1 and expected in got[0], got


def test_cycles_are_found():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
