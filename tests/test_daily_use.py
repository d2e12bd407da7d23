"""What a user of `tensorbend generate` and `tensorbend store` runs into day to day: chat
templates, sampling and stop options, interactive prompts, the time profile, store build /
prune, and failures that are one line (exit 2, nothing lost) instead of a traceback."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import pytest
from tiny_models import char_tokenizer, save_checkpoint

from tensorbend.capture.hf import DecodeConfig
from tensorbend.cli import main
from tensorbend.serving.decoding import Decoding, generate_kwargs
from tensorbend.serving.generate import GenerateConfig, generate
from tensorbend.serving.offloaded import ServeConfig

CHAT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "ckpt")


def _err(capsys, *argv) -> str:
    capsys.readouterr()
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def _cfg(ckpt, tmp_path, **kw) -> GenerateConfig:
    serve = ServeConfig(store_dir=tmp_path / "stores", progress=False)
    decode = kw.pop("decode", DecodeConfig(max_new_tokens=6))
    return GenerateConfig(model=str(ckpt), serve=serve, decode=decode, **kw)


def test_option_errors_are_one_line_before_any_work(ckpt, tmp_path, capsys):
    gen = ["generate", "--model", str(ckpt), "--prompt", "ab", "--quiet"]
    err = _err(capsys, *gen, "--json", str(tmp_path))
    assert f"--json {tmp_path}: expected a file path, found a directory" in err
    err = _err(capsys, *gen, "--json", str(tmp_path / "no" / "s.json"))
    assert "expected an existing folder" in err
    assert "--top-k: expected --sample too" in _err(capsys, *gen, "--top-k", "5")
    assert "--top-p: expected --sample too" in _err(capsys, *gen, "--top-p", "0.5")
    assert "--system: expected --chat too" in _err(capsys, *gen, "--system", "Be brief.")
    assert "--repetition-penalty 0.0: expected a value > 0" in _err(
        capsys, *gen, "--repetition-penalty", "0"
    )
    long = ["generate", "--model", str(ckpt), "--prompt", "ab" * 200, "--quiet"]
    err = _err(capsys, *long, "--max-new-tokens", "200")
    assert "a prompt of 400 tokens + --max-new-tokens 200: expected at most" in err
    err = _err(capsys, *gen, "--chat")
    assert "--chat: expected a chat template in the tokenizer" in err
    assert not (tmp_path / "stores").exists()  # (nothing was built)


def test_generate_kwargs_are_transformers_own():
    greedy, sample = DecodeConfig(max_new_tokens=4), DecodeConfig("sample", 4, temperature=0.7)
    tok = object()
    assert generate_kwargs(Decoding(), greedy, 1.0, tok) == {
        "max_new_tokens": 4,
        "do_sample": False,
    }
    kw = generate_kwargs(Decoding(top_k=5, repetition_penalty=1.3, stop=("\n",)), sample, 0.9, tok)
    assert kw == {"max_new_tokens": 4, "do_sample": True, "temperature": 0.7, "top_p": 0.9,
                  "top_k": 5, "repetition_penalty": 1.3, "stop_strings": ["\n"], "tokenizer": tok}  # fmt: skip


def test_chat_template_and_system_prompt(ckpt, tmp_path):
    """--chat feeds the template's rendering (the system turn first, then the user's, then the
    generation prompt), as transformers' apply_chat_template writes it."""
    chat = tmp_path / "chat"
    shutil.copytree(ckpt, chat)
    tok = char_tokenizer()
    tok.chat_template = CHAT
    tok.save_pretrained(chat)
    out = io.StringIO()
    text = Decoding(chat=True, system="Be brief.")
    s = generate(_cfg(chat, tmp_path, prompt="Hi", text=text), out=out, err=io.StringIO())
    assert out.getvalue().startswith("<system>Be brief.<user>Hi<assistant>")
    assert s["decode_tokens"] == 5  # (6 new tokens: the first is prefill's)


def test_stop_string_ends_the_continuation(tmp_path):
    """A string the greedy continuation reaches ends it there (transformers' stop_strings, on
    the bundled model's byte-level tokenizer), the stop string printed."""
    model, prompt = "zoo:qwen3moe-tiny", "And God said"
    decode = DecodeConfig(max_new_tokens=16)
    plain = io.StringIO()
    generate(_cfg(model, tmp_path, prompt=prompt, decode=decode), out=plain, err=io.StringIO())
    said = plain.getvalue().removeprefix(prompt)[:-1]  # (generate ends each with a newline)
    end = said.index("\n") + 1  # (the line break: a token of its own in byte-level BPE)
    assert end < len(said) - 1
    out = io.StringIO()
    cfg = _cfg(model, tmp_path, prompt=prompt, decode=decode, text=Decoding(stop=("\n",)))
    generate(cfg, out=out, err=io.StringIO())
    assert out.getvalue().removeprefix(prompt)[:-1] == said[:end]


def test_interactive_prompts_on_one_loaded_model_with_profile(ckpt, tmp_path):
    """-i: each line of standard input continued in turn, blank lines skipped, on one model;
    --profile's parts add up to decode's time, one row per MoE layer."""
    out, err = io.StringIO(), io.StringIO()
    cfg = _cfg(ckpt, tmp_path, text=Decoding(interactive=True), profile=True)
    s = generate(cfg, out=out, err=err, stdin=io.StringIO("ab\n\ncd\n"))
    lines = out.getvalue().splitlines()
    assert [ln[:2] for ln in lines] == ["ab", "cd"]
    assert s["decode_tokens"] == 2 * 5
    prof = s["profile"].splitlines()
    ms = [float(ln.split()[0]) for ln in prof[1:5]]
    per_token = s["decode_tokens"] and 1e3 / s["decode_tok_s"]
    assert sum(ms) == pytest.approx(per_token, rel=0.02)
    layers = [ln for ln in prof if ln.strip().startswith("layer")]
    import torch
    from transformers import AutoModelForCausalLM

    from tensorbend.models import describe_model, read_config

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(read_config(ckpt))
    assert len(layers) == describe_model(meta).num_moe_layers
    assert "per MoE layer" in err.getvalue()


def test_store_build_list_orphan_and_prune(ckpt, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    root = tmp_path / "stores"
    assert main(["store", "build", "--model", str(copy), "--store-dir", str(root), "--quiet"]) == 0
    built = capsys.readouterr().out.split()[0]
    assert os.path.isfile(built)
    shutil.rmtree(copy)
    assert main(["store", "list", "--store-dir", str(root), "--json"]) == 0
    [s] = json.loads(capsys.readouterr().out)
    assert s["orphan"] and s["store"] == built
    assert main(["store", "prune", "--store-dir", str(root)]) == 0
    assert "removed" in capsys.readouterr().out and not os.path.exists(built)


def test_a_closed_stdout_ends_quietly(ckpt, tmp_path):
    """`tensorbend generate ... | head -c 5`: no traceback, exit 141 (as SIGPIPE would)."""
    cmd = [sys.executable, "-m", "tensorbend", "generate", "--model", str(ckpt), "--prompt",
           "abcdefgh", "--max-new-tokens", "110", "--quiet", "--store-dir", str(tmp_path / "s")]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(5) == b"abcde"
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_store_verify_finds_a_corrupted_expert(ckpt, tmp_path, capsys):
    """A store byte flipped behind the record's back (size and times kept): `store verify`
    names that expert and exits 1; an intact store verifies (exit 0)."""
    root = tmp_path / "stores"
    base = ["--model", str(ckpt), "--store-dir", str(root), "--quiet"]
    assert main(["store", "build", *base]) == 0
    store = capsys.readouterr().out.split()[0]
    assert main(["store", "verify", *base]) == 0
    assert "every stored expert equals" in capsys.readouterr().out
    from tensorbend.offload.store import ExpertStore

    s = ExpertStore.open(store)
    start = s._data_start + s._offsets["layers.001.experts.0002"][0]
    s.close()
    st = os.stat(store)
    with open(store, "r+b") as f:
        f.seek(start + 8)
        byte = f.read(1)
        f.seek(start + 8)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(store, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert main(["store", "verify", *base]) == 1
    assert (
        "1 stored experts differ from the checkpoint (layer 1 expert 2)" in capsys.readouterr().err
    )


def test_a_build_that_fails_says_so_on_its_own_line_and_in_store_list(
    ckpt, tmp_path, capsys, monkeypatch
):
    """A store build that stops on an error inside its progress bar: the error is a line of
    its own (not appended to the bar's), exit 2, and `store list` calls the leftover `failed`
    with that error, not `interrupted`. (The error is planted at layer 1: a read failing in
    the middle of a real build, e.g. a shard replaced under it, cannot be timed in a test.)"""
    from tensorbend.errors import StoreError
    from tensorbend.offload.expert_plan import ExpertPlan

    real = ExpertPlan.expert_into

    def failing(self, m, e, *args, **kw):
        if m == 1:
            raise StoreError(f"planted read error at layer {m}")
        return real(self, m, e, *args, **kw)

    monkeypatch.setattr(ExpertPlan, "expert_into", failing)
    root = str(tmp_path / "stores")
    capsys.readouterr()
    assert main(["store", "build", "--model", str(ckpt), "--store-dir", root]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == "error: planted read error at layer 1", lines
    assert "expert store" in "".join(lines[:-1])  # (the bar ran, and ended its line)
    assert main(["store", "list", "--store-dir", root]) == 0
    out = capsys.readouterr().out
    assert "failed (1 of 3 layers: planted read error at layer 1;" in out, out
    assert "interrupted" not in out


def test_an_invalid_config_json_is_named_not_the_tokenizer(ckpt, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "config.json").write_text("{not json")
    err = _err(capsys, "generate", "--model", str(bad), "--prompt", "ab", "--quiet")
    assert err.startswith(f"error: {bad / 'config.json'}: expected a JSON object")
    assert "tokenizer" not in err


def test_collect_with_vllm_past_the_models_positions_is_one_line(ckpt, tmp_path, capsys):
    """The prompt + new-token window vLLM would be given (`max_model_len`) is checked against
    the model's positions before vLLM is imported (vLLM's own refusal is a pydantic
    traceback); the tiny model has 128 positions."""
    err = _err(capsys, "collect", "--engine", "vllm", "--model", str(ckpt), "--out",
               str(tmp_path / "t"), "--max-prompt-tokens", "100", "--max-new-tokens", "40")  # fmt: skip
    assert err == (
        "error: --max-prompt-tokens 100 + --max-new-tokens 40 + 1: expected at most 128 "
        "positions (the model's max_position_embeddings); lower --max-prompt-tokens or "
        "--max-new-tokens"
    )
    assert not (tmp_path / "t").exists()


def test_counts_and_sizes_are_refused_in_words(ckpt, capsys):
    """--max-new-tokens -5 and 0 get the same floor; a bare 1e9 is read as bytes and said so;
    a negative size reaches its own check instead of argparse's 'expected one argument'."""
    gen = ["generate", "--model", str(ckpt), "--prompt", "ab", "--quiet"]
    for n in ("-5", "0"):
        err = _err(capsys, *gen, "--max-new-tokens", n)
        assert err == f"error: --max-new-tokens {n}: expected a count >= 1"
    assert _err(capsys, *gen, "--max-memory", "1e9") == (
        "error: --max-memory '1e9': expected a size with a unit, found a bare number; write "
        "1000000000B for 1,000,000,000 bytes (1GB)"
    )
    assert _err(capsys, *gen, "--max-memory", "-1GB") == (
        "error: --max-memory '-1GB': expected a finite size of at least one byte, such as 8GB"
    )


def test_a_checkpoint_missing_experts_is_named_by_its_keys(ckpt, tmp_path, capsys):
    """An expert's tensors missing from the shards: the error names the decoder layer, the
    missing expert ids and a key the checkpoint does have (not tensorbend's MoE-layer index)."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    tensors = load_file(bad / "model.safetensors")
    gone = [k for k in tensors if ".layers.2.mlp.experts.5." in k]
    assert gone, sorted(tensors)[:20]
    save_file({k: v for k, v in tensors.items() if k not in gone}, bad / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    err = _err(capsys, "store", "build", "--model", str(bad), "--store-dir",
               str(tmp_path / "s"), "--quiet")  # fmt: skip
    assert f"{bad}: decoder layer 2 part " in err and "missing experts [5]; present: " in err
    assert "model.layers.2.mlp.experts." in err and err.endswith("is a shard missing?")
