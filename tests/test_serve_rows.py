"""The real-disk serving bench's rows (bench/serve_rows.py): each peer that predicts runs with
the cache and admission ours uses, the page-cache row keeps no expert of its own, narrower
prefetch widths are added for every predicting row, and an external engine's row must give
every key the aggregate reads."""

from pathlib import Path

import pytest

from bench import serve_rows
from bench.serve_rows import PAGE_CACHE, PREFETCH, ROW_KEYS, external_row, is_ours, policies


def test_peers_share_ours_cache_and_admission():
    rows = policies(Path("d1.st"), Path("h.st"), Path("seed.st"), accelerate=True)
    ours = rows["ours: horizon+d1/adm=predicted"]
    assert ours[: len(PREFETCH)] == PREFETCH
    for peer, flag in (("spec_gate", ["--baseline", "spec_gate"]),
                       ("seed_mlp", ["--predictor", "seed.st"])):  # fmt: skip
        assert rows[f"{peer}/adm=predicted"] == PREFETCH + flag
        assert rows[f"{peer}/adm=predicted/extra=-2"] == PREFETCH + flag + [
            "--prefetch-extra",
            "-2",
        ]
        assert not is_ours(f"{peer}/adm=predicted")
    assert rows["ours: horizon+d1/adm=predicted/extra=-3"] == ours + ["--prefetch-extra", "-3"]
    within = rows["ours: horizon(evict only)+d1/adm=predicted/extra=-2"]  # no next-forward
    assert within[within.index("--token-ahead-layers") + 1] == "0"  # prefetch, top-2 within
    assert {"--horizon", "h.st", "--predictor", "d1.st", "predicted", "-2"} <= set(within)
    assert rows[PAGE_CACHE] == ["--policy", "on_demand", "--io", "buffered"]
    assert rows["lru"] == ["--policy", "lru", "--admission", "all"]  # the plain cache
    assert not any("/extra=" in n for n in rows if "adm=predicted" not in n)


def test_without_seed_mlp_no_seed_rows():
    rows = policies(None, None, None, accelerate=False)
    assert not any(n.startswith(("seed_mlp", "ours")) for n in rows)
    assert "spec_gate/adm=predicted" in rows  # needs no training: always a peer


def test_external_row_must_give_every_key(monkeypatch):
    full = {k: None for k in ROW_KEYS}
    monkeypatch.setitem(serve_rows.EXTERNAL, "engine-x", lambda name, ctx, prefill: full)
    assert external_row("engine-x", {}, prefill=False) is full
    assert "engine-x" in policies(None, None, None, accelerate=False)
    short = {k: None for k in ROW_KEYS if k != "decode_tok_s"}
    monkeypatch.setitem(serve_rows.EXTERNAL, "engine-x", lambda name, ctx, prefill: short)
    with pytest.raises(AssertionError, match="decode_tok_s"):
        external_row("engine-x", {}, prefill=True)


def test_staging_variants_are_the_same_rows_with_one_flag_more():
    """--staging-slots N: every tensorbend row that keeps experts again, with the flag and
    nothing else changed; the page cache (keeps none) and accelerate get none; a cache's
    variant still counts as a cache without prediction (the best-cache reference)."""
    from bench.serve_rows import ACCELERATE, predicts_nothing

    plain = policies(Path("d1.st"), Path("h.st"), Path("seed.st"), accelerate=True)
    rows = policies(Path("d1.st"), Path("h.st"), Path("seed.st"), accelerate=True, staging=(1, 2))
    variants = {n: f for n, f in rows.items() if n not in plain}
    keeps = [n for n in plain if n not in (PAGE_CACHE, ACCELERATE)]
    assert sorted(variants) == sorted(f"{n}/staging={k}" for n in keeps for k in (1, 2))
    for name in keeps:
        for k in (1, 2):
            assert variants[f"{name}/staging={k}"] == plain[name] + ["--staging-slots", str(k)]
    assert predicts_nothing("lfru/adm=frequency/staging=1") and predicts_nothing("lru")
    assert not predicts_nothing("spec_gate/adm=predicted/staging=1")


def test_every_row_runs_the_admission_its_name_says():
    """generate's default admission is auto (lfru keeps frequency, prefetch predicted), so a
    row's flags, parsed by `tensorbend generate`'s own parser into its cache config (the
    ServeConfig default instance's fields, as `generate` builds it), must give the admission
    its name says: adm=X where it names one, else all; and generate alone gives lfru/frequency."""
    from tensorbend.cache.config import SERVING, PolicyConfig
    from tensorbend.cli import _verbs
    from tensorbend.flags import config_from_args
    from tensorbend.parser import build_parser

    def offload(flags):
        args = build_parser(_verbs()).parse_args(
            ["generate", "--model", "m", "--prompt", "x", *flags]
        )
        return config_from_args(PolicyConfig, args, _base=SERVING)

    rows = policies(Path("d1.st"), Path("h.st"), Path("seed.st"), accelerate=False)
    for name, flags in rows.items():
        want = next((p[4:] for p in name.split("/") if p.startswith("adm=")), "all")
        assert offload(flags).admission_rule == want, name
    plain = offload([])
    assert (plain.policy, plain.admission_rule) == ("lfru", "frequency")
    assert offload(["--policy", "prefetch"]).admission_rule == "predicted"
    from tensorbend.serving.offloaded import ServeConfig

    assert ServeConfig().offload is SERVING  # load_offloaded's default is generate's


def _run(tok_s: float, text: str, dtype: str | None = "float32", engine="tensorbend") -> dict:
    """One run's summary as the aggregate reads it (a tensorbend row's `generate --json`, or
    llama_cpp_serve.warm_row's dict, whose expert_dtype is the GGUF kind)."""
    plan = {"budget": 1, "non_expert": 1, "model": 1, "staging": 1, "reserve": 1, "cache": 1}
    run = {"engine": engine, "decode_tok_s": tok_s, "bytes_read_per_token": 1.0,
           "disk_read_bytes_per_token": 1.0, "demand_hit_rate": None, "stall_s_per_token": None,
           "ttft_s": 1.0, "predict_s_per_token": None, "peak_rss_bytes": 1, "cache_slots": None,
           "decode_tokens": 9, "expert_dtype": dtype, "text": text, "expert_bytes": 8}  # fmt: skip
    return run | ({"memory_plan": plan} if engine == "tensorbend" else {})


def test_rows_at_another_precision_meet_tensorbend_at_theirs(tmp_path):
    """Planted runs, 2 repeats: llama.cpp's Q8_0 row is the fastest but is not ours' best peer
    (ours computes f32); its bf16 row is set beside tensorbend's bf16 cache per repeat (ratios
    by hand) and its text compared with that row's; Q8_0 has no tensorbend row to meet."""
    from argparse import Namespace

    from bench.serve_memory import BF16_CACHE, _aggregate

    q8, bf = "llama.cpp Q8_0 (mmap, warm)", "llama.cpp bf16 (mmap, warm)"
    runs = {
        "lfru/adm=frequency": [_run(4.0, "a"), _run(5.0, "a")],
        "spec_gate/adm=predicted": [_run(6.0, "a"), _run(4.0, "a")],
        "ours: horizon+d1/adm=predicted": [_run(7.0, "a"), _run(6.0, "a")],
        BF16_CACHE: [_run(8.0, "b", "bfloat16"), _run(10.0, "b", "bfloat16")],
        bf: [_run(2.0, "b", "bf16", "llama.cpp"), _run(5.0, "c", "bf16", "llama.cpp")],
        q8: [_run(50.0, "d", "Q8_0", "llama.cpp"), _run(60.0, "d", "Q8_0", "llama.cpp")],
        "llama.cpp f32 (mmap, warm)": [_run(1.0, "a", "f32", "llama.cpp")] * 2,
    }
    args = Namespace(model="zoo:qwen3moe-tiny", factor=184, max_memory="1GB", prompts=1,
                     max_new_tokens=9, accelerate_tokens=None, repeats=2)  # fmt: skip
    res = _aggregate(runs, args, tmp_path, baseline=0)
    by = {r["policy"]: r for r in res["results"]}
    assert res["best_no_prediction"] == "lfru/adm=frequency"
    assert res["best_peer"] == "spec_gate/adm=predicted"  # 6, 4 vs the cache's 4, 5: median 5
    assert by[bf]["same_precision_row"] == BF16_CACHE
    assert by[bf]["vs_same_precision_range"] == [2.0 / 8.0, 5.0 / 10.0]
    assert by[bf]["text_equal_to_best"] is False and by[bf]["text_reference"] == BF16_CACHE
    assert "same_precision_row" not in by[q8] and by[q8]["text_equal_to_best"] is None
    f32 = by["llama.cpp f32 (mmap, warm)"]
    assert f32["text_equal_to_best"] is True  # (against the best cache, f32 as it)
    assert f32["vs_same_precision"] == pytest.approx((1 / 4 + 1 / 5) / 2)  # per-repeat median
    assert by[BF16_CACHE]["text_equal_to_best"] is True  # (its repeats against its first)
    assert "text_reference" not in by[BF16_CACHE]  # (the reference itself)
    assert by["ours: horizon+d1/adm=predicted"]["vs_best_peer_range"] == [7.0 / 6.0, 6.0 / 4.0]
