"""`tensorbend measure` configuration: every user error is one line, raised before a model loads;
"matches the resident model" means bit-identical; the CUDA path where a GPU exists."""

import json

import pytest
import torch
from tiny_models import build, char_tokenizer, save_checkpoint, write_prompts

import tensorbend.capture.hf
from tensorbend.cache.config import PolicyConfig
from tensorbend.capture.hf import DecodeConfig
from tensorbend.capture.prompts import Prompt
from tensorbend.cli import main
from tensorbend.offload import runner
from tensorbend.offload.session import OffloadSession, SessionConfig
from tensorbend.predictors.registry import build_baseline
from tensorbend.predictors.spec import PredictorSpec
from tensorbend.routers import router_params

PROMPTS = [Prompt("a", "the quick brown fox"), Prompt("b", "kernel module river")]
CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: the CUDA offload path (device slots, pinned staging, copy "
    "stream) runs only where torch.cuda.is_available()",
)


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(tensorbend.capture.hf, "load_model", refuse)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-prompts", "0"], "--max-prompts 0: expected a count >= 1"),
        (["--cache-bytes", "0"], "--cache-bytes 0: expected a positive byte count"),
        (["--link", "fast"], "--link 'fast': expected none, h100-pcie5-kimi, or BANDWIDTH"),
        (["--link", "0MB/s"], "--link '0MB/s': expected none"),
        (
            ["--policy", "prefetch"],
            "--policy prefetch needs a predictor: --predictor PRED, --baseline NAME and/or "
            "--horizon PRED",
        ),
        (
            ["--baseline", "spec_gate"],
            "--predictor/--baseline/--horizon with --policy lru: expected",
        ),
        (["--foresight", "2"], "--foresight 2 with --policy lru: expected a count >= 0 with"),
        (["--admission", "predicted"], "--admission predicted with --policy lru: expected"),
        (["--policy", "prefetch", "--baseline", "transition"], "expected --trace DIR"),
        (["--policy", "prefetch", "--predictor", "nope.safetensors"], "expected a checkpoint"),
        (["--cache-frac", "1.5"], "--cache-frac 1.5: expected a fraction in (0, 1]"),
        (["--io-threads", "0"], "--io-threads 0: expected a count >= 1"),
        (["--staging-slots", "0"], "--staging-slots 0: expected a number >= 1"),
        (["--device", "tpu"], "--device 'tpu': expected cpu, cuda or cuda:N"),
    ],
)
def test_bad_flags_fail_in_one_line_before_loading(flags, message, capsys, no_model_load):
    rc = main(["run", "--model", "some/model", "--quiet", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device exists here")
def test_cuda_without_a_gpu_is_a_clear_error(capsys, no_model_load):
    assert main(["run", "--model", "m", "--device", "cuda"]) == 2
    assert "--device cuda: expected a CUDA device, found none" in capsys.readouterr().err


def test_too_small_cache_fails_before_the_resident_run(tmp_path, capsys, monkeypatch):
    ckpt = save_checkpoint("mixtral", tmp_path / "model")  # 3 MoE layers x 6 experts, top-2
    prompts = write_prompts(tmp_path / "p.jsonl", 2)

    def refuse(*a, **k):
        raise AssertionError("the resident run started before the cache size was checked")

    monkeypatch.setattr(runner, "OffloadSession", refuse)
    base = ["run", "--model", str(ckpt), "--prompts", str(prompts), "--split", "all", "--quiet"]
    assert main([*base, "--cache-frac", "0.05"]) == 2  # round(0.9) = 1 slot < top_k
    assert "gives 1 cache slots: expected at least 2" in capsys.readouterr().err
    assert main([*base, "--cache-frac", "0.12", "--pool", "per_layer"]) == 2  # 2 slots < 3 layers
    assert "expected at least 3 (top_k and one per MoE layer" in capsys.readouterr().err


def test_a_logit_difference_is_not_a_match(monkeypatch):
    """Before the fix a 1e-6 relative error passed as a match (tolerance 1e-4 x logit scale)."""
    sess = OffloadSession(
        build("mixtral"), char_tokenizer(), PROMPTS, SessionConfig(DecodeConfig(max_new_tokens=3))
    )
    loose = SessionConfig(DecodeConfig(max_new_tokens=3), logit_tolerance=1e-3)
    sess_loose = OffloadSession(build("mixtral"), char_tokenizer(), PROMPTS, loose)
    try:
        assert sess.resident_result().output_matches_resident is None  # no comparison with itself
        assert sess.resident_result().max_logit_abs_diff is None
        exact = sess.run_policy(PolicyConfig("lru", cache_frac=0.5))
        assert exact.output_matches_resident is True and exact.max_logit_abs_diff == 0.0
        from tensorbend.offload import layer  # each run attaches fresh OffloadedExperts

        real = layer._swiglu_expert
        monkeypatch.setattr(layer, "_swiglu_expert", lambda m, x, W: real(m, x, W) * (1 + 1e-6))
        r = sess.run_policy(PolicyConfig("lru", cache_frac=0.5)).to_json()
        assert r["output_matches_resident"] is False and r["logit_tolerance"] == 0.0
        assert r["max_logit_abs_diff"] is not None and 0 < r["max_logit_abs_diff"] < 1e-3
        r = sess_loose.run_policy(PolicyConfig("lru", cache_frac=0.5)).to_json()
        assert r["output_matches_resident"] is True and r["logit_tolerance"] == 1e-3
        assert r["max_logit_abs_diff"] > 0  # reported, not hidden
    finally:
        sess.close()
        sess_loose.close()


def test_run_result_json_keys_and_values(tmp_path):
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "model")
    prompts = write_prompts(tmp_path / "p.jsonl", 3)
    out = tmp_path / "r.json"
    rc = main(
        ["run", "--model", str(ckpt), "--prompts", str(prompts), "--split", "all", "--quiet"]
        + ["--policy", "oracle", "--foresight", "1", "--pool", "per_layer", "--cache-frac", "0.5"]
        + ["--max-new-tokens", "2", "--link", "none", "--json", str(out)]
    )
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["output_matches_resident"] is True and r["max_logit_abs_diff"] == 0.0
    assert (r["policy"], r["foresight"], r["pool"], r["admission"]) == (
        "oracle",
        1,
        "per_layer",
        "all",
    )
    assert r["tokens"] == {
        "prefill": sum(r["tokens"].values()) - r["tokens"]["decode"],
        "decode": 6,
    }
    assert r["cache_slots"] == 12 and r["device"] == "cpu" and r["prompts"] == 3


@CUDA
def test_cuda_offload_matches_resident():
    model = build("deepseek_v3").to("cuda")
    spec_sess = OffloadSession(
        model, char_tokenizer(), PROMPTS, SessionConfig(DecodeConfig(max_new_tokens=4))
    )
    try:
        spec = spec_sess.spec
        gate = build_baseline("spec_gate", spec, "d1", router_params=router_params(model, spec))
        runs = [
            spec_sess.run_policy(PolicyConfig("on_demand")),
            spec_sess.run_policy(PolicyConfig("lru", cache_frac=0.25)),
            spec_sess.run_policy(PolicyConfig("prefetch", cache_frac=0.25), gate),
            spec_sess.run_policy(PolicyConfig("oracle", cache_frac=0.25, foresight=2)),
        ]
        for r in runs:
            assert r.device.startswith("cuda") and r.output_matches_resident, r
            assert r.max_logit_abs_diff == 0.0
    finally:
        spec_sess.close()


@CUDA
def test_run_verb_on_cuda(tmp_path):
    ckpt = save_checkpoint("olmoe", tmp_path / "model")
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    out = tmp_path / "r.json"
    rc = main(
        ["run", "--model", str(ckpt), "--prompts", str(prompts), "--split", "all", "--quiet"]
        + ["--device", "cuda", "--max-new-tokens", "3", "--json", str(out)]
    )
    r = json.loads(out.read_text())
    assert rc == 0 and r["device"].startswith("cuda") and r["output_matches_resident"] is True


def test_run_describes_the_model_once(tmp_path, monkeypatch):
    """`tensorbend measure` computes the model's description once and hands it to the predictors
    and the session (it was computed four times per run)."""
    import tensorbend.models
    from tensorbend.offload import session

    calls = []
    real = tensorbend.models.describe_model

    def counted(model):
        calls.append(1)
        return real(model)

    for mod in (runner, session):
        monkeypatch.setattr(mod, "describe_model", counted)
    ckpt = save_checkpoint("mixtral", tmp_path / "model")
    prompts = write_prompts(tmp_path / "p.jsonl", 1)
    res = runner.run(runner.RunConfig(model=str(ckpt), prompts=prompts, split="all", link="none",
                                      offload=PolicyConfig("prefetch"),
                                      prediction=PredictorSpec(baseline="spec_gate"),
                                      session=SessionConfig(DecodeConfig(max_new_tokens=2))))  # fmt: skip
    assert res.output_matches_resident and len(calls) == 1


def test_admission_auto_is_the_policys_own_and_a_bad_one_is_refused():
    """`--admission auto` resolves per policy from the policy table (what generate runs by
    default); from Python, a value that is no admission is one clear error."""
    from tensorbend.errors import TensorbendError

    policies = ("lru", "lfu", "lfru", "prefetch", "on_demand", "oracle", "resident")
    rules = [PolicyConfig(p, admission="auto").admission_rule for p in policies]
    assert rules == ["frequency", "frequency", "frequency", "predicted", "all", "all", "all"]
    assert PolicyConfig("lfru", admission="all").admission_rule == "all"  # a named rule stays
    with pytest.raises(TensorbendError, match="--admission 'sometimes': expected one of all, "):
        PolicyConfig(admission="sometimes")
