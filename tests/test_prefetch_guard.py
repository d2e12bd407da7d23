"""The prefetch guard on an adversarial predictor: one that always names experts the run does
not use must not read more than the same cache without prediction by more than the guard's
bound, and the output stays the resident model's."""

import pytest
import torch
from tiny_models import build, char_tokenizer

from tensorbend.cache.config import PolicyConfig
from tensorbend.hf import DecodeConfig
from tensorbend.offload import handle as handle_mod
from tensorbend.offload import loader as loader_mod
from tensorbend.offload.hooks import NoPredictor
from tensorbend.offload.recorded import RecordedRouting
from tensorbend.offload.session import OffloadSession, SessionConfig
from tensorbend.predictors.base import LOOKAHEADS
from tensorbend.prompts import Prompt

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
