"""Collect + trace on a real HF checkpoint directory saved by save_pretrained (tiny DeepSeek-V3)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from tiny_models import save_checkpoint, write_prompts

from tensorbend.capture.collect import CollectConfig, collect
from tensorbend.capture.hf import DecodeConfig, load_model
from tensorbend.capture.prompts import load_prompts, split_of
from tensorbend.capture.trace import FORMAT_VERSION, Trace
from tensorbend.cli import main
from tensorbend.errors import PromptFileError, TraceError
from tensorbend.models import describe_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    save_checkpoint("deepseek_v3", d / "model")
    write_prompts(d / "prompts.jsonl", n=12)
    return d


def _collect(ckpt, out, **kw):
    dec = {k: kw.pop(k) for k in ("decode", "max_new_tokens", "seed") if k in kw}
    cfg = dict(model=str(ckpt / "model"), out=out, prompts=ckpt / "prompts.jsonl")
    cfg.update(kw)
    dc = DecodeConfig(**{"max_new_tokens": 4, **dec})
    return collect(CollectConfig(**cfg, decode=dc), progress=False)


def test_collect_and_trace_info_json(ckpt, tmp_path, capsys):
    out = tmp_path / "trace"
    rc = main(
        [
            "collect",
            "--model",
            str(ckpt / "model"),
            "--out",
            str(out),
            "--prompts",
            str(ckpt / "prompts.jsonl"),
            "--max-new-tokens",
            "4",
            "--quiet",
        ]
    )
    assert rc == 0
    capsys.readouterr()
    assert main(["trace", "info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    prompts = load_prompts(ckpt / "prompts.jsonl")
    assert info["format_version"] == FORMAT_VERSION
    assert (info["num_moe_layers"], info["num_experts"], info["top_k"], info["hidden_size"]) == (
        3,
        16,
        4,
        32,
    )
    assert info["prompts"] == len(prompts)
    assert info["tokens"]["decode"] == 4 * len(
        prompts
    )  # the char tokenizer's eos is never argmax here
    assert info["features"] == ["ids", "weights", "gate_input"]
    assert info["decode_mode"] == "greedy"


def test_decode_rows_equal_full_sequence_routing(ckpt, tmp_path):
    """KV-cache decode steps route exactly like a full forward over the generated sequence."""
    _collect(ckpt, tmp_path / "t", max_new_tokens=6, dtype="float32")
    rows = Trace.open(tmp_path / "t").load(("ids",))
    model, _ = load_model(str(ckpt / "model"))
    spec = describe_model(model)
    from tensorbend.capture.routing import RoutingCapture

    for pi in range(3):
        sel = rows["prompt_index_T"] == pi
        with RoutingCapture(model, spec) as cap, torch.no_grad():
            model(rows["token_ids_T"][sel].long()[None])
            full = cap.pop()["expert_ids_TLK"]
        got = rows["expert_ids_TLK"][sel]
        assert got.shape == full.shape
        assert torch.equal(got.sort(-1).values, full.sort(-1).values)


def test_teacher_forcing_feeds_the_continuation(ckpt, tmp_path):
    s = _collect(ckpt, tmp_path / "t", decode="teacher", max_new_tokens=8)
    prompts = load_prompts(ckpt / "prompts.jsonl")
    assert s.prompts_without_continuation == sum(p.continuation is None for p in prompts)
    tr = Trace.open(tmp_path / "t")
    rows = tr.load(("ids",), phase="decode")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt / "model")
    for i, p in enumerate(prompts):
        dec = rows["token_ids_T"][rows["prompt_index_T"] == i].tolist()
        want = tok(p.continuation, add_special_tokens=False).input_ids[:8] if p.continuation else []
        assert dec == want
    assert tr.info()["decode_mode"] == "teacher"


def test_sampling_is_seeded(ckpt, tmp_path):
    _collect(ckpt, tmp_path / "a", decode="sample", seed=3, max_prompts=3)
    _collect(ckpt, tmp_path / "b", decode="sample", seed=3, max_prompts=3)
    _collect(ckpt, tmp_path / "c", decode="sample", seed=4, max_prompts=3)
    a, b, c = (Trace.open(tmp_path / x).load(("ids",))["token_ids_T"] for x in "abc")
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_split_filter_and_deterministic_split(ckpt, tmp_path):
    _collect(ckpt, tmp_path / "t")
    tr = Trace.open(tmp_path / "t")
    for split in ("train", "val", "test"):
        rows = tr.load(("ids",), split=split)
        idx = set(rows["prompt_index_T"].tolist())
        assert {tr.prompts[i]["id"] for i in idx} == {
            p["id"] for p in tr.prompts if p["split"] == split
        }
    # pinned: a prompt's split never moves (a trace collected before must keep its test set)
    assert [split_of(i) for i in ("p0001", "p0002", "p0010")] == ["train", "test", "val"]
    counts = {s: sum(split_of(f"x{i}") == s for i in range(2000)) for s in ("train", "val", "test")}
    assert (
        1300 < counts["train"] < 1500 and 130 < counts["val"] < 270 and 330 < counts["test"] < 470
    )


def test_existing_trace_refused_without_resume_or_overwrite(ckpt, tmp_path):
    _collect(ckpt, tmp_path / "t", max_prompts=2)
    with pytest.raises(TraceError, match="pass --resume to continue it or --overwrite"):
        _collect(ckpt, tmp_path / "t", max_prompts=2)
    s = _collect(ckpt, tmp_path / "t", resume=True)
    assert s.prompts_skipped_done == 2 and s.prompts_total == 12
    with pytest.raises(TraceError, match="resume .*features"):
        _collect(ckpt, tmp_path / "t", resume=True, features=("ids",))


def test_trace_of_another_model_refused(ckpt, tmp_path):
    _collect(ckpt, tmp_path / "t", max_prompts=1)
    other = tmp_path / "other"
    save_checkpoint("deepseek_v3", other, seed=7)
    with pytest.raises(TraceError, match="holds a trace of another model"):
        collect(
            CollectConfig(
                model=str(other),
                out=tmp_path / "t",
                prompts=ckpt / "prompts.jsonl",
                decode=DecodeConfig(max_new_tokens=2),
                resume=True,
            ),
            progress=False,
        )
    assert Trace.open(tmp_path / "t").info()["prompts"] == 1  # untouched


def test_truncated_shard_names_the_file_and_others_stay_readable(ckpt, tmp_path):
    _collect(ckpt, tmp_path / "t", shard_tokens=30)
    tr = Trace.open(tmp_path / "t")
    assert len(tr.manifest["shards"]) >= 3
    victim = tmp_path / "t" / tr.manifest["shards"][1]["file"]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match=f"shard .*{victim.name}: expected {len(data)} bytes"):
        Trace.open(tmp_path / "t")
    assert main(["trace", "info", str(tmp_path / "t")]) == 2
    victim.write_bytes(data[:8] + b"\xff" * (len(data) - 8))  # right size, corrupt header
    tr = Trace.open(tmp_path / "t")
    with pytest.raises(TraceError, match=victim.name):
        tr.load(("ids",))
    rows = tr.load(("ids",), skip_bad=True)
    assert (
        rows["expert_ids_TLK"].shape[0]
        == sum(s["tokens"] for s in tr.manifest["shards"]) - tr.manifest["shards"][1]["tokens"]
    )


def test_flipped_byte_in_a_shard_fails_its_checksum(ckpt, tmp_path):
    """Same size, valid header, one data byte changed: only the sha256 can tell."""
    _collect(ckpt, tmp_path / "t", max_prompts=2)
    tr = Trace.open(tmp_path / "t")
    victim = tmp_path / "t" / tr.manifest["shards"][0]["file"]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x01
    victim.write_bytes(bytes(data))
    tr = Trace.open(tmp_path / "t")  # sizes match
    with pytest.raises(TraceError, match=f"{victim.name}: expected sha256"):
        tr.load(("ids",))


def test_every_finished_prompt_is_on_disk_and_parts_merge(ckpt, tmp_path):
    """Each prompt is durable as soon as it finishes (a part shard listed in the manifest);
    parts merge into one shard once shard_tokens rows accumulate, and at close."""
    from tensorbend.capture.writer import TraceWriter

    _collect(ckpt, tmp_path / "t", max_prompts=3)
    tr = Trace.open(tmp_path / "t")
    w = TraceWriter(tmp_path / "t", model_meta=tr.manifest["model"], spec=tr.spec,
                    features=tr.manifest["features"], collection=tr.manifest["collection"],
                    resume=True, shard_tokens=10**9)  # fmt: skip
    before = tr.load(("ids",))
    sh0 = tr.load_shard(0)
    for i in range(2):  # two more prompts: copies of prompt 0's rows
        rows = {k: v[sh0["prompt_index_T"] == 0] for k, v in sh0.items() if k != "prompt_index_T"}
        rec = {**tr.prompts[0], "id": f"extra{i}"}
        w.add_prompt({k: rec[k] for k in ("id", "split", "topic", "prefill", "decode")}, rows)
        on_disk = Trace.open(tmp_path / "t")  # what a kill -9 right now would leave
        assert [p["id"] for p in on_disk.prompts][-1] == f"extra{i}"
        assert on_disk.manifest["shards"][-1]["file"] == f"part-{3 + i:06d}.safetensors"
    (tmp_path / "t" / "shard-00042.safetensors").write_bytes(b"orphan of a killed merge")
    w.close()
    tr = Trace.open(tmp_path / "t")
    assert [s["file"] for s in tr.manifest["shards"]] == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]
    assert not list((tmp_path / "t").glob("part-*"))
    after = tr.load(("ids",))
    n = before["expert_ids_TLK"].shape[0]
    assert torch.equal(after["expert_ids_TLK"][:n], before["expert_ids_TLK"])
    assert after["prompt_index_T"].max() == 4


def test_malformed_prompt_file_names_the_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "text": "hello"}\n\n{"id": "b", "text": }\n')
    with pytest.raises(PromptFileError, match=r"line 3: not valid JSON"):
        load_prompts(p)
    p.write_text('{"id": "a", "text": "hello"}\n{"id": "a", "text": "again"}\n')
    with pytest.raises(PromptFileError, match=r"line 2: duplicate prompt id 'a'"):
        load_prompts(p)
    p.write_text('{"id": "a"}\n')
    with pytest.raises(PromptFileError, match=r"line 1: expected a non-empty string field 'text'"):
        load_prompts(p)


def test_cli_user_error_is_one_line_exit_2(tmp_path, capsys):
    assert main(["collect", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model") and "never downloads" in err and "Traceback" not in err


def test_kill_and_resume_loses_and_duplicates_nothing(ckpt, tmp_path):
    """kill -9 in the middle of a collection at the default shard size, then --resume: every
    prompt finished before the kill is kept (not redone), every prompt exactly once, same rows."""
    ref = tmp_path / "ref"
    _collect(ckpt, ref, max_new_tokens=6)
    out = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "tensorbend",
        "collect",
        "--model",
        str(ckpt / "model"),
        "--out",
        str(out),
        "--prompts",
        str(ckpt / "prompts.jsonl"),
        "--max-new-tokens",
        "6",
        "--quiet",
    ]
    # Same thread count as this process (conftest): float reductions then match bit for bit.
    env = {**os.environ, "TENSORBEND_TEST_SLOW_PROMPT_S": "0.3", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        m = out / "manifest.json"
        if m.is_file() and len(json.loads(m.read_text())["prompts"]) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(json.loads((out / "manifest.json").read_text())["prompts"])
    assert 3 <= done_before < 12, "the kill should land mid-collection"
    env.pop("TENSORBEND_TEST_SLOW_PROMPT_S")  # the resume needs no slowing: nothing kills it
    rc = subprocess.run([*cmd, "--resume"], env=env, capture_output=True, text=True)
    assert rc.returncode == 0, rc.stderr
    assert re.search(rf"prompts_skipped_done\s+{done_before}\n", rc.stdout), rc.stdout
    a, b = Trace.open(ref), Trace.open(out)
    assert [p["id"] for p in b.prompts] == [p["id"] for p in a.prompts]
    ra, rb = a.load(("ids", "gate_input")), b.load(("ids", "gate_input"))
    for k in ra:
        assert torch.equal(ra[k], rb[k]), k
    assert b.info()["complete"]


def test_streamed_row_selection_equals_selecting_loaded_rows(ckpt, tmp_path):
    """load_selected (two passes, features of kept rows only) returns exactly what
    select_rows returns on the fully loaded split, over several shards."""
    from tensorbend.capture.rows import RowSelection, keep_mask, load_selected, select_rows

    _collect(ckpt, tmp_path / "t", features=("ids", "gate_input"), shard_tokens=40)
    tr = Trace.open(tmp_path / "t")
    assert len(tr.manifest["shards"]) >= 3
    feats = ("ids", "gate_input")
    for sel in (RowSelection(), RowSelection(max_rows=37, seed=3),
                RowSelection(max_prompts=4, tokens_per_forward=2, max_rows=20)):  # fmt: skip
        want = select_rows(tr.load(feats, split="train"), sel)
        got = load_selected(tr, feats, "train", sel)
        assert want.keys() == got.keys(), sel
        for k in want:
            assert torch.equal(want[k], got[k]), (sel, k)
    n = tr.load(("ids",), split="train")["phase_T"].numel()
    with pytest.raises(TraceError, match="row mask"):
        tr.load(("ids",), split="train", keep_T=torch.ones(n + 1, dtype=torch.bool))
    assert keep_mask(tr.load(("ids",), split="train"), RowSelection(max_rows=5)).sum() == 5


def test_evaluation_streamed_by_shard_equals_scoring_all_rows_at_once(ckpt, tmp_path):
    """eval scores shard by shard and merges by token counts: the same metrics (to float
    rounding) as score_predictor over the whole split loaded at once."""
    from tensorbend.predictors.base import TrainData, get_lookahead
    from tensorbend.predictors.evaluate import EvalConfig, evaluate
    from tensorbend.predictors.registry import build
    from tensorbend.predictors.scoring import score_predictor

    _collect(ckpt, tmp_path / "t", features=("ids", "gate_input"), shard_tokens=40)
    tr = Trace.open(tmp_path / "t")
    assert len(list(tr.iter_shards(("ids",), split="test"))) >= 2
    rep = evaluate(EvalConfig(trace=tmp_path / "t", baselines=("frequency", "spec_gate"),
                              lookaheads=("d1",), timing_rows=0))  # fmt: skip
    rows = tr.load(("ids", "gate_input"), split="test")
    data = TrainData(tr.load(("ids",), split="train"), router_params=tr.router_params())
    for r in rep.results:
        whole = score_predictor(build(r.predictor, tr.spec, get_lookahead("d1"), data), rows,
                                (0, 2, 4, tr.spec.top_k))[r.phase]  # fmt: skip
        assert r.tokens == whole["tokens"] > 0
        assert r.recall_at_k == pytest.approx(whole["recall_at_k"], abs=1e-6)
        assert r.exact_match == pytest.approx(whole["exact_match"], abs=1e-6)
        assert r.hit_at_k_plus_p["2"] == pytest.approx(whole["hit_at_k_plus_p"]["2"], abs=1e-6)
        for a, b in zip(r.per_layer, whole["per_layer"], strict=True):
            assert a["tokens"] == b["tokens"]
            assert a["recall_at_k"] == pytest.approx(b["recall_at_k"], abs=1e-6)


def test_resplit_by_topic_tests_on_unseen_topics_only(ckpt, tmp_path, capsys):
    from tensorbend.capture.resplit import UNUSED

    _collect(ckpt, tmp_path / "t")
    src = Trace.open(tmp_path / "t")
    before = (tmp_path / "t" / "manifest.json").read_bytes()
    assert main(["trace", "resplit", str(tmp_path / "t"), "--test-topics", "prose",
                 "--out", str(tmp_path / "d")]) == 0  # fmt: skip
    assert (tmp_path / "t" / "manifest.json").read_bytes() == before  # the source untouched
    view = Trace.open(tmp_path / "d")
    for p, q in zip(src.prompts, view.prompts, strict=True):
        assert p["id"] == q["id"]
        if p["topic"] == "prose":
            assert q["split"] == "test"
        else:
            assert q["split"] == (UNUSED if p["split"] == "test" else p["split"])
    # the test rows are exactly the prose prompts' rows, equal to the source's
    rows = view.load(("ids",), split="test")
    idx = sorted(set(rows["prompt_index_T"].tolist()))
    assert [view.prompts[i]["topic"] for i in idx] == ["prose"] * 6
    whole = src.load(("ids",))
    keep = torch.isin(whole["prompt_index_T"], torch.tensor(idx))
    assert torch.equal(rows["expert_ids_TLK"], whole["expert_ids_TLK"][keep])
    assert view.manifest["resplit"]["test_topics"] == ["prose"]
    for k, w in src.router_params().items():  # the router weights come along
        assert torch.equal(view.router_params()[k], w)
    capsys.readouterr()
    assert main(["trace", "resplit", str(tmp_path / "t"), "--test-topics", "poetry",
                 "--out", str(tmp_path / "e")]) != 0  # fmt: skip
    assert (
        "poetry not found; its prompts' topics are: code (6), prose (6)" in capsys.readouterr().err
    )
    assert not (tmp_path / "e").exists()
    assert main(["trace", "resplit", str(tmp_path / "t"), "--test-topics", "code",
                 "--out", str(tmp_path / "d")]) != 0  # fmt: skip
    assert "a trace is there already" in capsys.readouterr().err
    assert Trace.open(tmp_path / "d").manifest["resplit"]["test_topics"] == ["prose"]
