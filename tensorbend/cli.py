"""Command line: a thin shell over the Python API. `main(argv) -> int` is what tests call.

Every verb builds its config from flags derived from the config dataclass (`flags.py`: help,
defaults and choices live in the dataclass only), calls one public API function and prints
the result. User errors (`TensorbendError`, bad flags, a `--json` path that cannot be written,
a file that cannot be read) become one `error: ...` line on stderr and exit code 2, before the
work where they can be known before it; no traceback. A closed stdout (`| head`) ends quietly
with 141, as a process killed by SIGPIPE.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import replace
from pathlib import Path

from tensorbend.command_line import UsageError, check_json_path, quick_check
from tensorbend.errors import TensorbendError, TensorbendWarning
from tensorbend.flags import config_from_args
from tensorbend.parser import build_parser


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        table = _flags()
        if table is not None:  # (unknown verbs and flags: before torch is imported)
            quick_check(sys.argv[1:] if argv is None else list(argv), table)
        parser = build_parser(_verbs())
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        check_json_path(getattr(args, "json", None))
        with warnings.catch_warnings():  # (restores showwarning on the way out)
            warnings.showwarning = _warning_line(warnings.showwarning)
            return args.func(args) or 0
    except (TensorbendError, UsageError) as e:
        _close_bars()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PermissionError as e:
        print(
            f"error: {e.filename}: permission denied (expected this user to have access); "
            "check its permissions, or run as its owner",
            file=sys.stderr,
        )
        return 2
    except BrokenPipeError:  # (stdout closed by the reader: nothing more to say to it)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        print(f"error: interrupted{_kept(args)}", file=sys.stderr)
        return 130


def _flags() -> dict[str, list[str]] | None:
    """Every verb's flags (tensorbend/data/cli_flags.json, generated from the parser by
    tools/cli_reference.py; tests keep it current), or None where it is missing."""
    path = Path(__file__).parent / "data" / "cli_flags.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _close_bars() -> None:
    """End any progress bar still open (an error raised inside its loop), so the error line
    starts on a line of its own."""
    tqdm = sys.modules.get("tqdm")  # (never imported here: only a bar that ran is open)
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


def _kept(args) -> str:
    """What an interrupted verb kept on disk and how to continue, in the verb's own flags."""
    if hasattr(args, "resume"):  # (collect, zoo train)
        return " (finished work on disk is kept; rerun with --resume to continue)"
    if getattr(args, "verb", None) == "generate":
        return " (an expert store being built keeps its finished layers; rerun to continue it)"
    return ""


def _warning_line(show):
    """warnings.showwarning printing a TensorbendWarning as one `warning: ...` line."""

    def showwarning(message, category, *args, **kwargs):
        if issubclass(category, TensorbendWarning):
            print(f"warning: {message}", file=sys.stderr)
        else:
            show(message, category, *args, **kwargs)

    return showwarning


# ---------------------------------------------------------------- verbs


def _cmd_collect(args) -> int:
    from tensorbend.capture.collect import CollectConfig, collect

    cfg = config_from_args(CollectConfig, args)
    engine = None
    if cfg.engine == "vllm":
        from tensorbend.engines.vllm_engine import VllmEngine  # (imports vllm: this path only)

        engine = VllmEngine(cfg.model, cfg.model_dtype, cfg.decode)
    result = collect(cfg, progress=not args.quiet, engine=engine)
    print(_format_summary(result.to_json()))
    return 0


def _cmd_trace_info(args) -> int:
    from tensorbend.capture.trace import Trace

    info = Trace.open(Path(args.trace_dir)).info()
    print(json.dumps(info, indent=2) if args.json else _format_summary(info))
    return 0


def _cmd_trace_resplit(args) -> int:
    from tensorbend.capture.resplit import resplit

    topics = tuple(t.strip() for t in args.test_topics.split(",") if t.strip())
    record = resplit(Path(args.trace_dir), Path(args.out), topics)
    print(_format_summary(record))
    return 0


def _cmd_trace_export(args) -> int:
    from tensorbend.capture.trace import Trace
    from tensorbend.engines.importers.csv import trace_rows, write_csv

    trace, out = Trace.open(Path(args.trace_dir)), Path(args.out)
    write_csv(out, trace_rows(trace))  # (atomic: a kill leaves no half-written CSV)
    info = trace.info()
    print(
        f"{out}: {info['prompts']} prompts, {sum(info['tokens'].values())} tokens x "
        f"{info['num_moe_layers']} MoE layers (routing only; `tensorbend trace import "
        f"--source csv {out}` reads it back)"
    )
    return 0


def _cmd_train(args) -> int:
    from tensorbend.predictors.train import TrainConfig, train

    result = train(config_from_args(TrainConfig, args), progress=not args.quiet)
    print(_format_summary(result.to_json()))
    return 0


def _cmd_live(args) -> int:
    from tensorbend.engines.vllm_live import LiveConfig, live

    report = live(config_from_args(LiveConfig, args))
    print(_format_summary(report))
    _write_json(args.json, report)
    return 0


def _cmd_eval(args) -> int:
    from tensorbend.predictors.evaluate import EvalConfig, evaluate, format_table

    report = evaluate(config_from_args(EvalConfig, args))
    print(format_table(report))
    _write_json(args.json, report.to_json())
    if args.plots:
        from tensorbend.predictors.plots import plot_eval

        for p in plot_eval(report, Path(args.plots)):
            print(f"plot: {p}")
    return 0


def _cmd_run(args) -> int:
    from tensorbend.cache.report import host_warning
    from tensorbend.offload.runner import RunConfig, run

    result = run(config_from_args(RunConfig, args)).to_json()
    _write_json(args.json, result)
    print(_format_summary({k: v for k, v in result.items() if k != "counters"}))
    if warning := host_warning([result]):
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def _cmd_generate(args) -> int:
    from tensorbend.serving.generate import GenerateConfig, generate

    if args.max_new_tokens < 1:  # (before DecodeConfig, whose floor is collect's 0)
        raise TensorbendError(f"--max-new-tokens {args.max_new_tokens}: expected a count >= 1")
    cfg = config_from_args(GenerateConfig, args)
    decode = replace(cfg.decode, decode="sample") if args.sample else cfg.decode
    cfg = replace(cfg, decode=decode, serve=replace(cfg.serve, progress=not args.quiet))
    summary = generate(cfg)
    _write_json(args.json, summary)
    return 0


def _cmd_simulate(args) -> int:
    from tensorbend.simulate.simulator import SimulateConfig, format_table, simulate

    result = simulate(config_from_args(SimulateConfig, args, progress=not args.quiet))
    print(format_table(result))
    _write_json(args.json, result.to_json())
    return 0


def _cmd_trace_import(args) -> int:
    from tensorbend.engines.importers import ImportConfig, import_trace

    result = import_trace(config_from_args(ImportConfig, args, progress=not args.quiet))
    print(_format_summary(result.to_json()))
    return 0


def _cmd_demo(args) -> int:
    from tensorbend.demo import DemoConfig, demo

    print(demo(config_from_args(DemoConfig, args, progress=not args.quiet)).text)
    return 0


def _cmd_zoo_list(args) -> int:
    from tensorbend.zoo import format_models, list_models

    print(json.dumps(list_models(), indent=2) if args.json else format_models(list_models()))
    return 0


def _cmd_zoo_path(args) -> int:
    from tensorbend.zoo import model_path

    print(model_path(args.name))
    return 0


def _cmd_zoo_train(args) -> int:
    from tensorbend.zoo.trainer import ZooTrainConfig, train_zoo_model

    print(train_zoo_model(config_from_args(ZooTrainConfig, args), progress=not args.quiet))
    return 0


def _cmd_zoo_card(args) -> int:
    from tensorbend.capture.trace import Trace
    from tensorbend.zoo.realism import format_card, format_fit_detail, routing_card

    cards = {}
    for d in args.traces:
        trace = Trace.open(Path(d))
        cards[str(trace.manifest["model"].get("name", d))] = routing_card(trace, args.cache_frac)
    print(format_card(cards))
    print(format_fit_detail(cards))
    _write_json(args.json, cards)
    return 0


def _cmd_zoo_corpus(args) -> int:
    from tensorbend.zoo.corpus import prepare_corpus

    print(prepare_corpus(Path(args.out)))
    return 0


def _cmd_store_list(args) -> int:
    from tensorbend.serving.stores import format_stores, list_stores, store_root

    stores = list_stores(args.store_dir)
    print(
        json.dumps(stores, indent=2)
        if args.json
        else format_stores(stores, store_root(args.store_dir))
    )
    return 0


def _cmd_store_build(args) -> int:
    from tensorbend.serving.offloaded import load_offloaded

    model = load_offloaded(
        args.model,
        policy="on_demand",
        store_dir=args.store_dir,
        dtype=args.dtype,
        store_dtype=args.store_dtype,
        progress=not args.quiet,
    )
    path = model.tensorbend.store.path
    model.tensorbend.close()
    print(f"{path}  {path.stat().st_size / 1e6:.1f} MB")
    return 0


def _cmd_store_verify(args) -> int:
    from tensorbend.serving.offloaded import ServeConfig
    from tensorbend.serving.verify import verify_store

    cfg = ServeConfig(dtype=args.dtype, store_dtype=args.store_dtype, store_dir=args.store_dir)
    bad = verify_store(args.model, cfg, progress=not args.quiet)
    if not bad:
        print(f"{args.model}: every stored expert equals the checkpoint's")
        return 0
    shown = ", ".join(f"layer {m} expert {e}" for m, e in bad[:5])
    print(
        f"{args.model}: {len(bad)} stored experts differ from the checkpoint ({shown}"
        f"{', ...' if len(bad) > 5 else ''}); `tensorbend store rm {args.model}`, then rebuild",
        file=sys.stderr,
    )
    return 1


def _cmd_store_prune(args) -> int:
    from tensorbend.serving.stores import remove_orphans

    removed = remove_orphans(args.store_dir)
    print("\n".join(f"removed {p}" for p in removed) or "no stores of checkpoints that are gone")
    return 0


def _cmd_store_rm(args) -> int:
    from tensorbend.serving.stores import remove_partial, remove_store

    if (args.target is None) == (not args.partial):
        raise UsageError("tensorbend store rm: expected a checkpoint or store folder, or --partial")
    if args.partial:
        removed = remove_partial(args.store_dir)
        print("\n".join(f"removed {p}" for p in removed) or "no interrupted builds")
    else:
        print(f"removed {remove_store(args.target, args.store_dir)}")
    return 0


# ---------------------------------------------------------------- parser


def _write_json(path: str | None, obj: dict) -> None:
    if path:
        from tensorbend.atomic import atomic_write_text

        atomic_write_text(Path(path), json.dumps(obj, indent=1))


def _format_summary(d: dict) -> str:
    width = max(len(k) for k in d) if d else 0
    lines = []
    for k, v in d.items():
        if isinstance(v, (dict, list)):
            v = json.dumps(v)
        lines.append(f"{k:<{width}}  {v}")
    return "\n".join(lines)


def _verbs() -> dict:
    """Verb name (as tensorbend/parser.py calls it) -> the function that runs it."""
    return {
        "collect": _cmd_collect,
        "trace info": _cmd_trace_info,
        "trace import": _cmd_trace_import,
        "trace resplit": _cmd_trace_resplit,
        "trace export": _cmd_trace_export,
        "train": _cmd_train,
        "eval": _cmd_eval,
        "generate": _cmd_generate,
        "measure": _cmd_run,
        "simulate": _cmd_simulate,
        "live": _cmd_live,
        "store build": _cmd_store_build,
        "store list": _cmd_store_list,
        "store rm": _cmd_store_rm,
        "store prune": _cmd_store_prune,
        "store verify": _cmd_store_verify,
        "zoo list": _cmd_zoo_list,
        "zoo path": _cmd_zoo_path,
        "zoo card": _cmd_zoo_card,
        "zoo corpus": _cmd_zoo_corpus,
        "zoo train": _cmd_zoo_train,
        "demo": _cmd_demo,
    }
