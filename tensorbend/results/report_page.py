"""docs/REPORT.md: the technical report, its numbers rendered from the benches' committed JSON.

Usage:
    python -m bench.report_doc            # rewrites docs/REPORT.md
    python -m bench.report_doc --check    # exit 1 if docs/REPORT.md differs from the JSON
    text = report(root)                   # root: the repository (docs/ under it)

tests/test_docs_results.py runs the check, so a table can never drift from its JSON. Prose
that states a number takes it from the JSON too (`_n`); a missing JSON leaves its section
saying which command writes it.
"""

from __future__ import annotations

from pathlib import Path

from tensorbend.results import readme_section


def report(root: Path) -> str:
    parts = [
        _INTRO,
        _LEAD_TIME,
        _PREDICTORS,
        "## Within the token: held-out recall\n",
        _within(root, "docs/results_default.json", "results_default"),
        _within(root, "docs/results_qwen3moe.json", "results_qwen3moe"),
        "## The seed's claims, re-tested\n",
        _seed(root),
        "## Across tokens: what foresight buys a cache\n",
        _FORESIGHT + _foresight_reading(root),
        readme_section.foresight_section(root) or _missing("foresight_eval"),
        "## End to end: measured on this machine\n",
        _END_TO_END,
        readme_section.offload_section(root) or _missing("offload_sweep"),
        _cost(root),
        "## The simulator: validated, then projected\n",
        _validation(root),
        readme_section.projections_section(root) or _missing("projections"),
        "## Scale-out: traces and models larger than memory\n",
        _memory(root),
        _SCALE_OUT,
        _LIMITS,
        _REPRODUCE,
    ]
    return "\n".join(p.rstrip() + "\n" for p in parts if p)


def _memory(root: Path) -> str:
    rep = readme_section.load(root, "docs/bench/train_memory.json")
    if rep is None:
        return _missing("train_memory")
    lines = [
        f"Peak resident memory (MiB) against trace size (`{rep['trace']}` replicated; training "
        f"with --max-train-rows {rep['max_train_rows']} --max-val-rows {rep['max_val_rows']}; "
        "docs/bench/train_memory.md):",
        "",
        "| trace | rows | on disk MiB | load splits whole (no training) | train streamed | eval whole | "
        "eval streamed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rep["runs"]:
        lines.append(
            f"| {r['scale']}x | {r['rows']:,} | {r['disk_mib']:.0f} | {r['load_all_mib']:.0f} | "
            f"{r['train_streamed_mib']:.0f} | {r['eval_all_mib']:.0f} | "
            f"{r['eval_streamed_mib']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _missing(bench: str) -> str:
    return f"(not generated yet: run `python -m bench.{bench}`, see `make bench`)\n"


def _within(root: Path, rel: str, doc: str) -> str:
    rep = readme_section.load(root, rel)
    if rep is None:
        return _missing("predictor_eval")
    lines = [
        f"**{rep['model']}** (test split: {rep['prompts']['test']} prompts; decode rows "
        f"{rep['decode_mode']}; recall@{rep['top_k']} of {rep['num_experts']}; docs/{doc}.md):",
        "",
        "| lookahead | phase | " + " | ".join(_KINDS) + " |",
        "|---|---|" + "---|" * len(_KINDS),
    ]
    for la in ("pre_attn", "d1", "d2", "d3", "same_layer"):
        for ph in ("decode", "prefill"):
            at = {r["predictor"]: r["recall_at_k"] for r in rep["results"]
                  if r["lookahead"] == la and r["phase"] == ph}  # fmt: skip
            if not at:
                continue
            cells = [f"{at[k]:.3f}" if k in at else "-" for k in _KINDS]
            lines.append(f"| `{la}` | {ph} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


_KINDS = ("tensorbend", "seed_mlp", "spec_gate", "transition", "prev_token", "frequency", "random")


def _seed(root: Path) -> str:
    rep = readme_section.load(root, "docs/seed_study.json")
    if rep is None:
        return _missing("seed_study")
    runs = rep["runs"]
    base, d1, ours = runs["base"], runs["d1"], runs["ours_d1"]
    return (
        'The seed reports 99.8% top-k "accuracy": the best epoch\'s overlap on its first 200 '
        "*training* rows, for a predictor fed the router's own input. Re-run with its recipe "
        f"(docs/seed_study.md): {base['train_rows_recall']:.3f} on its training rows, "
        f"{base['test']['decode']:.3f} (decode) / {base['test']['prefill']:.3f} (prefill) on "
        "held-out prompts, at zero lead time, where the router itself (one matmul on the same "
        f"input) scores {rep['router_itself']['test']['decode']:.3f}. One MoE layer ahead (d1), "
        f"the seed's MLP scores {d1['test']['decode']:.3f}; ours {ours['test']['decode']:.3f} "
        f"with {ours['params'] / d1['params']:.0%} of its parameters. Its ranking variant: "
        f"{runs['ranking']['test']['decode']:.3f}; width 64/128/512: "
        f"{runs['width_64']['test']['decode']:.3f}/{runs['width_128']['test']['decode']:.3f}/"
        f"{runs['width_512']['test']['decode']:.3f}; without previous routing "
        f"{runs['no_prev']['test']['decode']:.3f}.\n"
    )


def _cost(root: Path) -> str:
    rep = readme_section.load(root, "docs/bench/predictor_cost.json")
    if rep is None:
        return _missing("predictor_cost")
    rows = "; ".join(
        f"{r['stack']} {r['us_per_token']:.0f} us ({r['ratio_to_decode_forward']:.1%})"
        for r in rep["results"]
    )
    met = "met" if rep["stack_ratio"] <= rep["target_ratio"] else "not met"
    return (
        "Cost of the prediction stack per decode token, through the prefetch API an engine "
        f"calls (`python -m bench.predictor_cost`, {rep['threads']} thread, side by side with the "
        f"resident decode forward of {rep['decode_forward_ms']:.2f} ms): {rows}. Target "
        f"{rep['target_ratio']:.0%} of a decode step for the whole stack: {met}. Timed outside "
        "the runtime on random inputs (hooks, locks and queueing not included). The "
        "within-token predictor's time is mostly per-call overhead of small tensor ops; the "
        "horizon's work grows with MoE layers x experts (about 120x zoo:default's on "
        "Kimi-K2.5), so its cost does not stay the same on a large model. The projections "
        f"below charge prediction zero seconds.{_in_runtime(rep.get('in_runtime'))}"
        f"{_split(rep)}{_cold_call(root)}{_stall_against_cost(root, rep)}\n"
    )


def _cold_call(root: Path) -> str:
    """Why a call costs more in the runtime: one call after other work (bench/cold_call.py)."""
    rep = readme_section.load(root, "docs/bench/cold_call.json")
    if rep is None:
        return ""
    by = {(r["call"], r["after"]): r["us"] for r in rep["results"]}
    calls = list(dict.fromkeys(r["call"] for r in rep["results"]))
    parts = "; ".join(
        f"{c}: {by[(c, 'back_to_back')]:.0f} us right after the same call, "
        f"{by[(c, 'spin_2ms')]:.0f} after 2 ms of a Python loop, {by[(c, 'sleep_2ms')]:.0f} "
        f"after 2 ms asleep, {by[(c, 'decode_forward')]:.0f} after a decode forward"
        for c in calls
    )
    return (
        " Why the same calls cost several times more in the runtime (`python -m "
        f"bench.cold_call`, medians of {rep['calls']} calls each, interleaved): {parts}. A "
        "call finds the CPU's caches holding the model's work, not its own code and data; "
        "in the runtime every call comes one MoE layer after the last, so a token pays "
        "about its number of calls times the after-forward cost. Trimming the Python of a "
        "call barely moves that; fewer calls per token would."
    )


def _stall_against_cost(root: Path, cost: dict) -> str:
    """What the within-token predictor alone saved in stall and spent in prediction per decode
    token in the offloaded headline sweep, beside its isolated cost (predictor_cost)."""
    rep = readme_section.load(root, "docs/bench/headline_default.json")
    iso = {r["stack"]: r["us_per_token"] for r in cost["results"]}.get("within-token")
    if rep is None or iso is None:
        return ""
    parts, all_lose = [], True
    for link in rep["links"]:
        at = [r for r in link["runs"] if abs(r.get("cache_frac", 0) - 0.25) < 0.01]
        none = next((r for r in at if r["label"] == "prefetch:none"), None)
        d1 = readme_section.ours(at, "within-token only")
        if none is None or d1 is None or d1.get("decode_predict_s_per_token") is None:
            return ""  # (older JSON: no prediction seconds)
        saved = (none["stall_s_per_token"] - d1["stall_s_per_token"]) * 1e3
        spent = (d1["decode_predict_s_per_token"] - none["decode_predict_s_per_token"]) * 1e3
        all_lose = all_lose and spent > saved
        parts.append(f"x{link['speedup']:g} link: {saved:.2f} ms less stall, {spent:.2f} ms "
                     f"more prediction ({spent * 1e3 / iso:.1f}x its isolated cost above)")  # fmt: skip
    return (
        " Offloaded (docs/headline_default.md, 25% cache, per decode token, the within-token "
        f"predictor alone against prefetch:none): {'; '.join(parts)}. The same calls cost "
        "more between the model's layers, with loads in flight, than in isolation."
        + (
            " At every link its extra prediction time exceeds the stall it removes."
            if all_lose
            else ""
        )
    )


def _split(rep: dict) -> str:
    """Where the runtime's decode prediction time goes: scoring (beside the same scoring
    timed in isolation), queueing, glue (absent from older JSON)."""
    rt = rep.get("in_runtime")
    iso = {r["stack"]: r.get("score_us_per_token") for r in rep["results"]}
    rows = [r for r in (rt or {}).get("results", []) if "decode_score_us_per_token" in r]
    if not rows:
        return ""
    parts = "; ".join(
        f"{r['stack']} {r['decode_predict_us_per_token']:.0f} us = scoring "
        f"{r['decode_score_us_per_token']:.0f} us"
        + (f" ({iso[r['stack']]:.0f} us in isolation)" if iso.get(r["stack"]) else "")
        + f" + queueing {r['decode_queue_us_per_token']:.0f} us + glue "
        f"{r['decode_glue_us_per_token']:.0f} us"
        for r in rows
    )
    return (
        " Where decode's calls go in the runtime (medians per decode token; scoring: the "
        "compiled kernels and the horizon's step; queueing: handing forecasts, hints and "
        f"prefetches to the cache and loader; glue: the Python of the hooks and of observe): {parts}."
    )


def _in_runtime(rt: dict | None) -> str:
    """The same stacks measured inside the offload runtime (absent from older JSON)."""
    if rt is None:
        return ""

    def decode_only(r: dict) -> str:  # (absent from older JSON)
        if "decode_predict_us_per_token" not in r:
            return ""
        return (f"; decode forwards' calls only {r['decode_predict_us_per_token']:.0f} us, "
                f"{r['decode_share_of_resident_step']:.1%}; handing predictions to the cache "
                f"and loader {r['queue_us_per_token']:.0f} us of the whole")  # fmt: skip

    rows = "; ".join(
        f"{r['stack']} {r['predict_us_per_token']:.0f} us ({r['share_of_resident_step']:.1%}"
        f"{decode_only(r)}; decode tok/s x{r['tok_s_ratio_vs_lru']:.2f} of lru, "
        f"{r['tok_s_ratio_range'][0]:.2f}-{r['tok_s_ratio_range'][1]:.2f})"
        for r in rt["results"]
    )
    return (
        " Inside the runtime (`OffloadSession.run_policy`, every expert cached, no link cap, "
        f"{rt['repeats']} repeats interleaved with lru; seconds in the prediction hooks per "
        f"decode token, prefill's calls included, over the resident decode step of "
        f"{rt['resident_decode_step_ms']:.2f} ms): {rows}." + _runtime_verdict(rt)
    )


def _runtime_verdict(rt: dict) -> str:
    """Each whole stack's decode calls (every predictor given: "both", and a predictor
    group's with the horizon) against issue 17's limit, over both steps: the resident one
    (measured once, at the session's start) and the lru runs' (measured beside them)."""
    rows = rt["results"]
    full = [r for r in rows if r["stack"] == "both" or r["stack"].endswith(" + horizon")]
    return "".join(_verdict(rt, r) for r in full or rows[-1:])


def _verdict(rt: dict, r: dict) -> str:
    if "decode_predict_us_per_token" not in r:
        return ""
    resident = r["decode_share_of_resident_step"]
    lru = r["decode_predict_us_per_token"] * 1e-6 * rt["lru_decode_tok_s"]
    limit = 0.05
    verdict = (
        "met over both" if max(resident, lru) <= limit
        else "met over neither" if min(resident, lru) > limit
        else "met over one only"
    )  # fmt: skip
    return (
        f" The whole stack ({r['stack']}), decode forwards' calls: {resident:.1%} of the "
        f"resident step, {lru:.1%} of the lru runs' own decode step; limit {limit:.0%}: "
        f"{verdict}."
    )


def _validation(root: Path) -> str:
    rep = readme_section.load(root, "docs/simulate_validation.json")
    if rep is None:
        return _missing("simulate_validate")
    metrics = ("decode_tok_s", "stall_s_per_token", "bytes_read_per_token")
    if "bias" not in rep:  # before the out-of-sample validation
        return _missing("simulate_validate")
    worst = max(rep["rows"], key=lambda r: max(abs(r[f"error_{k}"] or 0) for k in metrics))
    (cal, n_cal), (val, n_val) = ((s, len(ids)) for s, ids in rep["prompts"].items())
    b = rep["bias"]["decode_tok_s"]
    return (
        f"The simulator replays the runtime's own policies. Calibrated on {n_cal} {cal} prompts "
        f"and judged on {n_val} {val} prompts the calibration never saw, against `tensorbend run` "
        f"over the same link, its largest error in magnitude on decode tok/s, stall and bytes "
        f"per token over {len(rep['rows'])} configurations is {rep['max_error']:.1%} (worst: "
        f"{worst['label']}; bar {rep['bar']:.0%}); on decode tok/s its mean signed error is "
        f"{b['mean']:+.1%} (range {b['min']:+.1%} to {b['max']:+.1%}; above the run in "
        f"{b['over']} of {b['n']}; docs/simulate_validation.md). Projected on large models and "
        "real hardware:\n"
    )


def _name(row: dict) -> str:
    return f"{row['policy']} {row['predictor'] or ''}".strip()


_INTRO = """# tensorbend: predicting MoE routing early enough to matter

Generated by `python -m bench.report_doc` from the committed JSON of the benches (`make bench`);
tests/test_docs_results.py keeps it identical to that JSON.

Offloaded MoE inference (experts on NVMe or host memory, a bounded cache in fast memory) is
limited by the bytes it moves. A predictor of the router's choice can help in two ways: by
prefetching an expert before its layer asks (this needs *lead time*), and by keeping in the
cache the experts that will be needed again soon (this needs *foresight across tokens*). The
published system this project started from reports 99.8% "accuracy" for the first, measured on
training rows with zero lead time, and an end-to-end slowdown. We measure both honestly: on
held-out prompts, with the lead time stated, against every peer and the strongest caches
without prediction, in a real offloaded runtime whose output is bit-identical to the resident
model, and in a simulator validated against it.
"""

_LEAD_TIME = """## Lead time, phase, split

A prediction for MoE layer m starts from a **source point**: `pre_attn` (layer m's input,
before attention), `d1`..`d3` (the router input and routing of layer m-1..m-3), `same_layer`
(the router's own input: zero lead time, the seed's setup, reported for comparison only), or
`next_forwards` (the end of a forward, for the next forwards: across tokens). Phases prefill
and decode are reported apart; decode rows are teacher-forced (natural text, one token per KV
cached step). Prompts are split train / val / test by a hash of their id; every number here is
on test prompts.
"""

_PREDICTORS = """## Predictors

Peers: `frequency` (popularity), `prev_token` (the previous token's experts), `transition`
(expert-to-expert tables, MoE-Infinity-style), `spec_gate` (the target router on the earlier
hidden state: FATE / HOBBIT / Mixtral-offloading), `random`, `oracle`; the seed's MLP with its
own recipe (`seed_mlp`). Ours within the token (`tensorbend`): spec_gate's standardised scores
plus a small learned correction from the source hidden state, the source routing and the
previous token's experts (at most 25% of the seed MLP's parameters). Ours across tokens
(`horizon`): per layer and expert, the probability that its next use is 1..h forwards ahead or
later, from the request's routing history and the last layer's hidden state (or routing only);
a cache evicts the farthest expected next use (`Reuse`).
"""

_FORESIGHT = """Demand-only replay of held-out requests through the runtime's own cache code: the
bytes a policy must read, without timing. The oracle knowing h forwards (h = 2: the next token,
counting the current forward) is Belady within its sight and ranks and admits like the best
cache without prediction beyond it, so it never reads more than that cache
(docs/foresight_*.md has 12.5 / 25 / 50% and the routing-only configuration)."""


def _foresight_reading(root: Path) -> str:
    """How much knowing the next token and the next 8 saves, from the JSON (25% cache)."""
    said = []
    for name in ("default", "qwen"):
        rep = readme_section.load(root, f"docs/foresight_{name}.json")
        if rep is None or readme_section.stale(rep):
            continue
        r = next(r for r in rep["runs"] if r["cache_frac"] == 0.25)
        rp = r["replay"]
        best = rp[r["best_no_prediction"]]["experts_per_token"]
        save = {h: 1 - rp[r["oracle_ceiling"][h]]["experts_per_token"] / best for h in ("2", "8")}
        said.append(f"{rep['model']}: {save['2']:.0%} fewer experts per token than the best "
                    f"cache knowing the next token, {save['8']:.0%} knowing the next 7 tokens")  # fmt: skip
    return (" At 25% cache, " + "; ".join(said) + ":\n") if said else ":\n"


_END_TO_END = """`tensorbend run` on held-out prompts, every policy side by side in one run over the
same calibrated link (the PCIe Gen5 to H100 transfer/compute ratio of Kimi-sized experts, and
the same link 4x faster), 25% cache. "Byte gap closed" is the share of the distance from the
best no-prediction cache to the full oracle (every future routing) that the run covers:
"""

_SCALE_OUT = """Also tested, not timed (docs/scale_out.md): collection under torchrun (ranks take
prompt blocks; the merged trace equals one process's, a killed rank resumes), training over
ranks (`--fit-layers separate`: target layers spread, the checkpoint byte-identical to one
process's), and collection of a model larger than memory (`--max-memory`: accelerate
placement with layers on disk; the trace is bit-identical to the resident run once the
weights transformers converts at load are re-aligned, since CPU matmul results depend on
weight alignment).
"""

_LIMITS = """## Limits

- Small models (6 MoE layers, 32 experts) trained here on CPU; their routing is easier to
  predict within the token and their decode step is short, which makes the prediction stack's
  cost a larger share than on a large model.
- Everything ran on CPU. The CUDA offload path and the cuda placement of models larger than
  memory have tests that run where CUDA exists; they were not run on a GPU. Serving engines:
  routing import only (formats from their source). torchrun ran with 2 processes on one
  machine, not across nodes.
- The runtime decodes batch B as static lockstep batches (left-padded prefill, no refill of
  finished sequences), not continuous batching.
- Timing on a 2-core machine carries a few percent of noise; bytes and hit rates are the
  steadier columns, and every speed claim here is a ratio measured side by side in one run.
"""

_REPRODUCE = """## Reproduce

`make bench` (traces, checkpoints, then every bench below; the timing benches alone on the
machine). One command per table: bench/predictor_eval.py (within-token tables),
bench/seed_study.py (the seed), bench/foresight_eval.py (across tokens), bench/offload_sweep.py
(end to end), bench/predictor_cost.py (cost), bench/simulate_validate.py (validation),
bench/projections.py (projections), bench/train_memory.py (memory); each generated doc starts
with its exact command.
"""
