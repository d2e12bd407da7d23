"""Routing-realism statistics (zoo/realism.py) on traces whose answers are known by construction."""

import pytest
import torch
from planted import _phase, _record, _spec, _writer, cycle_trace

from tensorbend.cache.replay import planted_trace
from tensorbend.trace import Trace
from tensorbend.zoo.realism import REFERENCE, TOKEN_H, foresight_gaps, format_card, routing_card


def _token_trace(root, *, L=3, E=16, K=2, V=8, prompts=60, decode=24):
    """Routing is a function of the token id (token v uses experts 2v, 2v+1 at every layer)."""
    g = torch.Generator().manual_seed(0)
    spec = _spec(L, E, K, 8)
    w = _writer(root, spec, {}, "planted-token")
    for i in range(prompts):
        T = 1 + decode
        tok = torch.randint(0, V, (T,), generator=g)
        ids_TK = torch.stack([2 * tok, 2 * tok + 1], dim=1)
        rows = {
            "expert_ids_TLK": ids_TK[:, None, :].expand(T, L, K).to(torch.int16).contiguous(),
            "gate_input_TLD": torch.zeros(T, L, 8).half(),
            "layer_input_TLD": torch.zeros(T, L, 8).half(),
            "token_ids_T": tok.to(torch.int32),
            "positions_T": torch.arange(T, dtype=torch.int32),
            "phase_T": _phase(1, decode),
        }
        w.add_prompt(_record(i, 1, decode), rows)
    w.close()


def test_routing_that_follows_the_token_is_read_off_the_token_table(tmp_path):
    _token_trace(tmp_path / "t")
    card = routing_card(Trace.open(tmp_path / "t"))
    assert card["token_table_recall"] == 1.0
    assert card["token_table_recall_by_layer"] == [1.0, 1.0, 1.0]
    # the token table predicts the future routing exactly: its foresight is exact foresight
    rows = Trace.open(tmp_path / "t").load(("ids",), split="test", phase="decode")
    ids_FLK = [[sorted(map(int, r[m])) for m in range(3)] for r in rows["expert_ids_TLK"]]
    exact = foresight_gaps(ids_FLK, ids_FLK, 3, 16, 0.25, "global", TOKEN_H)
    assert card["token_foresight_gap"] == exact and exact[8] > exact[1] > 0


def test_a_two_set_cycle_recurs_every_other_token(tmp_path):
    cycle_trace(tmp_path / "c", L=2, K=2, prompts=40, decode=11)
    card = routing_card(Trace.open(tmp_path / "c"))
    assert card["recurrence"][1] == 0.0  # A, B, A, B: never the next token
    assert card["recurrence"][2] == card["recurrence"][8] == 1.0  # always two tokens later


def test_full_sight_closes_the_whole_gap_and_a_blind_oracle_none():
    ids_FLK = [[[f % 5, (f * 3) % 7 + 5]] for f in range(200)]  # L=1, E=12, K=2, reuse
    gaps = foresight_gaps(ids_FLK, ids_FLK, 1, 12, 0.25, "per_layer", (250,))
    assert gaps[250] == 1.0
    blind = [[[10, 11]] for _ in ids_FLK]  # sees only experts that are never used
    assert foresight_gaps(ids_FLK, blind, 1, 12, 0.25, "per_layer", (4,))[4] == 0.0


def test_the_card_puts_the_reference_beside_each_model(tmp_path):
    cycle_trace(tmp_path / "c", L=2, K=2, prompts=40, decode=11)
    text = format_card({"cycle": routing_card(Trace.open(tmp_path / "c"))})
    assert "| real (DeepSeek-V2-Lite) | cycle |" in text
    assert f"| {REFERENCE['token_table_recall']:.3f} | " in text
    assert text.count("\n") == 2 + 1 + 4 + 3 + 4


def test_the_compiled_replay_gives_the_same_gaps():
    """foresight_gaps through cache/compiled.py and through the Python resident set."""
    pytest.importorskip("numba")
    ids_FLK = planted_trace(prompts=3, tokens=30, layers=3, experts=10, top_k=2, seed=2)
    seen = planted_trace(prompts=3, tokens=30, layers=3, experts=10, top_k=2, seed=3)
    for pool, other in (("per_layer", ids_FLK), ("global", seen)):
        fast = foresight_gaps(ids_FLK, other, 3, 10, 0.25, pool, TOKEN_H, fast=True)
        slow = foresight_gaps(ids_FLK, other, 3, 10, 0.25, pool, TOKEN_H, fast=False)
        assert fast == slow and len(set(fast.values())) > 1
