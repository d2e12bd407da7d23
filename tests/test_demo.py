"""`tensorbend demo --quick`: the whole chain on the bundled model, resumable, with a report
whose printed numbers are its JSON's and lie where they must."""

import json
import math
import re

from tensorbend.capture.trace import Trace
from tensorbend.cli import main
from tensorbend.report.demo_summary import WITHHELD, DemoSummary
from tensorbend.zoo import resolve_model


def test_quick_demo_runs_end_to_end_and_resumes(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    for line in ("Held-out decode recall@k at d1", "Across tokens", "Offloaded generation",
                 "Projected on Kimi-K2.5"):  # fmt: skip
        assert line in text
    summary = json.loads((out / "report" / "summary.json").read_text())
    _check_numbers(summary, text, Trace.open(out / "trace").spec)
    assert all(r["output_matches_resident"] for r in summary["runs"])  # prediction never
    runs = {r["label"]: r for r in summary["runs"]}  # labels say what ran
    assert set(runs) == {
        "lru",
        "lfru/adm=frequency",
        "prefetch:none",
        "d1:spec_gate/adm=predicted",  # the peers that predict, with ours' admission
        "d1:seed_mlp/adm=predicted",
        "horizon+d1:tensorbend/adm=predicted",
        "oracle@h=all/adm=predicted",
    }
    busy = summary["host_warning"] is not None  # (then the speeds are withheld: below)
    _check_peers(summary, text if not busy else _render(summary, None))
    best = max(runs[k]["decode_tok_s"] for k in ("lru", "lfru/adm=frequency", "prefetch:none"))
    for r in runs.values():  # the ratio over the best of the three caches without prediction
        assert r["vs_best_cache"] == r["decode_tok_s"] / best
        assert r["repeats"] == 1 and r["ratio"] == f"{r['vs_best_cache']:.2f}x"  # --quick: once
        assert f"({r['ratio']} best cache)" in (text if not busy else _render(summary, None))
    _check_busy_host_withholds_speeds(summary)
    assert "one run each, no repeats" in text  # (the full demo: medians of 3 [range])
    assert (out / "report" / "plots" / "recall_by_layer.png").is_file()  # changes output
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*.json")}
    assert main(["demo", "--quick", "--out", str(out)]) == 0  # a re-run reuses every step
    err = capsys.readouterr().err
    assert err.count("reusing") == 7  # collect, 3 trainings, eval, run, simulate
    assert {p: p.stat().st_mtime_ns for p in stamps if p.name != "summary.json"} == {
        p: t for p, t in stamps.items() if p.name != "summary.json"
    }
    # the report of a demo from before the peers: its run and projection run again, with them
    run, sim = out / "report" / "run.json", out / "report" / "simulate.json"
    old = [{k: v for k, v in r.items() if k != "ours"} for r in json.loads(run.read_text())
           if "spec_gate" not in r["label"] and "seed_mlp" not in r["label"]]  # fmt: skip
    run.write_text(json.dumps(old))
    res = json.loads(sim.read_text())
    sim.write_text(json.dumps({**res, "results": [r for r in res["results"] if not r.get("peer")]}))
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert cap.err.count("reusing") == 5 and cap.err.count("predates the peers that predict") == 2
    assert len(json.loads(run.read_text())) == len(runs)
    again = json.loads((out / "report" / "summary.json").read_text())
    _check_peers(again, cap.out if again["host_warning"] is None else _render(again, None))


def _render(summary: dict, host_warning: str | None) -> str:
    fields = {k: v for k, v in summary.items() if k != "host_warning"}
    return DemoSummary(**fields, host_warning=host_warning).render("zoo:default", quick=True)


def _check_busy_host_withholds_speeds(summary: dict) -> None:
    """A busy host slows compute but not the emulated link: the measured section then names
    the load, prints bytes, hits and outputs but no tok/s, ratio or peer line; the replay and
    the projection (independent of load) stay as on an idle host."""
    idle, busy = _render(summary, None), _render(summary, "others used 1.9 of 2 cores")
    measured = busy.split("Offloaded generation")[1].split("Projected on")[0]
    assert WITHHELD in measured and "others used 1.9 of 2 cores" in measured
    assert "tok/s" not in measured.replace(WITHHELD, "") and "best peer" not in measured
    assert all(f"KB/token  hit {r['demand_hit_rate']:.2f}" in measured for r in summary["runs"])
    assert busy.split("Projected on")[1] == idle.split("Projected on")[1]
    assert busy.split("Offloaded generation")[0] == idle.split("Offloaded generation")[0]


def _check_peers(summary: dict, text: str) -> None:
    """Ours is claimed against the fastest row that is neither ours nor the oracle, by hand:
    the three caches and the two peers that predict, measured and simulated alike."""
    for step, rows, peers in (("run", summary["runs"], 5), ("project", summary["projection"], 0)):
        mine = [r for r in rows if r["ours"]]
        others = [r for r in rows if not r["ours"] and not r["label"].startswith("oracle")]
        assert {r["label"] for r in mine} <= {
            "horizon+d1:tensorbend/adm=predicted",
            "d1:tensorbend",
            "horizon",
            "horizon+d1:tensorbend",
        }
        assert len(others) >= peers and {"d1:spec_gate", "d1:seed_mlp"} <= {
            r["label"].split("/")[0] for r in others
        }, step
        peer = max(others, key=lambda r: r["decode_tok_s"])
        top = max(mine, key=lambda r: r["decode_tok_s"])
        p = summary["peers"][step]
        assert (p["best_peer"], p["ours"]) == (peer["label"], top["label"])
        assert p["repeats"] is None  # --quick runs once: the ratio is the single run's
        assert math.isclose(p["vs_best_peer"], top["decode_tok_s"] / peer["decode_tok_s"])
        line = (
            f"ours ({top['label']}) over the best peer, the fastest row neither ours nor the "
            f"oracle ({peer['label']}): {p['vs_best_peer']:.2f}x"
        )
        assert line in text, (line, text)


def _check_numbers(summary: dict, text: str, spec) -> None:
    """The printed recall table is summary.json's to 3 decimals, and each recall lies where it
    must: the oracle exactly 1, random within 0.05 of its expectation K/E (4/32 on zoo:default),
    ours (tensorbend, d1) in [0.6, 1] and above popularity (frequency) and random. The replay:
    gap closed = (best - ours) / (best - full oracle) from the same JSON, and Belady (the full
    oracle) reads no more than the best cache, which reads at most K * L experts per token.
    The runs: a decode token uses K experts in each of L layers, so every miss reads one
    expert's bytes: bytes/token >= (1 - hit rate) * K * L * expert bytes, with equality for
    the caches that prefetch nothing (at least two of them)."""
    K, E, L = spec.top_k, spec.num_experts, spec.num_moe_layers
    table = text.split("Held-out decode recall@k at d1")[1].split("\n\n")[0]
    printed = dict(re.findall(r"^  (\S+)\s+([01]\.\d{3})$", table, flags=re.M))
    recall = summary["recall_d1"]
    assert printed == {kind: f"{x:.3f}" for kind, x in recall.items()}
    assert {"tensorbend", "seed_mlp", "spec_gate", "transition", "random", "oracle"} <= set(recall)
    assert recall["oracle"] == 1.0
    assert abs(recall["random"] - K / E) <= 0.05, (recall["random"], K / E)
    assert 0.6 <= recall["tensorbend"] <= 1.0
    assert recall["tensorbend"] > max(recall["frequency"], recall["random"])

    f = summary["foresight"]
    best, ours = f["best_no_prediction_experts_per_token"], f["ours_experts_per_token"]
    full = f["full_oracle_experts_per_token"]
    assert 0 < full <= best <= K * L
    assert math.isclose(f["gap_closed"], (best - ours) / (best - full), rel_tol=1e-9)
    assert f"gap closed {f['gap_closed']:.0%}" in text

    cfg = json.loads((resolve_model("zoo:default") / "config.json").read_text())
    # a SwiGLU expert: gate, up and down projections of hidden x moe_intermediate, fp32
    expert_bytes = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 4
    exact = 0
    for r in summary["runs"]:
        assert 0 <= r["demand_hit_rate"] <= 1
        misses = (1 - r["demand_hit_rate"]) * K * L * expert_bytes
        assert r["bytes_read_per_token"] >= misses * (1 - 1e-9), r["label"]
        exact += math.isclose(r["bytes_read_per_token"], misses, rel_tol=1e-9)
    assert exact >= 2
