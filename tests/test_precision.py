"""Serving a checkpoint in its own precision: dtype="auto" keeps a bf16 checkpoint's experts in
bf16 (half the store, twice the slots of a budget) with the text of transformers' bf16 model."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_checkpoint
from transformers import AutoModelForCausalLM

import tensorbend
from tensorbend.models import describe_model, moe_block
from tensorbend.serving.offloaded import ServeConfig


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_bf16_checkpoint_stored_and_served_in_bf16(family, tmp_path):
    """dtype="auto" (the default): the store holds the checkpoint's bf16 bytes (each expert
    equals the bf16 resident model's row, 2 bytes a weight), the same cache budget holds twice
    float32's slots, greedy generate() equals transformers' own bf16 model with eager experts,
    and the counters read bf16 bytes."""
    ckpt = save_checkpoint(family, tmp_path / "ckpt", dtype=torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, experts_implementation="eager").eval()
    assert ref.dtype == torch.bfloat16  # (transformers' own default is the checkpoint's dtype)
    spec = describe_model(ref)
    f32 = tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "s32", dtype="fp32",
                                    progress=False, cache_frac=0.5)  # fmt: skip
    f32_bytes = f32.tensorbend.layout.nbytes
    f32.tensorbend.close()
    budget = 8 * f32_bytes
    model = tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "s16", cache_bytes=budget,
                                      progress=False)  # fmt: skip
    h = model.tensorbend
    assert h.layout.dtype == torch.bfloat16 and h.layout.nbytes * 2 == f32_bytes
    assert h.layout.nbytes == h.layout.numel * 2 == h.store.expert_nbytes
    assert h.cache.capacity == 16  # float32: budget // f32_bytes = 8
    stores = {d: next((tmp_path / d).glob("*/experts-*.safetensors")) for d in ("s32", "s16")}
    assert stores["s16"].name == "experts-bfloat16.safetensors"
    assert stores["s16"].stat().st_size < stores["s32"].stat().st_size  # (each expert padded
    # to 4096 bytes: exactly half only where both sizes are whole blocks)
    _served_like(ref, model, spec)
    c = h.counters()
    assert c["expert_dtype"] == c["compute_dtype"] == "bfloat16"
    assert c["expert_bytes"] == h.layout.nbytes
    assert c["totals"]["bytes_read"] == c["totals"]["misses"] * h.layout.nbytes > 0
    h.close()


def test_generate_cli_states_the_precision_and_writes_transformers_bf16_text(tmp_path, capsys):
    """`tensorbend generate` on a bf16 checkpoint: the summary line says the experts are stored
    and computed in bf16 (what bench/expert_dtype.py measured faster at real sizes), and the
    text is transformers' own bf16 model's (eager experts)."""

    from tensorbend.cli import main

    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt", dtype=torch.bfloat16)
    want = _eager_cli_text(ckpt, "river stone", 10)
    capsys.readouterr()
    assert main(["generate", "--model", str(ckpt), "--prompt", "river stone", "--max-new-tokens",
                 "10", "--store-dir", str(tmp_path / "s"), "--quiet"]) == 0  # fmt: skip
    out = capsys.readouterr()
    assert out.out == want
    assert "experts stored in bfloat16, computed in bfloat16" in out.err


def test_dtype_accepts_names_and_torch_dtypes_and_refuses_others_in_one_line():
    for value, name in [("auto", "auto"), ("bf16", "bfloat16"), (torch.bfloat16, "bfloat16"),
                        ("torch.float16", "float16"), ("FP32", "float32")]:  # fmt: skip
        assert ServeConfig(dtype=value).dtype == name
    for bad in ("int8", torch.int8, 16):
        with pytest.raises(tensorbend.TensorbendError) as e:
            ServeConfig(dtype=bad)
        assert str(e.value) == (
            f"--dtype {bad!r}: expected auto, float32 (fp32), float16 (fp16) or bfloat16 (bf16), "
            "as a name or a torch dtype"
        )


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_fp8_block_checkpoint_stored_in_fp8_and_served_as_transformers_dequantizes(family,
                                                                                    tmp_path):  # fmt: skip
    """An FP8 block checkpoint in the real on-disk format (F8_E4M3 weights, a float32
    weight_scale_inv per block, quantization_config): the store keeps each expert as fp8 +
    scales (1 byte a weight), dequantized into a bf16 slot it equals transformers' own
    dequantized model's expert, greedy text equals that model's (eager experts), and the
    counters read the fp8 bytes."""
    from tiny_models import save_fp8_checkpoint

    ckpt = save_fp8_checkpoint(family, tmp_path / "ckpt", block=16)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, experts_implementation="eager").eval()
    spec = describe_model(ref)
    model = tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "s", cache_frac=0.5,
                                      progress=False)  # fmt: skip
    h = model.tensorbend
    assert len(list((tmp_path / "s").glob("*/experts-fp8.safetensors"))) == 1
    assert h.layout.dtype == ref.dtype == torch.bfloat16 and h.layout.block == (16, 16)
    scales = sum(s[0] * s[1] // 256 for _, s in h.layout.parts)
    assert h.store.expert_nbytes == h.layout.stored_nbytes == h.layout.numel + 4 * scales
    assert set(_served_like(ref, model, spec)) == {h.layout.stored_nbytes}
    c = h.counters()
    assert c["expert_dtype"] == "float8_e4m3fn (16x16 blocks)" and c["compute_dtype"] == "bfloat16"
    assert c["totals"]["bytes_read"] == c["totals"]["misses"] * h.layout.stored_nbytes > 0
    h.close()


@pytest.mark.parametrize(
    "quant, name",
    [({"quant_method": "awq", "bits": 4}, "awq int4"),
     ({"quant_method": "gptq", "bits": 4}, "gptq int4"),
     ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [16, 16]},
      "fp8 (e4m3, static activations, weight_block_size [16, 16])")],
)  # fmt: skip
def test_other_quantizations_refused_by_name_in_one_line(quant, name, tmp_path, capsys):
    import json

    from tensorbend.cli import main

    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    msg = (
        f"{name} is not supported yet; expected an unquantized, fp8 (block), mxfp4 or "
        "compressed-tensors int4 (W4A16) checkpoint"
    )
    with pytest.raises(tensorbend.TensorbendError) as e:
        tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "s", progress=False)
    assert str(e.value) == msg
    capsys.readouterr()
    assert main(["generate", "--model", str(ckpt), "--prompt", "ab", "--quiet"]) == 2
    assert capsys.readouterr().err == f"error: {msg}\n"
    assert not (tmp_path / "s").exists()  # refused before a store is built


def test_mxfp4_dequantizer_equals_transformers_bit_for_bit(tmp_path):
    """offload/mxfp4.dequantize on a tiny gpt_oss checkpoint's own MXFP4 bytes, and on random
    bytes (every nibble, every finite e8m0 scale), equals transformers' own dequantization
    (`convert_moe_packed_tensors`, [E, A, B] from blocks [E, B, A / 32, 16]) bit for bit, in
    bf16, fp16 and fp32."""
    from safetensors.torch import load_file
    from tiny_models import save_mxfp4_checkpoint
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tensorbend.offload.mxfp4 import dequantize

    tensors = load_file(save_mxfp4_checkpoint(tmp_path / "ckpt") / "model.safetensors")
    cases = [(t, tensors[k.replace("_blocks", "_scales")]) for k, t in sorted(tensors.items())
             if k.endswith("_blocks")]  # fmt: skip
    assert [tuple(b.shape) for b, _ in cases] == [(8, 64, 1, 16), (8, 64, 2, 16)] * 2
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 17, 5, 16), dtype=torch.uint8, generator=g)
    cases.append((blocks, torch.randperm(255, generator=g).to(torch.uint8).view(3, 17, 5)))
    for blocks, scales in cases:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
            got = torch.full(want.shape, float("nan"), dtype=dtype)
            for e in range(len(blocks)):
                dequantize(blocks[e], scales[e], got[e])
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), dtype


def test_mxfp4_checkpoint_stored_in_mxfp4_and_served_as_transformers_dequantizes(tmp_path):
    """A gpt_oss checkpoint in gpt-oss's MXFP4 format (U8 `_blocks` / `_scales`, bf16 biases,
    quantization_config mxfp4): dtype="auto" stores each expert as its blocks + scales (17/32
    byte a weight, biases 2 bytes), a load dequantizes it into a bf16 slot equal to the expert
    of transformers' own dequantized model, and with 4 slots for 16 experts greedy text equals
    that model's (eager experts); the bf16 checkpoint of the same model stores 3.6x the bytes
    per expert for the same slots."""
    from tiny_models import save_mxfp4_checkpoint

    ckpt = save_mxfp4_checkpoint(tmp_path / "ckpt")
    plain = tensorbend.load_offloaded(save_mxfp4_checkpoint(tmp_path / "bf16", quantize=False),
                                      store_dir=tmp_path / "s16", progress=False)  # fmt: skip
    slot, plain_stored = plain.tensorbend.layout.nbytes, plain.tensorbend.store.expert_nbytes
    plain.tensorbend.close()
    ref = AutoModelForCausalLM.from_pretrained(ckpt, experts_implementation="eager").eval()
    assert ref.dtype == torch.bfloat16  # (dequantized at load: no triton kernels on CPU)
    spec = describe_model(ref)
    model = tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "s4", cache_bytes=4 * slot,
                                      progress=False)  # fmt: skip
    h = model.tensorbend
    D, I = 64, 32  # noqa: E741  (gate_up_proj [D, 2I] + bias [2I], down_proj [I, D] + bias [D])
    assert h.layout.block == "mxfp4" and h.layout.dtype == torch.bfloat16
    assert h.layout.nbytes == slot == plain_stored == (3 * D * I + 2 * I + D) * 2 == 12544
    assert h.store.expert_nbytes == h.layout.stored_nbytes == 3 * D * I * 17 // 32 + 256 == 3520
    assert h.cache.capacity == 4 < spec.num_moe_layers * spec.num_experts
    stores = {d: next((tmp_path / d).glob("*/experts-*.safetensors")) for d in ("s16", "s4")}
    assert stores["s4"].name == "experts-mxfp4.safetensors"
    assert stores["s4"].stat().st_size < stores["s16"].stat().st_size / 2
    assert set(_served_like(ref, model, spec)) == {3520}
    c = h.counters()
    assert c["expert_dtype"] == "mxfp4 (fp4 e2m1, an e8m0 scale per 32)"
    assert c["compute_dtype"] == "bfloat16" and c["expert_stored_bytes"] == 3520
    assert c["totals"]["bytes_read"] == c["totals"]["misses"] * 3520 > 0
    h.close()


def test_mxfp4_checkpoint_served_in_float32_as_transformers_dequantizes_in_float32(tmp_path):
    """--dtype float32 on an MXFP4 checkpoint: the same blocks + scales, the biases stored in
    float32 (its own store file), every expert dequantized into a float32 slot equal to
    transformers' float32 dequantized model's, and the same greedy text."""
    from tiny_models import save_mxfp4_checkpoint

    ckpt = save_mxfp4_checkpoint(tmp_path / "ckpt")
    ref = AutoModelForCausalLM.from_pretrained(ckpt, experts_implementation="eager",
                                               dtype=torch.float32).eval()  # fmt: skip
    model = tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "s", dtype="fp32",
                                      cache_frac=0.25, progress=False)  # fmt: skip
    h = model.tensorbend
    assert h.store.expert_nbytes == 3 * 64 * 32 * 17 // 32 + (2 * 32 + 64) * 4 == 3776
    assert next((tmp_path / "s").glob("*/experts-*.safetensors")).name == (
        "experts-mxfp4-float32.safetensors"
    )
    spec = describe_model(ref)
    for m in range(spec.num_moe_layers):
        mod = getattr(moe_block(ref, spec, m), spec.experts_attr)
        for e in range(spec.num_experts):
            got = torch.empty(h.layout.numel)
            h.store.read_into(m, e, got)
            assert torch.equal(got, torch.cat([getattr(mod, n)[e].reshape(-1)
                                               for n, _ in h.layout.parts])), (m, e)  # fmt: skip
    ids = torch.tensor([[5, 17, 33, 2, 40, 8]])
    with torch.inference_mode():
        want = ref.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=1)
        assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False,
                                          pad_token_id=1), want)  # fmt: skip
    h.close()


def test_generate_cli_serves_an_mxfp4_checkpoint_as_transformers_dequantizes(tmp_path, capsys):
    """`tensorbend generate` on an MXFP4 checkpoint, its cache too small for every expert: the
    text is transformers' own dequantized model's (eager experts), the summary line names the
    stored precision, and --json's bytes per token are whole mxfp4 experts."""
    import json

    from tiny_models import save_mxfp4_checkpoint

    from tensorbend.cli import main

    ckpt = save_mxfp4_checkpoint(tmp_path / "ckpt")
    want = _eager_cli_text(ckpt, "river stone", 10)
    capsys.readouterr()
    assert main(["generate", "--model", str(ckpt), "--prompt", "river stone", "--max-new-tokens",
                 "10", "--store-dir", str(tmp_path / "s"), "--cache-frac", "0.25", "--quiet",
                 "--json", str(tmp_path / "s.json")]) == 0  # fmt: skip
    out = capsys.readouterr()
    assert out.out == want
    assert "experts stored in mxfp4 (fp4 e2m1, an e8m0 scale per 32), computed in bfloat16" in (
        out.err
    )
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["expert_stored_bytes"] == 3520 and s["cache_slots"] < 16
    read = s["bytes_read_per_token"] * s["decode_tokens"]
    assert read > 0 and abs(read / 3520 - round(read / 3520)) < 1e-6


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_quantized_store_reused_after_a_touch_and_rebuilt_after_an_edit(fmt, tmp_path):
    """A quantized checkpoint's shard with a new mtime is re-hashed over the stored bytes of
    its experts (fp8 + scales, mxfp4 blocks + scales): same bytes, the store is reused; an
    expert's bytes edited, it is rebuilt."""
    import os

    from safetensors.torch import load_file, save_file
    from tiny_models import save_fp8_checkpoint, save_mxfp4_checkpoint

    ckpt = (save_fp8_checkpoint("qwen3_moe", tmp_path / "ckpt", block=16) if fmt == "fp8"
            else save_mxfp4_checkpoint(tmp_path / "ckpt"))  # fmt: skip
    shard = ckpt / "model.safetensors"

    def store_mtime():
        model = tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "s", progress=False)
        model.tensorbend.close()
        return next((tmp_path / "s").glob(f"*/experts-{fmt}.safetensors")).stat().st_mtime_ns

    built = store_mtime()
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert store_mtime() == built
    tensors = load_file(shard)
    key = next(
        k
        for k in sorted(tensors)
        if ".experts." in k and k.endswith(("proj.weight_scale_inv", "_scales"))
    )
    tensors[key][0].add_(1)  # (the same shapes and header: only the digests see it)
    save_file(tensors, shard, metadata={"format": "pt"})
    assert store_mtime() != built


def _eager_cli_text(ckpt, prompt: str, n: int) -> str:
    """What `tensorbend generate --prompt PROMPT` should print: transformers' greedy text with
    eager experts (the checkpoint dequantized as transformers does), after the prompt."""
    from tiny_models import char_tokenizer

    ref = AutoModelForCausalLM.from_pretrained(ckpt, experts_implementation="eager").eval()
    tok = char_tokenizer()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        want = ref.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=1)
    return prompt + tok.decode(want[0, ids.shape[1] :], skip_special_tokens=True) + "\n"


def _served_like(ref, model, spec) -> list[int]:
    """Assert every stored expert, read into a bf16 slot, equals the reference model's and
    greedy generate() equals the reference's; return each read's stored bytes."""
    h = model.tensorbend
    read = []
    for m in range(spec.num_moe_layers):
        mod = getattr(moe_block(ref, spec, m), spec.experts_attr)
        for e in range(spec.num_experts):
            want = torch.cat([getattr(mod, n)[e].reshape(-1) for n, _ in h.layout.parts])
            got = torch.empty(h.layout.numel, dtype=torch.bfloat16)
            read.append(h.store.read_into(m, e, got))
            assert torch.equal(got, want), (m, e)
    ids = torch.tensor([[5, 17, 33, 2, 40, 8]])
    with torch.inference_mode():
        want = ref.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=1)
        assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False,
                                          pad_token_id=1), want)  # fmt: skip
    return read
