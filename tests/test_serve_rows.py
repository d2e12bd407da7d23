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
