"""INT4 experts: compressed-tensors checkpoints (Kimi-K2-Thinking's format, written by the
compressed-tensors library) and `--store-dtype int4`, kept 4-bit in the store and, with int4
slots, in the cache (torch's int4 kernel)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import save_checkpoint, save_int4_checkpoint
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

import tensorbend
from tensorbend.models import describe_model, moe_block
from tensorbend.offload import int4

IDS = torch.tensor([[5, 17, 33, 2, 40, 8]])


def _transformers_int4(ckpt):
    """transformers' own model of an int4 checkpoint: dequantized by compressed-tensors while
    loading, eager experts (the reference users would compare with)."""
    return AutoModelForCausalLM.from_pretrained(
        ckpt,
        dtype=torch.bfloat16,
        experts_implementation="eager",
        quantization_config=CompressedTensorsConfig(dequantize=True),
    ).eval()


def _greedy(model, n=12):
    with torch.inference_mode():
        return model.generate(IDS, max_new_tokens=n, do_sample=False, pad_token_id=1)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_int4_checkpoint_in_dense_slots_equals_transformers_dequantized_model(family, tmp_path):
    """A Kimi-shaped (deepseek_v3, Kimi's ignore list) and a qwen3_moe compressed-tensors INT4
    checkpoint with --slots dense: the store keeps each expert as its checkpoint's nibbles and
    bf16 scales (0.28x a bf16 expert), every expert dequantized into a bf16 slot equals
    transformers' dequantized model's bit for bit, and with fewer slots than experts greedy
    text and logits equal that model's."""
    ckpt = save_int4_checkpoint(family, tmp_path / "ckpt")
    ref = _transformers_int4(ckpt)
    spec = describe_model(ref)
    model = tensorbend.load_offloaded(
        ckpt, store_dir=tmp_path / "s", cache_frac=0.25, slots="dense", progress=False
    )
    h = model.tensorbend
    D, I = 32, 32  # noqa: E741
    dense = 3 * D * I * 2  # a bf16 expert's bytes
    assert h.layout.block == int4.Int4(32, "ct") and h.layout.nbytes == dense
    assert h.store.expert_nbytes == 3 * D * I // 2 + 3 * D * I // 32 * 2 == 1728
    assert h.store.expert_nbytes / dense <= 0.30
    assert next((tmp_path / "s").glob("*/experts-*.safetensors")).name == "experts-int4.safetensors"
    assert h.cache.capacity < spec.num_moe_layers * spec.num_experts
    for m in range(spec.num_moe_layers):
        mod = getattr(moe_block(ref, spec, m), spec.experts_attr)
        for e in range(spec.num_experts):
            got = torch.empty(h.layout.numel, dtype=torch.bfloat16)
            assert h.store.read_into(m, e, got) == 1728
            want = torch.cat([getattr(mod, n)[e].reshape(-1) for n, _ in h.layout.parts])
            assert torch.equal(got, want), (m, e)
    assert torch.equal(_greedy(model), _greedy(ref))
    with torch.inference_mode():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)
    c = h.counters()
    assert c["expert_dtype"] == "int4 (compressed-tensors pack-quantized, a bf16 scale per 32)"
    assert (c["slot_dtype"], c["compute_dtype"]) == ("bfloat16", "bfloat16")
    assert c["totals"]["bytes_read"] == c["totals"]["misses"] * 1728 > 0
    h.close()


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_int4_slots_equal_the_resident_int4_run_and_agree_with_transformers(family, tmp_path):
    """The same checkpoints in int4 slots (the default on cpu): a slot is 0.31x a bf16 expert,
    greedy text with 6 slots for all experts equals the run whose cache holds every expert (the
    same int4 kernel, resident) token for token, its first tokens equal transformers'
    dequantized model's, and its logits differ from that model's by the kernel's rounding
    only (measured here: < 0.01)."""
    ckpt = save_int4_checkpoint(family, tmp_path / "ckpt")
    runs = {}
    for name, size in (("resident", {"cache_frac": 1.0}), ("offloaded", {"cache_bytes": 6 * 1920})):
        model = tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "s", progress=False, **size)
        h = model.tensorbend
        assert h.layout.int4_slots and h.layout.nbytes == 1920  # 3 * 32 * 32 / 2 + 6 * 32 * 4
        assert h.layout.nbytes / (3 * 32 * 32 * 2) <= 0.34
        with torch.inference_mode():
            runs[name] = (_greedy(model, 16), model(IDS).logits)
        runs[name] += (h.cache.capacity, h.counters())
        h.close()
    spec_experts = runs["resident"][2]
    assert runs["offloaded"][2] == 6 < spec_experts
    assert torch.equal(runs["offloaded"][0], runs["resident"][0])
    assert torch.equal(runs["offloaded"][1], runs["resident"][1])
    assert runs["offloaded"][3]["totals"]["misses"] > runs["resident"][3]["totals"]["misses"]
    assert runs["offloaded"][3]["slot_dtype"] == "int4"
    ref = _transformers_int4(ckpt)
    want = _greedy(ref, 16)
    assert torch.equal(runs["offloaded"][0][0, :10], want[0, :10])  # the first 4 new tokens
    with torch.inference_mode():
        diff = (runs["offloaded"][1].float() - ref(IDS).logits.float()).abs().max().item()
    assert 0 < diff < 0.01


def test_int4_kernel_on_the_stores_packing_computes_the_dequantized_weights(tmp_path):
    """The known answer for the repacking: every expert's int4 slot, run through torch's int4
    kernel in float32, equals F.linear with compressed-tensors' dequantized weights of the same
    checkpoint within 1% of the output's largest value (the kernel rounds like bf16: measured
    ~0.1%), where the same slot with its rows' nibbles out of place is off by over 10%."""
    ckpt = save_int4_checkpoint("qwen3_moe", tmp_path / "ckpt")
    model = tensorbend.load_offloaded(
        ckpt, store_dir=tmp_path / "s", dtype="float32", progress=False
    )
    h = model.tensorbend
    ref = _transformers_int4(ckpt)
    spec = describe_model(ref)
    assert h.layout.int4_slots and h.layout.dtype == torch.float32
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    slot = torch.empty(h.layout.nbytes, dtype=torch.uint8)
    for m in range(spec.num_moe_layers):
        mod = getattr(moe_block(ref, spec, m), spec.experts_attr)
        for e in range(spec.num_experts):
            h.store.read_into(m, e, slot)
            W = h.layout.views(slot)
            for name, _ in h.layout.parts:
                want = torch.nn.functional.linear(x, getattr(mod, name)[e].float())
                err = (int4.int4_linear(x, W[name], 32) - want).abs().max() / want.abs().max()
                assert err < 0.01, (m, e, name, err)
                packed, sz = W[name]
                shifted = (packed.roll(1, dims=0), sz)  # (a control: each row another's nibbles)
                bad = (int4.int4_linear(x, shifted, 32) - want).abs().max() / want.abs().max()
                assert bad > 0.1, (m, e, name, bad)
    h.close()


def test_kimi_k2_model_type_serves_as_deepseek_v3(tmp_path):
    """config.json `model_type: kimi_k2` (Kimi-K2's, which transformers does not know) is read
    as DeepSeek-V3's config without remote code: the same tokens as the deepseek_v3 copy."""
    ckpt = save_int4_checkpoint("deepseek_v3", tmp_path / "ckpt")
    want = _greedy(_transformers_int4(ckpt))
    config = json.loads((ckpt / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.X"})
    (ckpt / "config.json").write_text(json.dumps(config))
    model = tensorbend.load_offloaded(
        ckpt, store_dir=tmp_path / "s", cache_frac=0.25, slots="dense", progress=False
    )
    assert torch.equal(_greedy(model), want)
    model.tensorbend.close()


def test_quantized_attention_and_dense_mlps_are_dequantized_as_transformers_does(tmp_path):
    """A checkpoint whose attention and dense MLP projections are int4 too (ignore: lm_head and
    the routers only): those weights are dequantized while the model loads, and the output
    equals transformers' dequantized model's."""
    ckpt = save_int4_checkpoint(
        "qwen3_moe", tmp_path / "ckpt", intermediate_size=64, ignore=["lm_head", "re:.*mlp\\.gate$"]
    )
    from safetensors import safe_open

    with safe_open(ckpt / "model.safetensors", "pt") as f:
        assert "model.layers.1.mlp.gate_proj.weight_packed" in f.keys()
        assert "model.layers.0.self_attn.q_proj.weight_packed" in f.keys()
    ref = _transformers_int4(ckpt)
    model = tensorbend.load_offloaded(
        ckpt, store_dir=tmp_path / "s", cache_frac=0.25, slots="dense", progress=False
    )
    assert torch.equal(_greedy(model), _greedy(ref))
    model.tensorbend.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_dtype_int4_of_a_float_checkpoint_is_what_compressed_tensors_writes(dtype, tmp_path):
    """--store-dtype int4 on a bf16 (and a float32) checkpoint: the store's experts are the
    bytes the compressed-tensors library writes for those weights (an int4 checkpoint written
    by it, served with dense slots, gives the same store file body), served in bf16 they give
    transformers' dequantized text of that int4 checkpoint, and the bf16 store of the same
    checkpoint holds 3.6x the bytes per expert."""
    plain = save_checkpoint("qwen3_moe", tmp_path / "plain", dtype=dtype, moe_intermediate_size=32)
    ct = save_int4_checkpoint("qwen3_moe", tmp_path / "ct")  # (the same seed and config)
    stores = {}
    for name, ckpt, kw in (("ours", plain, {"store_dtype": "int4"}), ("ct", ct, {})):
        model = tensorbend.load_offloaded(
            ckpt,
            store_dir=tmp_path / name,
            slots="dense",
            dtype="bf16",
            cache_frac=0.25,
            progress=False,
            **kw,
        )
        h = model.tensorbend
        stores[name] = [
            h.store.read_into(m, e, raw := torch.empty(1728, dtype=torch.uint8)) and raw.clone()
            for m in range(3)
            for e in range(8)
        ]
        if name == "ours":
            text = _greedy(model)
        h.close()
    if dtype == torch.bfloat16:  # (from float32 the scales are computed from float32 weights)
        assert all(torch.equal(a, b) for a, b in zip(stores["ours"], stores["ct"], strict=True))
        assert torch.equal(text, _greedy(_transformers_int4(ct)))
    bf16 = tensorbend.load_offloaded(plain, store_dir=tmp_path / "b", dtype="bf16", progress=False)
    assert bf16.tensorbend.store.expert_nbytes == 6144 and 6144 / 1728 > 3.5
    bf16.tensorbend.close()


def test_int4_store_rebuilt_when_the_kernels_packing_changes(tmp_path, monkeypatch, capsys):
    """A store in the kernel's packing records a probe of how this torch build packs nibbles;
    under another probe (another CPU's vector width) it is built again before serving."""
    ckpt = save_int4_checkpoint("qwen3_moe", tmp_path / "ckpt")
    load = dict(store_dir=tmp_path / "s", cache_frac=0.25, progress=True)
    tensorbend.load_offloaded(ckpt, **load).tensorbend.close()
    capsys.readouterr()
    tensorbend.load_offloaded(ckpt, **load).tensorbend.close()
    assert "building it again" not in capsys.readouterr().err
    monkeypatch.setattr(int4, "cpu_probe", lambda: "another-layout")
    model = tensorbend.load_offloaded(ckpt, **load)
    assert "building it again" in capsys.readouterr().err
    assert model.tensorbend.store.meta["int4_cpu_probe"] == "another-layout"
    model.tensorbend.close()


@pytest.mark.parametrize(
    "weights, found",
    [
        (
            {
                "num_bits": 4,
                "type": "int",
                "symmetric": False,
                "strategy": "group",
                "group_size": 32,
            },
            "asymmetric int4 group 32",
        ),
        (
            {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "actorder": "weight",
            },
            "symmetric int4 group 32, act-order weight",
        ),
        (
            {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
            "symmetric float8 channel",
        ),
        (
            {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 16,
            },
            "symmetric int4 group 16",
        ),
    ],
)
def test_other_compressed_tensors_schemes_refused_in_one_line(weights, found, tmp_path, capsys):
    from tensorbend.cli import main

    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }
    (ckpt / "config.json").write_text(json.dumps(config))
    msg = (
        f"compressed-tensors config group group_0: {found} is not supported yet; expected "
        f"{int4.SERVED}, group size 32, 64, 128 or 256"
    )
    with pytest.raises(tensorbend.TensorbendError) as e:
        tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "s", progress=False)
    assert str(e.value) == msg
    capsys.readouterr()
    assert main(["generate", "--model", str(ckpt), "--prompt", "ab", "--quiet"]) == 2
    assert capsys.readouterr().err == f"error: {msg}\n"


def test_int4_options_that_do_not_apply_are_refused_in_one_line(tmp_path):
    from tiny_models import save_fp8_checkpoint

    fp8 = save_fp8_checkpoint("qwen3_moe", tmp_path / "fp8", block=16)
    plain = save_checkpoint("qwen3_moe", tmp_path / "plain")
    cases = [
        (
            fp8,
            {"store_dtype": "int4"},
            "--store-dtype int4: expected an unquantized checkpoint, "
            "found experts stored in float8_e4m3fn (16x16 blocks), which are served in their own "
            "format; drop --store-dtype",
        ),
        (
            plain,
            {"slots": "int4"},
            "--slots int4: expected an int4 store (a compressed-tensors "
            "int4 checkpoint, or --store-dtype int4), found none; add --store-dtype int4 or drop "
            "--slots",
        ),
        (
            plain,
            {"store_dtype": "int4"},
            "int4 experts: part down_proj of shape [32, 16]: "
            "expected a 2-D weight [N, K] with K a multiple of the group size 32 and N a multiple "
            "of 16 (the int4 kernel's); serve it with --slots dense or without --store-dtype int4",
        ),
    ]
    for ckpt, kw, msg in cases:
        with pytest.raises(tensorbend.TensorbendError) as e:
            tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "s", progress=False, **kw)
        assert str(e.value) == msg
    assert not (tmp_path / "s").exists()  # refused before a store is built


def test_generate_cli_states_int4_store_and_slots(tmp_path, capsys):
    """`tensorbend generate` on an int4 checkpoint: the summary line says how experts are
    stored and cached, --json says it too, and its bytes per token are whole stored experts."""
    from tensorbend.cli import main

    ckpt = save_int4_checkpoint("qwen3_moe", tmp_path / "ckpt")
    assert (
        main(
            [
                "generate",
                "--model",
                str(ckpt),
                "--prompt",
                "river stone",
                "--max-new-tokens",
                "8",
                "--store-dir",
                str(tmp_path / "s"),
                "--cache-frac",
                "0.25",
                "--quiet",
                "--json",
                str(tmp_path / "s.json"),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert (
        "experts stored in int4 (compressed-tensors pack-quantized, a bf16 scale per 32), "
        "computed in bfloat16 from int4 slots (torch's int4 kernel)"
    ) in err
    s = json.loads((tmp_path / "s.json").read_text())
    assert (s["slot_dtype"], s["expert_stored_bytes"], s["expert_bytes"]) == ("int4", 1728, 1920)
    read = s["bytes_read_per_token"] * s["decode_tokens"]
    assert read > 0 and abs(read / 1728 - round(read / 1728)) < 1e-6
