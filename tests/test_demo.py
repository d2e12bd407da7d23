"""`tensorbend demo --quick`: the whole chain on the bundled model, resumable, with a report."""

import json

from tensorbend.cli import main


def test_quick_demo_runs_end_to_end_and_resumes(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    for line in ("Held-out decode recall@k at d1", "Across tokens", "Offloaded generation",
                 "Projected on Kimi-K2.5"):  # fmt: skip
        assert line in text
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert set(summary["recall_d1"]) >= {"tensorbend", "seed_mlp", "spec_gate", "transition"}
    assert all(r["output_matches_resident"] for r in summary["runs"])  # prediction never
    runs = {r["label"]: r for r in summary["runs"]}  # labels say what ran
    assert set(runs) == {
        "lru",
        "lfru/adm=frequency",
        "prefetch:none",
        "horizon+d1:tensorbend/adm=predicted",
        "oracle@h=all/adm=predicted",
    }
    best = max(runs[k]["decode_tok_s"] for k in ("lru", "lfru/adm=frequency", "prefetch:none"))
    for r in runs.values():  # the ratio over the best of the three caches without prediction
        assert r["vs_best_cache"] == r["decode_tok_s"] / best
    assert (out / "report" / "plots" / "recall_by_layer.png").is_file()  # changes output
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*.json")}
    assert main(["demo", "--quick", "--out", str(out)]) == 0  # a re-run reuses every step
    err = capsys.readouterr().err
    assert err.count("reusing") == 7  # collect, 3 trainings, eval, run, simulate
    assert {p: p.stat().st_mtime_ns for p in stamps if p.name != "summary.json"} == {
        p: t for p, t in stamps.items() if p.name != "summary.json"
    }
