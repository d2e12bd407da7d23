"""docs/results/REPORT.md: the technical report, every number rendered from the committed JSON.

Usage:
    python -m tools.report            # rewrites docs/results/REPORT.md
    python -m tools.report --check    # exit 1 if it differs from what the JSON says
    text = report(root)               # root: the repository (docs/results/ under it)

tests/test_docs_results.py runs the check, so a table can never drift from its JSON. Prose that
states a number takes it from the JSON too. The end-to-end section is tools/end_to_end.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.pages.projections import first_prediction_row, sim_regime
from tensorbend.atomic import write_generated
from tools.end_to_end import cost, offload_table
from tools.readme_table import load
from tools.readme_table import table as side_by_side

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "docs/results"


def report(root: Path) -> str:
    parts = [
        _INTRO,
        "## Serving a checkpoint larger than memory\n",
        side_by_side(root),
        _LEAD_TIME,
        _PREDICTORS,
        "## Within the token: held-out recall\n",
        _within(root, "results_default"),
        _within(root, "results_qwen3moe"),
        _width(root),
        "## The seed's claims, re-tested\n",
        _seed(root),
        "## Across tokens: what foresight buys a cache\n",
        _FORESIGHT + _foresight_reading(root),
        _foresight_table(root),
        "## End to end: measured on this machine\n",
        _END_TO_END,
        offload_table(root),
        cost(root),
        "## The simulator: validated, then projected\n",
        _validation(root),
        _projections(root),
        "## Scale-out: traces and models larger than memory\n",
        _memory(root),
        _SCALE_OUT,
        _LIMITS,
        _REPRODUCE,
    ]
    return "\n".join(p.rstrip() + "\n" for p in parts if p)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true")
    a = p.parse_args(argv)
    return write_generated(ROOT / RESULTS / "REPORT.md", report(ROOT), a.check)


def _within(root: Path, name: str) -> str:
    rep = load(root, f"{name}.json")
    lines = [
        f"**{rep['model']}** (test split: {rep['prompts']['test']} prompts; decode rows "
        f"{rep['decode_mode']}; recall@{rep['top_k']} of {rep['num_experts']}; {name}.md):",
        "",
        "| lookahead | phase | " + " | ".join(_KINDS) + " |",
        "|---|---|" + "---|" * len(_KINDS),
    ]
    for la in ("pre_attn", "d1", "d2", "d3", "same_layer"):
        for ph in ("decode", "prefill"):
            at = {r["predictor"]: r["recall_at_k"] for r in rep["results"]
                  if r["lookahead"] == la and r["phase"] == ph}  # fmt: skip
            if at:
                cells = [f"{at[k]:.3f}" if k in at else "-" for k in _KINDS]
                lines.append(f"| `{la}` | {ph} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _width(root: Path) -> str:
    rep = load(root, "bench/prefetch_width.json")
    gains = ", ".join(f"{r['model']} {r['best_recall_gain']:+.3f}" for r in rep["runs"])
    return (
        "Prefetch width by confidence (bench/prefetch_width.md): ours' K x softmax is close to "
        "a calibrated P(routed), but listing the experts above a probability threshold recalls "
        "at best this much more than a fixed top-n of the same mean size (held-out decode, "
        f"recall as a fraction): {gains}. The runtime keeps fixed widths (`--prefetch-extra`).\n"
    )


_KINDS = ("tensorbend", "seed_mlp", "spec_gate", "transition", "prev_token", "frequency", "random")


def _seed(root: Path) -> str:
    rep = load(root, "seed_study.json")
    runs = rep["runs"]
    base, d1, ours = runs["base"], runs["d1"], runs["ours_d1"]
    return (
        'The seed reports 99.8% top-k "accuracy": the best epoch\'s overlap on its first 200 '
        "*training* rows, for a predictor fed the router's own input. Re-run with its recipe "
        f"(seed_study.md): {base['train_rows_recall']:.3f} on its training rows, "
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


# The replays' JSON per trace: the bundled models' test splits, then their held-out topics
# (`tensorbend trace resplit`: fitted on the other topics, tested on every prompt of these),
# then a routing-only trace made by `trace export` + `trace import` (what an imported trace is).
TRACES = ("default", "qwen", "deep", "default_domain", "deep_domain", "deep_imported")


def _foresight_reading(root: Path) -> str:
    """How much knowing the next token and the next 8 saves, from the JSON (25% cache)."""
    said = []
    for name in ("default", "qwen"):
        rep = load(root, f"foresight_{name}.json")
        r = next(r for r in rep["runs"] if r["cache_frac"] == 0.25)
        rp = r["replay"]
        best = rp[r["best_no_prediction"]]["experts_per_token"]
        save = {h: 1 - rp[r["oracle_ceiling"][h]]["experts_per_token"] / best for h in ("2", "8")}
        said.append(f"{rep['model']}: {save['2']:.0%} fewer experts per token than the best "
                    f"cache knowing the next token, {save['8']:.0%} knowing the next 7 tokens")  # fmt: skip
    return " At 25% cache, " + "; ".join(said) + ":\n"


def _foresight_table(root: Path) -> str:
    """Per trace at 25% cache: the best cache, the horizon, the next-token oracle, Belady."""
    lines, bound = [], []
    for name in TRACES:
        rep = load(root, f"foresight_{name}.json")
        tested = ("test split" if rep.get("resplit") is None
                  else "unseen topics: " + ", ".join(rep["resplit"]["test_topics"]))  # fmt: skip
        for r in (r for r in rep["runs"] if r["cache_frac"] == 0.25):
            epf = lambda n, rp=r["replay"]: rp[n]["experts_per_token"]  # noqa: E731
            best, nxt = r["best_no_prediction"], r["oracle_ceiling"]["2"]
            nxt_closed = (epf(best) - epf(nxt)) / (epf(best) - epf(r["full_oracle"]))
            lines.append(
                f"| {rep['model']} | {tested} | {r['inputs']} | {epf(best):.2f} ({best}) | "
                f"{epf(r['best_reuse']):.2f} | {epf(nxt):.2f} ({nxt_closed:.0%}) | "
                f"{epf(r['full_oracle']):.2f} | {r['gap_closed']:.0%} |"
            )
            if r["inputs"] == "routing+hidden":
                bound.append((f"{rep['model']} ({tested})", r["gap_closed"], nxt_closed))
    ours, nxt = [b[1] for b in bound], [b[2] for b in bound]
    reach = "; ".join(f"{m}: {o:.0%} of its {n:.0%}" for m, o, n in bound)
    return "\n".join([
        "Demand-only replay of held-out prompts at 25% cache, experts read per decode token "
        "(foresight_*.md):",
        "",
        "| model | tested on | inputs | best no-prediction cache | ours (horizon) | oracle "
        "knowing the next token (gap closed) | full oracle | gap closed |",
        "|---|---|---|---|---|---|---|---|",
        *lines,
        "",
        f"The horizon (routing+hidden) closes {min(ours):.0%}-{max(ours):.0%} of the gap; an "
        f"oracle that knows the exact routing of the next token closes {min(nxt):.0%}-"
        f"{max(nxt):.0%} ({reach}). Closing more takes foresight beyond the next token "
        "(zoo_card.md: what the exact routing of 2 and 4 tokens ahead closes).",
    ]) + "\n"  # fmt: skip


def _validation(root: Path) -> str:
    rep = load(root, "simulate_validation.json")
    metrics = ("decode_tok_s", "stall_s_per_token", "bytes_read_per_token")
    worst = max(rep["rows"], key=lambda r: max(abs(r[f"error_{k}"] or 0) for k in metrics))
    (cal, n_cal), (val, n_val) = ((s, len(ids)) for s, ids in rep["prompts"].items())
    b = rep["bias"]["decode_tok_s"]
    return (
        f"The simulator replays the runtime's own policies. Calibrated on {n_cal} {cal} prompts "
        f"and judged on {n_val} {val} prompts the calibration never saw, against `tensorbend measure` "
        f"over the same link, its largest error in magnitude on decode tok/s, stall and bytes "
        f"per token over {len(rep['rows'])} configurations is {rep['max_error']:.1%} (worst: "
        f"{worst['label']}; bar {rep['bar']:.0%}); on decode tok/s its mean signed error is "
        f"{b['mean']:+.1%} (range {b['min']:+.1%} to {b['max']:+.1%}; above the run in "
        f"{b['over']} of {b['n']}; simulate_validation.md). Projected on large models and "
        "real hardware:\n"
    )


def _projections(root: Path) -> str:
    rep = load(root, "projections.json")
    lines = [
        "Simulated from zoo:default's held-out routing, not measured; "
        f"{sim_regime(first_prediction_row(rep))} (projections.md):",
        "",
        "| geometry on hardware | best no-prediction cache | ours: horizon only | ours: "
        "horizon + within-token | full oracle |",
        "|---|---|---|---|---|",
    ]
    for p in rep["pairs"]:
        res = {r["label"]: r for r in p["results"]}
        best, oracle = res[p["best_no_prediction"]], res[p["full_oracle"]]
        cells = [f"{r['decode_tok_s']:.2f} ({r['vs_best_cache']:.2f}x)" for r in
                 (res["horizon/adm=predicted"], res["horizon+d1:tensorbend/adm=predicted"])]  # fmt: skip
        lines.append(
            f"| {p['geometry']} on {p['hardware']} | {best['label']}: "
            f"{best['decode_tok_s']:.2f} tok/s | "
            + " | ".join(cells)
            + f" | {oracle['decode_tok_s']:.2f} ({oracle['vs_best_cache']:.2f}x) |"
        )
    return "\n".join(lines) + "\n"


def _memory(root: Path) -> str:
    rep = load(root, "bench/train_memory.json")
    lines = [
        f"Peak resident memory (MiB) against trace size (`{rep['trace']}` replicated; training "
        f"with --max-train-rows {rep['max_train_rows']} --max-val-rows {rep['max_val_rows']}; "
        "bench/train_memory.md):",
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


_INTRO = """# tensorbend: predicting MoE routing early enough to matter

Generated by `python -m tools.report` from the committed JSON of the benches (`make bench`);
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
on test prompts. Paths below are relative to docs/results/.
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
(foresight_*.md has 12.5 / 25 / 50% and the routing-only configuration)."""


_END_TO_END = """`tensorbend measure` on held-out prompts, every policy side by side in one run over the
same calibrated link (the PCIe Gen5 to H100 transfer/compute ratio of Kimi-sized experts, and
the same link 4x faster), 25% cache. "Byte gap closed" is the share of the distance from the
best no-prediction cache to the full oracle (every future routing) that the run covers:
"""

_SCALE_OUT = """Also tested, not timed (../guide/scale_out.md): collection under torchrun (ranks take
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
machine), then `make docs` (this page, the README's table and every page from its JSON). One command per table: bench/predictor_eval.py (within-token tables),
bench/seed_study.py (the seed), bench/foresight_eval.py (across tokens), bench/offload_sweep.py
(end to end), bench/predictor_cost.py (cost), bench/simulate_validate.py (validation),
bench/projections.py (projections), bench/train_memory.py (memory); each generated doc starts
with its exact command.
"""


if __name__ == "__main__":
    sys.exit(main())
