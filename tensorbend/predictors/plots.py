"""PNG plots of an eval report: recall by layer, by lookahead, by over-provision, prefill vs decode.

Usage:
    paths = plot_eval(report, Path("runs/plots"))     # list of written PNG files

`report` is an EvalReport or its JSON (`tensorbend eval --json`). Lines and bars follow the
registry's order of kinds; a trained checkpoint's label carries a `*`.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tensorbend.predictors.registry import KINDS  # noqa: E402

_ORDER = list(KINDS)


def _label(r: dict) -> str:
    return r["predictor"] if r["checkpoint"] is None else f"{r['predictor']}*"


def _sorted(results):
    return sorted(
        results, key=lambda r: _ORDER.index(r["predictor"]) if r["predictor"] in _ORDER else 99
    )


def plot_eval(report, out_dir: Path) -> list[Path]:
    rep = report if isinstance(report, dict) else report.to_json()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lookaheads = list(rep["lookaheads"])
    la0 = "d1" if "d1" in lookaheads else lookaheads[0]  # the lookahead of plots 1, 3, 4
    phases = [p for p in ("prefill", "decode") if any(r["phase"] == p for r in rep["results"])]
    figures = {
        "recall_by_layer": _by_layer(rep, la0, phases),
        "recall_by_lookahead": _by_lookahead(rep, lookaheads, phases),
        "hit_by_overprovision": _by_overprovision(rep, la0, phases),
        "prefill_vs_decode": _prefill_vs_decode(rep, la0, phases),
    }
    return [_save(fig, out_dir / f"{name}.png") for name, fig in figures.items()]


def _title(rep: dict) -> str:
    return f"{rep['model']} ({rep['split']} split, top-{rep['top_k']} of {rep['num_experts']})"


def _by_layer(rep: dict, la0: str, phases: list[str]):
    """Recall@k by target layer, one panel per phase, at la0."""
    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4), squeeze=False)
    for ax, ph in zip(axes[0], phases, strict=True):
        for r in _sorted([r for r in rep["results"] if r["lookahead"] == la0 and r["phase"] == ph]):
            layers = [x["layer"] for x in r["per_layer"]]
            ax.plot(layers, [x["recall_at_k"] for x in r["per_layer"]], marker="o", label=_label(r))
        ylabel = f"recall@{rep['top_k']}"
        ax.set(title=f"{ph}, lookahead {la0}", xlabel="target MoE layer", ylabel=ylabel)
        ax.set(ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(_title(rep))
    return fig


def _by_lookahead(rep: dict, lookaheads: list[str], phases: list[str]):
    """Recall@k by lookahead, one panel per phase; a line breaks where a kind was not run."""
    res = rep["results"]
    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4), squeeze=False)
    for ax, ph in zip(axes[0], phases, strict=True):
        for kind in dict.fromkeys(_label(r) for r in _sorted(res)):
            by_la = {
                r["lookahead"]: r["recall_at_k"]
                for r in res
                if _label(r) == kind and r["phase"] == ph
            }
            if by_la:
                ys = [by_la.get(la, float("nan")) for la in lookaheads]
                ax.plot(lookaheads, ys, marker="o", label=kind)
        ax.set(title=ph, xlabel="lookahead (source point)", ylabel=f"recall@{rep['top_k']}")
        ax.set(ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(_title(rep))
    return fig


def _by_overprovision(rep: dict, la0: str, phases: list[str]):
    """Hits among top-(k+p) / k against p, decode (or prefill) at la0."""
    ph = "decode" if "decode" in phases else phases[0]
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in _sorted([r for r in rep["results"] if r["lookahead"] == la0 and r["phase"] == ph]):
        ps = sorted(
            (int(p) if p != "K" else rep["top_k"], v) for p, v in r["hit_at_k_plus_p"].items()
        )
        ax.plot([p for p, _ in ps], [v for _, v in ps], marker="o", label=_label(r))
    title = f"{ph}, {la0}: hits among top-(k+p) / k"
    ax.set(title=title, xlabel="over-provision p", ylabel="hit@k+p", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _prefill_vs_decode(rep: dict, la0: str, phases: list[str]):
    """Recall@k bars per kind, prefill beside decode, at la0."""
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = _sorted([r for r in rep["results"] if r["lookahead"] == la0])
    kinds = list(dict.fromkeys(_label(r) for r in rows))
    for j, p in enumerate(phases):
        vals = [
            next((r["recall_at_k"] for r in rows if _label(r) == k and r["phase"] == p), 0)
            for k in kinds
        ]
        ax.bar([i + 0.4 * j for i in range(len(kinds))], vals, width=0.4, label=p)
    ax.set_xticks([i + 0.2 for i in range(len(kinds))], kinds, rotation=30, ha="right")
    ax.set(title=f"prefill vs decode at {la0}", ylabel=f"recall@{rep['top_k']}", ylim=(0, 1.02))
    ax.legend()
    return fig


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
