"""bench.prefetch_width's metrics on hand-computed and planted cases (no trace needed)."""

import pytest

torch = pytest.importorskip("torch")

from bench.prefetch_width import evaluate, markdown  # noqa: E402


def test_hand_computed_widths_and_threshold():
    p = torch.tensor([[0.9, 0.6, 0.1, 0.0], [0.8, 0.2, 0.1, 0.0]])
    y = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    r = evaluate(p, y, K=2)
    top = {f["n"]: (f["mean_size"], f["precision"], f["recall"]) for f in r["fixed"]}
    assert top[1] == (1.0, 1.0, 0.5)  # e0 twice, both routed; 2 of 4 routed listed
    assert top[2] == (2.0, 0.75, 0.75)  # row 1 lists e1 (not routed), misses e2
    assert top[4] == (4.0, 0.5, 1.0)
    t = {x["tau"]: x for x in r["threshold"]}
    assert (t[0.5]["mean_size"], t[0.5]["precision"], t[0.5]["recall"]) == (1.5, 1.0, 0.75)
    assert t[0.5]["fixed_recall_same_size"] == 0.625  # halfway between top-1 and top-2
    assert t[0.5]["recall_gain"] == 0.125
    # calibration: p = 0.0 -> bin [0, 0.05): 2 experts, never routed; 0.9 -> [0.9, 1]: routed
    bins = {(c["lo"], c["hi"]): c for c in r["calibration"]}
    assert bins[(0.0, 0.05)]["routed"] == 0.0 and bins[(0.0, 0.05)]["per_token_layer"] == 1.0
    assert bins[(0.9, 1.0)]["routed"] == 1.0


def test_planted_confidence_pays_and_a_flat_profile_does_not():
    """Planted: half the tokens are certain of their 2 experts, half know nothing (p flat,
    the stable order lists e0 first, which is not routed). A threshold lists the certain
    tokens' pair and nothing for the others: at a mean size of 1 it recalls 2 of 4 routed,
    where top-1 recalls 1 of 4 (gain +0.25). With every token alike, the threshold lists a
    fixed width and gains nothing."""
    p = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    y = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    t = {x["tau"]: x for x in evaluate(p, y, K=2)["threshold"]}
    assert (t[0.6]["mean_size"], t[0.6]["recall"], t[0.6]["recall_gain"]) == (1.0, 0.5, 0.25)
    flat = torch.tensor([[0.9, 0.7, 0.3, 0.1]] * 3)
    routed = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    r = evaluate(flat, routed, K=2)
    assert all(abs(x["recall_gain"]) < 1e-9 for x in r["threshold"])
    assert r["best_recall_gain"] == 0.0


def test_page_names_the_gain():
    p = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    y = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    run = {"model": "planted", "lookahead": "d1", "top_k": 2, "num_experts": 4,
           "token_layers": 2, **evaluate(p, y, K=2)}  # fmt: skip
    page = markdown({"command": "python -m bench.prefetch_width ...", "runs": [run]})
    assert "**+0.2500**" in page and "| p >= 0.6 | 1.00 | 1.000 | 0.500 | 0.250 | +0.250 |" in page
