"""The eviction learner (imitation of Belady) on held-out test prompts: against the best
no-prediction cache, the horizon's `reuse`, and full Belady, with ablations (a deterministic
demand replay: experts read per decode token, no timing).

Usage:
    python -m bench.evictor_eval --trace runs/bench/default/trace \\
        --foresight-json docs/results/foresight_default.json \\
        --json docs/evictor_default.json --doc docs/evictor_default.md

Fits the learner by DAgger (`cache/imitation.py`) on the trace's train split at 25% cache
(val: the round kept), one learner without each feature group (fewer rounds), one without
on-policy rounds (`evictor-dagger`: LFRU's states only) and, with ablations, one without the
`--lean` groups fitted like the full learner (`evictor/lean`: does dropping the groups no
ablation row shows paying keep the learner as good?), then
replays the test split at each `--fracs` fraction: every no-prediction cache, Belady with and
without bypass, the learner, the learner under its LFRU shadow guard, and the ablations (at
25% only). The horizon `reuse` row is taken from the foresight bench's JSON (the same replay)
when that JSON's best no-prediction cache reads what this run's does (same requests).
The JSON is rewritten after each fraction, so a stopped run leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.record import command
from tensorbend.atomic import atomic_write_text
from tensorbend.cache.evictor import Evictor, EvictorModel
from tensorbend.cache.features import ALL_GROUPS, GROUPS
from tensorbend.cache.imitation import (
    evaluate_evictor,
    fit_evictor,
    load_requests,
    replay,
    summarize,
)
from tensorbend.trace import read_manifest


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    t0 = time.perf_counter()
    train, val, test = (load_requests(a.trace, s, a.horizon) for s in ("train", "val", "test"))
    train, test = train.subset(a.train_requests), test.subset(a.test_requests)
    out = {"trace": a.trace, "split": "test", "command": command("evictor_eval", argv), "train_requests": len(train.starts),
           "test_requests": len(test.starts), "rounds": a.rounds,
           "ablation_rounds": a.ablation_rounds, "guard_window": a.guard_window, "fits": {},
           "results": []}  # fmt: skip
    manifest = read_manifest(Path(a.trace))
    out["model"] = manifest["model"].get("name")
    resplit = manifest.get("resplit")
    if resplit:  # test = prompts of topics the learner never saw
        out["resplit"] = resplit
    # name -> (groups, on-policy rounds): the learner, without each input group, without DAgger
    plan = {"evictor": (GROUPS, a.rounds), "evictor-dagger": (GROUPS, 0)}
    if a.horizon:  # the learner that also reads the horizon's forecasts
        plan["evictor+forecast"] = (ALL_GROUPS, a.rounds)
        out["horizon"] = a.horizon
    if not a.no_ablations:
        for g in GROUPS:
            plan[f"evictor-{g}"] = (tuple(x for x in GROUPS if x != g), a.ablation_rounds)
        lean = set(filter(None, a.lean.split(",")))
        if lean - set(GROUPS):
            raise SystemExit(f"--lean {a.lean}: expected names from {', '.join(GROUPS)}")
        if lean:
            plan["evictor/lean"] = (tuple(x for x in GROUPS if x not in lean), a.rounds)
            out["lean_without"] = sorted(lean)
    models = {}
    for name, (groups, rounds) in plan.items():
        path = Path(a.models) / f"{name}.safetensors" if a.models else None
        if path is not None and path.exists():
            models[name] = EvictorModel.load(str(path))
            out["fits"][name] = f"loaded from {path}"
            continue
        models[name], out["fits"][name] = fit_evictor(train, val, 0.25, rounds, groups)
        _progress(f"{name} fitted: {out['fits'][name]}", t0)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            models[name].save(str(path))
    model = models["evictor"]
    for frac in (float(f) for f in a.fracs.split(",")):
        shown = models if frac == 0.25 else {"evictor": model}
        res = evaluate_evictor(shown, test, frac, guard_window=a.guard_window)
        # the round-0 learner: LFRU's ranking with the learner's bypass, no model
        res["replay"]["evictor/no-model"] = replay(
            test, Evictor(test.L, test.E, None, model.meta["prior_K"]),
            round(frac * test.L * test.E), admission="policy")  # fmt: skip
        _add_reuse(res, a.foresight_json)
        res.update(summarize(res["replay"], frac, res["cache_slots"]))  # gap of the rows added
        out["results"].append(res)
        out["seconds"] = time.perf_counter() - t0
        _write(out, a)
        _progress(f"cache {frac}: written", t0)
    return 0


def _progress(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:6.0f} s] {msg}", file=sys.stderr, flush=True)


def _add_reuse(res: dict, path: str | None) -> None:
    """The horizon's reuse row from the foresight bench JSON, if it replayed the same requests."""
    if not path or not Path(path).exists():
        return
    rows = res["replay"]
    best = rows[res["best_no_prediction"]]["experts_per_token"]
    full = rows[res["full_oracle"]]["experts_per_token"]
    for r in json.loads(Path(path).read_text())["runs"]:
        if r.get("inputs") != "routing+hidden" or abs(r["cache_frac"] - res["cache_frac"]) > 1e-9:
            continue
        theirs = r["replay"][r["best_no_prediction"]]["experts_per_token"]
        if abs(theirs - best) > 1e-9:
            res["reuse_note"] = f"foresight JSON's best cache reads {theirs:.3f}, ours {best:.3f}"
            return
        x = r["replay"][r["best_reuse"]]["experts_per_token"]
        rows["horizon reuse"] = {"experts_per_token": x, "good_decisions": r["good_decisions"],
                                 "gap_closed": (best - x) / (best - full), "from": path}  # fmt: skip


def _write(out: dict, a) -> None:
    if a.json:
        atomic_write_text(a.json, json.dumps(out, indent=1, default=_np) + "\n")
    if a.doc:
        atomic_write_text(a.doc, format_doc(out))


def _np(x):
    return x.tolist() if hasattr(x, "tolist") else str(x)


def format_doc(out: dict) -> str:
    lines = [
        f"# Eviction learner (imitating Belady) on `{out['trace']}` (held-out test prompts)",
        "",
        f"Generated by `{out['command']}` in {out['seconds']:.0f} s. Trained by DAgger on "
        f"{out['train_requests']} train requests at 25% cache ({out['rounds']} on-policy rounds "
        f"after the LFRU round; the round with the fewest val misses kept); replayed on "
        f"{out['test_requests']} test requests, demand loads only, one global pool; experts "
        "read per decode token (lower is better). Gap closed = (best no-prediction - X) / "
        "(best no-prediction - full Belady). Good decisions: evictions whose victim is next "
        "used no sooner than Belady's choice among the same residents.",
        "",
        f"Rows: `evictor` the learner (routing-only features, `cache/evictor.py`); "
        f"`evictor+shadow` the same under its LFRU shadow guard (window "
        f"{out.get('guard_window', 16)} forwards); `evictor/no-model` the round-0 rollout "
        "policy (LFRU's ranking, the learner's bypass rule); `evictor-dagger` the learner fitted "
        "on round-0 (LFRU) states only; `evictor-GROUP` the learner without one input group, "
        f"fitted with {out.get('ablation_rounds', 0)} on-policy rounds (compare with "
        "`evictor-dagger` when that is 0); `horizon reuse` the horizon predictor's forecasts "
        "(routing + hidden state) as eviction, from the foresight bench's JSON; "
        "`evictor+forecast` (with `--horizon`) the learner that also reads that horizon's "
        "forecast of each next use (feature group `forecast`), and `evictor+forecast+shadow` "
        "it under the guard."
        + (
            f" `evictor/lean` the learner without {' and '.join(out['lean_without'])}, fitted "
            "like `evictor` (the same on-policy rounds)."
            if out.get("lean_without")
            else ""
        ),
        "",
    ]
    for res in out["results"]:
        rows = res["replay"]
        lines += [f"## cache {res['cache_frac']:.3f} ({res['cache_slots']} slots)", "",
                  "| policy | experts / token | gap closed | good decisions |",
                  "|---|---|---|---|"]  # fmt: skip
        best = res["best_no_prediction"]
        order = [best, "horizon reuse", "evictor", "evictor+shadow", "evictor+forecast",
                 "evictor+forecast+shadow", "evictor/lean", "evictor/no-model",
                 *sorted(n for n in rows if n.startswith("evictor-")), "belady/all",
                 "belady/bypass"]  # fmt: skip
        for n in order:
            if n not in rows:
                continue
            r = rows[n]
            label = f"best no-prediction ({n})" if n == best else n
            gap, good = r.get("gap_closed"), r.get("good_decisions")
            lines.append(f"| {label} | {r['experts_per_token']:.3f} | "
                         f"{'-' if gap is None else f'{gap:.1%}'} | "
                         f"{'-' if good is None else f'{good:.1%}'} |")  # fmt: skip
        if "guard" in rows.get("evictor+shadow", {}):
            g = rows["evictor+shadow"]["guard"]
            lines.append(f"\nShadow guard: {g['lost_windows']} of {g['learner_windows']} learner "
                         f"windows lost to LFRU, {g['switches']} switches.")  # fmt: skip
        if "reuse_note" in res:
            lines.append(f"\nHorizon reuse not shown: {res['reuse_note']}.")
        lines.append("")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--foresight-json", default=None, help="foresight bench JSON (reuse row)")
    p.add_argument("--fracs", default="0.25,0.125,0.5")
    p.add_argument("--rounds", type=int, default=2, help="on-policy rounds after round 0")
    p.add_argument("--ablation-rounds", type=int, default=1)
    p.add_argument("--train-requests", type=int, default=120)
    p.add_argument("--test-requests", type=int, default=10**9, help="(a smoke run: fewer)")
    p.add_argument("--guard-window", type=int, default=48, help="forwards")
    p.add_argument("--no-ablations", action="store_true")
    p.add_argument("--lean", default="history,layer",
                   help="with ablations: groups the evictor/lean learner goes without ('' none)")  # fmt: skip
    p.add_argument("--horizon", default=None,
                   help="horizon checkpoint: adds the learner reading its forecasts")  # fmt: skip
    p.add_argument("--models", default=None,
                   help="folder of NAME.safetensors: a model found there is loaded, not fitted; "
                   "one fitted is saved there")  # fmt: skip
    p.add_argument("--json", default=None)
    p.add_argument("--doc", default=None)
    return p


if __name__ == "__main__":
    raise SystemExit(main())
