"""One home each: sizes, devices, the minimum cache, a store's identity, each with its one
message (the exact text is tested here once; other tests match a part of it)."""

from __future__ import annotations

import pytest
import torch

from tensorbend.cache.config import PolicyConfig, check_slots, min_slots
from tensorbend.errors import StoreError, TensorbendError
from tensorbend.memory import check_device, kv_bytes_per_token, parse_bytes
from tensorbend.offload.layout import ExpertLayout
from tensorbend.offload.store import ExpertStore, write_store


def test_sizes_parse_and_bad_ones_name_their_flag():
    assert parse_bytes("8GB") == 8 * 10**9 and parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1000B") == 1000 and parse_bytes(" 1.5kb ") == 1500 and parse_bytes(7) == 7
    assert parse_bytes(1.5e9) == 1_500_000_000  # a Python number is bytes, if whole
    with pytest.raises(TensorbendError) as e:
        parse_bytes("8XB", "--reserve")
    assert str(e.value) == "--reserve '8XB': expected a size such as 8GB, 512MB, 4GiB or 1000B"
    with pytest.raises(TensorbendError) as e:  # bytes or megabytes? the user says which
        parse_bytes("100")
    assert str(e.value) == (
        "--max-memory '100': expected a size with a unit, found a bare number; write 100GB, "
        "100MiB, or 100B for bytes"
    )
    with pytest.raises(TensorbendError) as e:
        parse_bytes(1.5)
    assert str(e.value) == (
        "--max-memory 1.5: expected a size such as '8GB' or a whole number of bytes, found float"
    )
    for bad in ("0", "-1GB", "nan"):
        with pytest.raises(TensorbendError) as e:
            parse_bytes(bad)
        assert str(e.value) == (
            f"--max-memory {bad!r}: expected a finite size of at least one byte, such as 8GB"
        )


def test_device_check_one_message_each():
    check_device("cpu")
    for bad in ("gpu", "cuda1", "cuda:x"):
        with pytest.raises(TensorbendError) as e:
            check_device(bad)
        assert str(e.value) == f"--device {bad!r}: expected cpu, cuda or cuda:N"
    if not torch.cuda.is_available():
        with pytest.raises(TensorbendError) as e:
            check_device("cuda:1")
        assert str(e.value) == (
            f"--device cuda:1: expected a CUDA device, found none (torch {torch.__version__}); "
            "use --device cpu"
        )


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer():
    from transformers import Qwen3MoeConfig

    c = Qwen3MoeConfig(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, hidden_size=32)  # fmt: skip
    assert kv_bytes_per_token(c, torch.float16) == 3 * 2 * (8 + 8) * 2


def test_minimum_slots_one_rule_one_message():
    from tensorbend.models import RoutingSpec

    assert (
        min_slots(2, 4, "global"),
        min_slots(2, 4, "per_layer"),
        min_slots(8, 4, "per_layer"),
    ) == (2, 4, 8)
    with pytest.raises(TensorbendError) as e:
        check_slots(3, "--cache-frac 0.1 of 32 experts", 2, 4, "per_layer")
    assert str(e.value) == (
        "--cache-frac 0.1 of 32 experts gives 3 cache slots: expected at least 4 (top_k and one "
        "per MoE layer for --pool per_layer); raise the cache size"
    )
    spec = RoutingSpec(family="qwen3_moe", router_kind="softmax", num_experts=8, top_k=2,
                       hidden_size=16, num_decoder_layers=4, moe_layer_ids=(0, 1, 2, 3))  # fmt: skip
    # a byte budget becomes slots here, once: whole experts, at most every routed one
    assert PolicyConfig(cache_bytes=5 * 100 - 1).slots(spec, 100) == 4
    assert PolicyConfig(cache_bytes=10**9).slots(spec, 100) == 32
    with pytest.raises(TensorbendError, match="--cache-bytes 199 .* gives 1 cache slots"):
        PolicyConfig(cache_bytes=199).slots(spec, 100)


def test_store_identity_one_check_one_message(tmp_path):
    mods = [torch.nn.Module() for _ in range(2)]
    for m in mods:
        m.gate_up_proj = torch.nn.Parameter(torch.zeros(3, 4, 2))
        m.down_proj = torch.nn.Parameter(torch.zeros(3, 2, 2))
    layout = ExpertLayout.of(mods[0])
    path = write_store(mods, layout, tmp_path / "s.safetensors", {"fingerprint": "abc"})
    store = ExpertStore.open(path)
    store.check({"fingerprint": "abc"}, 2, 3, layout)  # this model's: no error
    with pytest.raises(StoreError) as e:
        store.check({"fingerprint": "xyz"}, 2, 4, layout)
    assert str(e.value) == (
        f"expert store {path}: expected fingerprint xyz, experts 2 x 4 (this model, "
        "torch.float32), found fingerprint abc, experts 2 x 3: it was built for another model, "
        "checkpoint or dtype; delete it or pass another --store-dir"
    )
