"""Expert store: byte-exact round trip, standard safetensors, clear errors for broken files."""

import os

import pytest
import torch
from safetensors import safe_open
from tiny_models import build

from tensorbend.cache.transfers import Link, parse_link, real_link
from tensorbend.errors import StoreError
from tensorbend.models import describe_model, moe_block
from tensorbend.offload.blocks import aligned_empty, stride
from tensorbend.offload.layout import ExpertLayout
from tensorbend.offload.store import ExpertStore, StoreConfig, write_store


def _experts(family):
    model = build(family)
    spec = describe_model(model)
    return [
        getattr(moe_block(model, spec, m), spec.experts_attr) for m in range(spec.num_moe_layers)
    ]


@pytest.fixture(scope="module")
def ds_store(tmp_path_factory):
    experts = _experts("deepseek_v3")
    layout = ExpertLayout.of(experts[0])
    path = tmp_path_factory.mktemp("store") / "experts.safetensors"
    write_store(experts, layout, path, {"fingerprint": "abc"})
    return experts, layout, path


@pytest.mark.parametrize("io", ["buffered", "fadvise"])
def test_round_trip_is_byte_exact(ds_store, io):
    experts, layout, path = ds_store
    store = ExpertStore.open(path, StoreConfig(io))
    assert store.meta["fingerprint"] == "abc" and store.num_layers == len(experts)
    flat = torch.empty(layout.numel, dtype=layout.dtype)
    for m, mod in enumerate(experts):
        for e in (0, 5, mod.gate_up_proj.shape[0] - 1):
            assert store.read_into(m, e, flat) == layout.nbytes
            for name, part in layout.views(flat).items():
                assert torch.equal(part, getattr(mod, name)[e]), (m, e, name)
    store.close()


def test_store_is_standard_safetensors_one_tensor_per_expert(ds_store):
    experts, layout, path = ds_store
    E = experts[0].gate_up_proj.shape[0]
    with safe_open(str(path), "pt") as f:
        keys = list(f.keys())
        assert len([k for k in keys if ".experts." in k]) == len(experts) * E
        t = f.get_tensor("layers.001.experts.0003")
        pads = [f.get_tensor(k) for k in keys if k.startswith("pad.")]
    assert t.shape == (layout.numel,)
    assert torch.equal(layout.views(t)["down_proj"], experts[1].down_proj[3])
    assert layout.nbytes % 4096 != 0  # (else no pads: the padding below would be untested)
    assert len(pads) == len(experts) * E
    assert all(p.numel() == stride(layout.nbytes) - layout.nbytes and not p.any() for p in pads)


def test_every_expert_starts_on_a_4096_byte_boundary(ds_store):
    experts, layout, path = ds_store
    store = ExpertStore.open(path)
    E = store.num_experts
    starts = [store._data_start + store._offsets[f"layers.{m:03d}.experts.{e:04d}"][0]
              for m in range(store.num_layers) for e in range(E)]  # fmt: skip
    store.close()
    assert store._data_start % 4096 == 0 and all(s % 4096 == 0 for s in starts)
    assert starts[1] - starts[0] == stride(layout.nbytes)


def test_gpt_oss_layout_keeps_biases():
    layout = ExpertLayout.of(_experts("gpt_oss")[0])
    assert [n for n, _ in layout.parts] == [
        "gate_up_proj",
        "gate_up_proj_bias",
        "down_proj",
        "down_proj_bias",
    ]


def test_truncated_store_is_a_clear_error_naming_the_file(ds_store, tmp_path):
    _, layout, path = ds_store
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(StoreError, match=rf"{bad}.* is truncated: expected \d+ bytes, found \d+"):
        ExpertStore.open(bad)


def test_file_cut_after_open_is_a_clear_error_naming_the_file(ds_store, tmp_path):
    _, layout, path = ds_store
    bad = tmp_path / "shrinks.safetensors"
    bad.write_bytes(path.read_bytes())
    store = ExpertStore.open(bad)
    os.truncate(bad, bad.stat().st_size - layout.nbytes // 2)
    flat = torch.empty(layout.numel, dtype=layout.dtype)
    last = store.num_experts - 1
    with pytest.raises(
        StoreError, match=rf"{bad}: short read of layer {store.num_layers - 1} expert {last}"
    ):
        store.read_into(store.num_layers - 1, last, flat)
    store.close()


def test_not_a_store_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}   ")
    with pytest.raises(StoreError, match=rf"{bad}: expected a tensorbend store"):
        ExpertStore.open(bad)
    with pytest.raises(StoreError, match="unreadable header"):
        ExpertStore.open(tmp_path / "missing.safetensors")


def test_direct_io_reads_the_same_bytes_or_says_how_to_fix(ds_store):
    """Into an aligned slot the read is no copy (no bounce), into a misaligned one it bounces;
    both give the expert's exact bytes, and nothing is written past the slot."""
    experts, layout, path = ds_store
    try:
        store = ExpertStore.open(path, StoreConfig("direct"))
    except StoreError as e:  # e.g. tmpfs has no O_DIRECT: nothing was read, so nothing is tested
        assert "try --io fadvise" in str(e)
        pytest.skip(f"this filesystem refuses O_DIRECT, so direct reads cannot run here: {e}")
    pool = aligned_empty(3, layout.numel, layout.dtype).fill_(7.0)
    misaligned = torch.empty(layout.numel + 1, dtype=layout.dtype)[1:]
    assert misaligned.data_ptr() % 4096 != 0
    for m, e in ((1, 2), (0, 0), (store.num_layers - 1, store.num_experts - 1)):
        store.read_into(m, e, pool[1])
        assert store.bounced_reads == 0, "an aligned slot went through the bounce buffer"
        for name, part in layout.views(pool[1]).items():
            assert torch.equal(part, getattr(experts[m], name)[e]), (m, e, name)
        assert (pool[0] == 7).all() and (pool[2] == 7).all()  # its neighbours untouched
    store.read_into(1, 2, misaligned)
    assert store.bounced_reads == 1
    assert torch.equal(layout.views(misaligned)["gate_up_proj"], experts[1].gate_up_proj[2])
    store.close()


def test_a_paused_direct_read_goes_in_parts_and_reads_the_same_bytes(tmp_path, monkeypatch):
    """A prefetch's direct read (a `pause` given) reads PAUSE_CHUNK bytes at a time (one block
    here) and calls `pause` between parts: ceil(whole blocks / part) - 1 times, the bytes
    equal to the expert's (experts of 48 KB + a partial block: 13 parts)."""
    from tensorbend.offload import blocks

    model = build("deepseek_v3", moe_intermediate_size=130)
    spec = describe_model(model)
    experts = [getattr(moe_block(model, spec, m), spec.experts_attr)
               for m in range(spec.num_moe_layers)]  # fmt: skip
    layout = ExpertLayout.of(experts[0])
    path = write_store(experts, layout, tmp_path / "experts.safetensors", {"fingerprint": "t"})
    monkeypatch.setattr(blocks, "PAUSE_CHUNK", 4096)
    try:
        store = ExpertStore.open(path, StoreConfig("direct"))
    except StoreError as e:
        pytest.skip(f"this filesystem refuses O_DIRECT, so direct reads cannot run here: {e}")
    slot = aligned_empty(1, layout.numel, layout.dtype)[0]
    calls = []
    assert store.read_into(1, 2, slot, pause=lambda: calls.append(1)) == layout.nbytes
    body = layout.nbytes - layout.nbytes % 4096
    assert len(calls) == -(-body // 4096) - 1 > 1
    for name, part in layout.views(slot).items():
        assert torch.equal(part, getattr(experts[1], name)[2]), name
    store.close()


def test_a_store_of_the_old_format_is_refused_with_how_to_fix(ds_store, tmp_path):
    _, layout, path = ds_store
    old = tmp_path / "old.safetensors"
    blob = path.read_bytes().replace(b'"format_version": "2"', b'"format_version": "1"', 1)
    old.write_bytes(blob)
    with pytest.raises(StoreError, match=r"format_version 2\), found a store of format_version 1"
                       r".*delete it and rerun to rebuild it"):  # fmt: skip
        ExpertStore.open(old)


def test_link_speedup_scales_bandwidth_and_latency():
    fast = parse_link("40MB/s,20us", 1e-3, 1000, speedup=4)
    assert fast.bandwidth_Bps == 160e6 and fast.latency_s == pytest.approx(5e-6)
    assert fast.name == "40mb/s,20us x4"
    real, real4 = real_link(1e-3, 98_304), parse_link("h100-pcie5-kimi", 1e-3, 98_304, 4)
    assert real4.seconds(98_304) == pytest.approx(real.seconds(98_304) / 4)


def test_link_parsing_and_real_ratio():
    link = parse_link("40MB/s,20us", layer_s=1e-3, expert_bytes=1000)
    assert link.bandwidth_Bps == 40e6 and link.latency_s == pytest.approx(20e-6)
    assert link.seconds(40_000) == pytest.approx(1e-3 + 20e-6)
    assert parse_link("none", 1e-3, 1000) == Link()
    real = real_link(layer_s=1e-3, expert_bytes=98_304)
    # one expert transfer takes the real system's ratio (~2.3) of a resident MoE layer
    assert 2.0 < real.seconds(98_304) / 1e-3 < 2.6
    with pytest.raises(StoreError, match="expected none, h100-pcie5-kimi, or BANDWIDTH"):
        parse_link("fast", 1e-3, 1000)
