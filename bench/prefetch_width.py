"""Prefetch width by confidence, measured offline: does a probability threshold pick a better
decode prefetch list than a fixed top-n of the same mean size?

Usage:
    python -m bench.prefetch_width --trace runs/bench/deep/trace \
        --predictor runs/bench/deep/ours_d1.safetensors \
        --json docs/results/bench/prefetch_width.json --doc docs/results/bench/prefetch_width.md

Ours is trained with a listwise loss (-log softmax at the K routed experts), whose optimum puts
softmax_e = P(e routed) / K, so p_e = K x softmax(scores)_e (capped at 1) estimates the chance
that expert e is routed. On the held-out test prompts' decode tokens (the batch-1 rule the
runtime applies per target layer), for every (token, target layer):
  calibration   p_e binned, against how often the experts of each bin were routed;
  fixed width   top-n, n = 1 .. K + 2: mean list size, precision (listed experts routed),
                recall (routed experts listed);
  threshold     the top-(K + 2) whose p_e >= tau: the same three numbers, and the recall a fixed
                width of the same mean size gets (linear between the two integer widths around
                it): `recall gain` = threshold recall - that. A positive gain at some tau is what
                a confidence-width rule would need to pay for itself on bytes.
Deterministic (no timing); one JSON per run, the page rendered from it (`markdown`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tensorbend.atomic import write_generated
from tensorbend.capture.trace import Trace
from tensorbend.predictors.base import sources_from_rows
from tensorbend.predictors.checkpoint import load_predictor
from tensorbend.predictors.registry import KINDS

BINS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TAUS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, action="append", required=True, help="repeatable")
    ap.add_argument("--predictor", type=Path, action="append", required=True,
                    help="ours' checkpoint of each --trace, in the same order")  # fmt: skip
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--doc", type=Path, required=True)
    a = ap.parse_args(argv)
    if len(a.trace) != len(a.predictor):
        ap.error(f"expected one --predictor per --trace, found {len(a.predictor)} for "
                 f"{len(a.trace)}")  # fmt: skip
    cmd = "python -m bench.prefetch_width " + " ".join(sys.argv[1:] if argv is None else argv)
    rep = {
        "command": cmd,
        "runs": [width_report(t, p) for t, p in zip(a.trace, a.predictor, strict=True)],
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(rep, indent=1) + "\n")
    write_generated(a.doc, markdown(rep))
    print(markdown(rep))
    return 0


def width_report(trace: Path, checkpoint: Path) -> dict:
    """Calibration, fixed widths and thresholds of one checkpoint on its trace's test decode."""
    tr = Trace.open(trace)
    p = load_predictor(checkpoint)
    loss = getattr(getattr(p, "cfg", None), "loss", None)
    if p.kind != "tensorbend" or loss != "listwise":
        raise SystemExit(f"{checkpoint}: expected ours trained with the listwise loss (kind "
                         f"tensorbend), found kind {p.kind!r}, loss {loss!r}: K x softmax of its "
                         "scores is no estimate of P(routed); retrain with the default loss")  # fmt: skip
    K = tr.spec.top_k
    rows = tr.load(KINDS[p.kind].features(p.lookahead), split="test", phase="decode")
    ids_TLK = rows["expert_ids_TLK"].long()
    T, L = ids_TLK.shape[:2]
    probs, truth = [], []
    for m in p.lookahead.targets(L):
        with torch.no_grad():
            scores_TE = p.scores(m, sources_from_rows(rows, p.lookahead, m)).float()
        probs.append((K * torch.softmax(scores_TE, dim=1)).clamp(max=1.0))
        truth.append(torch.zeros_like(scores_TE).scatter_(1, ids_TLK[:, m], 1.0))
    p_NE, y_NE = torch.cat(probs), torch.cat(truth)
    return {
        "trace": str(trace),
        "model": tr.info().get("model"),
        "checkpoint": str(checkpoint),
        "lookahead": p.lookahead.name,
        "top_k": K,
        "num_experts": tr.spec.num_experts,
        "token_layers": p_NE.shape[0],
        **evaluate(p_NE, y_NE, K),
    }


def evaluate(p_NE: torch.Tensor, y_NE: torch.Tensor, K: int) -> dict:
    """The three tables of the module docstring from probabilities p_NE and routed y_NE (0/1).

    >>> p = torch.tensor([[0.9, 0.6, 0.1, 0.0], [0.8, 0.2, 0.1, 0.0]])
    >>> y = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    >>> r = evaluate(p, y, K=2)
    >>> [(w["n"], w["precision"], w["recall"]) for w in r["fixed"][:2]]
    [(1, 1.0, 0.5), (2, 0.75, 0.75)]
    >>> t = [x for x in r["threshold"] if x["tau"] == 0.5][0]  # lists: [0, 1], [0]
    >>> (t["mean_size"], t["precision"], t["recall"], t["fixed_recall_same_size"])
    (1.5, 1.0, 0.75, 0.625)
    """
    N, E = p_NE.shape
    routed = float(y_NE.sum())
    order_NE = p_NE.argsort(dim=1, descending=True, stable=True)
    calib = []
    for lo, hi in zip(BINS, BINS[1:], strict=False):
        sel = (p_NE >= lo) & ((p_NE < hi) if hi < 1.0 else (p_NE <= hi))
        n = int(sel.sum())
        if n:
            calib.append({"lo": lo, "hi": hi, "per_token_layer": round(n / N, 4),
                          "mean_p": round(float(p_NE[sel].mean()), 4),
                          "routed": round(float(y_NE[sel].mean()), 4)})  # fmt: skip
    fixed = []
    for n in range(1, min(K + 2, E) + 1):
        pick = torch.zeros_like(p_NE, dtype=torch.bool).scatter_(1, order_NE[:, :n], True)
        fixed.append(_pr(pick, y_NE, routed) | {"n": n})
    widest = torch.zeros_like(p_NE, dtype=torch.bool)
    widest.scatter_(1, order_NE[:, : min(K + 2, E)], True)
    thresh = []
    for tau in TAUS:
        row = _pr(widest & (p_NE >= tau), y_NE, routed) | {"tau": tau}
        row["fixed_recall_same_size"] = round(_recall_at(fixed, row["mean_size"]), 4)
        row["recall_gain"] = round(row["recall"] - row["fixed_recall_same_size"], 4)
        thresh.append(row)
    return {"calibration": calib, "fixed": fixed, "threshold": thresh,
            "best_recall_gain": max(t["recall_gain"] for t in thresh)}  # fmt: skip


def _pr(pick_NE: torch.Tensor, y_NE: torch.Tensor, routed: float) -> dict:
    listed = float(pick_NE.sum())
    hit = float((y_NE * pick_NE).sum())
    return {
        "mean_size": round(listed / pick_NE.shape[0], 4),
        "precision": round(hit / listed, 4) if listed else None,
        "recall": round(hit / routed, 4),
    }


def _recall_at(fixed: list[dict], size: float) -> float:
    """A fixed width's recall at a fractional mean size (0 at size 0, linear between widths)."""
    pts = [(0.0, 0.0)] + [(f["mean_size"], f["recall"]) for f in fixed]
    for (x0, r0), (x1, r1) in zip(pts, pts[1:], strict=False):
        if size <= x1:
            return r0 + (r1 - r0) * (size - x0) / (x1 - x0)
    return pts[-1][1]


def markdown(rep: dict) -> str:
    out = [
        "# Prefetch width by confidence (generated by `python -m bench.prefetch_width`)",
        "",
        f"`{rep['command']}`",
        "",
        "Ours' d1 predictor on each trace's held-out test prompts, decode tokens (batch 1, one "
        "list per token and target layer); no timing. p = K x softmax(scores), capped at 1: "
        "ours' listwise loss makes it an estimate of P(routed). Fixed width: top-n. Threshold: "
        "the top-(K + 2) with p >= tau. `fixed recall, same size`: a fixed width's recall at "
        "the threshold's mean list size (linear between integer widths); `gain` is the "
        "threshold's recall minus that: what choosing the width per token by confidence buys "
        "over a fixed width listing as many experts.",
        "",
    ]
    for r in rep["runs"]:
        out += [
            f"## {r['model']} ({r['lookahead']}, K = {r['top_k']} of {r['num_experts']}, "
            f"{r['token_layers']} token-layers)",
            "",
            f"Best recall gain of a threshold over a fixed width of the same mean size: "
            f"**{r['best_recall_gain']:+.4f}**.",
            "",
            "| p bin | experts per token-layer | mean p | routed |",
            "|---|---|---|---|",
            *[f"| [{c['lo']:.2f}, {c['hi']:.2f}{']' if c['hi'] >= 1 else ')'} | "
              f"{c['per_token_layer']:.2f} | {c['mean_p']:.3f} | {c['routed']:.3f} |"
              for c in r["calibration"]],
            "",
            "| rule | mean list size | precision | recall | fixed recall, same size | gain |",
            "|---|---|---|---|---|---|",
            *[f"| top-{f['n']} | {f['mean_size']:.2f} | {f['precision']:.3f} | "
              f"{f['recall']:.3f} | - | - |" for f in r["fixed"]],
            *[f"| p >= {t['tau']} | {t['mean_size']:.2f} | "
              f"{'-' if t['precision'] is None else format(t['precision'], '.3f')} | "
              f"{t['recall']:.3f} | {t['fixed_recall_same_size']:.3f} | "
              f"{t['recall_gain']:+.3f} |" for t in r["threshold"]],
            "",
        ]  # fmt: skip
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
