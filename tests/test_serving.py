"""Serving from the checkpoint: the store streamed from shards, `load_offloaded` + transformers'
own `generate()`, equal to the resident model; resumable builds; bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tiny_models import char_tokenizer, save_checkpoint
from transformers import AutoModelForCausalLM

import tensorbend
from tensorbend.cli import main
from tensorbend.models import describe_model, moe_block
from tensorbend.offload.expert_plan import ExpertPlan, build_store
from tensorbend.offload.layer import OFFLOAD_FAMILIES
from tensorbend.offload.layout import ExpertLayout
from tensorbend.offload.shards import Checkpoint
from tensorbend.offload.store import ExpertStore
from tensorbend.serving.budget import ONEDNN_RESERVE, RESERVE_FIXED
from tensorbend.serving.model_build import build_without_experts


def _resident(path):
    return AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()


@pytest.mark.parametrize("family", OFFLOAD_FAMILIES)
def test_store_from_shards_equals_model_and_generate_equals_resident(family, tmp_path):
    """Every expert streamed from the checkpoint equals the loaded model's fused row (byte for
    byte); greedy generate() through the offloaded model equals the resident one's tokens and
    logits, with a cache far smaller than the experts."""
    ckpt = save_checkpoint(family, tmp_path / "ckpt")
    ref = _resident(ckpt)
    spec = describe_model(ref)
    model = tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "store", cache_frac=0.25,
                                      progress=False)  # fmt: skip
    handle = model.tensorbend
    store = handle.store
    layout = handle.layout
    for m in range(spec.num_moe_layers):
        mod = getattr(moe_block(ref, spec, m), spec.experts_attr)
        for e in range(spec.num_experts):
            want = torch.cat([getattr(mod, n)[e].detach().reshape(-1) for n, _ in layout.parts])
            got = torch.empty(layout.numel, dtype=layout.dtype)
            store.read_into(m, e, got)
            assert torch.equal(got, want), (family, m, e)
    ids = torch.tensor([[5, 17, 33, 2, 40, 8]])
    with torch.inference_mode():
        want = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=1)
        got = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=1)
        assert torch.equal(got, want)
        assert torch.equal(model(got).logits, ref(got).logits)
    c = handle.counters()
    assert c["decode"]["tokens"] == want.shape[1] - ids.shape[1] - 1  # the last token: no forward
    assert (
        c["totals"]["bytes_read"] > 0 and c["cache_slots"] < spec.num_moe_layers * spec.num_experts
    )
    assert sum(layer["misses"] for layer in c["per_layer"]) == c["totals"]["misses"]
    # the prediction hooks run at every MoE layer of every forward, attributed to its phase:
    # two without a KV cache (generate's prefill, the whole-sequence check), then one decode
    # forward per new token but the last
    L = spec.num_moe_layers
    assert c["predict_calls"] == (2 + c["decode"]["tokens"]) * L
    assert c["decode_predict_calls"] == c["decode"]["tokens"] * L
    assert (
        0 < c["decode_predict_s"] < c["predict_s"] and 0 <= c["predict_queue_s"] <= c["predict_s"]
    )
    handle.close()
    with pytest.raises(tensorbend.TensorbendError, match="closed"):
        model(ids)


def test_direct_io_reads_every_expert_straight_into_its_slot(tmp_path):
    """io="direct" (O_DIRECT, the page cache bypassed): the cache's slots are 4096-aligned and
    the store's experts start on 4096-byte boundaries, so no read goes through the bounce
    buffer, and generate() equals the resident model's."""
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    ref = _resident(ckpt)
    try:
        model = tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "store", cache_frac=0.25,
                                          io="direct", progress=False)  # fmt: skip
    except tensorbend.TensorbendError as e:  # e.g. tmpfs: no O_DIRECT, nothing to test here
        assert "try --io fadvise" in str(e)
        pytest.skip(f"this filesystem refuses O_DIRECT: {e}")
    h = model.tensorbend
    ids = torch.tensor([[5, 17, 33, 2, 40, 8]])
    with torch.inference_mode():
        want = ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=1)
        assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False,
                                          pad_token_id=1), want)  # fmt: skip
    c = h.counters()
    assert c["totals"]["bytes_read"] > 0 and h.store.bounced_reads == 0
    h.close()


def test_batch_sampling_streamer_pipeline_equal_resident(tmp_path):
    """Batch of two left-padded prompts, seeded sampling, a TextStreamer and a text-generation
    pipeline give what the resident model gives; reset() zeroes the counters."""
    from transformers import TextStreamer, pipeline

    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    tok = char_tokenizer()
    tok.pad_token, tok.padding_side = tok.eos_token, "left"
    ref = _resident(ckpt)
    model = tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "s", cache_frac=0.3,
                                      policy="lfru", progress=False)  # fmt: skip
    batch = tok(["river stone light", "alpha"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=5, pad_token_id=1)
    with torch.inference_mode():
        assert torch.equal(model.generate(**batch, **kw), ref.generate(**batch, **kw))
        outs = []
        for m in (ref, model):
            torch.manual_seed(3)
            outs.append(m.generate(**batch, do_sample=True, temperature=0.9, **kw))
        assert torch.equal(outs[0], outs[1])
    printed = []

    class Capture(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            printed.append(text)

    ids = tok("kernel module", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, streamer=Capture(tok, skip_prompt=True), **kw)
    assert "".join(printed) == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    texts = [
        pipeline("text-generation", model=m, tokenizer=tok)("dark light", do_sample=False, **kw)
        for m in (ref, model)
    ]
    assert texts[0] == texts[1]
    assert model.tensorbend.counters()["decode"]["tokens"] > 0
    model.tensorbend.reset()
    c = model.tensorbend.counters()
    assert c["decode"]["tokens"] == 0 and c["totals"]["bytes_read"] == 0 and not c["per_layer"]
    model.tensorbend.close()


def test_interrupted_store_build_resumes_and_keeps_finished_layers(tmp_path, monkeypatch):
    ckpt = save_checkpoint("deepseek_v3", tmp_path / "ckpt")
    lm, spec, layout = build_without_experts(ckpt, torch.float32)
    plan = ExpertPlan.of(Checkpoint.open(ckpt), lm, spec, layout)
    path = tmp_path / "store" / "experts.safetensors"
    calls = []
    real = ExpertPlan.expert_into

    def flaky(self, m, e, out, staging=None):
        calls.append(m)
        if m == 2 and not getattr(flaky, "failed", False):
            flaky.failed = True
            raise KeyboardInterrupt  # killed while layer 2 was being written
        return real(self, m, e, out, staging)

    monkeypatch.setattr(ExpertPlan, "expert_into", flaky)
    with pytest.raises(KeyboardInterrupt):
        build_store(plan, path, {"fingerprint": "x"}, torch.float32, progress=False)
    assert not path.exists()
    record = json.loads(path.with_name(path.name + ".progress").read_text())
    assert record["layers_done"] == 2
    calls.clear()
    build_store(plan, path, {"fingerprint": "x"}, torch.float32, progress=False)
    assert min(calls) == 2  # layers 0 and 1 were not read again
    fresh = build_store(plan, tmp_path / "fresh.safetensors", {"fingerprint": "x"},
                        torch.float32, progress=False)  # fmt: skip
    assert path.read_bytes() == fresh.read_bytes()
    store = ExpertStore.open(path)
    assert (store.num_layers, store.num_experts) == (spec.num_moe_layers, spec.num_experts)
    store.close()


def test_bad_input_one_line_errors(tmp_path, capsys):
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "a")
    other = save_checkpoint("qwen3_moe", tmp_path / "b", seed=1)
    llama = save_checkpoint("llama4_text", tmp_path / "llama")
    store = tmp_path / "store"
    capsys.readouterr()

    def err(*argv):
        assert main(["generate", "--prompt", "ab", "--quiet", *argv]) == 2
        out = capsys.readouterr().err.strip()
        assert out.startswith("error: ") and "\n" not in out and "Traceback" not in out
        return out

    assert "config.json" in err("--model", str(tmp_path / "nothing"))
    assert "llama4_text" in err("--model", str(llama), "--store-dir", str(store))
    assert "expected at least" in err("--model", str(ckpt), "--max-memory", "10KB")
    assert main(["generate", "--model", str(ckpt), "--prompt", "ab", "--quiet", "--store-dir",
                 str(store), "--max-new-tokens", "2"]) == 0  # fmt: skip
    capsys.readouterr()  # (another checkpoint with the same --store-dir: served, its own store)
    assert main(["generate", "--model", str(other), "--prompt", "ab", "--quiet", "--store-dir",
                 str(store), "--max-new-tokens", "2"]) == 0  # fmt: skip
    capsys.readouterr()
    pred = tmp_path / "missing.safetensors"
    assert "expected a checkpoint file" in err("--model", str(ckpt), "--policy", "prefetch",
                                               "--horizon", str(pred))  # fmt: skip


def test_layout_and_dtype_refused(tmp_path):
    """A store whose experts have another layout or dtype than the model's is refused."""
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    lm, spec, layout = build_without_experts(ckpt, torch.float32)
    plan = ExpertPlan.of(Checkpoint.open(ckpt), lm, spec, layout)
    path = build_store(plan, tmp_path / "bf16.safetensors", {}, torch.bfloat16, progress=False)
    from tensorbend.cache.config import PolicyConfig
    from tensorbend.offload.handle import OffloadHandle

    with pytest.raises(
        tensorbend.TensorbendError,
        match=r"expected expert bytes \d+ \(this model, torch.float32\), found expert bytes \d+:",
    ):
        OffloadHandle(lm, spec, layout, path, PolicyConfig("lru", cache_frac=0.5))
    small = ExpertLayout(tuple((n, (1,) + s[1:]) for n, s in layout.parts), torch.float32)
    with pytest.raises(tensorbend.TensorbendError, match=r"expected layout .* found layout"):
        OffloadHandle(lm, spec, small, path, PolicyConfig("lru", cache_frac=0.5))


def _wide_checkpoint(path, moe_intermediate: int = 1536, dtype=torch.float32):
    """A Qwen3-MoE checkpoint of 302 MB of routed experts (4 layers x 32 experts of 2.4 MB;
    float32, moe_intermediate 1536), or of other widths and dtypes."""
    import transformers
    from tiny_models import COMMON

    config = transformers.Qwen3MoeConfig(**{**COMMON, "hidden_size": 128, "head_dim": 32},
                                         intermediate_size=256,
                                         moe_intermediate_size=moe_intermediate,
                                         num_hidden_layers=4, num_experts=32,
                                         num_experts_per_tok=2, eos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return model


def _import_baseline() -> int:
    from tensorbend.serving.offloaded import IMPORT_BASELINE as code

    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout)  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bf16"])
def test_generate_cli_streams_and_stays_within_budget(tmp_path, dtype):
    """A checkpoint whose experts are over twice the memory budget: `tensorbend generate` in
    its own process streams text, reads every expert from the store on disk, and its peak RSS
    (mapped file pages included) stays within the import baseline + the budget; in bf16 too
    (a bf16 checkpoint of 3x wider experts, 453 MB), where the experts' matmuls run through
    oneDNN on CPU (its kernels and scratch memory charged in the reserve:
    `budget.ONEDNN_RESERVE`)."""
    width = 1536 if dtype == "float32" else 3 * 1536
    _wide_checkpoint(tmp_path / "ckpt", width, getattr(torch, dtype.replace("bf", "bfloat")))
    expert_bytes = 3 * 128 * width * (4 if dtype == "float32" else 2)
    total = 4 * 32 * expert_bytes  # 302 MB (453 MB bf16) of routed experts
    budget = (96 if dtype == "float32" else 200) * 10**6
    base = _import_baseline()
    out = subprocess.run(
        [sys.executable, "-m", "tensorbend", "generate", "--model", str(tmp_path / "ckpt"),
         "--prompt", "alpha beta", "--max-new-tokens", "12", "--max-memory", f"{budget}B",
         "--store-dir", str(tmp_path / "store"), "--quiet", "--json", str(tmp_path / "s.json"),
         "--dtype", dtype],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("alpha beta") and "[tensorbend]" in out.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert total > 2 * budget and s["cache_slots"] * expert_bytes < budget
    assert s["bytes_read_per_token"] > 0 and s["decode_tokens"] > 0
    onednn = dtype == "bf16" and torch.backends.mkldnn.is_available()
    assert s["memory_plan"]["onednn"] == (ONEDNN_RESERVE if onednn else 0)
    name = "float32" if dtype == "float32" else "bfloat16"
    (store,) = (tmp_path / "store").glob(f"ckpt-*/experts-{name}.safetensors")
    assert store.stat().st_size > total
    assert s["peak_rss_bytes"] <= base + budget, (s["peak_rss_bytes"], base)


def test_accelerate_engine_streams_every_offloaded_layer_and_writes_the_same_text(tmp_path, capsys):
    """The baseline without tensorbend (`--engine accelerate`): under a 96 MB budget accelerate
    keeps at most one of the four 75 MB MoE layers and streams the rest in every forward; its
    greedy text equals tensorbend's (both equal the resident model's); with a budget the whole
    model fits in, nothing is offloaded; a predictor is refused with it."""
    from tensorbend.predictors.checkpoint import save_predictor
    from tensorbend.predictors.registry import build_baseline

    ref = _wide_checkpoint(tmp_path / "ckpt")
    layer_bytes = 32 * 3 * 128 * 1536 * 4
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "alpha beta",
            "--max-new-tokens", "6", "--store-dir", str(tmp_path / "store"), "--quiet"]  # fmt: skip
    texts, summaries = {}, {}
    for name, extra in (("tensorbend", ["--max-memory", "96MB"]),
                        ("accelerate", ["--max-memory", "96MB", "--engine", "accelerate"]),
                        ("fits", ["--max-memory", "2GB", "--engine", "accelerate"])):  # fmt: skip
        assert main(argv + extra + ["--json", str(tmp_path / f"{name}.json")]) == 0
        texts[name] = capsys.readouterr().out
        summaries[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert texts["accelerate"] == texts["tensorbend"] == texts["fits"]
    assert texts["tensorbend"].startswith("alpha beta")
    acc = summaries["accelerate"]
    assert acc["engine"] == "accelerate" and acc["decode_tokens"] == 5
    assert 3 * layer_bytes <= acc["offloaded_bytes"] == acc["bytes_read_per_token"]
    assert acc["offloaded_bytes"] < 4 * layer_bytes + 8 * 10**6
    assert summaries["fits"]["offloaded_bytes"] == 0
    assert acc["load_peak_rss_bytes"] > 0 and acc["peak_rss_bytes"] > 0
    assert not list((tmp_path / "store").glob("accelerate-offload-*"))  # its folder removed
    assert main(argv + ["--engine", "accelerate"]) == 2  # no budget: nothing to place within
    assert "expected --max-memory" in capsys.readouterr().err
    spec = describe_model(ref)
    ids = torch.randint(0, spec.num_experts, (8, spec.num_moe_layers, spec.top_k))
    rows = {"expert_ids_TLK": ids, "prompt_T": torch.zeros(8, dtype=torch.long),
            "position_T": torch.arange(8), "phase_T": torch.ones(8, dtype=torch.long)}  # fmt: skip
    pred = save_predictor(build_baseline("frequency", spec, "d1", train_rows=rows),
                          tmp_path / "freq.safetensors", fingerprint="0" * 16)  # fmt: skip
    flags = ["--engine", "accelerate", "--max-memory", "96MB", "--policy", "prefetch",
             "--predictor", str(pred)]  # fmt: skip
    assert main(argv + flags) == 2
    assert "predicts nothing" in capsys.readouterr().err


def test_budget_holds_with_a_predictor_and_serving_imports_no_numba(tmp_path):
    """With a predictor under --max-memory, peak RSS stays within the import baseline + the
    budget and the text is the one served without prediction; the predictors decode in numpy,
    so serving never imports numba (whose > 60 MB would come out of the expert cache)."""
    from tensorbend.predictors.checkpoint import save_predictor
    from tensorbend.predictors.registry import build_baseline
    from tensorbend.routers import model_fingerprint

    ref = _wide_checkpoint(tmp_path / "ckpt")
    spec = describe_model(ref)
    ids = torch.randint(0, spec.num_experts, (40, spec.num_moe_layers, spec.top_k))
    rows = {"expert_ids_TLK": ids, "prompt_T": torch.zeros(40, dtype=torch.long),
            "position_T": torch.arange(40), "phase_T": torch.ones(40, dtype=torch.long)}  # fmt: skip
    p = build_baseline("frequency", spec, "d1", train_rows=rows)
    pred = save_predictor(p, tmp_path / "freq.safetensors",
                          fingerprint=model_fingerprint(ref, spec))  # fmt: skip
    del ref
    budget = 250 * 10**6
    base = _import_baseline()
    cli = ("import sys; from tensorbend.cli import main; r = main(sys.argv[1:]); "
           "print('numba imported:', 'numba' in sys.modules, file=sys.stderr); sys.exit(r)")  # fmt: skip
    texts = {}
    for policy in ("lru", "prefetch"):
        flags = ["--predictor", str(pred)] if policy == "prefetch" else []
        out = subprocess.run(
            [sys.executable, "-c", cli, "generate", "--model", str(tmp_path / "ckpt"),
             "--prompt", "alpha beta", "--max-new-tokens", "8", "--max-memory", f"{budget}B",
             "--store-dir", str(tmp_path / "store"), "--quiet", "--policy", policy, *flags,
             "--json", str(tmp_path / f"{policy}.json")],
            capture_output=True, text=True,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "numba imported: False" in out.stderr, out.stderr
        s = json.loads((tmp_path / f"{policy}.json").read_text())
        assert s["peak_rss_bytes"] <= base + budget, (policy, s["peak_rss_bytes"], base)
        texts[policy] = out.stdout
    assert texts["prefetch"] == texts["lru"] != ""  # prediction changes what is read, not text


def test_memory_plan_charges_the_measured_model_part():
    """Hand-computed plan: 100 MB budget, experts of 1 MB, top-2 staging, a 10 MB reserve.
    With the model's tensors (5 MB) alone the cache gets 100 - 5 - 2 - 10 = 83 MB (83 slots at
    the slot table); when loading the model grew the process by 30 MB (modeling code, Python
    objects, predictors) that is charged instead: 58. A measured growth below the tensors'
    bytes charges the tensors; a budget too small names the measured part and the minimum."""
    from tensorbend.cache.config import PolicyConfig
    from tensorbend.models import RoutingSpec
    from tensorbend.serving.offloaded import ServeConfig, memory_plan

    spec = RoutingSpec(family="qwen3_moe", router_kind="softmax", num_experts=32,
                       top_k=2, hidden_size=16, num_decoder_layers=4,
                       moe_layer_ids=(0, 1, 2, 3))  # fmt: skip
    cfg = ServeConfig(max_memory="100MB", reserve="10MB")
    mb = 10**6
    assert memory_plan(cfg, 5 * mb, spec, mb, 0)["cache"] == 83 * mb
    assert PolicyConfig(cache_bytes=83 * mb).slots(spec, mb) == 83
    plan = memory_plan(cfg, 5 * mb, spec, mb, 0, loaded_bytes=30 * mb)
    assert (plan["cache"], plan["model"], plan["non_expert"]) == (58 * mb, 30 * mb, 5 * mb)
    assert memory_plan(cfg, 5 * mb, spec, mb, 0, loaded_bytes=3 * mb)["cache"] == 83 * mb
    # one staging slot instead of top-k (2): its other 1 MB goes to the cache
    one = ServeConfig(max_memory="100MB", reserve="10MB", offload=PolicyConfig(staging_slots=1))
    plan = memory_plan(one, 5 * mb, spec, mb, 0)
    assert (plan["staging"], plan["cache"]) == (1 * mb, 84 * mb)
    # --reserve auto (no KV cache, no heads: the fixed part) and oneDNN's part beside it
    auto = ServeConfig(max_memory="300MB")
    plain, dnn = (memory_plan(auto, 5 * mb, spec, mb, 0, onednn=o) for o in (False, True))
    assert plain["reserve"] == RESERVE_FIXED and plain["onednn"] == 0
    assert dnn["reserve"] == RESERVE_FIXED + ONEDNN_RESERVE == dnn["onednn"] + RESERVE_FIXED
    assert dnn["cache"] == plain["cache"] - ONEDNN_RESERVE
    with pytest.raises(tensorbend.TensorbendError) as e:
        memory_plan(cfg, 5 * mb, spec, mb, 0, loaded_bytes=90 * mb)
    assert str(e.value) == (
        "--max-memory 100MB: expected at least 104.0 MB = the model without its experts 90.0 MB "
        "(measured; its tensors 5.0 MB) + staging 2.0 MB + --reserve 10.0 MB + 2 cached experts "
        "of 1.0 MB; raise it"
    )


def test_peak_rss_is_the_process_own_not_its_parents():
    """A child started by a process that touched 1 GB reports its own peak resident set (an
    import of tensorbend's runtime, well under 1 GB), not the parent's: getrusage's ru_maxrss
    carries the parent's peak across fork/vfork and exec, which once made the serving bench's
    import baseline read 866 MB instead of ~400 MB."""
    from tensorbend.memory import peak_rss_bytes

    ballast = bytearray(b"\x01") * (1 << 30)  # every page touched
    code = "from tensorbend.memory import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True).stdout)  # fmt: skip
    assert peak_rss_bytes() >= len(ballast)
    assert 0 < child < 700 << 20, child / 2**20
    del ballast


def test_readme_serving_snippet_runs(tmp_path, monkeypatch, capsys):
    """README's load_offloaded example, as written, on a checkpoint directory named as in it (a
    link to the bundled default, as the README suggests); its store in a scratch directory."""
    import re
    from pathlib import Path

    from tensorbend.zoo import resolve_model

    monkeypatch.setenv("TENSORBEND_STORE_DIR", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-moe-checkpoint").symlink_to(resolve_model("zoo:default"))
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = next(
        b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "load_offloaded" in b
    )
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "'bytes_read_per_token'" in out
    assert list((tmp_path / "store").glob("*/experts-float32.safetensors"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: checks that the device "
                    "path (cache slots on the GPU, pinned staging, copy stream) generates what "
                    "the resident model on the same GPU generates")  # fmt: skip
def test_cuda_generate_equals_resident(tmp_path):
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    ref = _resident(ckpt).to("cuda")
    model = tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "s", cache_frac=0.3,
                                      device="cuda", progress=False)  # fmt: skip
    ids = torch.tensor([[5, 17, 33, 2, 40, 8]], device="cuda")
    with torch.inference_mode():
        want = ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=1)
        assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False,
                                          pad_token_id=1), want)  # fmt: skip
    assert model.tensorbend.counters()["peak_device_bytes"] > 0
    model.tensorbend.close()


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_same_entry_reproduces_run_bytes(policy, tmp_path):
    """`tensorbend measure` (resident reference, then the handle per policy) and load_offloaded +
    transformers' generate() read exactly the same expert bytes on the same prompts (greedy:
    the same tokens, so the same routing; generate's N new tokens take N - 1 decode forwards),
    load_offloaded with its default admission (auto: frequency for these)."""
    from tensorbend.cache.config import PolicyConfig
    from tensorbend.capture.hf import DecodeConfig
    from tensorbend.capture.prompts import load_prompts
    from tensorbend.offload.runner import RunConfig, run
    from tensorbend.offload.session import SessionConfig
    from tensorbend.zoo import resolve_model

    n = 6
    session = SessionConfig(decode=DecodeConfig(decode="greedy", max_new_tokens=n))
    ran = run(RunConfig(model="zoo:default", max_prompts=2, link="none", session=session,
                        offload=PolicyConfig(policy, cache_frac=0.25, admission="auto")))  # fmt: skip
    from transformers import AutoTokenizer

    path = resolve_model("zoo:default")
    tok = AutoTokenizer.from_pretrained(path)
    model = tensorbend.load_offloaded(path, store_dir=tmp_path, cache_frac=0.25, policy=policy,
                                      progress=False)  # fmt: skip
    with torch.inference_mode():
        for p in load_prompts(None, "test")[:2]:
            ids = tok(p.text, return_tensors="pt").input_ids
            model.generate(ids, max_new_tokens=n + 1, do_sample=False)
    c = model.tensorbend.counters()
    model.tensorbend.close()
    assert (
        c["decode"]["tokens"] == ran.tokens["decode"]
        and c["prefill"]["tokens"] == ran.tokens["prefill"]
    )
    assert c["totals"]["bytes_read"] == ran.counters["bytes_read"] > 0
    assert c["decode"]["bytes_read_per_token"] == ran.bytes_read_per_token


def test_predictor_of_another_model_or_kind_refused(tmp_path, capsys):
    """A within-token checkpoint saved for another fingerprint is refused by `generate`, and
    one of the right model passed as --horizon is refused as the wrong kind; one of the right
    model and kind serves."""
    from tensorbend.predictors.checkpoint import save_predictor
    from tensorbend.predictors.registry import build_baseline
    from tensorbend.routers import model_fingerprint

    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    ref = _resident(ckpt)
    spec = describe_model(ref)
    ids = torch.randint(0, spec.num_experts, (40, spec.num_moe_layers, spec.top_k))
    rows = {"expert_ids_TLK": ids, "prompt_T": torch.zeros(40, dtype=torch.long),
            "position_T": torch.arange(40), "phase_T": torch.ones(40, dtype=torch.long)}  # fmt: skip
    p = build_baseline("frequency", spec, "d1", train_rows=rows)
    other = save_predictor(p, tmp_path / "other.safetensors", fingerprint="0123456789abcdef")
    mine = save_predictor(p, tmp_path / "mine.safetensors",
                          fingerprint=model_fingerprint(ref, spec))  # fmt: skip
    capsys.readouterr()
    base = ["generate", "--model", str(ckpt), "--prompt", "ab", "--quiet", "--store-dir",
            str(tmp_path / "s"), "--policy", "prefetch"]  # fmt: skip
    assert main([*base, "--predictor", str(other)]) == 2
    assert "trained for model fingerprint 0123456789abcdef" in capsys.readouterr().err
    assert main([*base, "--horizon", str(mine)]) == 2
    assert "expected a cross-token (horizon) predictor" in capsys.readouterr().err
    assert main([*base, "--predictor", str(mine), "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("ab")


def test_bf16_checkpoint_converted_into_a_float32_store(tmp_path):
    """Shards in bf16, served in float32: each stored expert equals what from_pretrained(dtype=
    float32) builds (the conversion goes through the staging buffer)."""
    from tiny_models import build

    model = build("qwen3_moe").to(torch.bfloat16)
    model.config.eos_token_id = 1
    model.save_pretrained(tmp_path / "ckpt")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32,
                                               experts_implementation="eager")  # fmt: skip
    spec = describe_model(ref)
    lm = tensorbend.load_offloaded(tmp_path / "ckpt", store_dir=tmp_path / "s", cache_frac=0.5,
                                   dtype=torch.float32, progress=False)  # fmt: skip
    h = lm.tensorbend
    for m in range(spec.num_moe_layers):
        mod = getattr(moe_block(ref, spec, m), spec.experts_attr)
        for e in range(spec.num_experts):
            want = torch.cat([getattr(mod, n)[e].reshape(-1) for n, _ in h.layout.parts])
            got = torch.empty(h.layout.numel)
            h.store.read_into(m, e, got)
            assert got.dtype == torch.float32 and torch.equal(got, want)
    h.close()


def test_generate_flags_build_the_nested_decode_config(monkeypatch):
    """`tensorbend generate` keeps its flags and defaults (--max-new-tokens 64, --sample,
    --temperature, --top-p, --seed) over the one DecodeConfig it nests."""
    import tensorbend.serving.generate
    from tensorbend.capture.hf import DecodeConfig

    got = []
    monkeypatch.setattr(tensorbend.serving.generate, "generate", lambda cfg: got.append(cfg) or {})
    base = ["generate", "--model", "m", "--prompt", "x", "--quiet"]
    assert main(base) == 0 and main([*base, "--sample", "--seed", "3", "--top-p", "0.5"]) == 0
    assert got[0].decode == DecodeConfig("greedy", max_new_tokens=64) and got[0].top_p == 1.0
    assert got[1].decode == DecodeConfig("sample", max_new_tokens=64, seed=3)
    assert got[1].top_p == 0.5


def test_the_serving_guides_zoo_budget_fits(tmp_path):
    """docs/guide/serving.md's zoo:default command's --max-memory serves zoo:default (a budget
    below the model without experts + staging + reserve + a layer's top-k is refused): generate
    with that budget and one prompt, on its default cache (the guide's predictor files would
    need training first)."""
    import re
    from pathlib import Path

    guide = (Path(__file__).parents[1] / "docs" / "guide" / "serving.md").read_text()
    [budget] = re.findall(r"--model zoo:default --prompts \S+ --max-memory (\S+)", guide)
    cmd = [sys.executable, "-m", "tensorbend", "generate", "--model", "zoo:default", "--prompt",
           "The river", "--max-new-tokens", "2", "--max-memory", budget, "--quiet",
           "--store-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "policy lfru, admission frequency" in done.stderr  # generate's default cache


def test_generate_prints_the_plan_of_an_explicit_reserve(tmp_path, capsys):
    """`--reserve 80MB` (no context to size for: the plan's context_tokens is None) prints the
    plan's line with that reserve; it used to fail formatting None. In bf16 on a CPU with
    oneDNN, --reserve auto names oneDNN's part."""
    argv = ["generate", "--model", "zoo:qwen3moe-tiny", "--prompt", "hello", "--max-new-tokens",
            "2", "--max-memory", "200MB", "--store-dir", str(tmp_path / "store")]  # fmt: skip
    assert main(argv + ["--reserve", "80MB"]) == 0
    assert "+ reserve 80.0 + cache " in capsys.readouterr().err
    assert main(argv + ["--dtype", "bf16"]) == 0
    err = capsys.readouterr().err
    onednn = f"+ reserve {(RESERVE_FIXED + ONEDNN_RESERVE) / 1e6:.1f} (oneDNN 64.0)"
    assert (onednn in err) == torch.backends.mkldnn.is_available(), err[-600:]
