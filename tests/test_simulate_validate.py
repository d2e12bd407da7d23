"""The out-of-sample simulator validation (bench/sim_calibration.py) on a tiny model.

Timings are not checked (the bench runs alone on a quiet machine); what is checked has a known
answer: disjoint prompt splits, both sides of every configuration paired by what ran, bytes
that must agree, signed errors computed from the two sides, the runtime's own counters."""

import json
from pathlib import Path

import pytest
from tiny_models import save_checkpoint, write_prompts

from bench import simulate_validate
from bench.sim_validation import METRICS, ValidateConfig, checks, markdown
from tensorbend.cache.config import PolicyConfig
from tensorbend.capture.hf import DecodeConfig, load_model
from tensorbend.capture.prompts import load_prompts
from tensorbend.errors import TensorbendError
from tensorbend.offload.session import OffloadSession, SessionConfig

ROOT = Path(__file__).resolve().parent.parent


def test_validation_calibrates_on_one_split_and_judges_the_other(tmp_path, capsys):
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    prompts = write_prompts(tmp_path / "p.jsonl", n=12, continuation_every=1)
    rc = simulate_validate.main(
        ["--model", str(ckpt), "--prompts", str(prompts), "--max-prompts", "2",
         "--max-new-tokens", "3", "--baseline", "random", "--link", "20MB/s,20us",
         "--json", str(tmp_path / "v.json"), "--doc", str(tmp_path / "v.md")]
    )  # fmt: skip
    assert rc == 0
    out = json.loads((tmp_path / "v.json").read_text())
    # t005 is the only val prompt of the 12, t000 and t011 the test ones (prompts.split_of)
    assert out["prompts"] == {"val": ["t005"], "test": ["t000", "t011"]}
    want = checks(1, horizon=False)
    assert len(out["rows"]) == len(want)
    labels = [r["label"] for r in out["rows"]]
    assert len(set(labels)) == len(labels)
    assert {"lru/per_layer/adm=frequency", "prefetch:none", "oracle@h=all/adm=predicted",
            "d1:random", "lfru/adm=frequency"} <= set(labels)  # fmt: skip
    for r in out["rows"]:
        for k in METRICS:
            run, sim = r[f"runtime_{k}"], r[f"simulated_{k}"]
            assert run >= 0 and sim >= 0
            if run:
                assert r[f"error_{k}"] == pytest.approx((sim - run) / run)
    # no cache: every decode demand is read on both sides, the same bytes
    od = out["rows"][0]
    assert od["policy"] == "on_demand"
    assert od["simulated_bytes_read_per_token"] == od["runtime_bytes_read_per_token"]
    b = out["bias"]["bytes_read_per_token"]
    assert b["n"] == len(want) and b["min"] <= b["mean"] <= b["max"]
    cal = out["calibration"]
    assert cal["expert_bytes"] > 0 and cal["attn_s"] > 0 and cal["expert_s"] > 0
    assert cal["predict_s"] > 0 and cal["forecast_s"] == 0  # a predictor, no horizon
    doc = (tmp_path / "v.md").read_text()
    assert doc == markdown(out)
    assert doc.count("\n| ") == 1 + len(want) + 1 + len(METRICS)  # two tables with headers
    capsys.readouterr()


def test_validation_refuses_one_split_for_both():
    with pytest.raises(TensorbendError, match="expected two splits"):
        ValidateConfig(calibrate_split="test", validate_split="test")


def test_runtime_counts_its_expert_math_and_prediction_calls(tmp_path):
    """`RunResult.expert_compute` counts what ran: decode calls of one token, one call per MoE
    layer per forward, every routed (token, expert) pair once; `predict_calls` one per hook."""
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    model, tok = load_model(str(ckpt))
    prompts = load_prompts(write_prompts(tmp_path / "p.jsonl", n=2, continuation_every=1))
    cfg = SessionConfig(decode=DecodeConfig(decode="teacher", max_new_tokens=3))
    sess = OffloadSession(model, tok, prompts, cfg)
    try:
        r = sess.run_policy(PolicyConfig("lru", cache_frac=1.0))
    finally:
        sess.close()
    L, K = sess.spec.num_moe_layers, sess.spec.top_k
    rows = {row[0]: row[1:] for row in r.expert_compute}
    calls, experts, pairs, seconds = rows.pop(1)
    assert calls == r.tokens["decode"] * L and pairs == calls * K and seconds > 0
    assert K <= experts / calls <= K  # batch-1 decode: K distinct experts per layer
    prefill_pairs = sum(c[2] for c in rows.values())
    assert prefill_pairs == r.tokens["prefill"] * L * K
    assert sum(c[0] for c in rows.values()) == len(prompts) * L
    # the router hook predicts at every MoE layer of every forward (nothing to predict for lru)
    assert r.predict_calls == (len(prompts) + r.tokens["decode"]) * L
    ref = sess.reference.ids
    assert sum(f.shape[0] for f in ref) == r.tokens["prefill"] + r.tokens["decode"]


@pytest.mark.skipif(
    not (ROOT / "docs/results/simulate_validation.json").is_file(),
    reason="make bench-timing writes it",
)
def test_committed_validation_doc_is_its_json_rendered():
    out = json.loads((ROOT / "docs/results/simulate_validation.json").read_text())
    if "bias" not in out:
        pytest.skip("docs/results/simulate_validation.json predates the out-of-sample validation")
    assert markdown(out) == (ROOT / "docs/results/simulate_validation.md").read_text()
