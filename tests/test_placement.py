"""Models larger than memory: collection through transformers + accelerate placement
(`--max-memory`, layers spilled to disk) records exactly the trace of a resident run."""

import inspect
from pathlib import Path

import pytest
import torch

from tensorbend.capture.collect import CollectConfig, collect
from tensorbend.capture.hf import DecodeConfig, load_model
from tensorbend.capture.placement import _Realigned
from tensorbend.capture.trace import Trace

pytest.importorskip("accelerate")

FEATURES = ("ids", "weights", "logits", "gate_input", "layer_input")


def _model_bytes() -> int:
    model, _ = load_model("zoo:default")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_model_spilled_to_disk_gives_the_resident_trace(tmp_path, monkeypatch):
    """The spilled collection really ran from disk: the model it loaded maps decoder layers to
    "disk", holds their parameters on `meta` (accelerate streams them in per forward) and at
    least the bytes that do not fit the budget there, with files in the offload folder; its
    trace equals the resident one bit for bit."""
    import tensorbend.capture.collect as collect_mod

    total = _model_bytes()
    budget = int(total * 0.4)  # less than half the model fits: most layers on disk
    loaded = []
    load = collect_mod.load_model

    def spying(*args, **kwargs):
        model, tok = load(*args, **kwargs)
        given = inspect.signature(load).bind(*args, **kwargs).arguments
        if given.get("max_memory") is not None:  # the spilled run
            files = sorted(p.name for p in Path(given["offload_dir"]).iterdir())
            loaded.append((dict(model.hf_device_map), dict(model.named_parameters()), files))
        return model, tok

    monkeypatch.setattr(collect_mod, "load_model", spying)
    runs = {}
    for name, mem in (("resident", None), ("spilled", f"{budget}B")):
        cfg = CollectConfig(model="zoo:default", out=tmp_path / name, max_prompts=3,
                            features=FEATURES, dtype="float32", max_memory=mem,
                            decode=DecodeConfig(max_new_tokens=5))  # fmt: skip
        collect(cfg, progress=False)
        runs[name] = Trace.open(tmp_path / name)
    a, b = runs["resident"], runs["spilled"]
    assert a.manifest["model"]["fingerprint"] == b.manifest["model"]["fingerprint"]
    ra, rb = a.load(FEATURES), b.load(FEATURES)
    assert ra.keys() == rb.keys() and ra["expert_ids_TLK"].shape[0] > 0
    for k in ra:  # bit for bit, hidden states and logits included
        assert torch.equal(ra[k], rb[k]), k
    pa, pb = a.router_params(), b.router_params()
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not (tmp_path / "spilled" / ".offload").exists()  # the default offload dir is removed
    [(device_map, params, files)] = loaded
    assert "disk" in device_map.values() and "cpu" in device_map.values(), device_map
    on_disk = [m for m, where in device_map.items() if where == "disk"]
    assert any(m.startswith("model.layers.") for m in on_disk), device_map
    for name, p in params.items():
        if any(name.startswith(m + ".") for m in on_disk):
            assert p.device.type == "meta", name
    meta_bytes = sum(p.numel() * p.element_size() for p in params.values() if p.is_meta)
    assert sum(p.numel() * p.element_size() for p in params.values()) == total
    assert total - budget <= meta_bytes < total  # what does not fit the budget is not in memory
    assert any(f.endswith(".safetensors") for f in files), files


def test_only_weights_from_the_offload_folder_are_realigned(tmp_path):
    """accelerate's loader is stood in for by a dict with its `index` (the real one needs a
    dispatched model; the end-to-end test above covers it)."""

    class Loader(dict):
        index = {"moved": {"safetensors_file": str(tmp_path / "off" / "w.safetensors")},
                 "kept": {"safetensors_file": str(tmp_path / "model.safetensors")}}  # fmt: skip

    buf = torch.zeros(4 * 64 + 8, dtype=torch.uint8)
    unaligned = buf[8:].view(torch.float32)  # 8 bytes past a 64-byte boundary
    unaligned.copy_(torch.arange(64.0))
    m = _Realigned(Loader(moved=unaligned, kept=unaligned), (tmp_path / "off").resolve())
    assert unaligned.data_ptr() % 64 == 8
    assert m["moved"].data_ptr() % 64 == 0 and torch.equal(m["moved"], unaligned)
    assert m["kept"] is unaligned  # as the resident model maps it from the checkpoint
    assert sorted(m) == ["kept", "moved"] and len(m) == 2 and "kept" in m.index
