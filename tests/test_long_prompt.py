"""The memory budget holds at any prompt length: `--reserve auto` follows the request (its
prompt + new tokens), the prompt prefills in chunks (transformers' `prefill_chunk_size`) so its
attention grows with the chunk, a request past what the budget holds is refused in one line
before it runs, and chunking changes no token."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from tiny_models import save_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

import tensorbend
from tensorbend.serving.budget import PREFILL_CHUNK, prefill_chunk
from tensorbend.zoo import resolve_model


def test_prefill_chunk_never_leaves_a_one_token_chunk():
    """A one-token forward on a filled cache reads as a decode step, so no chunk is one token."""
    assert prefill_chunk(100) == PREFILL_CHUNK == 512
    assert prefill_chunk(1024) == prefill_chunk(1026) == 512
    assert prefill_chunk(1025) == 511 and 1025 % 511 == 3
    assert prefill_chunk(513) == 511


@pytest.fixture(scope="module")
def long_qwen(tmp_path_factory):
    """zoo:qwen3moe-tiny (its own BPE tokenizer, 4 heads) with 16,384 positions."""
    path = tmp_path_factory.mktemp("long") / "qwen"
    shutil.copytree(resolve_model("zoo:qwen3moe-tiny"), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 16384}))
    return path


def _prompt(path, tokens: int) -> str:
    tok = AutoTokenizer.from_pretrained(path)
    words = "river stone kernel module alpha delta poetry table light dark seven".split()
    text = " ".join(words[(i * 7) % len(words)] + str(i % 97) for i in range(tokens))
    ids = tok(text).input_ids[:tokens]
    return tok.decode(ids)


def _baseline() -> int:
    from tensorbend.serving.budget import IMPORT_BASELINE

    run = subprocess.run([sys.executable, "-c", IMPORT_BASELINE], capture_output=True, text=True)
    return int(run.stdout)


def test_peak_rss_holds_the_budget_at_2k_6k_and_12k_tokens(long_qwen, tmp_path):
    """One budget (250 MB), prompts of about 2k, 6k and 12k tokens, each `tensorbend generate`
    in its own process: the reserve grows with the prompt (the cache takes what is left) and
    peak RSS stays within the import baseline + the budget."""
    base, budget = _baseline(), 250 * 10**6
    reserves = []
    for n in (2000, 6000, 12000):
        out = tmp_path / f"{n}.json"
        run = subprocess.run(
            [sys.executable, "-m", "tensorbend", "generate", "--model", str(long_qwen),
             "--prompt", _prompt(long_qwen, n), "--max-new-tokens", "4", "--max-memory",
             f"{budget}B", "--store-dir", str(tmp_path / "store"), "--quiet", "--json", str(out)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        s = json.loads(out.read_text())
        plan = s["memory_plan"]
        assert n - 10 <= plan["context_tokens"] - 4 <= n, plan  # the prompt's tokens + 4 new
        assert s["prefill_tokens"] >= n - 10 and s["decode_tokens"] == 3, s
        assert s["peak_rss_bytes"] <= base + budget, (n, s["peak_rss_bytes"] - base)
        reserves.append(plan["reserve"])
    assert reserves == sorted(reserves) and reserves[0] < reserves[-1]


def test_a_budget_too_small_for_the_prompt_is_refused_before_loading(long_qwen, tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "tensorbend", "generate", "--model", str(long_qwen), "--prompt",
         _prompt(long_qwen, 12000), "--max-new-tokens", "4", "--max-memory", "130MB",
         "--store-dir", str(tmp_path / "store"), "--quiet"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 2
    err = run.stderr.strip()
    assert err.startswith("error: --max-memory 130MB: expected at least ") and "\n" not in err
    assert "the reserve for 12,004 tokens (KV cache, attention)" in err
    assert err.endswith("; raise it or shorten the prompt")
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())


def test_a_sequence_past_the_reserved_tokens_is_refused_and_chunks_change_no_token(tmp_path):
    """Python API: a model loaded for 300 tokens per sequence refuses a 400-token forward in
    one line, before it runs; a 700-token prompt on a model loaded for it prefills in two chunks
    (512 + 188 tokens: counted as prefill, not decode) and generates what transformers' eager
    model generates with the same chunks, its logits equal."""
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt", max_position_embeddings=1024)
    kw = {"store_dir": tmp_path / "store", "progress": False}
    small = tensorbend.load_offloaded(ckpt, max_memory="200MB", context_tokens=300, **kw)
    ids = torch.randint(2, 97, (1, 400), generator=torch.Generator().manual_seed(0))
    try:
        with pytest.raises(tensorbend.TensorbendError) as e, torch.inference_mode():
            small.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=1)
    finally:
        small.tensorbend.close()
    assert str(e.value) == (
        "1 sequence(s) of 400 tokens: expected at most 300 tokens, what --reserve auto kept "
        "room for within --max-memory; load with context_tokens=400 (`tensorbend generate` "
        "sizes it from its prompts), or pass --reserve"
    )
    ids = torch.randint(2, 97, (1, 700), generator=torch.Generator().manual_seed(1))
    served = tensorbend.load_offloaded(ckpt, max_memory="200MB", context_tokens=712, **kw)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, experts_implementation="eager").eval()
    gen = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 1}
    try:
        with torch.inference_mode():
            got = served.generate(ids, **gen)  # (the load set prefill_chunk_size = 512)
            c = served.tensorbend.counters()
            want = ref.generate(ids, prefill_chunk_size=PREFILL_CHUNK, **gen)
            assert torch.equal(got, want)
            assert torch.equal(served(want).logits, ref(want).logits)
    finally:
        served.tensorbend.close()
    assert (c["prefill"]["tokens"], c["decode"]["tokens"]) == (700, 11)
