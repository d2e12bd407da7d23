"""The expert store under real use: concurrent builds, edited checkpoints, full or unwritable
disks, one location setting, `tensorbend store list / rm`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tiny_models import save_checkpoint

_SERVE = textwrap.dedent("""
    import sys, time, torch, tensorbend, tensorbend.serving as serving
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
