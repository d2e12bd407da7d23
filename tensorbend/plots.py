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
    report = report if isinstance(report, dict) else report.to_json()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = report["results"]
    title = f"{report['model']} ({report['split']} split, top-{report['top_k']} of {report['num_experts']})"
    paths = []
    lookaheads = list(report["lookaheads"])
    phases = [p for p in ("prefill", "decode") if any(r["phase"] == p for r in res)]

    # 1. recall@k by target layer, one panel per phase, at the first headline lookahead with data
    la0 = "d1" if "d1" in lookaheads else lookaheads[0]
    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4), squeeze=False)
    for ax, ph in zip(axes[0], phases, strict=True):
        for r in _sorted([r for r in res if r["lookahead"] == la0 and r["phase"] == ph]):
            ax.plot(
                [x["layer"] for x in r["per_layer"]],
                [x["recall_at_k"] for x in r["per_layer"]],
                marker="o",
                label=_label(r),
            )
        ax.set(
            title=f"{ph}, lookahead {la0}",
            xlabel="target MoE layer",
            ylabel=f"recall@{report['top_k']}",
            ylim=(0, 1.02),
        )
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title)
    paths.append(_save(fig, out_dir / "recall_by_layer.png"))

    # 2. recall@k by lookahead (decode and prefill)
    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4), squeeze=False)
    for ax, ph in zip(axes[0], phases, strict=True):
        kinds = dict.fromkeys(_label(r) for r in _sorted(res))
        for kind in kinds:
            by_la = {
                r["lookahead"]: r["recall_at_k"]
                for r in res
                if _label(r) == kind and r["phase"] == ph
            }
            if by_la:  # NaN where a kind was not run at a lookahead: the line breaks there
                ys = [by_la.get(la, float("nan")) for la in lookaheads]
                ax.plot(lookaheads, ys, marker="o", label=kind)
        ax.set(
            title=ph,
            xlabel="lookahead (source point)",
            ylabel=f"recall@{report['top_k']}",
            ylim=(0, 1.02),
        )
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title)
    paths.append(_save(fig, out_dir / "recall_by_lookahead.png"))

    # 3. hit rate vs over-provision, decode (or prefill) at la0
    ph = "decode" if "decode" in phases else phases[0]
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in _sorted([r for r in res if r["lookahead"] == la0 and r["phase"] == ph]):
        ps = sorted(
            (int(p) if p != "K" else report["top_k"], v) for p, v in r["hit_at_k_plus_p"].items()
        )
        ax.plot([p for p, _ in ps], [v for _, v in ps], marker="o", label=_label(r))
    ax.set(
        title=f"{ph}, {la0}: hits among top-(k+p) / k",
        xlabel="over-provision p",
        ylabel="hit@k+p",
        ylim=(0, 1.02),
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "hit_by_overprovision.png"))

    # 4. prefill vs decode bars at la0
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = _sorted([r for r in res if r["lookahead"] == la0])
    kinds = list(dict.fromkeys(_label(r) for r in rows))
    for j, p in enumerate(phases):
        vals = [
            next((r["recall_at_k"] for r in rows if _label(r) == k and r["phase"] == p), 0)
            for k in kinds
        ]
        ax.bar([i + 0.4 * j for i in range(len(kinds))], vals, width=0.4, label=p)
    ax.set_xticks([i + 0.2 for i in range(len(kinds))], kinds, rotation=30, ha="right")
    ax.set(title=f"prefill vs decode at {la0}", ylabel=f"recall@{report['top_k']}", ylim=(0, 1.02))
    ax.legend()
    paths.append(_save(fig, out_dir / "prefill_vs_decode.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
