"""Offloaded generation: identical tokens and logits for every policy, family and predictor;
hand-countable counters; clear errors for a broken store; the `run` verb."""

import json

import pytest
import torch
from tiny_models import build, char_tokenizer, save_checkpoint, write_prompts

from tensorbend.cache.config import PolicyConfig
from tensorbend.cache.transfers import Link
from tensorbend.capture.hf import DecodeConfig
from tensorbend.capture.prompts import Prompt
from tensorbend.cli import main
from tensorbend.errors import StoreError, UnsupportedModelError
from tensorbend.models import describe_model
from tensorbend.offload.layer import OFFLOAD_FAMILIES
from tensorbend.offload.recorded import RecordedRouting
from tensorbend.offload.session import OffloadSession, SessionConfig
from tensorbend.offload.store import ExpertStore
from tensorbend.predictors.base import LOOKAHEADS
from tensorbend.predictors.registry import build_baseline
from tensorbend.routers import router_params
from tensorbend.zoo import list_models

PROMPTS = [Prompt("a", "the quick brown fox"), Prompt("b", "kernel module river")]
RUN_KEYS = {
    "model",
    "policy",
    "predictor",
    "cache_frac",
    "decode_tok_s",
    "prefill_tok_s",
    "stall_s_per_token",
    "bytes_read_per_token",
    "demand_hit_rate",
    "wasted_prefetch_bytes",
    "output_matches_resident",
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: on a shared 2-core machine spinning OpenMP threads cost 10-100x."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class EmptyPredictor:
    """Predicts nothing (every score -inf): prefetch must still finish and match."""

    kind = "empty"
    needs_truth = recorded_routing = predicts_nothing = False
    checkpoint = None

    def __init__(self, spec, la):
        self.spec, self.lookahead = spec, LOOKAHEADS[la]

    def scores(self, m, src):
        return torch.full((len(src), self.spec.num_experts), float("-inf"))


def _session(family, tmp_path=None, n_new=4, seed=0):
    model = build(family, seed)
    cfg = SessionConfig(DecodeConfig(max_new_tokens=n_new), store_dir=tmp_path, io_threads=3)
    return OffloadSession(model, char_tokenizer(), PROMPTS, cfg, model_name=family)


def _check(result):
    r = result.to_json()
    assert r["output_matches_resident"] is True, r
    assert r["max_logit_abs_diff"] == 0.0  # same ops, same order: bit-identical in fp32
    c = r["counters"]
    assert c["peak_entries"] <= r["cache_slots"]
    assert c["hits"] + c["late"] + c["misses"] > 0 and c["stall_s"] >= 0
    return r


@pytest.mark.parametrize("family", [f for f in OFFLOAD_FAMILIES if f != "deepseek_v3"])
def test_every_family_matches_resident(family):
    sess = _session(family)
    spec = sess.spec
    rnd = build_baseline("random", spec, "d1", seed=1)
    try:
        _check(sess.run_policy(PolicyConfig("lru", cache_frac=0.3)))
        _check(sess.run_policy(PolicyConfig("prefetch", cache_frac=0.3), predictor=rnd))
        _check(sess.run_policy(PolicyConfig("oracle", cache_frac=0.3, lookahead="pre_attn")))
    finally:
        sess.close()


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_bfloat16_offloaded_matches_resident_bit_for_bit(family):
    """In bfloat16 too, the offloaded experts (weights viewed from cache slots, the same ops
    in eager's order) give the resident model's tokens and logits exactly."""
    model = build(family).to(torch.bfloat16)
    cfg = SessionConfig(DecodeConfig(max_new_tokens=4), io_threads=2)
    sess = OffloadSession(model, char_tokenizer(), PROMPTS, cfg, model_name=family)
    try:
        r = sess.run_policy(PolicyConfig("lru", cache_frac=0.3)).to_json()
        assert r["output_matches_resident"] is True and r["max_logit_abs_diff"] == 0.0, r
        assert r["tokens"]["decode"] > 0 and r["counters"]["misses"] > 0
    finally:
        sess.close()


def test_every_policy_and_predictor_matches_resident_deepseek():
    sess = _session("deepseek_v3", n_new=5)
    spec = sess.spec
    params = router_params_of(sess)
    preds = [
        build_baseline("random", spec, "d2", seed=3),
        build_baseline("spec_gate", spec, "d1", router_params=params),
        build_baseline("spec_gate", spec, "pre_attn", router_params=params),
        build_baseline("spec_gate", spec, "same_layer", router_params=params),
        EmptyPredictor(spec, "d1"),
    ]
    link = Link(50e6, 20e-6, "test")
    try:
        for pol in ("on_demand", "lru", "lfu", "oracle"):
            _check(sess.run_policy(PolicyConfig(pol, cache_frac=0.25), link=link))
        for p in preds:
            pc = PolicyConfig("prefetch", cache_frac=0.25)
            r = _check(sess.run_policy(pc, p, link, prefetch_extra=2))
            assert r["predictor"] == p.kind and r["lookahead"] == p.lookahead.name
            assert r["link"]["bandwidth_MBps"] == 50.0
        assert r["counters"]["prefetch_issued"] == 0  # the empty predictor prefetched nothing
    finally:
        sess.close()


def router_params_of(sess):
    # the session freed the experts, but routers stay resident
    return router_params(sess.model, sess.spec)


def test_counters_by_hand_on_demand_and_full_oracle():
    sess = _session("mixtral", n_new=6)
    spec, ref = sess.spec, sess.reference
    L, K, nbytes = spec.num_moe_layers, spec.top_k, sess.layout.nbytes
    try:
        r = _check(sess.run_policy(PolicyConfig("on_demand", cache_frac=0.5)))
        c = r["counters"]
        assert c["bypassed"] == c["misses"]  # nothing kept: every miss is read into staging
        # keeps nothing: every needed expert of every forward is read once
        needed = sum(
            len(set(ids_TLK[:, m].flatten().tolist())) for ids_TLK in ref.ids for m in range(L)
        )
        assert c["hits"] == 0 and c["misses"] == needed and c["bytes_read"] == needed * nbytes
        assert r["bytes_read_per_token"] == K * L * nbytes  # batch-1 decode: K distinct per layer
        assert r["demand_hit_rate"] == 0.0
        # the I/O threads spent CPU on those reads; decode's share is part of the run's total
        decode_io_cpu = r["io_cpu_s_per_token"] * r["tokens"]["decode"]
        assert 0 < decode_io_cpu < c["io_cpu_s"] + 1e-9
        assert sess.resident_result().to_json()["io_cpu_s_per_token"] is None  # no I/O threads

        # one staging slot: a layer's K misses load one after another through it (each
        # computed and dropped before the next is read), the same reads, the same output
        r1 = _check(sess.run_policy(PolicyConfig("on_demand", cache_frac=0.5, staging_slots=1)))
        assert r1["counters"]["bytes_read"] == c["bytes_read"]
        assert r1["counters"]["bypassed"] == c["bypassed"]

        r = _check(sess.run_policy(PolicyConfig("oracle", cache_frac=1.0)))
        c = r["counters"]
        used = {
            (m, e)
            for ids_TLK in ref.ids
            for m in range(L)
            for e in ids_TLK[:, m].flatten().tolist()
        }
        # everything fits and predictions are exact: each used expert is read exactly once
        assert c["bytes_read"] == len(used) * nbytes and c["evictions"] == 0
        assert r["wasted_prefetch_bytes"] == 0 and c["prefetch_wasted"] == 0

        r = _check(sess.run_policy(PolicyConfig("lru", cache_bytes=5 * nbytes + 7)))
        assert r["cache_slots"] == 5 and r["counters"]["peak_entries"] <= 5
    finally:
        sess.close()


def test_llama4_is_declared_unsupported():
    model = build("llama4_text")
    with pytest.raises(
        UnsupportedModelError, match=r"offload of llama4_text .* not supported .*pre-scaled"
    ):
        OffloadSession(
            model, char_tokenizer(), PROMPTS, SessionConfig(DecodeConfig(max_new_tokens=1))
        )


def test_truncated_store_and_failing_reads_name_the_file(tmp_path, monkeypatch):
    sess = _session("qwen2_moe", tmp_path, n_new=2)
    path = sess.store_path
    try:
        data = path.read_bytes()
        path.write_bytes(data[:-10])
        with pytest.raises(StoreError, match=rf"{path} is truncated"):
            sess.run_policy(PolicyConfig("lru", cache_frac=0.5))
        path.write_bytes(data)

        real = ExpertStore.read_into

        def flaky(self, m, e, out, pause=None):
            if (m, e) == (1, 3):
                raise StoreError(f"expert store {self.path}: read of layer 1 expert 3 failed (EIO)")
            return real(self, m, e, out, pause)

        monkeypatch.setattr(ExpertStore, "read_into", flaky)
        with pytest.raises(StoreError, match=rf"{path}: read of layer 1 expert 3 failed"):
            sess.run_policy(PolicyConfig("on_demand", cache_frac=0.5))
    finally:
        sess.close()


def test_run_verb_writes_design_json(tmp_path, capsys):
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "model")
    prompts = write_prompts(tmp_path / "p.jsonl", 4)
    out = tmp_path / "r.json"
    base = [
        "run",
        "--model",
        str(ckpt),
        "--prompts",
        str(prompts),
        "--split",
        "all",
        "--max-prompts",
        "2",
        "--max-new-tokens",
        "3",
        "--quiet",
    ]
    rc = main(
        [
            *base,
            "--policy",
            "prefetch",
            "--baseline",
            "spec_gate",
            "--link",
            "200MB/s,10us",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    r = json.loads(out.read_text())
    assert RUN_KEYS <= set(r) and r["output_matches_resident"] is True
    assert r["predictor"] == "spec_gate" and r["link"]["bandwidth_MBps"] == 200.0
    rc = main([*base, "--policy", "prefetch"])
    assert (
        rc == 2
        and "error: --policy prefetch needs a predictor: --predictor" in capsys.readouterr().err
    )


@pytest.mark.skipif(
    not any(m["default"] for m in list_models()), reason="zoo:default not bundled yet"
)
def test_zoo_default_matches_resident():
    from tensorbend.capture.hf import load_model

    model, tok = load_model("zoo:default")
    spec = describe_model(model)
    cfg = SessionConfig(DecodeConfig(max_new_tokens=3))
    sess = OffloadSession(model, tok, PROMPTS[:1], cfg, "zoo:default")
    try:
        p = build_baseline("spec_gate", spec, "d1", router_params=router_params(model, spec))
        for pol, pred in (("lru", None), ("prefetch", p), ("oracle", None)):
            _check(sess.run_policy(PolicyConfig(pol, cache_frac=0.125), pred))
    finally:
        sess.close()


def test_teacher_forced_decode_feeds_the_continuation():
    prompts = [Prompt("c", "stone light", continuation=" dark river"), Prompt("d", "alpha")]
    cfg = SessionConfig(DecodeConfig(decode="teacher", max_new_tokens=4))
    sess = OffloadSession(build("olmoe"), char_tokenizer(), prompts, cfg, model_name="olmoe")
    try:
        assert sess.reference.tokens["decode"] == 4  # " dar", then prompt d has no continuation
        assert [len(d.fed_ids) for d in sess.reference.decoded] == [4, 0]
        r = _check(sess.run_policy(PolicyConfig("lfu", cache_frac=0.5)))
        assert r["decode"] == "teacher" and r["tokens"] == {"prefill": 16, "decode": 4}
    finally:
        sess.close()


def test_every_cache_option_matches_resident():
    sess = _session("qwen3_moe", n_new=5)
    rnd = build_baseline("random", sess.spec, "d1", seed=2)
    link = Link(80e6, 10e-6, "test")
    try:
        for pc, pred in [
            (PolicyConfig("lfru", cache_frac=0.3), None),
            (PolicyConfig("lru", cache_frac=0.5, pool="per_layer"), None),
            (PolicyConfig("lfu", cache_frac=0.3, admission="frequency", admission_window=2), None),
            (PolicyConfig("prefetch", cache_frac=0.3, admission="predicted"), rnd),
            (PolicyConfig("oracle", cache_frac=0.3, foresight=0), None),
            (PolicyConfig("oracle", cache_frac=0.3, foresight=1, admission="predicted"), None),
            (PolicyConfig("oracle", cache_frac=0.5, foresight=2, pool="per_layer"), None),
            (PolicyConfig("oracle", cache_frac=0.3, lookahead="d2", foresight=4), None),
        ]:
            r = _check(sess.run_policy(pc, pred, link))
            assert (r["pool"], r["admission"]) == (pc.pool, pc.admission)
    finally:
        sess.close()


def test_oracle_without_foresight_is_lru_and_with_it_prefetches_across_tokens(monkeypatch):
    sess = _session("mixtral", n_new=6)  # 3 MoE layers x 6 experts: 9 slots > one layer's 6
    try:
        counts = ("hits", "late", "misses", "bytes_read", "evictions", "prefetch_issued")
        lru = _check(sess.run_policy(PolicyConfig("lru", cache_frac=0.5)))["counters"]
        blind = _check(sess.run_policy(PolicyConfig("oracle", cache_frac=0.5, foresight=0)))
        assert {k: blind["counters"][k] for k in counts} == {k: lru[k] for k in counts}
        assert lru["prefetch_issued"] == 0
        differ = []
        for rule in ("lfu", "lfru"):  # --oracle-beyond: what it cannot see ranks by that rule
            cache = _check(sess.run_policy(PolicyConfig(rule, cache_frac=0.5)))["counters"]
            differ.append(cache["misses"] != lru["misses"])
            pc = PolicyConfig("oracle", cache_frac=0.5, foresight=0, oracle_beyond=rule)
            seen = _check(sess.run_policy(pc))
            assert {k: seen["counters"][k] for k in counts} == {k: cache[k] for k in counts}
            assert seen["oracle_beyond"] == rule
        assert any(differ)  # the rule beyond its sight made a difference here

        asked = []
        real = RecordedRouting.ahead

        def ahead(self, now):
            out = real(self, now)
            asked.append((self.foresight, now, out))
            return out

        monkeypatch.setattr(RecordedRouting, "ahead", ahead)
        L, ids = sess.spec.num_moe_layers, sess.reference.ids
        for h in (1, 2, None):
            _check(sess.run_policy(PolicyConfig("oracle", cache_frac=0.5, foresight=h)))
        for h, now, out in asked:
            target = now + 1  # d1
            crosses = target // L > now // L
            if target >= len(ids) * L or (h == 1 and crosses):
                assert out == [], (h, now)  # past the run, or beyond its sight
            else:  # exactly the experts the resident run used at the target step
                f, m = divmod(target, L)
                assert sorted(e for (_, e), _ in out) == sorted(
                    set(ids[f][:, m].flatten().tolist())
                )
                assert all(mm == m and w == target for (mm, _), w in out)
        crossing = [out for h, now, out in asked if h == 2 and (now + 1) % L == 0 and out]
        assert len(crossing) == len(ids) - 1  # each forward's last router -> next forward
    finally:
        sess.close()


def test_a_batch_of_four_matches_its_resident_batch_and_loads_the_union():
    """Four prompts of different lengths in lockstep (left-padded prefill): every policy's
    tokens and logits equal the resident batched run's; each decode forward routes 4 tokens,
    and the oracle's loads are the union of their experts; prompts are counted without pads."""
    prompts = [Prompt("a", "the quick brown fox"), Prompt("b", "kernel"),
               Prompt("c", "a river of stone and light"), Prompt("d", "moss")]  # fmt: skip
    cfg = SessionConfig(DecodeConfig(max_new_tokens=3), batch=4)
    model = build("deepseek_v3")
    sess = OffloadSession(model, char_tokenizer(), prompts, cfg, model_name="deepseek_v3")
    spec = sess.spec
    try:
        ref = sess.reference
        n_prompt = sum(len(d.prompt_ids) for d in ref.decoded)
        assert ref.tokens == {"prefill": n_prompt, "decode": 4 * 3}
        assert ref.forwards == 4 and all(x.shape[0] == 4 for x in ref.logits)
        assert [x.shape[0] for x in ref.ids[1:]] == [4, 4, 4]  # one token per sequence
        assert all(len(d.fed_ids) == 3 for d in ref.decoded)
        p = build_baseline("spec_gate", spec, "d1", router_params=router_params_of(sess))
        for pol, pred in (("lru", None), ("lfru", None), ("prefetch", p), ("oracle", None)):
            r = _check(sess.run_policy(PolicyConfig(pol, cache_frac=0.25), pred))
            assert r["batch"] == 4 and r["tokens"] == ref.tokens
        r = sess.run_policy(PolicyConfig("on_demand", cache_frac=0.25)).to_json()
        assert r["output_matches_resident"] is True
        # on_demand loads, per decode forward and layer, exactly the union of the 4 tokens'
        # experts (each expert used once per forward: nothing kept between forwards)
        union = sum(len(set(x[:, m].flatten().tolist())) for x in ref.ids[1:]
                    for m in range(spec.num_moe_layers))  # fmt: skip
        dec_bytes = r["bytes_read_per_token"] * r["tokens"]["decode"]
        assert dec_bytes == union * r["expert_bytes"]
        from test_prefetcher import _horizon

        hz = _horizon(spec)  # one history per sequence, forecasts merged
        r = _check(sess.run_policy(PolicyConfig("prefetch", cache_frac=0.25), p, horizon=hz))
        assert r["horizon"] is not None and r["counters"]["prefetch_issued"] > 0
    finally:
        sess.close()


def test_predictions_followed_by_a_wait_for_a_load_count_as_overlapping_it():
    """Exposed prediction time (`PredictionHooks.settle`): a decode prediction is exposed
    unless the compute thread then waits for an expert load in the same MoE layer (overlaps
    it). With a cache of top-k slots and a link far slower than the tiny model's math, every
    layer waits for a load (its experts were evicted by the layers between its visits; a
    prefetch is still on the wire), so none is exposed; with every expert held and no link
    cap, exposed seconds are part of the decode prediction seconds, and so are its scoring
    and queueing seconds; a run without a predictor scores nothing."""
    sess = _session("deepseek_v3", n_new=4)
    spec = sess.spec
    pred = build_baseline("spec_gate", spec, "d1", router_params=router_params_of(sess))
    try:
        slow = Link(0.2e6, 0.0, "slow")  # ~50 ms per expert of this model
        pc = PolicyConfig("prefetch", cache_bytes=spec.top_k * sess.layout.nbytes)
        r = _check(sess.run_policy(pc, pred, slow))
        assert r["decode_predict_s_per_token"] > 0
        assert r["decode_predict_exposed_s_per_token"] == 0.0
        r = _check(sess.run_policy(PolicyConfig("prefetch", cache_frac=1.0), pred))
        assert 0.0 <= r["decode_predict_exposed_s_per_token"] <= r["decode_predict_s_per_token"]
        # decode's split: scoring (the baseline's scores calls) and queueing are parts of it
        score, queue = r["decode_predict_score_s_per_token"], r["decode_predict_queue_s_per_token"]
        assert score > 0 and queue > 0 and score + queue <= r["decode_predict_s_per_token"]
        lru = _check(sess.run_policy(PolicyConfig("lru", cache_frac=1.0)))
        assert lru["decode_predict_score_s_per_token"] == 0.0  # nothing scores without one
    finally:
        sess.close()
