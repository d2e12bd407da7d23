"""The vLLM plugin: a real OpenAI-compatible vLLM server on localhost with zoo:qwen3moe-tiny,
requests through the `openai` client vLLM ships, the counters file read back.

Runs where vLLM imports and the plugin's entry point is registered (`make test-vllm`); the
settings' errors are checked everywhere.
"""

import importlib.util
import json
import time
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import pytest

from tensorbend.cli import main
from tensorbend.engines.vllm_counters import ranks_of_experts, read_counters
from tensorbend.engines.vllm_plugin import PluginSettings
from tensorbend.errors import TensorbendError

ROOT = Path(__file__).resolve().parents[1]


def test_settings_from_env_and_their_errors(tmp_path):
    assert PluginSettings.from_env({}) == PluginSettings()  # unset: the plugin does nothing
    s = PluginSettings.from_env({"TENSORBEND_COUNTERS": str(tmp_path), "TENSORBEND_EP": "4"})
    assert s.counters == tmp_path and s.ep == 4 and s.predictor is None and s.flush_s == 1.0
    bad = [({"TENSORBEND_EP": "two"}, "TENSORBEND_EP='two': expected int"),
           ({"TENSORBEND_EP": "0"}, "TENSORBEND_EP=0: expected >= 1"),
           ({"TENSORBEND_PREDICTOR": str(tmp_path / "no")}, "no such file")]  # fmt: skip
    for env, msg in bad:
        with pytest.raises(TensorbendError, match=msg):
            PluginSettings.from_env(env)


def test_linear_placement_is_vllms():
    assert ranks_of_experts(32, 2) == [0] * 16 + [1] * 16
    assert ranks_of_experts(7, 3) == [0, 0, 0, 1, 1, 2, 2]  # determine_expert_map's "linear"


needs_plugin = pytest.mark.skipif(
    not importlib.util.find_spec("vllm")
    or "tensorbend" not in {e.name for e in entry_points(group="vllm.general_plugins")},
    reason="vLLM with tensorbend's plugin entry point is not installed here: `make vllm-env`, "
    "`make test-vllm`",
)


def _diff(after: dict, before: dict, *keys) -> np.ndarray:
    a, b = after, before
    for k in keys:
        a, b = a[k], b[k]
    return np.asarray(a) - np.asarray(b)


@needs_plugin
def test_served_requests_fill_the_counters(tmp_path):
    """Known answers: every layer routes tokens x K, per-rank counts are the per-expert counts
    grouped by vLLM's linear placement, predicted counts sum like actual ones, and recall is
    what `tensorbend live` measures on the same prompts (one request at a time)."""

    from tensorbend.capture.hf import DecodeConfig, encode_prompt, load_tokenizer
    from tensorbend.capture.prompts import load_prompts
    from tensorbend.zoo import resolve_model

    common = ["--model", "zoo:qwen3moe-tiny", "--model-dtype", "float32", "--quiet"]
    assert main(["collect", *common, "--out", str(tmp_path / "tr"), "--decode", "teacher",
                 "--max-new-tokens", "8", "--max-prompts", "40", "--dtype", "float32",
                 "--features", "ids", "gate_input"]) == 0  # fmt: skip
    ckpt = tmp_path / "d1.safetensors"
    assert main(["train", "--trace", str(tmp_path / "tr"), "--out", str(ckpt),
                 "--lookahead", "d1", "--epochs", "2", "--quiet"]) == 0  # fmt: skip
    assert main(["live", "--model", "zoo:qwen3moe-tiny", "--predictor", str(ckpt), "--split",
                 "test", "--max-prompts", "3", "--max-new-tokens", "8",
                 "--json", str(tmp_path / "live.json")]) == 0  # fmt: skip
    live = json.loads((tmp_path / "live.json").read_text())

    from vllm_server import openai_server

    path = resolve_model("zoo:qwen3moe-tiny")
    counters = tmp_path / "counters"
    env = {"TENSORBEND_COUNTERS": str(counters), "TENSORBEND_PREDICTOR": str(ckpt),
           "TENSORBEND_EP": "2", "TENSORBEND_FLUSH_S": "0.2"}  # fmt: skip
    with openai_server(tmp_path, path, env) as (client, model):
        before = read_counters(counters)[0]
        tok = load_tokenizer(path)
        dc = DecodeConfig("greedy", 8, 256)
        fed = 0
        for p in load_prompts(None, "test")[:3]:
            ids = encode_prompt(tok, p, dc).ids_1S[0].tolist()
            r = client.completions.create(model=model, prompt=ids, max_tokens=9, temperature=0)
            fed += r.usage.prompt_tokens + r.usage.completion_tokens - 1  # last one not fed
        for _ in range(50):
            after = read_counters(counters)[0]
            if sum(after["forwards"].values()) - sum(before["forwards"].values()) >= 27:
                break
            time.sleep(0.2)
    assert after["predictor"] == str(ckpt) and after["lookahead"] == "d1"
    assert after["ep_degree"] == 2 and after["expert_placement"] == "linear"
    forwards = {ph: n - before["forwards"][ph] for ph, n in after["forwards"].items()}
    assert forwards == {"decode": 24, "prefill": 3}
    K, E = after["top_k"], after["num_experts"]
    act_LE = _diff(after, before, "tokens_per_expert", "actual")
    assert (act_LE.sum(1) == fed * K).all()  # every layer routed every fed token's K experts
    rank_of = np.array(after["rank_of_expert"])
    act_LR = _diff(after, before, "tokens_per_rank", "actual")
    assert (act_LR == np.stack([act_LE[:, rank_of == r].sum(1) for r in range(2)], 1)).all()
    pred_LR = _diff(after, before, "tokens_per_rank", "predicted")
    seen_LR = _diff(after, before, "tokens_per_rank", "actual_when_predicted")
    assert (pred_LR[0] == 0).all()  # d1: no prediction for the first MoE layer
    assert (pred_LR[1:].sum(1) == fed * K).all() and (seen_LR[1:] == act_LR[1:]).all()
    err_LR = _diff(after, before, "tokens_per_rank", "sum_abs_error")
    assert (err_LR >= np.abs(pred_LR - seen_LR)).all() and E == len(rank_of)
    assert (np.asarray(after["tokens_per_rank"]["max_abs_error"])[1:] > 0).any()
    rate = {ph: _diff(after, before, "hits", ph).sum() / _diff(after, before, "total", ph).sum()
            for ph in ("decode", "prefill")}  # fmt: skip
    assert rate["decode"] == pytest.approx(live["decode_recall@4"], abs=1e-4), (rate, live)
    assert rate["prefill"] == pytest.approx(live["prefill_union_recall"], abs=1e-4)
