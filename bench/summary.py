"""The README's results section, built from the committed JSON of the benches (never typed).

Usage:
    python bench/summary.py            # rewrites the section between the README's markers
    python bench/summary.py --check    # exit 1 if the README differs from the JSON

Sources: docs/results_default.json (within-token predictors, bench/predictor_eval.py),
docs/foresight_{default,qwen}.json (bench/foresight_eval.py), docs/bench/offload_{default,qwen}.json
(bench/offload_sweep.py), docs/projections.json (bench/projections.py). tests/test_docs_results.py
runs the check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tensorbend.atomic import write_generated

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- results:begin (bench/summary.py) -->", "<!-- results:end -->"


def section(root: Path = ROOT) -> str:
    parts = [_within_token(root), _foresight(root), _offload(root), _projections(root)]
    return "\n".join(p for p in parts if p)


def _load(root: Path, rel: str) -> dict | None:
    path = root / rel
    return json.loads(path.read_text()) if path.is_file() else None


def _within_token(root: Path) -> str:
    rep = _load(root, "docs/results_default.json")
    if rep is None:
        return ""
    dec = [r for r in rep["results"] if r["phase"] == "decode"]
    lines = [
        f"**Within the token** ({rep['model']}, held-out test prompts, decode rows "
        f"{rep['decode_mode']}; recall@{rep['top_k']} of {rep['num_experts']}; "
        "docs/results_default.md):",
        "",
        "| lookahead | ours (`tensorbend`) | best peer | seed MLP (its recipe) |",
        "|---|---|---|---|",
    ]
    for la in ("pre_attn", "d1", "d2", "d3"):
        at = {r["predictor"]: r["recall_at_k"] for r in dec if r["lookahead"] == la}
        if "tensorbend" not in at:
            continue
        peers = {k: v for k, v in at.items() if k not in ("tensorbend", "oracle")}
        best = max(peers, key=peers.get)
        seed = f"{at['seed_mlp']:.3f}" if "seed_mlp" in at else "-"
        lines.append(
            f"| `{la}` | **{at['tensorbend']:.3f}** | {peers[best]:.3f} ({best}) | {seed} |"
        )
    return "\n".join(lines) + "\n"


def _foresight(root: Path) -> str:
    lines = []
    for name in ("default", "qwen"):
        rep = _load(root, f"docs/foresight_{name}.json")
        if rep is None:
            continue
        for r in rep["runs"]:
            if r["cache_frac"] != 0.25:
                continue
            rp = r["replay"]
            best = rp[r["best_no_prediction"]]["experts_per_token"]
            full = min(rp["belady/h=all/all"]["experts_per_token"],
                       rp["belady/h=all/predicted"]["experts_per_token"])  # fmt: skip
            lines.append(
                f"| {rep['model']} | {r['inputs']} | {best:.2f} ({r['best_no_prediction']}) | "
                f"{rp[r['best_reuse']]['experts_per_token']:.2f} | "
                f"{rp['belady/h=2/all']['experts_per_token']:.2f} | {full:.2f} | "
                f"{r['gap_closed']:.0%} |"
            )
    if not lines:
        return ""
    head = [
        "**Across tokens** (the `horizon` predictor's forecasts driving eviction; demand-only "
        "replay of held-out test prompts at 25% cache, experts read per decode token; "
        "docs/foresight_default.md, docs/foresight_qwen.md):",
        "",
        "| model | inputs | best no-prediction cache | ours (reuse) | Belady knowing the next "
        "token | full Belady | gap closed |",
        "|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + lines) + "\n"


def _offload(root: Path) -> str:
    lines = []
    for name in ("default", "qwen", "default_b4"):
        rep = _load(root, f"docs/bench/offload_{name}.json")
        if rep is None:
            continue
        for entry in rep["links"]:
            summ = entry["by_frac"].get("0.25")
            if not summ:
                continue
            runs = {r["label"]: r for r in entry["runs"] if abs(r["cache_frac"] - 0.25) < 0.01}
            ours = max((k for k in runs if "+horizon" in k), default=None,
                       key=lambda k: runs[k]["decode_tok_s"] or 0)  # fmt: skip
            if ours is None:
                continue
            row = summ["runs"][ours]
            within = max((k for k in runs if k.startswith("prefetch:tensorbend") and "+" not in k),
                         default=None, key=lambda k: runs[k]["decode_tok_s"] or 0)  # fmt: skip
            w = summ["runs"][within]["vs_best_cache"] if within else None
            lines.append(
                f"| {rep['model']}{_batch(rep)} | x{entry['speedup']:g} | "
                f"{summ['best_no_prediction_cache']}: "
                f"{summ['best_no_prediction_decode_tok_s']:.1f} | "
                f"{'-' if w is None else f'{w:.2f}x'} | {ours}: "
                f"{runs[ours]['decode_tok_s']:.1f} (**{row['vs_best_cache']:.2f}x**) | "
                f"{row['gap_closed_bytes']:.0%} | {summ['full_oracle']['decode_tok_s']:.1f} |"
            )
    if not lines:
        return ""
    head = [
        "**End to end** (`tensorbend run`, measured: teacher-forced decode of held-out prompts, "
        "25% cache, the `h100-pcie5-kimi` link and one 4x faster; outputs identical to the "
        "resident model in every run; docs/offload_default.md, docs/offload_qwen.md, and "
        "4 sequences in lockstep: docs/offload_default_b4.md):",
        "",
        "| model | link | best no-prediction cache (tok/s) | ours within-token only | ours "
        "(horizon + within-token) | byte gap closed | full oracle tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + lines) + "\n"


def _batch(rep: dict) -> str:
    b = rep.get("batch", 1)
    return "" if b == 1 else f", batch {b}"


def _projections(root: Path) -> str:
    rep = _load(root, "docs/projections.json")
    if rep is None:
        return ""
    lines = [
        "**Projected** (simulated from zoo:default's held-out routing, not measured; "
        "docs/projections.md):",
        "",
        "| geometry on hardware | best no-prediction cache | best ours | oracle |",
        "|---|---|---|---|",
    ]
    for p in rep["pairs"]:
        res = p["results"]
        best = next(r for r in res if r["label"] == res[0]["best_no_prediction"])
        ours = max((r for r in res if "horizon" in r["label"] or "tensorbend" in r["label"]),
                   key=lambda r: r["decode_tok_s"])  # fmt: skip
        oracle = max((r for r in res if r["policy"] == "oracle"), key=lambda r: r["decode_tok_s"])
        lines.append(
            f"| {p['geometry']} on {p['hardware']} | {best['label']}: "
            f"{best['decode_tok_s']:.2f} tok/s | {ours['label']}: {ours['decode_tok_s']:.2f} "
            f"({ours['vs_best_no_prediction']:.2f}x) | {oracle['decode_tok_s']:.2f} "
            f"({oracle['vs_best_no_prediction']:.2f}x) |"
        )
    return "\n".join(lines) + "\n"


def render_readme(text: str, root: Path = ROOT) -> str:
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:a] + "\n" + section(root) + text[b:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true")
    a = p.parse_args(argv)
    readme = ROOT / "README.md"
    return write_generated(readme, render_readme(readme.read_text()), a.check)


if __name__ == "__main__":
    sys.exit(main())
