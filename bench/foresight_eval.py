"""Cross-token foresight on held-out prompts: the horizon predictor against the strongest caches
and the bounded-foresight oracles, per cache size (a deterministic replay: no timing).

Usage:
    python -m bench.foresight_eval --trace runs/bench/default/trace --out runs/bench/default \\
        --json docs/results/foresight_default.json --doc docs/results/foresight_default.md

Trains (when missing, seed 0) the horizon predictor with routing + hidden-state inputs and the
routing-only configuration on the trace's train split (val: early stopping), then scores both
on the test split with `foresight.evaluate_foresight` at each `--fracs` cache fraction:
next-forward recall, within-h recall, and the demand-only replay (experts read per decode
token) of every no-prediction cache, of the forecast-driven `horizon(evict only)` policy (and
the same driven by the training-free peer `recency`, the request's decayed routing) and
of the oracle knowing h = 1, 2, 4, 8 forwards or the whole future (Belady within its sight,
the best no-prediction cache's rule, pool and admission beyond it). Writes JSON and a markdown doc whose
numbers all come from that JSON (tests/test_docs_results.py checks the tables).
The page is rendered from the JSON by `bench.pages.foresight`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.pages.foresight import markdown
from bench.record import command, emit
from tensorbend.atomic import atomic_write_text
from tensorbend.capture.trace import Trace
from tensorbend.predictors.checkpoint import load_predictor
from tensorbend.predictors.foresight import evaluate_foresight
from tensorbend.predictors.recency import NAME, RecencyForecaster
from tensorbend.predictors.train import TrainConfig, train

INPUTS = ("routing+hidden", "routing")


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    t0 = time.perf_counter()
    tr = Trace.open(a.trace)
    out = {"trace": a.trace, "model": tr.info()["model"], "decode_mode": tr.info()["decode_mode"],
           "split": "test", "command": command("foresight_eval", argv), "runs": []}  # fmt: skip
    if "resplit" in tr.manifest:  # test = prompts of topics the predictors never saw
        out["resplit"] = tr.manifest["resplit"]
    for inputs in a.inputs.split(","):
        ckpt = Path(a.out) / f"horizon_{inputs.replace('+', '_')}.safetensors"
        if not ckpt.is_file():
            train(TrainConfig(trace=Path(a.trace), out=ckpt, predictor="horizon", inputs=inputs),
                  progress=False)  # fmt: skip
        pred = load_predictor(ckpt, spec=tr.spec)
        rows = tr.load(pred.cfg.features, split="test")
        for frac in (float(f) for f in a.fracs.split(",")):
            rep = evaluate_foresight(pred, rows, cache_frac=frac)
            out["runs"].append({"checkpoint": str(ckpt), **rep})
            print(f"{inputs} {frac}: gap closed {rep['gap_closed']}", file=sys.stderr)
    if not a.no_peer:  # the training-free cross-token peer, scored the same way
        peer = RecencyForecaster(tr.spec)
        rows = tr.load(("ids",), split="test")
        for frac in (float(f) for f in a.fracs.split(",")):
            rep = evaluate_foresight(peer, rows, cache_frac=frac)
            out["runs"].append({"checkpoint": NAME, **rep})
            print(f"{NAME} {frac}: gap closed {rep['gap_closed']}", file=sys.stderr)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if a.doc:
        atomic_write_text(Path(a.doc), markdown(out))
    return emit(out, a.json)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--out", required=True, help="directory for the horizon checkpoints")
    p.add_argument("--fracs", default="0.125,0.25,0.5")
    p.add_argument("--inputs", default=",".join(INPUTS),
                   help="horizon input configurations to train (when missing) and score")  # fmt: skip
    p.add_argument(
        "--no-peer",
        action="store_true",
        help="without the training-free cross-token peer (recency)",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--doc", default=None)
    return p


if __name__ == "__main__":
    sys.exit(main())
