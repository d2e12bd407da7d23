"""llama.cpp as a peer (bench/llama_cpp.py). The parser runs everywhere; the conversion and
greedy-text checks need the optional build (`make llama-cpp`, under runs/llama.cpp or
$TENSORBEND_LLAMA_CPP) and skip without it."""

import pytest
import torch

from bench import llama_cpp
from tensorbend.errors import TensorbendError
from tensorbend.zoo import resolve_model

# Captured from a real run (llama-completion of llama-cpp-python 0.3.36's vendored llama.cpp,
# zoo:dsv3-tiny as f32 GGUF, 2 threads): the tail of its stderr.
PERF = """\
llama_perf_sampler_print:    sampling time =       1.12 ms /    30 runs   (    0.04 ms per token, 26833.63 tokens per second)
llama_perf_context_print:        load time =      21.73 ms
llama_perf_context_print: prompt eval time =       0.97 ms /     6 tokens (    0.16 ms per token,  6185.57 tokens per second)
llama_perf_context_print:        eval time =      14.02 ms /    23 runs   (    0.61 ms per token,  1640.51 tokens per second)
llama_perf_context_print:       total time =      17.70 ms /    29 tokens
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
        6, 0.97, 23, 14.02)  # fmt: skip
    assert t["decode_tok_s"] == pytest.approx(23 / 14.02e-3)
    assert t["prefill_tok_s"] == pytest.approx(6 / 0.97e-3)


def test_parse_timings_without_a_summary_is_one_clear_error():
    with pytest.raises(TensorbendError, match="perf summary"):
        llama_cpp.parse_timings("main: error: failed to load model\n")


@needs_build
@pytest.mark.parametrize("name", ["qwen3moe-tiny", "dsv3-tiny"])
def test_gguf_greedy_text_equals_transformers(tmp_path, name):
    """The zoo model converted at its own precision (f32) continues two prompts with the
    same greedy text as transformers (eager experts)."""
    from tensorbend.hf import load_model

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
