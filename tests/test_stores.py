"""The expert store under real use: concurrent builds, edited checkpoints, full or unwritable
disks, one location setting, `tensorbend store list / rm`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from tiny_models import save_checkpoint
from transformers import AutoModelForCausalLM

import tensorbend
from tensorbend.cli import main
from tensorbend.models import describe_model, moe_block
from tensorbend.offload.blocks import stride
from tensorbend.offload.shards import Checkpoint
from tensorbend.serving.model_build import build_without_experts

_SERVE = textwrap.dedent("""
    import sys, time, torch, tensorbend, tensorbend.serving.stores as serving
    real = serving.build_store
    def counted(*a, **k):  # (slow, so that the other process arrives while this one builds)
        with open(sys.argv[3], "a") as f:
            f.write("build\\n")
        time.sleep(2)
        return real(*a, **k)
    serving.build_store = counted
    model = tensorbend.load_offloaded(sys.argv[1], store_dir=sys.argv[2], cache_frac=0.3,
                                      progress=False)
    ids = torch.tensor([[5, 17, 33, 2, 40, 8]])
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=1)
    print(out.tolist())
    model.tensorbend.close()
""")


def test_two_processes_building_one_store_both_serve_and_one_builds(tmp_path):
    """Two real processes load the same checkpoint at once into the same store root: both
    succeed with the same tokens, the store is built once (the second waits on the lock)."""
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    script, builds = tmp_path / "serve.py", tmp_path / "builds.txt"
    script.write_text(_SERVE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, str(script), str(ckpt), str(tmp_path / "stores"), str(builds)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    assert outs[0][0] == outs[1][0] and outs[0][0].startswith("[[5, 17, 33, 2, 40, 8, ")
    assert builds.read_text() == "build\n"


def _experts_of(model, spec, layout):
    return {(m, e): torch.cat([getattr(mod, n)[e].detach().reshape(-1) for n, _ in layout.parts])
            for m in range(spec.num_moe_layers)
            for mod in [getattr(moe_block(model, spec, m), spec.experts_attr)]
            for e in range(spec.num_experts)}  # fmt: skip


def _store_experts(handle, spec):
    out = {}
    for m in range(spec.num_moe_layers):
        for e in range(spec.num_experts):
            out[m, e] = torch.empty(handle.layout.numel, dtype=handle.layout.dtype)
            handle.store.read_into(m, e, out[m, e])
    return out


def test_expert_edited_in_place_is_never_served_stale(tmp_path):
    """One expert weight changed in place (same header, same size): the next load serves the
    new bytes (store rebuilt; its experts and greedy tokens follow the edited checkpoint); a
    touched but unchanged shard is re-hashed, not rebuilt."""
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    kw = dict(store_dir=tmp_path / "stores", cache_frac=0.3, progress=False)
    model = tensorbend.load_offloaded(ckpt, **kw)
    store = model.tensorbend.store.path
    model.tensorbend.close()
    ref = next(r for k, r in Checkpoint.open(ckpt).refs.items() if ".experts." in k)
    with open(ref.shard, "r+b") as f:  # (flip the sign of the tensor's first 8 values)
        f.seek(ref.start)
        vals = torch.frombuffer(bytearray(f.read(32)), dtype=torch.float32)
        f.seek(ref.start)
        f.write((-vals - 1).numpy().tobytes())
    resident = AutoModelForCausalLM.from_pretrained(ckpt, experts_implementation="eager").eval()
    spec = describe_model(resident)
    model = tensorbend.load_offloaded(ckpt, **kw)
    got = _store_experts(model.tensorbend, spec)
    want = _experts_of(resident, spec, model.tensorbend.layout)
    assert all(torch.equal(got[k], want[k]) for k in want)
    ids = torch.tensor([[5, 17, 33, 2, 40, 8]])
    with torch.inference_mode():
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=1),
                           resident.generate(ids, max_new_tokens=6, do_sample=False,
                                             pad_token_id=1))  # fmt: skip
    model.tensorbend.close()
    built = store.stat().st_ino
    os.utime(ref.shard)  # (a new mtime, the same bytes)
    tensorbend.load_offloaded(ckpt, **kw).tensorbend.close()
    assert store.stat().st_ino == built


def test_an_edit_whose_mtime_was_put_back_is_never_served(tmp_path):
    """An expert scaled in place and the shard's mtime restored (as `touch -r`, `cp -p`,
    `rsync -a` or `tar` leave it): the next load still sees the change (the shard's change
    time moved), rebuilds the store and serves the edited experts."""
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    kw = dict(store_dir=tmp_path / "stores", cache_frac=0.3, progress=False)
    model = tensorbend.load_offloaded(ckpt, **kw)
    store = model.tensorbend.store.path
    model.tensorbend.close()
    built = store.stat().st_ino
    ref = next(r for k, r in Checkpoint.open(ckpt).refs.items() if ".experts." in k)
    st = os.stat(ref.shard)
    with open(ref.shard, "r+b") as f:  # (double the tensor's first 8 values)
        f.seek(ref.start)
        vals = torch.frombuffer(bytearray(f.read(32)), dtype=torch.float32)
        f.seek(ref.start)
        f.write((vals * 2).numpy().tobytes())
    os.utime(ref.shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # (the mtime put back)
    assert (os.stat(ref.shard).st_size, os.stat(ref.shard).st_mtime_ns) == (
        st.st_size,
        st.st_mtime_ns,
    )
    resident = AutoModelForCausalLM.from_pretrained(ckpt, experts_implementation="eager").eval()
    spec = describe_model(resident)
    model = tensorbend.load_offloaded(ckpt, **kw)
    assert store.stat().st_ino != built  # (rebuilt)
    got = _store_experts(model.tensorbend, spec)
    want = _experts_of(resident, spec, model.tensorbend.layout)
    model.tensorbend.close()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_symlink_to_a_checkpoint_shares_its_store(tmp_path):
    """The README's `ln -s` recipe: loading through the link reuses the store the real path
    built (one folder under the root, the store file not rebuilt)."""
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    link = tmp_path / "my-moe-checkpoint"
    link.symlink_to(ckpt)
    kw = dict(store_dir=tmp_path / "stores", cache_frac=0.3, progress=False)
    model = tensorbend.load_offloaded(ckpt, **kw)
    store = model.tensorbend.store.path
    model.tensorbend.close()
    built = store.stat().st_ino
    model = tensorbend.load_offloaded(link, **kw)
    assert model.tensorbend.store.path == store and store.stat().st_ino == built
    model.tensorbend.close()
    assert [p.name for p in (tmp_path / "stores").iterdir()] == [store.parent.name]


def test_budget_disk_space_and_unwritable_root_refused_before_a_byte(tmp_path, monkeypatch, capsys):
    """A budget too small, a disk too full and a store root that cannot be a folder are each
    one line, before anything is written; the disk message gives the size and the place."""
    import shutil

    import tensorbend.serving.stores as stores

    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    root = tmp_path / "stores"
    capsys.readouterr()

    def err(*argv):
        assert main(["generate", "--model", str(ckpt), "--prompt", "ab", "--quiet", *argv]) == 2
        out = capsys.readouterr().err.strip()
        assert out.startswith("error: ") and "\n" not in out and "Traceback" not in out
        return out

    assert "expected at least" in err("--store-dir", str(root), "--max-memory", "10KB")
    assert not root.exists()  # (the budget is checked before the store's folder is made)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(stores.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    msg = err("--store-dir", str(root))
    lm, spec, layout = build_without_experts(ckpt, torch.float32)
    nbytes = spec.num_moe_layers * spec.num_experts * stride(layout.nbytes)  # (+ its header)
    mb = float(re.search(r"needs ([\d.]+) MB, its disk has 0.0 MB free", msg).group(1))
    assert nbytes / 1e6 < mb < nbytes / 1e6 + 1 and str(root) in msg and "--store-dir" in msg
    assert not [p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    monkeypatch.undo()
    (tmp_path / "file").write_text("")
    assert "pass --store-dir DIR" in err("--store-dir", str(tmp_path / "file" / "stores"))


def test_store_dir_flag_and_env_var_are_one_root(tmp_path, monkeypatch, capsys):
    """--store-dir and $TENSORBEND_STORE_DIR both name a root with one folder per checkpoint:
    two checkpoints under one --store-dir get two stores, and the env var finds the same one
    (reused, not built again)."""
    a, b = (save_checkpoint("qwen3_moe", tmp_path / n, seed=s) for n, s in (("a", 0), ("b", 1)))
    root = tmp_path / "stores"
    gen = ["generate", "--prompt", "ab", "--quiet", "--max-new-tokens", "2"]
    for ckpt in (a, b):
        assert main([*gen, "--model", str(ckpt), "--store-dir", str(root)]) == 0
    stores = sorted(root.glob("*/experts-float32.safetensors"))
    assert [p.parent.name.split("-")[0] for p in stores] == ["a", "b"]
    built = {p: p.stat().st_ino for p in stores}
    monkeypatch.setenv("TENSORBEND_STORE_DIR", str(root))
    assert main([*gen, "--model", str(a)]) == 0
    assert {p: p.stat().st_ino for p in root.glob("*/experts-float32.safetensors")} == built


def test_store_list_and_rm(tmp_path, monkeypatch, capsys):
    """`store list` shows each store's checkpoint, dtype, size and build time, and an
    interrupted build with its layers done; `store rm CHECKPOINT` removes that checkpoint's
    folder only; `store rm --partial` removes interrupted builds; bad targets are one line."""
    import pytest

    from tensorbend.offload.expert_plan import ExpertPlan

    a, b, c = (save_checkpoint("qwen3_moe", tmp_path / n, seed=i) for i, n in enumerate("abc"))
    root = tmp_path / "stores"
    kw = dict(store_dir=root, cache_frac=0.3, progress=False)
    for ckpt in (a, b):
        tensorbend.load_offloaded(ckpt, **kw).tensorbend.close()
    real = ExpertPlan.expert_into

    def killed(self, m, e, out, staging=None):
        if m == 1:
            raise KeyboardInterrupt  # (killed while layer 1 was being written)
        return real(self, m, e, out, staging)

    monkeypatch.setattr(ExpertPlan, "expert_into", killed)
    with pytest.raises(KeyboardInterrupt):
        tensorbend.load_offloaded(c, **kw)
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["store", "list", "--store-dir", str(root), "--json"]) == 0
    listed = {Path(s["checkpoint"]).name: s for s in json.loads(capsys.readouterr().out)}
    assert sorted(listed) == ["a", "b", "c"]
    for name in "ab":
        s = listed[name]
        assert s["checkpoint"] == str(tmp_path / name) and s["dtype"] == "float32"
        assert s["bytes"] == Path(s["store"]).stat().st_size and s["partial"] is None
        assert s["built"].startswith(time.strftime("%Y-"))
    assert listed["c"]["built"] is None and listed["c"]["partial"].startswith("1 of ")
    assert main(["store", "list", "--store-dir", str(root)]) == 0
    table = capsys.readouterr().out
    assert "3 expert store(s)" in table and "interrupted (1 of " in table
    assert main(["store", "rm", str(a), "--store-dir", str(root)]) == 0
    assert not Path(listed["a"]["store"]).parent.exists() and Path(listed["b"]["store"]).exists()
    assert main(["store", "rm", "--partial", "--store-dir", str(root)]) == 0
    assert f"removed {listed['c']['store']}" in capsys.readouterr().out
    assert not Path(listed["c"]["store"]).exists() and Path(listed["b"]["store"]).exists()
    for argv in (["store", "rm", str(a)], ["store", "rm"], ["store", "rm", str(b), "--partial"]):
        assert main([*argv, "--store-dir", str(root)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err
    assert Path(listed["b"]["store"]).exists()


def test_interrupt_message_names_real_flags(monkeypatch, capsys):
    """Ctrl-C: generate's message says a rerun continues its store (generate has no --resume);
    collect's names its --resume; exit code 130 for both."""
    import tensorbend.capture.collect
    import tensorbend.serving.generate

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(tensorbend.serving.generate, "generate", interrupted)
    monkeypatch.setattr(tensorbend.capture.collect, "collect", interrupted)
    assert main(["generate", "--model", "x", "--prompt", "ab", "--quiet"]) == 130
    err = capsys.readouterr().err
    assert "--resume" not in err and "rerun to continue it" in err
    assert main(["collect", "--model", "x", "--out", "y", "--quiet"]) == 130
    assert "rerun with --resume" in capsys.readouterr().err
