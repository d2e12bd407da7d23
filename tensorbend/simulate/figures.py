"""PNG plots of a simulation: decode tok/s and stall per run, and by cache size.

Usage:
    paths = plot_results(result, Path("runs/sim_plots"))     # list of written PNG files

Titles state hardware, geometry, split and batch; every bar is one policy (x predictor) at one
cache fraction, so the baselines of the same run sit beside the predictors.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_results(res, out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    title = f"{res.geometry} on {res.hardware} (simulated; {res.split} split, batch {res.batch})"
    paths = [_bars(res.results, title, out_dir / "simulate_runs.png")]
    if len({r["cache_frac"] for r in res.results if r["policy"] != "resident"}) > 1:
        paths.append(_by_cache(res.results, title, out_dir / "simulate_by_cache.png"))
    return paths


def _label(r: dict) -> str:
    return r["policy"] + (
        f"\n{r['predictor']}" if r["predictor"] and r["policy"] == "prefetch" else ""
    )


def _bars(results: list[dict], title: str, path: Path) -> Path:
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(results)), 4.2))
    labels = [f"{_label(r)}\n{r['cache_frac']:.3g}" for r in results]
    a.bar(range(len(results)), [r["decode_tok_s"] or 0 for r in results], color="tab:blue")
    b.bar(range(len(results)), [r["stall_s_per_token"] * 1e3 for r in results], color="tab:red")
    for ax, ylab in ((a, "decode tokens/s"), (b, "stall ms per decode token")):
        ax.set_xticks(range(len(results)), labels, fontsize=7)
        ax.set_ylabel(ylab)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _by_cache(results: list[dict], title: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        if r["policy"] != "resident":
            series.setdefault(_label(r).replace("\n", " "), []).append(
                (r["cache_frac"], r["decode_tok_s"] or 0)
            )
    for name, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("cache (fraction of each layer's experts)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
