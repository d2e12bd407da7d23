"""Command line: a thin shell over the Python API. `main(argv) -> int` is what tests call.

Every verb builds a config, calls one public API function and prints the result.
User errors (`TensorbendError`) become one `error: ...` line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tensorbend.errors import TensorbendError


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except TensorbendError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "error: interrupted (finished work on disk is kept; rerun with --resume)",
            file=sys.stderr,
        )
        return 130


# ---------------------------------------------------------------- verbs


def _cmd_collect(args: argparse.Namespace) -> int:
    from tensorbend.collect import CollectConfig, collect

    cfg = CollectConfig(
        model=args.model,
        out=Path(args.out),
        prompts=Path(args.prompts) if args.prompts else None,
        split=args.split,
        max_new_tokens=args.max_new_tokens,
        features=tuple(args.features),
        dtype=args.dtype,
        decode=args.decode,
        seed=args.seed,
        max_prompts=args.max_prompts,
        resume=args.resume,
        overwrite=args.overwrite,
        shard_tokens=args.shard_tokens,
    )
    summary = collect(cfg, progress=not args.quiet)
    print(_format_summary(summary))
    return 0


def _cmd_trace_info(args: argparse.Namespace) -> int:
    from tensorbend.trace import Trace

    info = Trace.open(Path(args.trace_dir)).info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(_format_summary(info))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from tensorbend.train import TrainConfig, train

    cfg = TrainConfig(
        trace=Path(args.trace),
        out=Path(args.out),
        predictor=args.predictor,
        lookahead=args.lookahead,
        seed=args.seed,
        loss=args.loss,
        width=args.width,
        use_prev=not args.no_prev,
        epochs=args.epochs,
    )
    print(_format_summary(train(cfg, progress=not args.quiet)))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from tensorbend.evaluate import EvalConfig, evaluate, format_table

    baselines = () if args.baselines in ("none", "") else tuple(args.baselines.split(","))
    cfg = EvalConfig(
        trace=Path(args.trace),
        predictors=tuple(Path(p) for p in args.predictor),
        baselines=baselines,
        lookaheads=tuple(args.lookahead),
        split=args.split,
    )
    report = evaluate(cfg)
    print(format_table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plots:
        from tensorbend.plots import plot_eval

        for p in plot_eval(report, Path(args.plots)):
            print(f"plot: {p}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from tensorbend.offload.runner import RunConfig, run
    from tensorbend.offload.runtime import SessionConfig

    cfg = RunConfig(
        model=args.model,
        prompts=Path(args.prompts) if args.prompts else None,
        split=args.split,
        max_prompts=args.max_prompts,
        policy=args.policy,
        predictor=Path(args.predictor) if args.predictor else None,
        baseline=args.baseline,
        lookahead=args.lookahead,
        trace=Path(args.trace) if args.trace else None,
        cache_frac=args.cache_frac,
        cache_bytes=args.cache_bytes,
        link=args.link,
        session=SessionConfig(
            max_new_tokens=args.max_new_tokens,
            store_dir=Path(args.store) if args.store else None,
            io=args.io,
            decode=args.decode,
            progress=not args.quiet,
        ),
    )
    result = run(cfg)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(_format_summary({k: v for k, v in result.items() if k != "counters"}))
    return 0


def _cmd_zoo_list(args: argparse.Namespace) -> int:
    from tensorbend.zoo import list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"{'name':<18} {'arch':<12} {'params':>10} {'experts':>7} {'top_k':>5} {'moe_layers':>10} {'heldout_loss':>12}"
    )
    for r in rows:
        mark = " (default)" if r["default"] else ""
        loss = f"{r['heldout_loss']:.3f}" if r["heldout_loss"] is not None else "-"
        print(
            f"{r['name']:<18} {str(r['arch']):<12} {str(r['params']):>10} {str(r['num_experts']):>7} "
            f"{str(r['top_k']):>5} {str(r['num_moe_layers']):>10} {loss:>12}{mark}"
        )
    return 0


def _cmd_zoo_path(args: argparse.Namespace) -> int:
    from tensorbend.zoo import model_path

    print(model_path(args.name))
    return 0


def _cmd_zoo_train(args: argparse.Namespace) -> int:
    from tensorbend.zoo.trainer import ZooTrainConfig, train_zoo_model

    cfg = ZooTrainConfig(
        arch=args.arch,
        corpus=Path(args.corpus),
        out=Path(args.out),
        minutes=args.minutes,
        tokens=args.tokens,
        size=args.size,
        seed=args.seed,
        resume=args.resume,
        threads=args.threads,
    )
    out = train_zoo_model(cfg, progress=not args.quiet)
    print(out)
    return 0


def _cmd_zoo_corpus(args: argparse.Namespace) -> int:
    from tensorbend.zoo.corpus import prepare_corpus

    out = prepare_corpus(Path(args.out), install=not args.no_install)
    print(out)
    return 0


# ---------------------------------------------------------------- parser


def _build_parser() -> argparse.ArgumentParser:
    from tensorbend import __version__

    p = argparse.ArgumentParser(
        prog="tensorbend",
        description="Predict MoE expert routing ahead of the router; capture, train, evaluate, run.",
    )
    p.add_argument("--version", action="version", version=f"tensorbend {__version__}")
    sub = p.add_subparsers(dest="verb", metavar="VERB")

    c = sub.add_parser(
        "collect", help="run prompts through a model and record exact routing to a trace"
    )
    c.add_argument("--model", required=True, help="local HF checkpoint directory or zoo:NAME")
    c.add_argument("--out", required=True, help="trace directory to write")
    c.add_argument("--prompts", help="prompts JSONL (default: the shipped calibration prompts)")
    c.add_argument(
        "--split",
        default="all",
        choices=["train", "val", "test", "all"],
        help="which prompts of the file to run (default: all)",
    )
    c.add_argument(
        "--max-new-tokens", type=int, default=32, help="decode steps per prompt (default: 32)"
    )
    c.add_argument(
        "--features",
        nargs="+",
        default=["ids", "weights", "gate_input"],
        choices=["ids", "weights", "logits", "gate_input", "layer_input"],
        help="what to record per token and MoE layer (default: ids weights gate_input)",
    )
    c.add_argument(
        "--dtype",
        default="float16",
        choices=["float32", "float16", "bfloat16"],
        help="storage dtype of hidden states and logits in the trace (default: float16)",
    )
    c.add_argument(
        "--decode",
        default="greedy",
        choices=["greedy", "sample", "teacher"],
        help="how decode tokens are produced (teacher: feed the prompt's continuation)",
    )
    c.add_argument("--seed", type=int, default=0, help="seed for --decode sample (default: 0)")
    c.add_argument("--max-prompts", type=int, default=None, help="stop after this many prompts")
    c.add_argument(
        "--shard-tokens", type=int, default=4096, help="tokens per shard (default: 4096)"
    )
    c.add_argument("--resume", action="store_true", help="continue an interrupted collection")
    c.add_argument("--overwrite", action="store_true", help="replace an existing trace in --out")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=_cmd_collect)

    t = sub.add_parser("trace", help="inspect traces")
    tsub = t.add_subparsers(dest="trace_verb", metavar="SUBVERB")
    ti = tsub.add_parser("info", help="summary of a trace directory")
    ti.add_argument("trace_dir")
    ti.add_argument("--json", action="store_true", help="print JSON (keys in DESIGN.md)")
    ti.set_defaults(func=_cmd_trace_info)

    from tensorbend.predictors import BASELINES, LOOKAHEADS, TRAINABLE

    tr = sub.add_parser("train", help="train a predictor on a trace's train split")
    tr.add_argument("--trace", required=True, help="trace directory (from `collect`)")
    tr.add_argument("--out", required=True, help="predictor checkpoint to write (.safetensors)")
    tr.add_argument(
        "--predictor", default="tensorbend", choices=TRAINABLE, help="kind (default: tensorbend)"
    )
    tr.add_argument(
        "--lookahead", default="d1", choices=list(LOOKAHEADS), help="source point (default: d1)"
    )
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--loss", default=None, help="tensorbend: listwise|bce; seed_mlp: bce|ranking")
    tr.add_argument(
        "--width", type=int, default=None, help="tensorbend: correction width; seed_mlp: p"
    )
    tr.add_argument("--no-prev", action="store_true", help="do not feed previous routing")
    tr.add_argument("--epochs", type=int, default=None, help="override the kind's epoch budget")
    tr.add_argument("--quiet", action="store_true")
    tr.set_defaults(func=_cmd_train)

    ev = sub.add_parser("eval", help="score predictors and peers on held-out prompts")
    ev.add_argument("--trace", required=True)
    ev.add_argument(
        "--predictor", action="append", default=[], help="trained checkpoint (repeatable)"
    )
    ev.add_argument(
        "--baselines",
        default="all",
        help=f"'all', 'none' or comma-separated from: {','.join(BASELINES)} (default: all)",
    )
    ev.add_argument(
        "--lookahead",
        action="append",
        default=[],
        choices=list(LOOKAHEADS),
        help="lookahead(s) for the baselines (repeatable; default: every one the trace supports)",
    )
    ev.add_argument(
        "--split",
        default="test",
        choices=["test", "val", "train", "all"],
        help="prompts to score (default: test; 'all' for a trace never used in training)",
    )
    ev.add_argument("--json", default=None, help="write the report as JSON (keys in DESIGN.md)")
    ev.add_argument("--plots", default=None, help="directory for PNG plots")
    ev.set_defaults(func=_cmd_eval)

    from tensorbend.offload import POLICIES

    rn = sub.add_parser("run", help="offloaded generation: expert store + cache + prefetch policy")
    rn.add_argument("--model", required=True, help="local HF checkpoint directory or zoo:NAME")
    rn.add_argument("--prompts", help="prompts JSONL (default: the shipped prompts)")
    rn.add_argument("--split", default="test", choices=["train", "val", "test", "all"])
    rn.add_argument("--max-prompts", type=int, default=8, help="prompts to run (default: 8)")
    rn.add_argument(
        "--max-new-tokens", type=int, default=32, help="greedy decode steps (default: 32)"
    )
    rn.add_argument("--policy", default="lru", choices=list(POLICIES), help="(default: lru)")
    rn.add_argument("--predictor", help="trained predictor checkpoint (policy prefetch)")
    rn.add_argument("--baseline", help="peer predictor by name (policy prefetch), e.g. spec_gate")
    rn.add_argument(
        "--lookahead",
        default="d1",
        choices=list(LOOKAHEADS),
        help="lookahead of --baseline and of the oracle (default: d1)",
    )
    rn.add_argument("--trace", help="trace whose train split fits frequency/prev_token/transition")
    rn.add_argument(
        "--cache-frac",
        type=float,
        default=0.25,
        help="cache capacity as a fraction of all routed experts (default: 0.25)",
    )
    rn.add_argument("--cache-bytes", type=int, default=None, help="cache capacity in bytes")
    rn.add_argument(
        "--link",
        default="h100-pcie5-kimi",
        help="transfer cap: none, h100-pcie5-kimi (real ratio, scaled here), or BW[,LAT] "
        "like 40MB/s,20us (default: h100-pcie5-kimi)",
    )
    rn.add_argument(
        "--io",
        default="buffered",
        choices=["buffered", "fadvise", "direct"],
        help="store reads: page cache, drop pages after read, or O_DIRECT",
    )
    rn.add_argument(
        "--decode",
        default="greedy",
        choices=["greedy", "teacher"],
        help="decode tokens: greedy, or teacher (feed each prompt's continuation)",
    )
    rn.add_argument("--store", help="directory to keep the expert store in (default: a temp dir)")
    rn.add_argument("--json", help="write the result as JSON (keys in DESIGN.md)")
    rn.add_argument("--quiet", action="store_true")
    rn.set_defaults(func=_cmd_run)

    z = sub.add_parser("zoo", help="small real MoE models trained here")
    zsub = z.add_subparsers(dest="zoo_verb", metavar="SUBVERB")
    zl = zsub.add_parser("list", help="bundled models")
    zl.add_argument("--json", action="store_true")
    zl.set_defaults(func=_cmd_zoo_list)
    zp = zsub.add_parser("path", help="directory of a bundled model")
    zp.add_argument("name")
    zp.set_defaults(func=_cmd_zoo_path)
    zc = zsub.add_parser("corpus", help="prepare the offline training corpus (Debian packages)")
    zc.add_argument("--out", required=True)
    zc.add_argument("--no-install", action="store_true", help="use only what is already installed")
    zc.set_defaults(func=_cmd_zoo_corpus)
    zt = zsub.add_parser("train", help="train a small MoE LM from scratch")
    zt.add_argument("--arch", required=True, choices=["deepseek_v3", "qwen3_moe", "mixtral"])
    zt.add_argument("--corpus", required=True, help="corpus directory from `zoo corpus`")
    zt.add_argument("--out", required=True, help="output checkpoint directory")
    zt.add_argument("--minutes", type=float, default=None, help="wall-clock budget")
    zt.add_argument("--tokens", type=int, default=None, help="token budget")
    zt.add_argument(
        "--size", default="small", help="size preset (see tensorbend.zoo.trainer.SIZES)"
    )
    zt.add_argument("--seed", type=int, default=0)
    zt.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint in --out"
    )
    zt.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all)")
    zt.add_argument("--quiet", action="store_true")
    zt.set_defaults(func=_cmd_zoo_train)
    return p


def _format_summary(d: dict) -> str:
    width = max(len(k) for k in d) if d else 0
    lines = []
    for k, v in d.items():
        if isinstance(v, (dict, list)):
            v = json.dumps(v)
        lines.append(f"{k:<{width}}  {v}")
    return "\n".join(lines)
