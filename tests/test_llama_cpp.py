"""llama.cpp as a peer (bench/llama_cpp.py). The parser runs everywhere; the conversion and
greedy-text checks need the optional build (`make llama-cpp`, under runs/llama.cpp or
$TENSORBEND_LLAMA_CPP) and skip without it."""

import pytest
import torch

from bench import llama_cpp
from tensorbend.errors import TensorbendError
from tensorbend.zoo import resolve_model

# Captured from a real run: the tail of llama-completion's stderr (llama-cpp-python 0.3.36's
# vendored llama.cpp, zoo:qwen3moe-tiny as an f32 GGUF, "And God said", -n 24, 2 threads).
PERF = """\
0.00.093.385 I common_perf_print:    sampling time =       0.48 ms
0.00.093.411 I common_perf_print:    samplers time =       0.29 ms /    27 tokens
0.00.093.434 I common_perf_print:        load time =       2.28 ms
0.00.093.454 I common_perf_print: prompt eval time =       1.91 ms /     3 tokens (    0.64 ms per token,  1574.80 tokens per second)
0.00.093.472 I common_perf_print:        eval time =      11.33 ms /    23 runs   (    0.49 ms per token,  2029.65 tokens per second)
0.00.093.486 I common_perf_print:       total time =      14.70 ms /    26 tokens
0.00.093.500 I common_perf_print: unaccounted time =       0.98 ms /   6.6 %      (total - sampling - prompt eval - eval) / (total)
"""

tools = llama_cpp.find()
needs_build = pytest.mark.skipif(
    tools is None,
    reason=f"no llama.cpp build under {llama_cpp.default_root()} (optional extra: `make "
    f"llama-cpp`, or ${llama_cpp.ENV}=DIR)",
)


def test_parse_timings_reads_the_perf_summary():
    t = llama_cpp.parse_timings(PERF)
    assert (t["prompt_tokens"], t["prompt_ms"], t["decode_tokens"], t["decode_ms"]) == (
        3, 1.91, 23, 11.33)  # fmt: skip
    assert t["decode_tok_s"] == pytest.approx(23 / 11.33e-3)
    assert t["prefill_tok_s"] == pytest.approx(3 / 1.91e-3)


def test_parse_timings_without_a_summary_is_one_clear_error():
    with pytest.raises(TensorbendError, match="perf summary"):
        llama_cpp.parse_timings("main: error: failed to load model\n")


@needs_build
@pytest.mark.parametrize("name", ["qwen3moe-tiny"])  # (dsv3-*: converted, not loaded)
def test_gguf_greedy_text_equals_transformers(tmp_path, name):
    """The zoo model converted at its own precision (f32) continues two prompts with the
    same greedy text as transformers (eager experts). The DeepSeek-V3 zoo models convert but
    llama.cpp refuses to load them (docs/guide/peers.md)."""
    from tensorbend.capture.hf import load_model

    ckpt = resolve_model(f"zoo:{name}")
    gguf = llama_cpp.convert(ckpt, tmp_path / f"{name}.gguf", tools=tools)
    model, tok = load_model(str(ckpt))
    for prompt in ("And God said", "The history of the city begins"):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=24, do_sample=False,
                                 pad_token_id=tok.eos_token_id)  # fmt: skip
        want = tok.decode(out[0, ids.shape[1] :])
        got = llama_cpp.run(gguf, prompt, 24, threads=1, tools=tools)
        assert got["prompt_tokens"] == ids.shape[1]
        assert got["text"] == want


def _binding() -> bool:
    try:
        import llama_cpp as _  # noqa: F401
    except ImportError:
        return False
    return True


@needs_build
@pytest.mark.skipif(
    not _binding(), reason="no llama-cpp-python (python -m bench.llama_cpp_serve install)"
)
def test_warm_serve_continues_every_prompt_with_transformers_greedy_text(tmp_path):
    """The warm row's process (bench.llama_cpp_serve.serve): two prompts in one process, each
    continued with transformers' greedy text (f32 GGUF of zoo:qwen3moe-tiny), prefill and
    decode timed apart, decode steps = new tokens - 1."""
    from bench.llama_cpp_serve import serve
    from tensorbend.capture.hf import load_model

    ckpt = resolve_model("zoo:qwen3moe-tiny")
    gguf = llama_cpp.convert(ckpt, tmp_path / "q.gguf", tools=tools)
    model, tok = load_model(str(ckpt))
    prompts = ["And God said", "The history of the city begins"]
    res = serve(gguf, prompts, 12, threads=1)
    for prompt, got in zip(prompts, res["prompts"], strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(
                ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id
            )
        assert got["text"] == tok.decode(out[0, ids.shape[1] :])
        assert got["prompt_tokens"] == ids.shape[1] and got["decode_steps"] == 11
        assert got["ttft_s"] > 0 and got["decode_s"] > 0
