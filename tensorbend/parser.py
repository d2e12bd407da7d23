"""The command line's parser: every verb in pipeline order, its flags in titled groups (from the
config dataclasses, `flags.py`), and 2-3 examples each.

Usage:
    parser = build_parser({"collect": fn, "trace info": fn, ...})   # cli.py passes its verbs
    verb_paths(parser)          # [("collect",), ("trace", "info"), ...]: docs/cli.md's order

Errors are one line: `_Parser.error` raises `UsageError`, which `cli.main` prints as `error: ...`
with exit code 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from tensorbend.command_line import UsageError, joined_sizes
from tensorbend.flags import add_config_flags, option_group

SENTENCE = (
    "tensorbend serves Mixture-of-Experts checkpoints larger than memory: the routed experts "
    "stay on disk, a bounded cache holds the ones in use, and routing predicted ahead of the "
    "router prefetches them."
)
"""What tensorbend is, in one sentence (the same in pyproject.toml, the package docstring and
the README)."""

EXAMPLES = {
    "collect": [
        "tensorbend collect --model zoo:default --out runs/t --decode teacher "
        "--features ids weights gate_input layer_input",
        "torchrun --nproc-per-node 2 -m tensorbend collect --model DIR --out runs/t",
        "tensorbend collect --engine vllm --model zoo:qwen3moe-tiny --out runs/tv",
    ],
    "trace info": ["tensorbend trace info runs/t", "tensorbend trace info runs/t --json"],
    "trace import": ["tensorbend trace import --source csv routing.csv --out runs/imported"],
    "trace resplit": ["tensorbend trace resplit runs/t --test-topics poetry,python --out runs/td"],
    "trace export": ["tensorbend trace export runs/t --out routing.csv"],
    "train": [
        "tensorbend train --trace runs/t --out ours_d1.safetensors --lookahead d1",
        "tensorbend train --trace runs/t --predictor horizon --out horizon.safetensors",
        "tensorbend train --trace runs/t --predictor seed_mlp --out seed.safetensors",
    ],
    "eval": [
        "tensorbend eval --trace runs/t --predictor ours_d1.safetensors --baselines all",
        "tensorbend eval --trace runs/t --predictor ours_d1.safetensors --json eval.json "
        "--plots plots/",
    ],
    "generate": [
        'tensorbend generate --model DIR --prompt "Explain MoE offloading." --max-memory 8GB '
        "--io direct",
        'tensorbend generate --model DIR --store-dtype int4 --max-memory 8GB --prompt "..."',
        "tensorbend generate --model zoo:default --prompts p.jsonl --max-memory 120MB --policy "
        "prefetch --predictor ours_d1.safetensors --json summary.json",
    ],
    "measure": [
        "tensorbend measure --model zoo:default --policy lru --cache-frac 0.25 --json r.json",
        "tensorbend measure --model zoo:default --policy prefetch --predictor ours_d1.safetensors "
        "--link h100-pcie5-kimi",
    ],
    "simulate": [
        "tensorbend simulate --trace runs/t --hardware dgx-spark --geometry kimi-k2.5",
        "tensorbend simulate --trace runs/t --hardware h100-pcie5 --geometry deepseek-v3 "
        "--policy prefetch --predictor ours_d1.safetensors --json sim.json",
    ],
    "live": [
        "VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/tensorbend live --engine vllm "
        "--model zoo:qwen3moe-tiny --predictor ours_d1.safetensors",
    ],
    "store build": ["tensorbend store build --model DIR --dtype bfloat16"],
    "store list": ["tensorbend store list", "tensorbend store list --json"],
    "store prune": ["tensorbend store prune"],
    "store verify": ["tensorbend store verify --model DIR --dtype bfloat16"],
    "store rm": ["tensorbend store rm my-moe-checkpoint", "tensorbend store rm --partial"],
    "zoo list": ["tensorbend zoo list"],
    "zoo path": ["tensorbend zoo path default"],
    "zoo card": ["tensorbend zoo card runs/t --json card.json"],
    "zoo corpus": ["tensorbend zoo corpus --out runs/corpus"],
    "zoo train": [
        "tensorbend zoo corpus --out runs/corpus",
        "tensorbend zoo train --arch deepseek_v3 --corpus runs/corpus --out runs/zoo/mine "
        "--minutes 50",
    ],
    "demo": ["tensorbend demo", "tensorbend demo --quick --out runs/demo"],
}
"""Each verb's examples, shown under its --help."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (`error: ...`) and exit 2 through `cli.main`."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(joined_sizes(args), namespace)


def build_parser(funcs: dict[str, Callable]) -> argparse.ArgumentParser:
    """The whole CLI: verbs in pipeline order, each calling `funcs[its name]`."""
    from tensorbend.capture.collect import CollectConfig
    from tensorbend.demo import DemoConfig
    from tensorbend.engines.importers import ImportConfig
    from tensorbend.engines.vllm_live import LiveConfig
    from tensorbend.offload.runner import RunConfig
    from tensorbend.predictors.evaluate import EvalConfig
    from tensorbend.predictors.train import TrainConfig
    from tensorbend.serving.generate import GenerateConfig
    from tensorbend.serving.offloaded import SERVED_PEERS, SERVED_POLICIES
    from tensorbend.simulate.simulator import SimulateConfig
    from tensorbend.version import __version__

    p = _Parser(prog="tensorbend", description=SENTENCE)
    p.add_argument("--version", action="version", version=f"tensorbend {__version__}")
    sub = p.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    verb = _Verbs(sub, funcs)

    add_config_flags(
        verb("collect", "run prompts through a model and record exact routing"),
        CollectConfig,
        title="model and prompts",
    )
    _trace_parser(sub, funcs, ImportConfig)
    add_config_flags(verb("train", "train a predictor on a trace"), TrainConfig, title="training")
    ev = verb("eval", "score predictors and peers on held-out prompts")
    add_config_flags(ev, EvalConfig, title="evaluation")
    _json(ev, "write the report as JSON (keys in docs/guide/formats.md)")
    option_group(ev, "output").add_argument("--plots", help="directory for PNG plots")

    gn = verb("generate", "serve a model larger than memory: stream text, one summary line")
    add_config_flags(
        gn,
        GenerateConfig,
        skip=("foresight", "lookahead", "oracle_beyond"),  # (the oracle's: `measure` only)
        narrow={"policy": SERVED_POLICIES, "baseline": SERVED_PEERS},
        title="model and prompts",
    )
    option_group(gn, "decoding").add_argument(
        "--sample", action="store_true", help="Sample instead of greedy decoding."
    )
    _json(gn, "write the summary as JSON (keys in docs/guide/serving.md)")
    rn = verb(
        "measure",
        "a measured offloaded run beside a resident reference (alias: run)",
        aliases=("run",),
    )
    add_config_flags(rn, RunConfig, title="model and measurement")
    _json(rn, "write the result as JSON (keys in docs/guide/formats.md)")
    sm = verb("simulate", "simulate offloaded decode of a trace on a geometry + hardware")
    add_config_flags(
        sm, SimulateConfig, skip=("progress", "predictor", "baseline"), title="simulation"
    )
    _json(sm, "write the results as JSON (keys in docs/guide/formats.md)")
    lv = verb("live", "vLLM: a predictor inside vLLM's forward, live recall and cost")
    add_config_flags(lv, LiveConfig, title="vLLM and the predictor")
    _json(lv, "write the report as JSON")
    _store_parser(sub, funcs)
    _zoo_parser(sub, funcs)
    add_config_flags(
        verb("demo", "the whole chain on the bundled model, with a report"),
        DemoConfig,
        title="demo",
    )
    _output_last(p)
    return p


def verb_paths(parser: argparse.ArgumentParser) -> list[tuple[str, ...]]:
    """Every verb of the parser, as the words that call it (aliases left out), in help order."""
    out: list[tuple[str, ...]] = []

    def walk(p: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            out.append(path)
            return
        seen = set()
        for name, child in subs[0].choices.items():
            if id(child) not in seen:
                seen.add(id(child))
                walk(child, (*path, name))

    walk(parser, ())
    return out


# ------------------------------------------------------------ helpers


class _Verbs:
    """Adds verbs (or sub-verbs) to a subparsers action: help, description, examples, --quiet."""

    def __init__(self, sub, funcs: dict[str, Callable], prefix: str = ""):
        self.sub, self.funcs, self.prefix = sub, funcs, prefix

    def __call__(self, name: str, help_text: str, quiet: bool = True, aliases=()):
        key = f"{self.prefix}{name}"
        examples = EXAMPLES.get(key, [])
        epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples) if examples else None
        v = self.sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=epilog,
            aliases=list(aliases),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        v.set_defaults(func=self.funcs[key])
        if quiet:
            option_group(v, "output").add_argument(
                "--quiet", action="store_true", help="no progress bars"
            )
        return v


def _output_last(parser: argparse.ArgumentParser) -> None:
    """Every (sub)parser's --help lists its "output" group last, after the verb's own groups."""
    parser._action_groups.sort(key=lambda g: g.title == "output")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                _output_last(child)


def _json(parser, help_text: str) -> None:
    option_group(parser, "output").add_argument("--json", help=help_text)


def _trace_parser(sub, funcs, import_config) -> None:
    tsub = sub.add_parser("trace", help="inspect, import, export and resplit traces")
    verb = _Verbs(
        tsub.add_subparsers(dest="trace_verb", metavar="SUBVERB", parser_class=_Parser),
        funcs,
        "trace ",
    )
    ti = verb("info", "summary of a trace directory", quiet=False)
    ti.add_argument("trace_dir", help="trace directory (from `collect`)")
    ti.add_argument(
        "--json", action="store_true", help="print JSON (keys in docs/guide/formats.md)"
    )
    add_config_flags(
        verb("import", "import routing from a serving engine"),
        import_config,
        skip=("progress",),
        positional=("path",),
    )
    tr = verb("resplit", "split a trace's prompts by topic (held-out domains)", quiet=False)
    tr.add_argument("trace_dir", help="trace directory (from `collect`); not modified")
    tr.add_argument(
        "--test-topics",
        required=True,
        help="comma-separated topics: all their prompts become the test split",
    )
    tr.add_argument("--out", required=True, help="new trace directory (shards hard-linked)")
    te = verb("export", "write a trace's routing as the canonical CSV", quiet=False)
    te.add_argument("trace_dir", help="trace directory; not modified")
    te.add_argument("--out", required=True, help="CSV file to write (routing only)")


def _store_parser(sub, funcs) -> None:
    ssub = sub.add_parser("store", help="expert stores on disk: build, list, remove, prune")
    verb = _Verbs(
        ssub.add_subparsers(dest="store_verb", metavar="SUBVERB", parser_class=_Parser),
        funcs,
        "store ",
    )
    root = "root of the stores (default: $TENSORBEND_STORE_DIR or ~/.cache/tensorbend/stores)"
    _store_of(
        verb("build", "build a checkpoint's store without generating (reused if current)"), root
    )
    sl = verb("list", "each store's checkpoint, dtype, size and build time", quiet=False)
    sl.add_argument("--store-dir", help=root)
    sl.add_argument("--json", action="store_true", help="print JSON")
    sr = verb("rm", "remove a checkpoint's stores, or interrupted builds", quiet=False)
    sr.add_argument("target", nargs="?", help="the checkpoint's path, or its store folder")
    sr.add_argument(
        "--partial",
        action="store_true",
        help="remove every interrupted build instead (none being built now)",
    )
    sr.add_argument("--store-dir", help=root)
    _store_of(verb("verify", "compare every stored expert with the checkpoint's bytes"), root)
    sp = verb("prune", "remove the stores of checkpoints that are gone", quiet=False)
    sp.add_argument("--store-dir", help=root)


def _store_of(v, root: str) -> None:
    """The flags naming one checkpoint's store: the checkpoint, its precisions, the root."""
    v.add_argument("--model", required=True, help="local HF checkpoint directory or zoo:NAME")
    v.add_argument("--dtype", default="auto", help="precision the model is served in")
    v.add_argument(
        "--store-dtype",
        choices=("auto", "int4"),
        default="auto",
        help="what the store keeps of each expert",
    )
    v.add_argument("--store-dir", help=root)


def _zoo_parser(sub, funcs) -> None:
    from tensorbend.zoo.trainer import ZooTrainConfig

    zsub = sub.add_parser("zoo", help="small real MoE models trained here")
    verb = _Verbs(
        zsub.add_subparsers(dest="zoo_verb", metavar="SUBVERB", parser_class=_Parser), funcs, "zoo "
    )
    verb("list", "bundled models", quiet=False).add_argument(
        "--json", action="store_true", help="print JSON"
    )
    verb("path", "directory of a bundled model", quiet=False).add_argument("name")
    zk = verb("card", "routing realism of traces beside a real MoE's", quiet=False)
    zk.add_argument(
        "traces",
        nargs="+",
        metavar="TRACE_DIR",
        help="traces with held-out decode rows (`collect --decode teacher`)",
    )
    zk.add_argument(
        "--cache-frac",
        type=float,
        default=0.25,
        help="cache size for the foresight statistics (default: 0.25)",
    )
    zk.add_argument("--json", help="write the statistics as JSON")
    zc = verb("corpus", "extract the offline training corpus", quiet=False)
    zc.add_argument("--out", required=True, help="corpus directory to write")
    add_config_flags(verb("train", "train a small MoE LM"), ZooTrainConfig, title="training")
