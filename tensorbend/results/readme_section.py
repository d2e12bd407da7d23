"""The README's results section, built from the committed JSON of the benches (never typed).

Usage:
    python -m bench.summary            # rewrites the section between the README's markers
    python -m bench.summary --check    # exit 1 if the README differs from the JSON
    text = render_readme(readme.read_text(), root)   # root: the repository (docs/ under it)

Sources: docs/results_default.json (within-token predictors, bench/predictor_eval.py),
docs/foresight_{default,qwen}.json (bench/foresight_eval.py), docs/bench/offload_{default,qwen}.json
(bench/offload_sweep.py), docs/projections.json (bench/projections.py). tests/test_docs_results.py
runs the check.
"""

from __future__ import annotations

import json
from pathlib import Path

from tensorbend.cache.report import compare, format_ratio, run_label, shown_ratio
from tensorbend.results.offload_page import dropped

BEGIN, END = "<!-- results:begin (bench/summary.py) -->", "<!-- results:end -->"


def section(root: Path) -> str:
    parts = [_within_token(root), foresight_section(root), offload_section(root),
             cache_size_section(root), _serving(root), projections_section(root)]  # fmt: skip
    return "\n".join(p for p in parts if p)


def _serving(root: Path) -> str:
    """The larger-than-memory serving bench (bench/serve_memory.py), one row per policy."""
    rep = load(root, "docs/bench/serve_memory.json")
    if rep is None:
        return ""
    budget, base = rep["max_memory_bytes"], rep["import_baseline_rss_bytes"]
    lines = [
        f"**Serving a model larger than memory** (`tensorbend generate`, measured: "
        f"{rep['checkpoint_bytes'] / 1e9:.1f} GB checkpoint, `--max-memory "
        f"{budget / 1e9:.0f}GB`, every expert read from the disk with `--io direct`, "
        f"{rep['prompts']} held-out prompts x {rep['max_new_tokens']} greedy tokens, median of "
        f"{rep['repeats']} interleaved repeats [range]; peak RSS above the "
        f"{base / 1e6:.0f} MB import baseline; docs/serve_memory.md):",
        "",
        "| policy | decode tok/s | vs best cache | MB read / token | hit rate | "
        "peak RSS - baseline (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rep["results"]:
        lo, hi = r["decode_tok_s_range"]
        lines.append(
            f"| {r['policy']} | {r['decode_tok_s']:.2f} [{lo:.2f}, {hi:.2f}] | "
            f"{r['vs_best_cache']:.2f}x [{r['vs_best_cache_range'][0]:.2f}, "
            f"{r['vs_best_cache_range'][1]:.2f}] | {r['bytes_read_per_token'] / 1e6:.0f} | "
            f"{r['demand_hit_rate']:.2f} | {(r['peak_rss_bytes'] - base) / 1e6:.0f} of "
            f"{budget / 1e6:.0f} |"
        )
    return "\n".join(lines) + "\n" + _serving_stall(rep) + _serving_accelerate(root)


def _serving_accelerate(root: Path) -> str:
    """tensorbend beside transformers + accelerate offloading (bench.serve_memory --accelerate,
    docs/bench/serve_accelerate.json), when measured."""
    rep = load(root, "docs/bench/serve_accelerate.json")
    acc = (
        next((r for r in rep["results"] if r.get("engine") == "accelerate"), None) if rep else None
    )
    if acc is None:
        return ""
    best = next(r for r in rep["results"] if r["policy"] == rep["best_no_prediction"])
    lo, hi = acc["vs_best_cache_range"]
    cap = rep.get("memory_cap_bytes")
    same = all(r.get("text_equal_to_best") for r in rep["results"])
    return (
        f"\nBeside transformers + accelerate offloading (`tensorbend generate --engine "
        f"accelerate`: `device_map=\"auto\"` within the same budget, the rest streamed in from "
        f"disk every forward; {rep['repeats']} interleaved repeats"
        + (f", every run in a memory cgroup of {cap / 1e6:.0f} MB, the page cache counted"
           if cap else "") + f"; docs/serve_accelerate.md): tensorbend's best cache "
        f"({best['policy']}) decodes {best['decode_tok_s']:.2f} tok/s reading "
        f"{best['bytes_read_per_token'] / 1e6:.0f} MB per token, accelerate "
        f"{acc['decode_tok_s']:.2f} tok/s streaming {acc['bytes_read_per_token'] / 1e6:.0f} MB: "
        f"tensorbend is {1 / acc['vs_best_cache']:.1f}x faster [{1 / hi:.1f}, {1 / lo:.1f}]"
        + (", with the same greedy text in every run" if same else "") + ". That gain is the "
        "expert cache's, not prediction's.\n"
    )  # fmt: skip


def _serving_stall(rep: dict) -> str:
    """Where a serving token's time goes: the best cache's wait for loads (the most any
    prefetcher could hide) beside our row that waits least (absent from older JSON)."""
    rows = rep["results"]
    if not all("no_stall_ceiling" in r for r in rows):
        return ""
    best = next(r for r in rows if r["policy"] == rep["best_no_prediction"])
    ours = min((r for r in rows if r["policy"].startswith("ours")),
               key=lambda r: r["stall_s_per_token"], default=None)  # fmt: skip
    rest = lambda r: (1 / r["decode_tok_s"] - r["stall_s_per_token"]) * 1e3  # noqa: E731
    text = (
        f"\nThe best cache ({best['policy']}) waits {best['stall_s_per_token'] * 1e3:.1f} ms "
        f"per decode token for expert loads; the rest of its {1e3 / best['decode_tok_s']:.0f} "
        f"ms is compute and overhead, so hiding every wait would make it at most "
        f"{best['no_stall_ceiling']:.2f}x faster at the same bytes."
    )
    if ours is not None:
        text += (
            f" Our row that waits least ({ours['policy']}) waits "
            f"{ours['stall_s_per_token'] * 1e3:.1f} ms, but reads "
            f"{ours['bytes_read_per_token'] / 1e6:.0f} MB per token (against "
            f"{best['bytes_read_per_token'] / 1e6:.0f}) and spends "
            f"{ours['predict_s_per_token'] * 1e3:.1f} ms predicting; the rest of its token "
            f"takes {rest(ours):.0f} ms against {rest(best):.0f}, so it runs "
            f"{ours['vs_best_cache']:.2f}x the best cache."
        )
    return text + "\n"


def load(root: Path, rel: str) -> dict | None:
    """The JSON at `root / rel`, or None when it was not generated yet."""
    path = root / rel
    return json.loads(path.read_text()) if path.is_file() else None


def _within_token(root: Path) -> str:
    rep = load(root, "docs/results_default.json")
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


def stale(rep: dict) -> bool:
    """A foresight JSON written before the oracle ceiling and prefetch:none in the replay."""
    return "oracle_ceiling" not in rep["runs"][0]


# The replays' JSON per trace: the bundled models' test splits, then their held-out topics
# (`tensorbend trace resplit`: fitted on the other topics, tested on every prompt of these),
# then a routing-only trace made by `trace export` + `trace import` (what an imported trace is).
TRACES = ("default", "qwen", "deep", "default_domain", "deep_domain", "deep_imported")


def _tested_on(rep: dict) -> str:
    """The test prompts of a replay: the test split, or the held-out topics."""
    r = rep.get("resplit")
    return "test split" if r is None else "unseen topics: " + ", ".join(r["test_topics"])


def foresight_section(root: Path) -> str:
    lines, old, docs, bound = [], [], [], []
    for name in TRACES:
        rep = load(root, f"docs/foresight_{name}.json")
        if rep is None:
            continue
        docs.append(f"docs/foresight_{name}.md")
        if stale(rep):
            old.append(f"docs/foresight_{name}.json ({rep['model']})")
            continue
        for r in rep["runs"]:
            if r["cache_frac"] != 0.25:
                continue
            epf = lambda n, rp=r["replay"]: rp[n]["experts_per_token"]  # noqa: E731
            best, nxt = r["best_no_prediction"], r["oracle_ceiling"]["2"]
            gap = epf(best) - epf(r["full_oracle"])
            nxt_closed = (epf(best) - epf(nxt)) / gap if gap else None
            lines.append(
                f"| {rep['model']} | {_tested_on(rep)} | {r['inputs']} | {epf(best):.2f} ({best}) | "
                f"{epf(r['best_reuse']):.2f} | {epf(nxt):.2f} ({_pct(nxt_closed)}) | "
                f"{epf(r['full_oracle']):.2f} | {r['gap_closed']:.0%} |"
            )
            if r["inputs"] == "routing+hidden" and nxt_closed is not None:
                bound.append((rep["model"], _tested_on(rep), r["gap_closed"], nxt_closed))
    if not lines:
        return ""
    head = [
        "**Across tokens** (the `horizon` predictor's forecasts driving eviction; demand-only "
        "replay of held-out test prompts at 25% cache, experts read per decode token; the "
        "oracle ranks and admits like the best no-prediction cache beyond what it knows; "
        "unseen topics: trained on the other topics' prompts, tested on every prompt of "
        f"these; {', '.join(docs)}):",
        "",
        "| model | tested on | inputs | best no-prediction cache | ours (horizon) | oracle "
        "knowing the next token (gap closed) | full oracle | gap closed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    return _table(head, lines, old, "the oracle ceiling and `prefetch:none` in the replay") + (
        _bound_sentence(bound) if bound else ""
    )


def _bound_sentence(bound: list[tuple[str, str, float, float]]) -> str:
    """What the next-token oracle says about the gap the horizon can close (generated)."""
    ours = [b[2] for b in bound]
    nxt = [b[3] for b in bound]
    reach = [f"{m} ({t}): {o:.0%} of its {n:.0%}" for m, t, o, n in bound]
    return (
        f"\nThe horizon (routing+hidden) closes {min(ours):.0%}-{max(ours):.0%} of the gap; "
        f"an oracle that knows the exact routing of the next token closes {min(nxt):.0%}-"
        f"{max(nxt):.0%} ({'; '.join(reach)}). Closing more takes foresight beyond the next "
        "token (docs/zoo_card.md: what the exact routing of 2 and 4 tokens ahead closes).\n"
    )


def _table(head: list[str], lines: list[str], old: list[str], lacks: str) -> str:
    """A replay table, then a line per JSON left out for predating `lacks`."""
    tail = [""] + [f"Not shown: {o} predates {lacks}; `make bench-accuracy` regenerates it."
                   for o in old]  # fmt: skip
    return "\n".join(head + lines + (tail if old else [])) + "\n"


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
                and "+" not in (r.get("lookahead") or "")  # (not a predictor group's)
                and r["admission"] == want["admission"]):  # fmt: skip
            return r
    return None


# The batch-1 headline sweeps (docs/bench/headline_NAME.json), in table order; batch 4 follows.
HEADLINES = ("default", "qwen", "deep", "deep_x4", "default_domain", "deep_domain")


def offload_rows(root: Path) -> list[dict]:
    """Per sweep and link at 25% cache: the comparison (cache.report.compare) and ours."""
    out = []
    for name in (*HEADLINES, "default_b4", "deep_b4"):
        rep = load(root, f"docs/bench/headline_{name}.json")  # the repeated runs, if measured
        rep = rep or load(root, f"docs/bench/offload_{name}.json")
        for entry, runs, c in _at_quarter(rep):
            row = {"rep": rep, "entry": entry, "cmp": c}
            for which in OURS:
                r = ours(runs, which)
                row[which] = r and {"run": r, "label": run_label(r), **c["runs"][run_label(r)]}
            out.append(row)
    return out


def _at_quarter(rep: dict | None):
    """Per link of a sweep: (entry, its runs at 25% cache, their `cache.report.compare`)."""
    for entry in rep["links"] if rep else ():
        runs = [r for r in entry["runs"] if abs(r["cache_frac"] - 0.25) < 0.01]
        comp = compare(runs)
        if comp:
            (c,) = comp.values()
            yield entry, runs, c


def offload_section(root: Path) -> str:
    lines, rows = [], offload_rows(root)
    for x in rows:
        rep, entry, c = x["rep"], x["entry"], x["cmp"]
        cells = []
        for which in OURS:
            o = x[which]
            cells.append("-" if o is None else f"{o['label']}: {o['run']['decode_tok_s']:.1f} "
                         f"(**{format_ratio(o)}**, {_pct(o.get('gap_closed_bytes'))})")  # fmt: skip
        topics = rep.get("topics")
        mark = " †" if dropped(rep) else ""
        lines.append(
            f"| {rep['model']}{_batch(rep)}{', unseen topics' if topics else ''}{mark} | "
            f"x{entry['speedup']:g} | " + _versus(c, cells)
        )
    if not lines:
        return ""
    head = [
        "**End to end** (`tensorbend run`, measured: teacher-forced decode of held-out prompts, "
        "25% cache, the `h100-pcie5-kimi` link and one 4x faster; outputs identical to the "
        f"resident model in every run; {_headline_docs(root)}, and "
        f"4 sequences in lockstep: {_b4_doc(root)}). Each of ours is one fixed "
        "configuration; cells: decode tok/s (ratio to the best no-prediction cache, share of "
        "the byte gap to the full oracle closed). A ratio with a range is the median of "
        "interleaved repeats [range] (a range that holds 1.00 is no gain); a ratio without one "
        "ran once: byte-identical twin runs differ by up to 4.6% in tok/s on this machine, so "
        "single-run ratios within 0.95-1.05x are ties:",
        "",
        "| model | link | best no-prediction cache (tok/s) | "
        + " | ".join(f"ours: {w}" for w in OURS)
        + " | full oracle tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    tail = []
    if any(dropped(x["rep"]) for x in rows):
        tail = ["", "† Measured while the request queue dropped a prefetch taken behind a busy "
                "link; a prefetch now waits in the queue until the link has room (its JSON "
                "records `busy_link_prefetch`). Dropping threw away most within-token prefetches, "
                "so these rows understate within-token prefetch; the row's `make bench-headline*` "
                "target measures it again."]  # fmt: skip
    return "\n".join(head + lines + tail) + "\n" + _reading(root)


def _headline_docs(root: Path) -> str:
    """The batch-1 headline pages the table reads (the repeated sweeps that were measured)."""
    names = [n for n in HEADLINES if (root / f"docs/bench/headline_{n}.json").is_file()]
    return ", ".join(f"docs/headline_{n}.md" for n in names) or "docs/offload_*.md"


def _b4_doc(root: Path) -> str:
    """The batch-4 pages the table reads: the repeated runs when they were measured."""
    repeated = (root / "docs/bench/headline_default_b4.json").is_file()
    docs = ["docs/headline_default_b4.md" if repeated else "docs/offload_default_b4.md"]
    if (root / "docs/bench/headline_deep_b4.json").is_file():
        docs.append("docs/headline_deep_b4.md")
    return ", ".join(docs)


def cache_size_section(root: Path) -> str:
    """Every cache size of the headline sweeps that ran more than one (batch 1, each link)."""
    lines, docs = [], []
    for name in ("default", "qwen", "deep"):
        rep = load(root, f"docs/bench/headline_{name}.json")
        for entry in rep["links"] if rep else ():
            comp = compare(entry["runs"])
            if len(comp) < 2:
                continue
            if f"docs/headline_{name}.md" not in docs:
                docs.append(f"docs/headline_{name}.md")
            for frac, c in sorted(comp.items()):
                at = [r for r in entry["runs"] if abs(r["cache_frac"] - frac) < 0.01]
                cells = []
                for r in [ours(at, w) for w in OURS]:
                    o = r and c["runs"][run_label(r)]
                    cells.append("-" if r is None else f"{r['decode_tok_s']:.1f} "
                                 f"(**{format_ratio(o)}**, {_pct(o.get('gap_closed_bytes'))})")  # fmt: skip
                lines.append(
                    f"| {rep['model']} | x{entry['speedup']:g} | {frac:.1%} | " + _versus(c, cells)
                )
    if not lines:
        return ""
    head = [
        f"**By cache size** (the same sweep and cells as above, batch 1; {', '.join(docs)}):",
        "",
        "| model | link | cache | best no-prediction cache (tok/s) | "
        + " | ".join(f"ours: {w}" for w in OURS)
        + " | full oracle tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + lines) + "\n"


NOISE = 0.05  # one-run tok/s ratios inside 1 +- this are ties (twin runs differ by up to 4.6%)


def _reading(root: Path) -> str:
    """What the end-to-end table says, in words that follow its numbers."""
    rows = offload_rows(root)

    def span(which: str) -> tuple[float, float] | None:
        xs = [shown_ratio(x[which]) for x in rows if x[which] is not None]
        return (min(xs), max(xs)) if xs else None

    def gains(which: str) -> list[bool]:
        """Per row: a gain (repeats: the whole range above 1; one run: above 1 + NOISE)."""
        out = []
        for x in rows:
            o = x[which]
            if o is not None:
                rep = o.get("vs_best_cache_repeats")
                out.append(rep[0] > 1 if rep else o["vs_best_cache"] > 1 + NOISE)
        return out

    parts = []
    for which, name in (("within-token only", "A within-token predictor alone"),
                        ("horizon only", "The horizon alone"),
                        ("horizon + within-token", "The horizon plus a within-token predictor")):  # fmt: skip
        sp = span(which)
        if sp is None:
            continue
        lo, hi = sp
        won = gains(which)
        if not any(won):
            verdict = "it does not beat the best cache without prediction"
        elif all(won):
            verdict = "it beats the best cache without prediction in every row"
        else:
            verdict = (f"it beats the best cache without prediction in {sum(won)} of "
                       f"{len(won)} rows")  # fmt: skip
        parts.append(f"{name} reaches {lo:.2f}-{hi:.2f}x: {verdict}.")
    both = [shown_ratio(x["horizon + within-token"]) - shown_ratio(x["horizon only"])
            for x in rows if x["horizon + within-token"] and x["horizon only"]]  # fmt: skip
    if both:
        parts.append(
            f"Adding the within-token predictor to the horizon moves the ratio by "
            f"{min(both):+.2f} to {max(both):+.2f}"
            + (": a tie at this noise." if max(abs(d) for d in both) < NOISE else ".")
        )
    dead = [x for x in rows for w in OURS
            if x[w] is not None and "[0 prefetches loaded]" in x[w]["label"]]  # fmt: skip
    if dead:
        parts.append(
            "A label ending in [0 prefetches loaded] marks a run whose predictor's prefetches "
            "were all dropped (the link backlog rule of the † rows): it measures the eviction "
            "alone."
        )
    return "\n" + " ".join(parts) + "\n" if parts else ""


def _versus(c: dict, cells: list[str]) -> str:
    """A comparison row's cells from the best no-prediction cache on: best cache (tok/s),
    `cells` (ours), full oracle tok/s."""
    return (f"{c['best_no_prediction_cache']}: {c['best_no_prediction_decode_tok_s']:.1f} | "
            + " | ".join(cells) + f" | {c['full_oracle']['decode_tok_s']:.1f} |")  # fmt: skip


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def _batch(rep: dict) -> str:
    b = rep.get("batch", 1)
    return "" if b == 1 else f", batch {b}"


def projections_section(root: Path) -> str:
    rep = load(root, "docs/projections.json")
    if rep is None:
        return ""
    lines = [
        "**Projected** (simulated from zoo:default's held-out routing, not measured; "
        "prediction is charged zero seconds; docs/projections.md):",
        "",
        "| geometry on hardware | best no-prediction cache | ours: horizon only | ours: "
        "horizon + within-token | full oracle |",
        "|---|---|---|---|---|",
    ]
    for p in rep["pairs"]:
        res = {r["label"]: r for r in p["results"]}
        best = res[p["best_no_prediction"]]
        cells = []
        for label in ("horizon/adm=predicted", "horizon+d1:tensorbend/adm=predicted"):
            r = res.get(label)
            cells.append(
                "-" if r is None else f"{r['decode_tok_s']:.2f} ({r['vs_best_cache']:.2f}x)"
            )
        oracle = res[p["full_oracle"]]
        lines.append(
            f"| {p['geometry']} on {p['hardware']} | {best['label']}: "
            f"{best['decode_tok_s']:.2f} tok/s | "
            + " | ".join(cells)
            + f" | {oracle['decode_tok_s']:.2f} ({oracle['vs_best_cache']:.2f}x) |"
        )
    return "\n".join(lines) + "\n"


def render_readme(text: str, root: Path) -> str:
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:a] + "\n" + section(root) + text[b:]
