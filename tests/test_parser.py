"""The command line's shape: every verb's help grouped and with examples, `run` an alias of
`measure`, every example parsing with the verb's own parser."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys

import pytest

from tensorbend.cli import _flags, _verbs
from tensorbend.command_line import quick_check
from tensorbend.parser import EXAMPLES, build_parser, verb_paths


def _verb(parser, path):
    for word in path:
        [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[word]
    return parser


def test_generate_help_shows_its_groups_and_examples():
    text = _verb(build_parser(_verbs()), ["generate"]).format_help()
    groups = ["model and prompts:", "decoding:", "memory and store:", "prediction:"]
    groups += ["cache policy:", "output:", "examples:"]
    at = [text.index(g) for g in groups]
    assert at == sorted(at), "groups out of the pipeline's order"
    section = {g: text[a:b] for g, a, b in zip(groups, at, [*at[1:], len(text)], strict=True)}
    assert "  --max-memory" in section["memory and store:"]
    assert "  --predictor" in section["prediction:"]
    assert "  --policy" in section["cache policy:"]


def test_measure_is_run():
    parser = build_parser(_verbs())
    a = parser.parse_args(["measure", "--model", "m"])
    b = parser.parse_args(["run", "--model", "m"])
    assert a.func is b.func is _verbs()["measure"]
    assert vars(a) == {**vars(b), "verb": "measure"}


@pytest.mark.parametrize("key", sorted(EXAMPLES))
def test_every_example_parses_as_its_verb(key):
    """Each example in a verb's help calls tensorbend (after a launcher, such as torchrun, or
    an environment setting) with flags its parser accepts; one at least calls the verb itself."""
    parser = build_parser(_verbs())
    assert tuple(key.split()) in verb_paths(parser)
    called = []
    for example in EXAMPLES[key]:
        words = shlex.split(example)
        start = next(i for i, w in enumerate(words) if w.split("/")[-1] == "tensorbend")
        quick_check(words[start + 1 :], _flags())  # (the pre-import check lets it through)
        args = parser.parse_args(words[start + 1 :])
        called.append(args.func)
    assert _verbs()[key] in called


def test_the_flag_table_is_the_parsers():
    """tensorbend/data/cli_flags.json (what the CLI checks before importing torch) lists every
    verb, alias and flag the parser has, and no other."""
    from tools.cli_reference import flags

    assert json.loads(flags()) == _flags(), "run `python tools/cli_reference.py`"
    assert {"generate", "measure", "run", "trace info", "store build", ""} <= set(_flags())


def test_a_bad_verb_or_flag_is_refused_before_torch_is_imported():
    """Misspelled verbs and flags get argparse's kind of line, exit 2, without importing torch
    or transformers (which take seconds); abbreviations argparse accepts pass through."""
    code = (
        "import sys; from tensorbend.cli import main\n"
        "for argv in (['generate', '--bogus'], ['genrate'], ['trace', 'infoo']):\n"
        "    assert main(argv) == 2\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.stdout.split() == ["False", "False"], run.stderr
    err = run.stderr.splitlines()
    assert err == [
        "error: tensorbend generate: unrecognized arguments: --bogus (see `tensorbend "
        "generate --help`)",
        "error: tensorbend: argument VERB: invalid choice: 'genrate' (choose from collect, demo, "
        "eval, generate, live, measure, run, simulate, store, trace, train, zoo) (see "
        "`tensorbend --help`)",
        "error: tensorbend trace: argument VERB: invalid choice: 'infoo' (choose from export, "
        "import, info, resplit) (see `tensorbend trace --help`)",
    ]
    quick_check(["generate", "--max-mem", "1GB", "--prompt", "--", "--anything"], _flags())
