"""Capture timing: the model the capture benches time, and one timed prompt through the decode loop.

Usage (bench/capture_overhead.py, bench/trace_io.py):
    model, name = build_model("zoo:default")     # or a config-built DeepSeek-V3 (random weights)
    seconds = run_once(model, describe_model(model), ("ids",), ids_1T, n_decode=16)

`build_model(None)` (or a model that does not load) builds a DeepSeek-V3-style model of the
bundled default's shape from config: timing only, its routing is noise.
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch

from tensorbend.capture.hf import DecodeConfig, PromptInput, decode_prompt
from tensorbend.capture.routing import RoutingCapture


def build_model(spec: str | None):
    if spec:
        from tensorbend.capture.hf import load_model

        try:
            return load_model(spec)[0], spec
        except Exception as e:  # noqa: BLE001 - fall back to a config-built model, and say so
            print(
                f"note: {spec} not loadable ({e}); using a config-built DeepSeek-V3",
                file=sys.stderr,
            )
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=8192,
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=64,
        num_hidden_layers=7,
        first_k_dense_replace=1,
        n_routed_experts=32,
        num_experts_per_tok=4,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=32,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        cfg
    ).eval(), "config:deepseek_v3-h128-L7-E32"


def run_once(model, spec, features, ids, n_decode) -> float:
    """One prompt through the one decode loop (greedy, no EOS), capturing `features`."""
    cfg = DecodeConfig(decode="greedy", max_new_tokens=n_decode, max_prompt_tokens=ids.shape[1])
    inp = PromptInput("bench", ids, None)
    ctx = RoutingCapture(model, spec, features) if features else contextlib.nullcontext()
    t0 = time.perf_counter()
    with torch.inference_mode(), ctx as cap:

        def forward(phase, **kw):
            out = model(**kw)
            if cap is not None:
                cap.pop()
            return out

        decode_prompt(model, inp, cfg, forward=forward)
    return time.perf_counter() - t0
