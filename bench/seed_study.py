"""The seed's claims re-tested with held-out numbers; writes JSON and docs/seed_study.md.

Usage:
    python bench/seed_study.py --trace runs/trace_default [--out runs/study] [--doc docs/seed_study.md] [--quick]

Every run trains the seed's MLP (SEED.md recipe: BCE, AdamW 1e-3, cosine to 1%, 200
full-batch epochs, clip 1.0) on the trace's train prompts and scores the test prompts; the
seed reports accuracy on its first 200 training rows, which we report beside it.
Ablations (each changes one thing from the seed's setup, `same_layer` unless stated):
  1. training-rows vs held-out recall
  2. BCE vs the ranking + importance-weighting loss
  3. number of training prompts: 30, 100, all (the seed compared 30x256 and 100x32 tokens)
  4. predictor width p: 64, 128, 256, 512
  5. with and without previous routing
  6. same_layer (zero lead time) vs d1 (one MoE layer ahead) vs ours at d1
--quick uses 40 epochs (for a smoke run; the doc says so).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tensorbend.evaluate import EvalConfig, evaluate
from tensorbend.trace import Trace
from tensorbend.train import TrainConfig, train


def run(trace: Path, out: Path, name: str, epochs: int | None, **kw) -> dict:
    ckpt = out / f"{name}.safetensors"
    t0 = time.perf_counter()
    if ckpt.is_file():  # resume a killed study (same trace, same config: same bytes)
        from tensorbend.predictors.checkpoint import read_metadata

        meta = read_metadata(ckpt)
        s = {
            "params": meta["params"],
            "train_rows_recall": meta.get("train_rows_recall"),
            "val": {ph: v["recall_at_k"] for ph, v in meta["val_metrics"].items()},
        }
    else:
        s = train(TrainConfig(trace=trace, out=ckpt, epochs=epochs, **kw), progress=False)
    rep = evaluate(EvalConfig(trace=trace, predictors=(ckpt,), baselines=(), timing_rows=20))
    res = {r["phase"]: round(r["recall_at_k"], 4) for r in rep["results"]}
    row = {
        "run": name,
        **kw,
        "params": s["params"],
        "train_rows_recall": s.get("train_rows_recall"),
        "val": s["val"],
        "test": res,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(row), file=sys.stderr)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--out", default="runs/study")
    ap.add_argument("--doc", default="docs/seed_study.md")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--max-rows", type=int, default=10000, help="train rows per run (the seed's cap)"
    )
    args = ap.parse_args(argv)
    trace, out = Path(args.trace), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ep = 40 if args.quick else None
    info = Trace.open(trace).info()
    # The seed kept at most 10,000 rows per layer; so do we (uniform sample of train rows).
    S = dict(predictor="seed_mlp", lookahead="same_layer", max_train_rows=args.max_rows)
    rows = {"base": run(trace, out, "seed_same_layer", ep, **S)}
    rows["ranking"] = run(trace, out, "seed_ranking", ep, loss="ranking", **S)
    for n in (30, 100):
        rows[f"prompts_{n}"] = run(trace, out, f"seed_prompts_{n}", ep, max_train_prompts=n, **S)
    for w in (64, 128, 512):
        rows[f"width_{w}"] = run(trace, out, f"seed_width_{w}", ep, width=w, **S)
    rows["no_prev"] = run(trace, out, "seed_no_prev", ep, use_prev=False, **S)
    rows["d1"] = run(
        trace,
        out,
        "seed_d1",
        ep,
        predictor="seed_mlp",
        lookahead="d1",
        max_train_rows=args.max_rows,
    )
    rows["ours_d1"] = run(trace, out, "ours_d1", None, predictor="tensorbend", lookahead="d1")
    result = {
        "bench": "seed_study",
        "trace": str(trace),
        "model": info["model"],
        "decode_mode": info["decode_mode"],
        "prompts": info["splits"],
        "epochs": ep or 200,
        "max_train_rows": args.max_rows,
        "runs": rows,
    }
    (out / "seed_study.json").write_text(json.dumps(result, indent=1))
    Path(args.doc).parent.mkdir(parents=True, exist_ok=True)
    Path(args.doc).write_text(_doc(result))
    Path(args.doc).with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


def _doc(r: dict) -> str:
    R = r["runs"]

    def line(label, x):
        tr = f"{x['train_rows_recall']:.3f}" if x.get("train_rows_recall") is not None else "-"
        return (
            f"| {label} | {x.get('lookahead', 'same_layer')} | {x['params']:,} | {tr} | "
            f"{x['test'].get('prefill', float('nan')):.3f} | {x['test'].get('decode', float('nan')):.3f} |"
        )

    rows = [
        ("seed as published (BCE, p=256, prev routing, all train prompts)", R["base"]),
        ("ranking + importance-weighting loss", R["ranking"]),
        ("30 training prompts", R["prompts_30"]),
        ("100 training prompts", R["prompts_100"]),
        ("width p=64", R["width_64"]),
        ("width p=128", R["width_128"]),
        ("width p=512", R["width_512"]),
        ("without previous routing", R["no_prev"]),
        ("seed MLP one MoE layer ahead (d1)", R["d1"]),
        ("ours (tensorbend) at d1", R["ours_d1"]),
    ]
    return "\n".join(
        [
            "# The seed's claims, re-tested with held-out prompts",
            "",
            f"Generated by `python bench/seed_study.py --trace {r['trace']}` (JSON beside the checkpoints).",
            f"Model `{r['model']}`; decode rows: {r['decode_mode']}; prompts per split {r['prompts']}; "
            f"seed recipe with {r['epochs']} full-batch epochs on at most {r['max_train_rows']:,} train rows "
            "(the seed kept at most 10,000 per layer; our predictor at d1 uses every train row).",
            "Recall@k on the **test** prompts (never trained on or used for selection), per phase; "
            "'train rows' is the seed's own number: recall on the first 200 training rows.",
            "Lead time: `same_layer` predicts layer m from the router's own input (zero lead time: the "
            "router itself is as cheap); `d1` predicts from layer m-1's router input and routing.",
            "",
            "| setup | lookahead | params | train rows | test prefill | test decode |",
            "|---|---|---|---|---|---|",
            *[line(a, b) for a, b in rows],
            "| the router itself (spec_gate at same_layer, no training) | same_layer | 0 | - | 1.000 | 1.000 |",
            "",
            "At `same_layer` the router's own matmul on the same input is exact and as cheap as any "
            "predictor, so the seed's setup cannot prefetch anything; only `d1` rows have lead time.",
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
