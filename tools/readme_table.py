"""The README's one results table: transformers + accelerate, tensorbend's best cache and
tensorbend with prediction, side by side, one row per regime, every cell from committed JSON.

Usage:
    python -m tools.readme_table            # rewrites the table between the README's markers
    python -m tools.readme_table --check    # exit 1 if the README differs from the JSON
    text = table(root)                      # root: the repository (docs/results/ under it)

Rows (each names its regime; `make bench-serve-accelerate`, `make bench-serve`,
`make bench-headline`, `make bench-accuracy` write their JSON):
  real disk      docs/results/bench/serve_memory.json: accelerate, the best cache and the best
                 prediction row, one run (docs/results/bench/serve_accelerate.json gives the
                 accelerate cell when serve_memory.json has no accelerate row)
  emulated link  docs/results/bench/headline_default.json, x1 link, 25% cache (OURS)
  simulated      docs/results/projections.json, Kimi-K2.5 on a DGX Spark
tests/test_docs_results.py runs the check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.pages.offload import format_peer_ratio, peer_summary
from bench.pages.projections import sim_regime
from tensorbend.atomic import write_generated
from tensorbend.cache.report import compare, format_ratio, ratio_verdict, run_label
from tensorbend.timing.time_model import regime_line

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- table:begin (python -m tools.readme_table) -->", "<!-- table:end -->"


def table(root: Path) -> str:
    serving = load(root, "bench/serve_memory.json")
    rows = [
        *([] if _acc_row(serving) else [_accelerate(load(root, "bench/serve_accelerate.json"))]),
        _serving(serving),
        _emulated(load(root, "bench/headline_default.json")),
        _simulated(load(root, "projections.json")),
    ]
    head = [
        "| regime | setup (page in docs/results/) | transformers + accelerate | tensorbend, "
        "best cache | tensorbend with prediction |",
        "|---|---|---|---|---|",
    ]
    return "\n".join(head + rows) + "\n"


def render(readme: str, root: Path) -> str:
    """`readme` with its table replaced by what the JSON says."""
    a, b = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[:a] + "\n" + table(root) + readme[b:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true")
    a = p.parse_args(argv)
    readme = ROOT / "README.md"
    return write_generated(readme, render(readme.read_text(), ROOT), a.check)


OURS = {  # one configuration each, fixed before the runs (never the best of several)
    "within-token only": dict(predictor="tensorbend", horizon=False, admission="all"),
    "horizon only": dict(predictor=None, horizon=True, admission="predicted"),
    "horizon + within-token": dict(predictor="tensorbend", horizon=True, admission="predicted"),
}


def ours(runs: list[dict], which: str) -> dict | None:
    """The run of `OURS[which]` among `runs` (prefetch, global pool, next-forward prefetches)."""
    want = OURS[which]
    for r in runs:
        if (r["policy"] == "prefetch" and r["pool"] == "global"
                and (r["predictor"] if r["predictor"] != "none" else None) == want["predictor"]
                and bool(r.get("horizon")) == want["horizon"]
                and r.get("token_ahead_layers") in (None, 1)
                and r["admission"] == want["admission"]):  # fmt: skip
            return r
    return None


def load(root: Path, name: str) -> dict:
    """The committed JSON `docs/results/NAME` under the repository `root`."""
    return json.loads((root / "docs" / "results" / name).read_text())


def _setup(rep: dict) -> str:
    return (f"{rep['checkpoint_bytes'] / 1e9:.1f} GB checkpoint, `--max-memory "
            f"{rep['max_memory_bytes'] / 1e9:.0f}GB`, {rep['repeats']} repeats")  # fmt: skip


def _accelerate(rep: dict) -> str:
    """One run of both engines: accelerate's tok/s and the best cache's speed-up over it."""
    acc = next(r for r in rep["results"] if r["engine"] == "accelerate")
    best = next(r for r in rep["results"] if r["policy"] == rep["best_no_prediction"])
    lo, hi = acc["vs_best_cache_range"]
    same = "same text" if all(r["text_equal_to_best"] for r in rep["results"]) else "TEXT DIFFERS"
    cap = (
        f", {rep['memory_cap_bytes'] / 1e6:.0f} MB memory cgroup"
        if "memory_cap_bytes" in rep
        else ""
    )
    return (
        f"| real disk | {_setup(rep)}{cap} (serve_accelerate.md) | {_tok_s(acc)} | "
        f"{best['policy']}: {_tok_s(best)}, **{1 / acc['vs_best_cache']:.1f}x [{1 / hi:.1f}, "
        f"{1 / lo:.1f}]** faster, {same} | not in this run |"
    )


def _serving(rep: dict) -> str:
    """The same serving without accelerate: the best cache beside the prediction row with the
    highest median ratio to it (the most prediction did there), and whether that is a gain."""
    best = next(r for r in rep["results"] if r["policy"] == rep["best_no_prediction"])
    ours = [r for r in rep["results"] if r["policy"].startswith("ours")]
    key = "vs_best_peer" if "best_peer" in rep else "vs_best_cache"  # (older JSON: caches only)
    top = max(ours, key=lambda r: r[key])
    lo, hi = top[f"{key}_range"]
    verdict = ratio_verdict(lo, hi)
    link = " with" if verdict == "a tie" else " than"
    peer = f"{link} the best peer ({rep['best_peer']})" if key == "vs_best_peer" else ""
    acc = _acc_row(rep)
    if acc is None:
        acc_cell = "not in this run"
    else:
        a_lo, a_hi = acc["vs_best_cache_range"]
        acc_cell = (f"{_tok_s(acc)}; the best cache is **{1 / acc['vs_best_cache']:.1f}x "
                    f"[{1 / a_hi:.1f}, {1 / a_lo:.1f}]** faster")  # fmt: skip
    same = "same text" if all(r["text_equal_to_best"] for r in rep["results"]) else "TEXT DIFFERS"
    cap = (
        f", {rep['memory_cap_bytes'] / 1e6:.0f} MB memory cgroup"
        if rep.get("memory_cap_bytes")
        else ""
    )
    over_cache = ""
    if key == "vs_best_peer":  # the same row over the best cache too, as the emulated row
        c_lo, c_hi = top["vs_best_cache_range"]
        over_cache = (f"{top['vs_best_cache']:.2f}x [{c_lo:.2f}, {c_hi:.2f}] over the best "
                      f"cache (**{ratio_verdict(c_lo, c_hi)}**); ")  # fmt: skip
    return (
        f"| real disk | {_setup(rep)}{cap} (serve_memory.md) | {acc_cell} | "
        f"{best['policy']}: {_tok_s(best)}, {same} | best of {len(ours)} rows, "
        f"{top['policy'].removeprefix('ours: ')}: {_tok_s(top)}, {over_cache}"
        f"{top[key]:.2f}x [{lo:.2f}, {hi:.2f}]: **{verdict}**{peer} |"
    )


def _acc_row(rep: dict) -> dict | None:
    return next((r for r in rep["results"] if r.get("engine") == "accelerate"), None)


def _emulated(rep: dict) -> str:
    """The x1 link at 25% cache: the best cache beside ours (horizon + within-token)."""
    link = rep["links"][0]
    runs = [r for r in link["runs"] if abs(r["cache_frac"] - 0.25) < 0.01]
    ((_, c),) = compare(runs).items()
    mine = ours(runs, "horizon + within-token")
    o = c["runs"][run_label(mine)]
    peer = peer_summary(runs, 0.25)
    vs = format_peer_ratio(peer["ours"][run_label(mine)])
    return (
        f"| emulated link | {rep['model']}, 25% cache, {link['link']['name']} link x{link['speedup']:g}, "
        f"{rep['repeats']} repeats (headline_default.md); {regime_line(runs)} | not run | "
        f"{c['best_no_prediction_cache']}: {c['best_no_prediction_decode_tok_s']:.1f} tok/s | "
        f"{run_label(mine)}: {mine['decode_tok_s']:.1f} tok/s, {format_ratio(o)}; over the best "
        f"peer ({peer['best_peer']}): {vs} |"
    )


def _simulated(rep: dict) -> str:
    """The first projection (a large model on real hardware), prediction charged as the rows'
    time model says (JSON before it: zero seconds)."""
    p = rep["pairs"][0]
    res = {r["label"]: r for r in p["results"]}
    best, mine = res[p["best_no_prediction"]], res["horizon+d1:tensorbend/adm=predicted"]
    summ = peer_summary(p["results"], mine["cache_frac"])
    peer = (f"; over the best peer ({summ['best_peer']}): "
            f"{summ['ours'][mine['label']]['as_run']:.2f}x"
            if summ and any(r.get("peer") for r in p["results"]) else "")  # fmt: skip
    return (
        f"| simulated | {p['geometry']} on {p['hardware']}, zoo:default's routing; "
        f"{sim_regime(mine)} (projections.md) | not run | {best['label']}: {best['decode_tok_s']:.2f} "
        f"tok/s | {mine['label']}: {mine['decode_tok_s']:.2f} tok/s, "
        f"{mine['vs_best_cache']:.2f}x{peer} |"
    )


def _tok_s(r: dict) -> str:
    lo, hi = r["decode_tok_s_range"]
    return f"{r['decode_tok_s']:.2f} tok/s [{lo:.2f}, {hi:.2f}]"


if __name__ == "__main__":
    sys.exit(main())
