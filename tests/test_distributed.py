"""torchrun with 2 CPU processes (gloo). Data-parallel collection: each rank collects its own
block of the prompts, together the same trace content as a single-process collection, and a
killed rank resumes losing nothing. Training over ranks: each rank fits its own target layers
(logged per rank), together the same checkpoint bytes as one process."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_models import save_checkpoint, write_prompts

from tensorbend.capture.collect import CollectConfig, collect
from tensorbend.capture.hf import DecodeConfig
from tensorbend.capture.trace import Trace
from tensorbend.cli import main

FEATURES = ("ids", "gate_input", "layer_input")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    save_checkpoint("deepseek_v3", d / "model")
    write_prompts(d / "prompts.jsonl", n=9)
    collect(CollectConfig(model=str(d / "model"), out=d / "ref", prompts=d / "prompts.jsonl",
                          features=FEATURES, decode=DecodeConfig(max_new_tokens=4)),
            progress=False)  # fmt: skip
    return d


def _torchrun(d: Path, out: Path, *extra, slow: float = 0.0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tensorbend", "collect", "--model", str(d / "model"), "--out", str(out),
           "--prompts", str(d / "prompts.jsonl"), "--max-new-tokens", "4", "--quiet",
           "--features", *FEATURES, *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TENSORBEND_TEST_SLOW_PROMPT_S": str(slow)}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def _split_in_two_blocks(d: Path, out: Path) -> None:
    """Each rank collected its own contiguous block of the 9 prompts (5, then 4), every one
    with rows: the work was split, not done twice or by one rank."""
    ids = [p["id"] for p in Trace.open(d / "ref").prompts]
    assert len(ids) == 9
    assert _done(out / "rank-000") == ids[:5] and _done(out / "rank-001") == ids[5:]
    for r in ("rank-000", "rank-001"):
        records = json.loads((out / r / "manifest.json").read_text())["prompts"]
        assert all(p["prefill"] > 0 and p["decode"] > 0 for p in records), r


def _same_as_reference(d: Path, out: Path) -> None:
    ref, got = Trace.open(d / "ref"), Trace.open(out)
    assert [p["id"] for p in got.prompts] == [p["id"] for p in ref.prompts]
    assert got.info()["complete"] and got.manifest["ranks"] == ["rank-000", "rank-001"]
    a, b = ref.load(FEATURES), got.load(FEATURES)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_two_ranks_collect_what_one_process_collects(setup):
    p = _torchrun(setup, setup / "two")
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    _same_as_reference(setup, setup / "two")
    _split_in_two_blocks(setup, setup / "two")


def test_a_killed_rank_resumes_losing_and_duplicating_nothing(setup):
    out = setup / "killed"
    p = _torchrun(setup, out, slow=0.4)
    deadline = time.time() + 120
    while time.time() < deadline and len(_done(out / "rank-001")) < 2:
        time.sleep(0.05)
    workers = _children(p.pid)
    assert len(workers) == 2
    os.kill(max(workers), signal.SIGKILL)  # one rank dies mid-collection
    p.communicate(timeout=120)
    assert p.returncode != 0
    before = {r: _done(out / r) for r in ("rank-000", "rank-001")}
    assert 2 <= len(before["rank-001"]) < 4  # of its 4 prompts: the kill landed mid-run
    p = _torchrun(setup, out, "--resume")
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    _same_as_reference(setup, out)
    for r, ids in before.items():  # what was finished was kept, not redone
        assert _done(out / r)[: len(ids)] == ids
    _split_in_two_blocks(setup, out)


# Runs `tensorbend` with fit._fit_loop logging each target layer it fits, one file per rank.
FIT_LOGGER = """
import os, sys
from tensorbend.cli import main
from tensorbend.predictors import fit

real = fit._fit_loop

def logged(*args, **kwargs):
    desc = kwargs.get("desc", args[-1])
    with open(os.path.join(os.environ["FIT_LOG"], "rank" + os.environ.get("RANK", "0")), "a") as f:
        f.write(desc + "\\n")
    return real(*args, **kwargs)

fit._fit_loop = logged
sys.exit(main(sys.argv[1:]))
"""


def _fitted_layers(log: Path) -> dict[int, list[int]]:
    """rank -> the target layers it fitted, in order (lines "<kind> layer <li>")."""
    return {
        int(f.name.removeprefix("rank")): [
            int(x.rsplit(" ", 1)[1]) for x in f.read_text().splitlines()
        ]
        for f in sorted(log.iterdir())
    }


@pytest.mark.parametrize("kind", ["tensorbend", "seed_mlp"])
def test_training_over_two_ranks_writes_the_single_process_bytes(setup, kind):
    """Rank r fits target layers r, r + 2, ... (each rank some, none twice: logged per rank),
    and the merged checkpoint is byte for byte the single process's."""
    import tensorbend
    from tensorbend.predictors.train import TrainConfig, train

    script = setup / "fit_logger.py"
    script.write_text(FIT_LOGGER)
    args = ["--trace", str(setup / "ref"), "--predictor", kind, "--epochs", "3",
            "--fit-layers", "separate", "--quiet"]  # fmt: skip
    root = str(Path(tensorbend.__file__).parents[1])  # the package under test, in every rank
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}  # fmt: skip
    logs = {}
    for n in (1, 2):
        logs[n] = setup / f"{kind}_fit_log_{n}"
        logs[n].mkdir()
        launch = [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                  "--standalone", "--nproc-per-node", "2"]  # fmt: skip
        p = subprocess.run([*launch, str(script), "train", *args, "--out",
                            str(setup / f"{kind}_{n}.safetensors")],
                           env={**env, "FIT_LOG": str(logs[n])}, capture_output=True, text=True,
                           timeout=300)  # fmt: skip
        assert p.returncode == 0, p.stderr
    one, two = _fitted_layers(logs[1]), _fitted_layers(logs[2])
    Lt = len(one[0])
    assert list(one) == [0] and one[0] == list(range(Lt)) and Lt >= 2
    assert two == {0: list(range(0, Lt, 2)), 1: list(range(1, Lt, 2))}  # split, each non-empty
    a = (setup / f"{kind}_1.safetensors").read_bytes()
    assert a == (setup / f"{kind}_2.safetensors").read_bytes()
    joint = train(TrainConfig(trace=setup / "ref", out=setup / f"{kind}_joint.safetensors",
                              predictor=kind, epochs=3), progress=False)  # fmt: skip
    assert joint.params > 0 and (setup / f"{kind}_joint.safetensors").read_bytes() != a


def test_training_over_ranks_without_separate_layers_is_refused(setup, monkeypatch, capsys):
    """The refusal comes before the process group is joined and reads only torchrun's
    WORLD_SIZE (train._ranks), so it runs in this process with that variable set, as torchrun
    would set it (no launch: the two tests above run torchrun itself)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = setup / "refused.safetensors"
    code = main(["train", "--trace", str(setup / "ref"), "--epochs", "1", "--out", str(out),
                 "--quiet"])  # fmt: skip
    assert code != 0 and "--fit-layers separate" in capsys.readouterr().err
    assert not out.exists()


def _done(rank_dir: Path) -> list[str]:
    m = rank_dir / "manifest.json"
    return [p["id"] for p in json.loads(m.read_text())["prompts"]] if m.is_file() else []


def _children(pid: int) -> list[int]:
    """Process ids whose parent is pid (the torchrun agent's workers)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out
