"""Levers of the real-disk regime. The prefetch guard on an adversarial predictor: one that
always names experts the run does not use must not read more than the same cache without
prediction by more than the guard's bound, and the output stays the resident model's. CPU
decode forwards run with the intra-op threads capped (a core left to the I/O threads)."""

import pytest
import torch
from tiny_models import build, char_tokenizer, save_checkpoint
from transformers import AutoModelForCausalLM

import tensorbend
from tensorbend.cache.config import PolicyConfig
from tensorbend.capture.hf import DecodeConfig
from tensorbend.capture.prompts import Prompt
from tensorbend.offload import handle as handle_mod
from tensorbend.offload import loader as loader_mod
from tensorbend.offload.hooks import NoPredictor
from tensorbend.offload.recorded import RecordedRouting
from tensorbend.offload.session import OffloadSession, SessionConfig
from tensorbend.predictors.base import LOOKAHEADS

PROMPTS = [Prompt("a", "the quick brown fox"), Prompt("b", "kernel module river")]
THREADS = 2


class AlwaysWrong(RecordedRouting):
    """At each source point names, for the d1 target step, experts of that layer that the
    resident run routes to neither then nor in the next two forwards: every prefetch is wrong."""

    kind = "always_wrong"

    def __init__(self, ids_per_forward, num_experts: int):
        super().__init__(ids_per_forward, LOOKAHEADS["d1"], foresight=None)
        self.num_experts = num_experts

    def ahead(self, now: int):
        target = now + self.lookahead.distance
        steps = range(target, min(target + 3 * self.L, len(self.experts_by_step)), self.L)
        used = {e for s in steps for e in self.experts_by_step[s]}
        wrong = [e for e in range(self.num_experts) if e not in used][:4]
        return [((target % self.L, e), target) for e in wrong]


@pytest.fixture(scope="module")
def session():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    model = build("mixtral", 0)
    cfg = SessionConfig(DecodeConfig(max_new_tokens=12), io_threads=THREADS)
    sess = OffloadSession(model, char_tokenizer(), PROMPTS, cfg, model_name="mixtral")
    yield sess
    sess.close()
    torch.set_num_threads(n)


def _run(sess, predictor):
    r = sess.run_policy(PolicyConfig("prefetch", cache_frac=0.3), predictor).to_json()
    assert r["output_matches_resident"] is True and r["max_logit_abs_diff"] == 0.0, r
    return r


def test_guard_bounds_an_always_wrong_predictor(session, monkeypatch):
    spec = session.spec
    adversary = AlwaysWrong(session.reference.ids, spec.num_experts)
    none = _run(session, NoPredictor(spec.num_experts, LOOKAHEADS["d1"]))
    guarded = _run(session, adversary)
    g = loader_mod.PrefetchGuard()
    c = guarded["counters"]
    assert c["prefetch_used"] == 0  # the adversary is never right
    # the guard closes after slack wasted reads; reads already started when it closed finish
    assert 0 < c["prefetch_loaded"] <= g.slack + 1 + THREADS
    # each wasted read costs its own bytes and at most one warm expert's reload
    bound = 2 * (g.slack + 1 + THREADS) * guarded["expert_bytes"]
    extra = c["bytes_read"] - none["counters"]["bytes_read"]
    assert extra <= bound, (extra, bound)

    # without the guard the same predictor keeps reading: the bound above is the guard's doing
    monkeypatch.setattr(handle_mod, "PrefetchGuard", lambda: None)
    unguarded = _run(session, adversary)["counters"]
    assert unguarded["prefetch_used"] == 0
    assert unguarded["prefetch_loaded"] > g.slack + 1 + THREADS


def test_decode_threads_leave_a_core(monkeypatch):
    monkeypatch.setattr(handle_mod.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert [handle_mod.decode_threads(n) for n in (1, 2, 8)] == [1, 1, 1]
    monkeypatch.setattr(handle_mod.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert [handle_mod.decode_threads(n) for n in (1, 8, 16, 32)] == [1, 8, 15, 15]


def test_decode_forwards_run_capped_and_prefill_and_close_restore(tmp_path, monkeypatch):
    """The cap holds during decode forwards only; tokens equal the resident model's."""
    ckpt = save_checkpoint("qwen3_moe", tmp_path / "ckpt")
    ref = AutoModelForCausalLM.from_pretrained(ckpt, experts_implementation="eager").eval()
    monkeypatch.setattr(handle_mod, "decode_threads", lambda n: 1)
    caller = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _generate_capped(ckpt, ref, tmp_path)
    finally:
        torch.set_num_threads(caller)


def _generate_capped(ckpt, ref, tmp_path):
    model = tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "store", cache_frac=0.25,
                                      progress=False)  # fmt: skip
    seen = []
    model.register_forward_hook(lambda *a: seen.append(torch.get_num_threads()))
    ids = torch.tensor([[5, 17, 33, 2, 40, 8]])
    with torch.inference_mode():
        want = ref.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=1)
        got = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=1)
    model.tensorbend.close()
    assert torch.equal(got, want)
    assert seen == [2, 1, 1, 1]  # prefill with the caller's threads, then 3 decode forwards
    assert torch.get_num_threads() == 2
