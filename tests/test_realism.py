"""Routing-realism statistics (zoo/realism.py) on traces whose answers are known by construction."""

import json

import numpy as np
import torch
from planted import _phase, _record, _spec, _writer, cycle_trace

from tensorbend.capture.trace import Trace
from tensorbend.zoo.realism import (
    REFERENCE,
    TOKEN_H,
    foresight_gaps,
    format_card,
    format_fit_detail,
    recall_by_fit_count,
    recall_by_fit_fraction,
    routing_card,
    token_table,
)


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


def test_recall_by_fit_count_and_fit_share_by_hand():
    """Token v routes to experts (2v, 2v + 1). Fit: tokens 0, 0 (prompt 0) and 1 (prompt 1);
    held out: 0, 1, 2. Tokens 0 and 1 (seen 2 and 1 times) are read off the table; token 2 was
    never seen and falls back to the layer's frequency (experts 0, 1), which misses {4, 5}."""
    fit_tok, fit_prompt = np.array([0, 0, 1]), np.array([0, 0, 1])
    route = lambda tok: np.stack([2 * tok, 2 * tok + 1], axis=1)[:, None, :]  # noqa: E731
    held = np.array([0, 1, 2])
    table = token_table(fit_tok, route(fit_tok), 8)
    by_count = recall_by_fit_count(table, np.bincount(fit_tok), held, route(held), 2)
    assert by_count["0"] == {"share": round(1 / 3, 4), "recall": 0.0}
    assert by_count["1-4"] == {"share": round(2 / 3, 4), "recall": 1.0}
    assert by_count["100+"] == {"share": 0.0, "recall": None}
    # half the fit prompts: one of the two tokens is unseen whichever prompt is drawn
    by_share = recall_by_fit_fraction(fit_tok, route(fit_tok), fit_prompt, held, route(held), 8, 2,
                                      fractions=(0.5, 1.0))  # fmt: skip
    assert by_share == {0.5: round(1 / 3, 4), 1.0: round(2 / 3, 4)}


def test_routing_by_the_token_is_read_off_even_rare_tokens(tmp_path):
    _token_trace(tmp_path / "t")
    card = routing_card(Trace.open(tmp_path / "t"))
    assert all(b["recall"] in (None, 1.0) for b in card["token_table_by_fit_count"].values())
    assert card["token_table_fit_fraction"][1.0] == card["token_table_recall"] == 1.0
    text = format_fit_detail({"planted": card})
    assert "| held-out token seen 100+ time(s) in fit | 1.000 (100.0% of rows) |" in text


def test_zoo_card_verb_prints_the_card_and_writes_its_json(tmp_path, capsys):
    """`tensorbend zoo card TRACE --json F` (the CLI over routing_card): the printed table and
    the JSON carry the same token-table recall, 1.0 on a trace routed by the token."""
    from tensorbend.cli import main

    _token_trace(tmp_path / "t")
    assert main(["zoo", "card", str(tmp_path / "t"), "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    card = json.loads((tmp_path / "c.json").read_text())
    (only,) = [v for v in card.values() if isinstance(v, dict) and "token_table_recall" in v]
    assert only["token_table_recall"] == 1.0 and "| 1.000 |" in out
