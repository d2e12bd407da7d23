"""Command-line flags derived from config dataclasses: each default, choice and help text once.

Usage:
    >>> import argparse
    >>> from tensorbend.capture.hf import DecodeConfig
    >>> p = argparse.ArgumentParser()
    >>> add_config_flags(p, DecodeConfig)
    >>> config_from_args(DecodeConfig, p.parse_args(["--decode", "teacher", "--seed", "3"]))
    DecodeConfig(decode='teacher', max_new_tokens=32, max_prompt_tokens=256, temperature=0.8, seed=3)
    >>> [a.help for a in p._actions if a.dest == "decode"][0].split(" (")[0]
    'How decode tokens are produced.'

Rules, from the field's annotation and default:
  `Literal[...]`          -> choices;     `bool` (default False) -> `--name`;
  `bool | None` (None)    -> `--name` / `--no-name` / neither (None: the kind's default);
  `bool` (default True)   -> `--no-name`; `tuple[X, ...]` -> values, repeatable and/or
                             comma-separated (`--x a b`, `--x a --x b`, `--x a,b`; `none`: empty);
  `X | None`              -> optional X;  a nested config dataclass -> its fields, flattened,
                             their defaults those of the field's default instance;
  no default              -> a required flag.
The help text is the first sentence of the attribute docstring under the field (read from the
source), followed by the default; `title=` and a nested config's `metadata={"group": TITLE}`
sort the flags into --help's option groups. `field(metadata={"choices": TABLE})` takes choices from a table defined elsewhere
(e.g. the predictor registry), `{"flags": ("--old-spelling",)}` adds aliases,
`{"cli": False}` keeps a field off the command line, and on a nested config
`{"skip": ("name", ...)}` keeps those of its fields off this command's line (they keep the
default instance's values).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from functools import cache
from pathlib import Path

from tensorbend.errors import TensorbendError


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    skip: tuple[str, ...] = (),
    required: tuple[str, ...] = (),
    positional: tuple[str, ...] = (),
    defaults=None,
    title: str | None = None,
    narrow: dict[str, tuple] | None = None,
    _root: argparse.ArgumentParser | None = None,
) -> None:
    """Add one flag per field of dataclass `cls` (nested config dataclasses flattened);
    `defaults`: an instance of `cls` whose values are the defaults (else the fields').
    title: the help's option group for `cls`'s own fields; a nested config whose field has
    `metadata={"group": TITLE}` gets a group of its own (else it joins its parent's), and so
    does a plain field with that metadata. narrow: field name -> the choices this command
    accepts of a field that has more (e.g. the policies `generate` serves)."""
    root = _root or parser
    if title and isinstance(root, argparse.ArgumentParser):
        parser = option_group(root, title)
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.metadata.get("cli", True):
            continue
        hint = hints[f.name]
        default = _default(f) if defaults is None else getattr(defaults, f.name)
        if dataclasses.is_dataclass(hint):
            inner = skip + tuple(f.metadata.get("skip", ()))
            add_config_flags(
                parser,
                hint,
                skip=inner,
                defaults=default,
                title=f.metadata.get("group"),
                narrow=narrow,
                _root=root,
            )
            continue
        kind, base = _kind(hint)
        help_text = first_clause(docs.get(f.name, ""))
        group = f.metadata.get("group")
        target = option_group(root, group) if group else parser
        if f.name in positional:
            target.add_argument(f.name, type=_converter(base), help=help_text)
            continue
        names = ["--" + f.name.replace("_", "-"), *f.metadata.get("flags", ())]
        kw: dict = {"dest": f.name, "help": help_text}
        if kind == "bool" and default is None:  # unset, --name or --no-name
            kw["action"] = argparse.BooleanOptionalAction
            target.add_argument(*names, default=None, **kw)
            continue
        if kind == "bool":
            if default is True:
                names = ["--no-" + f.name.replace("_", "-"), *f.metadata.get("flags", ())]
                kw["action"] = "store_false"
            else:
                kw["action"] = "store_true"
            target.add_argument(*names, default=bool(default), **kw)
            continue
        choices = (narrow or {}).get(f.name) or _choices(f, base)
        kw["type"] = _converter(type(choices[0]) if choices else base)
        if choices:
            kw["choices"] = list(choices)
        if kind == "tuple":
            kw.update(nargs="+", action="extend", type=str)  # split and checked in config_from_args
            kw.pop("choices", None)
            if choices:
                kw["metavar"] = "{" + ",".join(map(str, choices)) + "}"
        if default is dataclasses.MISSING or f.name in required:
            kw["required"] = True
        else:
            kw["default"] = None if kind == "tuple" else default
            shown = " ".join(map(str, default)) if kind == "tuple" else default
            if default not in (None, ()):
                kw["help"] = f"{help_text} (default: {shown})".strip()
        target.add_argument(*names, **kw)


def config_from_args(cls: type, args: argparse.Namespace, *, _base=None, _skip=(), **overrides):
    """Build `cls` from parsed flags (nested configs too, from their field's default instance);
    `overrides` win over flags."""
    hints = typing.get_type_hints(cls)
    values = {}
    ns = vars(args)
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif dataclasses.is_dataclass(hints[f.name]):
            skip = tuple(f.metadata.get("skip", ()))
            values[f.name] = config_from_args(hints[f.name], args, _base=_default(f), _skip=skip)
        elif f.name in _skip:
            continue
        elif f.name in ns and ns[f.name] is not None:
            value = ns[f.name]
            if isinstance(value, list):
                base = _kind(hints[f.name])[1]
                value = _tuple_value(value, _converter(base), _choices(f, base), f.name)
            values[f.name] = value
    return cls(**values) if _base is None else dataclasses.replace(_base, **values)


def _tuple_value(values: list[str], convert, choices, name: str) -> tuple:
    """Repeated flags and comma-separated lists both work; a lone `none` is the empty tuple."""
    items = [x for v in values for x in str(v).split(",") if x]
    if items == ["none"]:
        return ()
    flag = "--" + name.replace("_", "-")
    try:
        out = tuple(convert(x) for x in items)
    except ValueError as e:
        raise TensorbendError(f"{flag}: invalid value in {items} ({e})") from e
    bad = [x for x in out if choices and x not in choices]
    if bad:
        raise TensorbendError(
            f"{flag}: invalid choice {bad[0]!r} (choose from {', '.join(map(str, choices))}, "
            "or none)"
        )
    return out


def _choices(f: dataclasses.Field, base) -> tuple | None:
    """A field's fixed choices: metadata["choices"], or the values of its Literal type."""
    if f.metadata.get("choices"):
        return tuple(f.metadata["choices"])
    return typing.get_args(base) if typing.get_origin(base) is typing.Literal else None


@cache
def option_group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The parser's option group called `title` (made on first use): --help lists each group's
    options under its title."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def first_clause(text: str) -> str:
    """A field's help on the command line: its docstring's first clause, up to the first
    sentence end, colon or semicolon outside brackets and backticks (the guide holds the rest);
    a colon after at most three words ends a scope ("Oracle only:"), not the clause.

    >>> first_clause("Budget for the model (8GB; a unit). Overrides --cache-frac; e.g. 8GB.")
    'Budget for the model (8GB; a unit).'
    >>> first_clause("What the store keeps: auto (its own) or int4.")
    'What the store keeps.'
    >>> first_clause("Oracle only: how it ranks; more")
    'Oracle only: how it ranks.'
    >>> first_clause("Inputs, e.g. routing; more")
    'Inputs, e.g. routing.'
    >>> first_clause("Prompts JSONL (`{'id': 1}` per line): each in turn.")
    "Prompts JSONL (`{'id': 1}` per line)."
    """
    depth, code = 0, False
    for i, c in enumerate(text):
        if c == "`":
            code = not code
        elif not code and c in "([{":
            depth += 1
        elif not code and c in ")]}":
            depth -= 1
        elif depth == 0 and not code and text[i + 1 : i + 2] in (" ", ""):
            end = c == "." and (i + 2 >= len(text) or text[i + 2].isupper())
            if end or c == ";" or (c == ":" and len(text[:i].split()) > 3):
                return text[:i] + "."
    return text


def field_docs(cls: type) -> dict[str, str]:
    """{field name: its attribute docstring, whitespace-normalised} from the class source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (e.g. built in a REPL): no help text
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _kind(hint) -> tuple[str, object]:
    """("bool" | "tuple" | "scalar", the base type without None / tuple wrapping)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        assert len(args) == 1, f"unsupported config annotation {hint}"
        return _kind(args[0])
    if hint is bool:
        return "bool", bool
    if origin is tuple:
        return "tuple", typing.get_args(hint)[0]
    return "scalar", hint


def _converter(base):
    if base in (int, float, str):
        return base
    if base is Path or (isinstance(base, type) and issubclass(base, Path)):
        return Path
    return str
