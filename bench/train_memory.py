"""Peak memory of training and evaluation against trace size: rows streamed from the shards
stay bounded, loading the split at once grows with the trace.

Usage:
    python -m bench.train_memory --trace runs/bench/default/trace [--scales 1 4 16]
        [--json docs/results/bench/train_memory.json] [--doc docs/results/bench/train_memory.md]

The trace is replicated 1x/4x/16x (every shard copied with its prompts renamed and its
prompt indices shifted; new sha256s), and each step runs in its own process whose peak
resident set (its own high-water mark, `memory.peak_rss_bytes`) is read at its end:

  imports         python + torch + tensorbend, nothing loaded (the floor)
  load_all        the train and val splits loaded whole, then rows selected (what `train`
                  did before rows were streamed; no training)
  train_streamed  `tensorbend train` (tensorbend, d1) with --max-train-rows/--max-val-rows:
                  two passes over the shards (row metadata, then the features and previous
                  tokens' routing of the kept rows only)
  eval_all        the test split loaded whole and scored at once (the previous `eval`)
  eval_streamed   `tensorbend eval` of that checkpoint: shard by shard, merged by tokens

Memory is not time: nothing here depends on what else runs on the machine.
The page is rendered from the JSON by `bench.pages.train_memory`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.pages.train_memory import MODES, markdown
from bench.record import command, emit

ROOT = Path(__file__).resolve().parent.parent
FEATS = ("ids", "gate_input")


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    if a.child:
        return _child(a)
    t0 = time.perf_counter()
    work = Path(a.work)
    out = {"command": command("train_memory", argv),
           "trace": a.trace, "features": list(FEATS), "max_train_rows": a.max_train_rows,
           "max_val_rows": a.max_val_rows, "epochs": a.epochs, "runs": []}  # fmt: skip
    for s in a.scales:
        trace = replicate(Path(a.trace), work / f"x{s}", s)
        ckpt = work / f"x{s}.safetensors"
        row = {"scale": s, **_size(trace)}
        for mode in MODES:
            row[mode + "_mib"] = _run_child(a, mode, trace, ckpt)
        out["runs"].append(row)
        print(json.dumps(row), file=sys.stderr)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if a.doc:
        from tensorbend.atomic import atomic_write_text

        atomic_write_text(Path(a.doc), markdown(out))
    return emit(out, a.json)


def replicate(src: Path, dst: Path, times: int) -> Path:
    """A trace holding `times` copies of `src`'s prompts (ids suffixed ~k), shard by shard."""
    from safetensors.torch import save as save_bytes

    from tensorbend.atomic import atomic_write_bytes, atomic_write_text
    from tensorbend.capture.trace import MANIFEST, ROUTER_FILE, Trace, file_sha256

    if (dst / MANIFEST).is_file():
        return dst
    tr = Trace.open(src)
    m = json.loads((src / MANIFEST).read_text())
    P = len(m["prompts"])
    prompts, shards = [], []
    for k in range(times):
        prompts += [{**p, "id": f"{p['id']}~{k}", "shard": p["shard"] + k * len(m["shards"])}
                    for p in m["prompts"]]  # fmt: skip
        for i, sh in enumerate(m["shards"]):
            t = tr.load_shard(i)
            t["prompt_index_T"] = t["prompt_index_T"] + k * P
            meta = {"format_version": str(m["format_version"]),
                    "fingerprint": m["model"]["fingerprint"]}  # fmt: skip
            blob = save_bytes({n: v.contiguous() for n, v in t.items()}, metadata=meta)
            name = f"shard-{k * len(m['shards']) + i:05d}.safetensors"
            atomic_write_bytes(dst / name, blob)
            lo, hi = sh["prompts"]
            shards.append({**sh, "file": name, "bytes": len(blob), "sha256": file_sha256(blob),
                           "prompts": [lo + k * P, hi + k * P]})  # fmt: skip
    atomic_write_bytes(dst / ROUTER_FILE, (src / ROUTER_FILE).read_bytes())
    atomic_write_text(dst / MANIFEST, json.dumps({**m, "prompts": prompts, "shards": shards}))
    return dst


def _size(trace: Path) -> dict:
    m = json.loads((trace / "manifest.json").read_text())
    return {"rows": sum(s["tokens"] for s in m["shards"]),
            "disk_mib": sum(s["bytes"] for s in m["shards"]) / 2**20}  # fmt: skip


def _run_child(a, mode: str, trace: Path, ckpt: Path) -> float:
    cmd = [sys.executable, __file__, "--child", mode, "--trace", str(trace), "--ckpt", str(ckpt),
           "--max-train-rows", str(a.max_train_rows), "--max-val-rows", str(a.max_val_rows),
           "--epochs", str(a.epochs)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if p.returncode:
        raise SystemExit(f"{mode} on {trace} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])["peak_mib"]


def _child(a) -> int:
    import torch

    from tensorbend.capture.rows import RowSelection, select_rows
    from tensorbend.capture.trace import Trace
    from tensorbend.memory import peak_rss_bytes
    from tensorbend.predictors.checkpoint import load_predictor
    from tensorbend.predictors.evaluate import EvalConfig, evaluate
    from tensorbend.predictors.scoring import score_predictor
    from tensorbend.predictors.train import TrainConfig, train

    torch.set_num_threads(1)
    tr = Trace.open(a.trace)
    if a.child == "load_all":
        sel = RowSelection(max_rows=a.max_train_rows)
        rows = [select_rows(tr.load(FEATS, split="train"), sel), tr.load(FEATS, split="val")]
        assert rows[0]["phase_T"].numel() == min(a.max_train_rows, rows[0]["phase_T"].numel())
    elif a.child == "train_streamed":
        train(TrainConfig(trace=Path(a.trace), out=Path(a.ckpt), predictor="tensorbend",
                          lookahead="d1", epochs=a.epochs, max_train_rows=a.max_train_rows,
                          max_val_rows=a.max_val_rows), progress=False)  # fmt: skip
    elif a.child == "eval_all":
        pred = load_predictor(Path(a.ckpt), spec=tr.spec)
        score_predictor(pred, tr.load(FEATS, split="test"))
    elif a.child == "eval_streamed":
        evaluate(EvalConfig(trace=Path(a.trace), predictors=(Path(a.ckpt),), baselines=(),
                            lookaheads=("d1",), timing_rows=0))  # fmt: skip
    peak = peak_rss_bytes() / 2**20  # this process's own (not ru_maxrss: inherited on exec)
    print(json.dumps({"mode": a.child, "peak_mib": round(peak, 1)}))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--scales", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--work", default="runs/bench/train_memory")
    p.add_argument("--max-train-rows", type=int, default=20000)
    p.add_argument("--max-val-rows", type=int, default=4000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--doc", default=None)
    p.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    sys.exit(main())
