"""What `tensorbend demo` measured, and the summary it prints (tensorbend/demo.py runs the steps).

Usage:
    s = DemoSummary.of(out, seconds, step_seconds, sizes, eval_json, run_rows, projection_rows)
    print(s.render("zoo:default"))         # what the CLI prints; s.to_json(): report/summary.json
    against_peer(run_rows)                 # ours' fastest row over the best peer of the same run

Rows are the demo's own (`label`, `policy`, `decode_tok_s`, `ours`, ... : tensorbend/demo.py's
`_run` and `_project`); the best peer is `cache.report.best_peer` of the rows not ours.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tensorbend.cache.report import best_peer, host_warning, repeat_ratios
from tensorbend.timing.time_model import label, regime_line

WITHHELD = (
    "tok/s and ratios withheld: other processes slowed this machine's compute but not the "
    "emulated link, so the measured speeds are not this machine's; bytes, hits and outputs "
    "above, the replay and the projection do not depend on load (rerun `tensorbend demo` "
    "on an idle machine for speeds; the JSON in report/ keeps them)"
)


@dataclass
class DemoSummary:
    """What the demo measured; `text` is what the CLI prints, `to_json()` the report's JSON."""

    out: str
    seconds: float
    recall_d1: dict  # predictor -> held-out decode recall@k at d1
    foresight: dict  # gap closed, best cache and ours' experts per token (replay)
    runs: list  # per offloaded run: label, decode tok/s, bytes/token, hit rate, matches
    projection: list  # per simulated run: label, decode tok/s
    peers: dict = field(default_factory=dict)  # "run"/"project" -> ours against the best peer
    step_seconds: dict = field(default_factory=dict)  # step -> wall seconds (reused: ~0)
    sizes: dict = field(default_factory=dict)  # DemoConfig.size and the trace's prompts per split
    host_warning: str | None = None  # other processes disturbed the timed runs (host_load.py)
    text: str = ""

    @classmethod
    def of(
        cls,
        out: Path,
        seconds: float,
        step_seconds: dict,
        sizes: dict,
        ev: dict,
        runs: list[dict],
        projection: list[dict],
    ) -> DemoSummary:
        """From the steps' outputs: eval's JSON, the run's and the projection's rows."""
        note = next((r["timing_note"] for r in runs if r.get("timing_note")), None)
        return cls(
            out=str(out),
            seconds=seconds,
            step_seconds=step_seconds,
            sizes=sizes,
            recall_d1=_recalls(ev),
            foresight=_foresight(ev),
            runs=runs,
            projection=projection,
            peers={"run": against_peer(runs), "project": against_peer(projection)},
            host_warning=host_warning(runs) or note,
        )

    def to_json(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "text"}

    def render(self, model: str, quick: bool = False) -> str:
        """The text the CLI prints (and report/summary.md holds)."""
        return _text(self, model, quick)


def against_peer(rows: list[dict]) -> dict | None:
    """Ours' fastest row over the best peer (`cache.report.best_peer`) of the same run: the
    median of the repeats' ratios [range] where the run repeated, else the single ratio."""
    peer = best_peer([r for r in rows if not r["ours"]])
    mine = [r for r in rows if r["ours"] and r.get("decode_tok_s")]
    if peer is None or not mine:
        return None
    top = max(mine, key=lambda r: r["decode_tok_s"])
    xs = repeat_ratios(top, peer)
    return {
        "ours": top["label"],
        "best_peer": peer["label"],
        "best_peer_tok_s": peer["decode_tok_s"],
        "vs_best_peer": statistics.median(xs) if xs else top["decode_tok_s"] / peer["decode_tok_s"],
        "repeats": xs,
    }


# ---------------------------------------------------------------- helpers


def _recalls(ev: dict) -> dict:
    return {
        r["predictor"]: r["recall_at_k"]
        for r in ev["results"]
        if r["phase"] == "decode" and r["lookahead"] == "d1"
    }


def _foresight(ev: dict) -> dict:
    f = ev["foresight"][0]
    rp = f["replay"]
    return {
        "best_no_prediction": f["best_no_prediction"],
        "best_no_prediction_experts_per_token": rp[f["best_no_prediction"]]["experts_per_token"],
        "ours_experts_per_token": rp[f["best_reuse"]]["experts_per_token"],
        "full_oracle_experts_per_token": rp[f["full_oracle"]]["experts_per_token"],
        "gap_closed": f["gap_closed"],
    }


def _text(s: DemoSummary, model: str, quick: bool) -> str:
    lines = [
        f"tensorbend demo on {model}{' (quick)' if quick else ''}: {s.seconds:.0f} s, "
        f"report in {s.out}/report",
        _sizes_line(s.sizes),
        "Step wall times (s, 0 = reused): "
        + ", ".join(f"{k} {v:.0f}" for k, v in s.step_seconds.items()),
        "",
        "Held-out decode recall@k at d1 (one MoE layer ahead):",
    ]
    for kind, x in sorted(s.recall_d1.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:<12} {x:.3f}")
    f = s.foresight
    gap = "-" if f["gap_closed"] is None else f"{f['gap_closed']:.0%}"
    lines += [
        "",
        "Across tokens (replay at 25% cache, experts read per decode token): best cache "
        f"{f['best_no_prediction']} {f['best_no_prediction_experts_per_token']:.2f}, ours "
        f"{f['ours_experts_per_token']:.2f}, full oracle {f['full_oracle_experts_per_token']:.2f} "
        f"(gap closed {gap})",
        "",
        "Offloaded generation, 25% cache, h100-pcie5-kimi link (measured here):",
        f"  {regime_line(s.runs)}",
    ]
    for r in s.runs:
        speed = (
            ""
            if s.host_warning
            else f" {r['decode_tok_s']:7.1f} tok/s ({r.get('ratio') or _x(r['vs_best_cache'])} "
            "best cache) "
        )
        lines.append(
            f"  {r['label']:<40}{speed} {r['bytes_read_per_token'] / 1e3:7.1f} "
            f"KB/token  hit {r['demand_hit_rate']:.2f}  identical output: {r['output_matches_resident']}"
        )
    if s.host_warning:  # a busy host slows compute, not the emulated link: ratios would move
        lines += [
            f"  WARNING: {s.host_warning}",
            f"  {WITHHELD}",
        ]
    else:
        lines += _peer_line(s.peers.get("run"))
    pred = [r for r in s.projection if r.get("predictor") not in (None, "none")]
    lines += [
        "",
        "Projected on Kimi-K2.5 / DGX Spark (simulated, not measured):",
        "  regime: " + label((pred or [{}])[0].get("time_model")),
    ]
    for r in s.projection:
        lines.append(
            f"  {r['label']:<40} {r['decode_tok_s']:6.2f} tok/s ({_x(r['vs_best_cache'])} best cache)"
        )
    lines += _peer_line(s.peers.get("project"))
    n = max((r.get("repeats", 1) for r in s.runs), default=1)
    lines.append(
        "  (measured ratios: over the fastest cache without prediction, "
        + (
            f"medians of {n} interleaved repeats [range]; a range holding 1.00 is no gain)"
            if n > 1
            else "one run each, no repeats: within 0.95-1.05x is a tie)"
        )
        + "\n  (projected ratios: one simulation each)"
    )
    return "\n".join(lines)


def _peer_line(p: dict | None) -> list[str]:
    if p is None:
        return []
    xs = p["repeats"]
    rng = f" [{xs[0]:.2f}, {xs[-1]:.2f}]" if xs else ""
    return [
        f"  ours ({p['ours']}) over the best peer, the fastest row neither ours nor the "
        f"oracle ({p['best_peer']}): {p['vs_best_peer']:.2f}x{rng}"
    ]


def _sizes_line(z: dict) -> str:
    sp = z.get("splits", {})
    rows = "" if z.get("seed_mlp_rows") is None else f", seed_mlp on {z['seed_mlp_rows']} rows"
    return (
        f"Sizes: {sum(sp.values())} prompts collected (train/val/test "
        f"{sp.get('train')}/{sp.get('val')}/{sp.get('test')}), {z['tokens']} decode tokens each"
        f"{rows}; run: {z['run_prompts']} test prompts x {z['run_tokens']} tokens, up to "
        f"{z['run_repeats']} repeats within {z['run_budget_s']} s; projection: "
        f"{z['sim_prompts']} prompts; {z.get('torch_threads')} torch thread(s) (the free cores)"
    )


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"
