"""Bad input gets one clear line and exit code 2, never a traceback; cheap checks come first.

Every case runs `main(argv)` in-process and checks: exit code 2, stderr is exactly one line
starting with `error:`, it matches what was expected and found, and nothing expensive ran for
a bad flag (the model loader is booby-trapped for cases that must fail before loading).
"""

import json
import re

import pytest
import transformers
from planted import permutation_trace
from tiny_models import save_checkpoint, write_prompts

from tensorbend.cli import main


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    save_checkpoint("deepseek_v3", d / "model")
    write_prompts(d / "prompts.jsonl", n=4)
    permutation_trace(d / "trace", prompts=12)
    (d / "empty.jsonl").write_text("\n")
    (d / "broken.jsonl").write_text('{"id": "a", "text": "x"}\n{"id": \n')
    (d / "nomanifest").mkdir()
    for name, text in {
        "corrupt": "{not json",
        "future": json.dumps({"format_version": 99}),
    }.items():
        (d / name).mkdir()
        (d / name / "manifest.json").write_text(text)
    _damaged_copies(d)
    _bad_imports(d)
    argv = f"train --trace {d}/trace --out {d}/transition.safetensors --predictor transition"
    assert main([*argv.split(), "--quiet"]) == 0
    with open(d / "seen.jsonl", "w") as f:  # the planted trace's prompt ids: q000..q011
        f.writelines(
            json.dumps({"id": f"q{i:03d}", "text": "alpha beta"}) + "\n" for i in range(12)
        )
    (d / "junk.safetensors").write_bytes(b"\x00" * 40)
    (d / "cal_list.json").write_text("[1, 2]")
    good = {"expert_bytes": 1000, "link_bandwidth_Bps": 1e9, "link_latency_s": 1e-5,
            "attn_s": 1e-4, "expert_s": 1e-5, "forward_s": 1e-4}  # fmt: skip
    (d / "cal_text.json").write_text(json.dumps({**good, "attn_s": "fast"}))
    (d / "cal_zero.json").write_text(json.dumps({**good, "link_bandwidth_Bps": 0}))
    return d


def _damaged_copies(d):
    import shutil

    for name in ("truncated", "missing"):
        shutil.copytree(d / "trace", d / name)
    shard = sorted((d / "truncated").glob("shard-*"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    sorted((d / "missing").glob("shard-*"))[0].unlink()


def _bad_imports(d):
    import gzip

    head = "prompt_id,layer,position,expert_ids\n"
    (d / "noids.csv").write_text(head + "a,0,0,1 2\na,0,1,\n")
    (d / "latin1.csv").write_bytes((head + "caf\xe9,0,0,1 2\n").encode("latin-1"))
    (d / "notgz.csv.gz").write_bytes(b"prompt_id,layer\n")
    whole = gzip.compress((head + "a,0,0,1 2\n" * 50).encode())
    (d / "cut.csv.gz").write_bytes(whole[: len(whole) // 2])
    (d / "bigid.csv").write_text(head + "a,0,0,40000 2\n")


# (id, argv with {d} for the fixture dir, regex the one error line must match, model may load)
CASES = [
    ("no-model-dir", "collect --model {d}/nope --out {d}/o", r"model .*no such directory.*never downloads", False),
    ("unknown-zoo", "collect --model zoo:nope --out {d}/o", r"unknown zoo model 'nope': expected one of", False),
    ("missing-prompts", "collect --model {d}/model --out {d}/o --prompts {d}/none.jsonl", r"prompts file .*not found", False),
    ("empty-prompts", "collect --model {d}/model --out {d}/o --prompts {d}/empty.jsonl", r"empty.jsonl: no prompts", False),
    ("broken-prompts", "collect --model {d}/model --out {d}/o --prompts {d}/broken.jsonl", r"line 2: not valid JSON", False),
    ("bad-feature", "collect --model {d}/model --out {d}/o --features ids hidden", r"--features hidden: expected some of ids, weights", False),
    ("negative-tokens", "collect --model {d}/model --out {d}/o --max-new-tokens -1", r"--max-new-tokens -1: expected a count >= 0", False),
    ("zero-prompt-tokens", "collect --model {d}/model --out {d}/o --max-prompt-tokens 0", r"--max-prompt-tokens 0: expected a count >= 1", False),
    ("zero-temperature", "collect --model {d}/model --out {d}/o --temperature 0", r"--temperature 0.0: expected a number > 0", False),
    ("zero-shard", "collect --model {d}/model --out {d}/o --shard-tokens 0", r"--shard-tokens 0: expected >= 1", False),
    ("zero-max-prompts", "collect --model {d}/model --out {d}/o --max-prompts 0", r"--max-prompts 0: expected >= 1", False),
    ("resume-and-overwrite", "collect --model {d}/model --out {d}/o --resume --overwrite", r"--resume and --overwrite contradict", False),
    ("bad-decode", "collect --model {d}/model --out {d}/o --decode beam", r"--decode: invalid choice: 'beam'", False),
    ("bad-int", "collect --model {d}/model --out {d}/o --max-new-tokens many", r"--max-new-tokens: invalid int value: 'many'", False),
    ("missing-flag", "collect --out {d}/o", r"the following arguments are required: --model", False),
    ("existing-trace", "collect --model {d}/model --out {d}/trace", r"trace already holds a trace: pass --resume .* or --overwrite", False),
    ("other-models-trace", "collect --model {d}/model --out {d}/trace --prompts {d}/prompts.jsonl --resume --quiet", r"holds a trace of another model \(planted", True),
    ("no-trace", "trace info {d}/nomanifest", r"nomanifest: no trace here \(expected manifest.json\)", False),
    ("corrupt-manifest", "trace info {d}/corrupt", r"manifest.json: corrupt manifest", False),
    ("future-format", "trace info {d}/future", r"expected trace format_version 1 or 2, found 99", False),
    ("truncated-shard", "trace info {d}/truncated", r"shard .*shard-00000.safetensors: expected \d+ bytes, found 100", False),
    ("missing-shard", "trace info {d}/missing", r"shard-00000.safetensors listed in the manifest is missing", False),
    ("unknown-zoo-path", "zoo path nope", r"unknown zoo model 'nope'", False),
    ("zoo-no-budget", "zoo train --arch mixtral --corpus {d} --out {d}/z", r"expected a budget, found neither --minutes nor --tokens", False),
    ("zoo-bad-arch", "zoo train --arch gpt2 --corpus {d} --out {d}/z --tokens 10", r"--arch: invalid choice: 'gpt2'", False),
    ("train-no-trace", "train --trace {d}/nomanifest --out {d}/p.safetensors", r"no trace here", False),
    ("train-bad-kind", "train --trace {d}/trace --out {d}/p.safetensors --predictor magic", r"magic", False),
    ("eval-missing-predictor", "eval --trace {d}/trace --predictor {d}/none.safetensors", r"none.safetensors: no such file", False),
    ("eval-junk-predictor", "eval --trace {d}/trace --predictor {d}/junk.safetensors", r"junk.safetensors: not a readable safetensors file", False),
    ("eval-bad-baseline", "eval --trace {d}/trace --baselines magic", r"--baselines: invalid choice 'magic'", False),
    ("eval-bad-lookahead", "eval --trace {d}/trace --lookahead d9", r"'d9'.*(expected one of|choose from)", False),
    ("run-bad-policy", "run --model {d}/model --policy fastest", r"--policy.*fastest", False),
    ("run-bad-frac", "run --model {d}/model --cache-frac 2", r"--cache-frac 2.0: expected a fraction in \(0, 1\]", False),
    ("max-memory-nan", "collect --model {d}/model --out {d}/o --max-memory nan", r"--max-memory 'nan': expected a finite size", False),
    ("max-memory-inf", "collect --model {d}/model --out {d}/o --max-memory inf", r"--max-memory 'inf': expected a finite size", False),
    ("link-lone-dot", "run --model {d}/model --link .MB/s", r"--link '.MB/s': expected .* decimal numbers", False),
    ("link-two-dots", "run --model {d}/model --link 1.2.3MB/s", r"--link '1.2.3MB/s': expected", False),
    ("csv-empty-ids", "trace import --from csv {d}/noids.csv --out {d}/imp --quiet", r"noids.csv, line 3: prompt 'a' layer 0 position 1 has no expert ids; expected", False),
    ("csv-not-utf8", "trace import --from csv {d}/latin1.csv --out {d}/imp --quiet", r"latin1.csv: not UTF-8 text .*re-export it as UTF-8", False),
    ("csv-not-gzip", "trace import --from csv {d}/notgz.csv.gz --out {d}/imp --quiet", r"notgz.csv.gz: unreadable \(BadGzipFile.*complete .csv.gz", False),
    ("csv-cut-gzip", "trace import --from csv {d}/cut.csv.gz --out {d}/imp --quiet", r"cut.csv.gz: unreadable \(EOFError.*complete .csv.gz", False),
    ("csv-id-beyond-int16", "trace import --from csv {d}/bigid.csv --out {d}/imp --quiet", r"routes to expert 40000; a trace stores expert ids as int16, expected ids below 32768", False),
    ("import-experts-beyond-int16", "trace import --from csv {d}/bigid.csv --out {d}/imp --num-experts 40000 --quiet", r"--num-experts 40000: .*int16, expected at most 32768", False),
    ("simulate-zero-prompts", "simulate --trace {d}/trace --hardware h100-pcie5 --geometry kimi-k2.5 --max-prompts 0", r"--max-prompts 0: expected a count >= 1", False),
    ("simulate-negative-prompts", "simulate --trace {d}/trace --hardware h100-pcie5 --geometry kimi-k2.5 --max-prompts -1", r"--max-prompts -1: expected a count >= 1", False),
    ("calibration-list", "simulate --trace {d}/trace --hardware h100-pcie5 --geometry from-trace --calibration {d}/cal_list.json", r"cal_list.json: expected a JSON object of numbers .* found a list", False),
    ("calibration-text", "simulate --trace {d}/trace --hardware h100-pcie5 --geometry from-trace --calibration {d}/cal_text.json", r"cal_text.json: attn_s = 'fast'; expected a finite number >= 0", False),
    ("calibration-zero", "simulate --trace {d}/trace --hardware h100-pcie5 --geometry from-trace --calibration {d}/cal_zero.json", r"link_bandwidth_Bps = 0; expected a finite number > 0", False),
    ("simulate-missing-horizon", "simulate --trace {d}/trace --hardware h100-pcie5 --geometry kimi-k2.5 --horizon {d}/none.safetensors", r"--horizon .*none.safetensors: expected a checkpoint file, found none", False),
    ("run-missing-horizon", "run --model {d}/model --policy prefetch --horizon {d}/none.safetensors", r"--horizon .*none.safetensors: expected a checkpoint file, found none; train one with `tensorbend train --predictor horizon`", False),
    ("run-teacher-batch-without-continuation", "run --model {d}/model --prompts {d}/prompts.jsonl --split all --batch 2 --decode teacher", r"--decode teacher --batch 2: prompts \['t001', 't003'\] have no continuation.*drop those prompts or run --batch 1", False),
    ("run-within-token-as-horizon", "run --model {d}/model --policy prefetch --horizon {d}/transition.safetensors", r"--horizon expected a cross-token \(horizon\) predictor, found kind transition \(within-token\): pass it as --predictor", False),
    ("run-on-seen-prompts", "run --model {d}/model --prompts {d}/seen.jsonl --split all --policy prefetch --predictor {d}/transition.safetensors", r"transition.safetensors was trained or early-stopped on 7 of the 8 prompts of split 'all': expected held-out prompts .*--allow-seen-split", False),
    ("run-on-seen-prompts-allowed", "run --model {d}/model --prompts {d}/seen.jsonl --split all --policy prefetch --predictor {d}/transition.safetensors --allow-seen-split", r"transition.safetensors was trained for model fingerprint planted", True),
    ("simulate-on-seen-prompts", "simulate --trace {d}/trace --hardware h100-pcie5 --geometry kimi-k2.5 --split all --predictor {d}/transition.safetensors", r"was trained or early-stopped on \d+ of the 12 prompts of split 'all'", False),
    ("simulate-on-seen-val-prompts", "simulate --trace {d}/trace --hardware h100-pcie5 --geometry kimi-k2.5 --split val --max-prompts 1 --predictor {d}/transition.safetensors", r"early-stopped on 1 of the 1 prompts of split 'val'", False),
    ("link-bad-latency", "run --model {d}/model --link 40MB/s,1..2us", r"--link '40MB/s,1..2us': expected", False),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2(case, env, capsys, monkeypatch):
    _, argv, pattern, may_load = case
    if not may_load:

        def trap(*a, **k):
            raise AssertionError("the model was loaded before a cheap check failed")

        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", trap)
    assert_one_error_line(main(argv.format(d=env).split()), capsys, pattern)


def assert_one_error_line(rc: int, capsys, pattern: str) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    assert re.search(pattern, err), err
    return err


@pytest.mark.parametrize("kind", ["transition", "frequency", "horizon"])
def test_torchrun_refuses_kinds_it_cannot_split_before_joining(kind, env, capsys, monkeypatch):
    # No second rank exists: joining the group would hang, so the refusal must come first.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setattr("torch.distributed.init_process_group", _no_group)
    argv = f"train --trace {env}/trace --out {env}/p.safetensors --predictor {kind} --quiet"
    why = "one network over every MoE layer" if kind == "horizon" else "tables in one pass"
    assert_one_error_line(main(argv.split()), capsys, rf"{kind} .*{why}.*found 2 ranks")


def _no_group(*a, **k):
    raise AssertionError("joined the process group before refusing")


def test_there_are_at_least_25_cases():
    assert len(CASES) >= 25


def test_a_trace_refuses_more_experts_than_int16_ids_hold(tmp_path):
    from tensorbend.capture.writer import TraceWriter
    from tensorbend.errors import TraceError
    from tensorbend.models import RoutingSpec

    spec = RoutingSpec("qwen3_moe", "softmax", 40_000, 8, 16, 2, (0, 1))
    with pytest.raises(TraceError, match="40000 routed experts per layer: .* at most 32768"):
        TraceWriter(tmp_path / "t", model_meta={}, spec=spec, features={}, collection={})
    assert not (tmp_path / "t").exists()


def test_a_teacher_batch_with_an_empty_continuation_is_refused_before_any_forward():
    import torch

    from tensorbend.capture.hf import DecodeConfig, PromptInput, decode_batch
    from tensorbend.errors import TensorbendError

    ids = torch.tensor([[1, 2, 3]])
    inps = [PromptInput("a", ids, [4, 5]), PromptInput("b", ids, [])]  # "b": tokenized to nothing
    with pytest.raises(TensorbendError, match=r"prompts \['b'\] whose continuation is empty"):
        decode_batch(None, inps, DecodeConfig(decode="teacher"))  # no model: refused first


# ------------------------------------------- serving: refused before a store is built


@pytest.fixture(scope="module")
def serving_env(tmp_path_factory):
    """A tiny checkpoint, and copies of it that are each wrong in one way."""
    import shutil

    from tiny_models import build, char_tokenizer

    d = tmp_path_factory.mktemp("serve_bad")
    save_checkpoint("mixtral", d / "model")
    shutil.copytree(d / "model", d / "notok")
    for f in (d / "notok").glob("token*"):
        f.unlink()
    shutil.copytree(d / "model", d / "alien")
    config = json.loads((d / "alien" / "config.json").read_text())
    (d / "alien" / "config.json").write_text(json.dumps({**config, "model_type": "frobnicator"}))
    build("mixtral").save_pretrained(d / "sharded", max_shard_size="20KB")
    char_tokenizer().save_pretrained(d / "sharded")
    (d / "sharded" / "model-00002-of-00013.safetensors").unlink()
    (d / "latin1.jsonl").write_bytes('{"id": "a", "text": "caf\xe9"}\n'.encode("latin-1"))
    return d


SERVE_CASES = [
    ("empty-prompt", ["--model", "{d}/model", "--prompt", ""],
     "--prompt '': expected text of at least one token, found 0 tokens (the tokenizer adds no "
     "BOS token); give the prompt some text"),
    ("no-tokenizer", ["--model", "{d}/notok", "--prompt", "hi"],
     "{d}/notok: expected a tokenizer (tokenizer.json or tokenizer_config.json), found no "
     "tokenizer files; save the base model's tokenizer into it with "
     "AutoTokenizer.from_pretrained(BASE).save_pretrained('{d}/notok')"),
    ("prompts-not-utf8", ["--model", "{d}/model", "--prompts", "{d}/latin1.jsonl"],
     "{d}/latin1.jsonl, line 1: not UTF-8 text (byte 0xe9); expected UTF-8 JSONL: re-save the "
     "file as UTF-8"),
    ("size-without-unit", ["--model", "{d}/model", "--prompt", "hi", "--max-memory", "100"],
     "--max-memory '100': expected a size with a unit, found a bare number; write 100GB, "
     "100MiB, or 100B for bytes"),
    ("reserve-not-a-size", ["--model", "{d}/model", "--prompt", "hi", "--max-memory", "1GB",
                            "--reserve", "abc"],
     "--reserve 'abc': expected a size such as 8GB, 512MB, 4GiB or 1000B"),
    ("unknown-model-type", ["--model", "{d}/alien", "--prompt", "hi"],
     "{d}/alien/config.json: model_type 'frobnicator' is unknown to transformers "
     f"{transformers.__version__}: expected one of the supported MoE families deepseek_v3, "
     "qwen3_moe, qwen2_moe, mixtral, olmoe, gpt_oss, phimoe, granitemoe, llama4_text; fix "
     "model_type or upgrade transformers"),
    ("missing-shard", ["--model", "{d}/sharded", "--prompt", "hi"],
     "{d}/sharded: expected shard model-00002-of-00013.safetensors, named in "
     "model.safetensors.index.json for 6 tensors (e.g. "
     "model.layers.0.block_sparse_moe.experts.0.w2.weight), found no such file; download or "
     "copy the missing shard"),
]  # fmt: skip


@pytest.mark.parametrize("case", SERVE_CASES, ids=[c[0] for c in SERVE_CASES])
def test_bad_serving_input_is_refused_in_one_line_before_a_store_is_built(
    case, serving_env, capsys
):
    name, argv, expected = case
    store = serving_env / f"store-{name}"
    argv = ["generate", *(a.format(d=serving_env) for a in argv), "--store-dir", str(store)]
    err = assert_one_error_line(main([*argv, "--quiet"]), capsys, "")
    assert err == "error: " + expected.format(d=serving_env)
    assert not store.exists()  # nothing written, nothing to clean up


def test_a_budget_above_physical_memory_is_a_warning_line(serving_env, capsys, monkeypatch):
    monkeypatch.setattr("tensorbend.serving.offloaded.physical_bytes", lambda device: 10**9)
    argv = f"generate --model {serving_env}/model --prompt hi --max-new-tokens 1 --quiet"
    argv += f" --max-memory 2GB --store-dir {serving_env}/store-big"
    assert main(argv.split()) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "warning: --max-memory 2GB: expected at most the 1.0 GB of physical memory on cpu, "
        "found more; the cache is sized for memory that is not there (expect swapping or an "
        "out-of-memory kill): lower it"
    )
    assert [line.startswith("[tensorbend]") for line in err[1:]] == [True, True]


def test_load_offloaded_takes_python_types_as_their_users_write_them(serving_env):
    """accelerate's max_memory dict, a float byte count, a torch.device and an upper-case
    policy serve the same greedy text as their string forms."""
    import torch

    from tensorbend.serving.offloaded import load_offloaded

    ids = torch.tensor([[40, 41, 42]])
    texts = []
    for kw in ({"max_memory": "1GB", "device": "cpu", "policy": "lru"},
               {"max_memory": {"cpu": "1GB"}, "device": torch.device("cpu"), "policy": "LRU"},
               {"max_memory": 1e9, "policy": "Lru"}):  # fmt: skip
        model = load_offloaded(serving_env / "model", store_dir=serving_env / "store-py",
                               progress=False, **kw)  # fmt: skip
        try:
            assert model.tensorbend.memory_plan["budget"] == 10**9
            texts.append(model.generate(ids, max_new_tokens=6, do_sample=False).tolist())
        finally:
            model.tensorbend.close()
    assert texts[0] == texts[1] == texts[2]


def test_load_offloaded_refuses_python_values_it_cannot_read_in_one_line():
    import torch

    from tensorbend.cache.config import POLICIES
    from tensorbend.errors import TensorbendError
    from tensorbend.serving.offloaded import ServeConfig

    cases = [
        ({"max_memory": {"disk": "8GB"}},
         "max_memory {'disk': '8GB'}: expected a size, or a dict with an entry for the serving "
         "device cpu (key 'cpu'); found keys ['disk']; pass max_memory=\"8GB\" or add the "
         "device's entry"),
        ({"max_memory": 1.5}, "--max-memory 1.5: expected a size such as '8GB' or a whole "
         "number of bytes, found float"),
        ({"device": torch.device("meta")}, "--device 'meta': expected cpu, cuda or cuda:N"),
    ]  # fmt: skip
    for kw, expected in cases:
        with pytest.raises(TensorbendError) as e:
            ServeConfig(**kw)
        assert str(e.value) == expected
    from tensorbend.cache.config import PolicyConfig

    with pytest.raises(TensorbendError) as e:
        PolicyConfig(policy="fastest")
    assert str(e.value) == f"--policy 'fastest': expected one of {', '.join(POLICIES)}"
