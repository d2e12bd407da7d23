"""The eviction learner: Belady labels computed by hand, imitation that reproduces Belady where
the features determine the future, the shadow guard's bound on an adversarial trace."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from tensorbend.cache.evictor import AdmitByPolicy, Evictor, EvictorModel, ShadowGuard
from tensorbend.cache.features import GROUPS, Features, FoldedScore, feature_names
from tensorbend.cache.imitation import Requests, fit_evictor, replay
from tensorbend.cache.policies import LFRU, LRU, NextUse
from tensorbend.cache.resident import ResidentSet
from tensorbend.cache.victim_heap import IndexedResidentSet
from tensorbend.errors import CheckpointError


def _requests(seq: list[int], E: int, per_request: int | None = None) -> Requests:
    """One MoE layer, one expert per forward (all decode), requests of `per_request` forwards."""
    used = np.zeros((len(seq), 1, E), dtype=bool)
    used[np.arange(len(seq)), 0, seq] = True
    n = per_request or len(seq)
    return Requests(used, ["decode"] * len(seq), list(range(0, len(seq), n)))


def test_belady_labels_by_hand():
    # a b c a b, two slots: at c the residents a (next use in 1 step), b (in 2) and the
    # missed c (never) are the candidates; Belady bypasses c, then a and b hit.
    req = _requests([0, 1, 2, 0, 1], E=3)
    out = replay(req, Evictor(1, 3), slots=2, admission="policy", label=True)
    x_CX, y_C = out["decisions"][0]  # (the LFRU-ranked rollout then evicts a, so more follow)
    assert y_C.tolist() == [1, 2, float("inf")]
    assert x_CX[:, -1].tolist() == [0, 0, 1]  # the incoming column marks the missed key
    belady = replay(req, NextUse(req.steps_by_key(), 1), slots=2, admission="predicted")
    assert belady["experts_per_token"] == 3 / 5
    assert replay(req, LFRU(), slots=2)["experts_per_token"] == 5 / 5


def test_label_reservoir_keeps_a_sample_of_the_full_set():
    # the capped rollout takes the same decisions (the policy does not see the cap) and keeps
    # exactly max_labels of them, each one identical to a decision of the uncapped rollout
    rng = np.random.default_rng(3)
    req = _requests(rng.integers(0, 6, 200).tolist(), E=6)
    full = replay(req, Evictor(1, 6), slots=3, admission="policy", label=True)
    capped = replay(req, Evictor(1, 6), slots=3, admission="policy", label=True, max_labels=7)
    assert capped["labelled"] == full["labelled"] == len(full["decisions"]) > 7
    assert capped["experts_per_token"] == full["experts_per_token"]
    assert len(capped["decisions"]) == 7
    as_bytes = lambda d: (d[0].tobytes(), d[1].tobytes())  # noqa: E731
    seen = {as_bytes(d) for d in full["decisions"]}
    assert all(as_bytes(d) in seen for d in capped["decisions"])
    assert len({as_bytes(d) for d in capped["decisions"]}) > 1


def test_features_by_hand():
    f = Features(num_layers=2, num_experts=2)
    for now, key in [(0, (0, 1)), (2, (0, 1)), (3, (1, 0)), (6, (0, 1))]:
        f.touch(key, now)
    x = f.matrix(np.array([1, 2]), now=7, groups=("recency", "history", "request", "layer"))
    names = feature_names(("recency", "history", "request", "layer"), 2)
    row = dict(zip(names, x[0], strict=True))  # (0, 1): used at forwards 0, 1, 3
    assert row["log_age"] == np.log1p(0.5)  # one step = half a forward
    assert [row[f"used_visit-{j}"] for j in range(4)] == [1, 0, 1, 1]
    assert row["log_request_uses"] == np.log1p(3) and row["visit_in"] == 1 / 2
    row = dict(zip(names, x[1], strict=True))  # (1, 0): used at forward 1; layer 1 ran at 7
    assert [row[f"used_visit-{j}"] for j in range(4)] == [0, 0, 1, 0]
    assert row["visit_in"] == 1.0 and row["layer=1"] == 1.0


def test_forecast_features_by_hand():
    # L = 2: a forecast made after forward 3 says (m, e) is next used at ahead, or at after
    # once layer m of forward 4 has run without it; features are in forwards from now
    f = Features(num_layers=2, num_experts=1)
    groups = ("forecast",)
    assert f.matrix(np.array([0, 1]), 8, groups)[:, :2].tolist() == [[0, 0], [0, 0]]  # none yet
    f.set_forecast(3, [[9.0], [15.0]], [[12.0], [17.0]])
    x = f.matrix(np.array([0, 1]), now=8, groups=groups)  # step 8 = layer 0 of forward 4
    # layer 0 of forward 4 is step 8 (not ahead of now): after = 12, 2 forwards; layer 1: 15
    assert x[:, 0].tolist() == [np.log1p(2.0), np.log1p(3.5)] and x[:, 1].tolist() == [1, 1]
    f.new_request()  # a forecast is of one request
    assert f.matrix(np.array([0]), 9, groups)[0, 1] == 0


def _exact_forecasts(req: Requests) -> np.ndarray:
    """Perfect forecasts for one-layer requests: after forward f, each key's next use after f
    (ahead) and after f + 1 (after class 1), 1e9 for never."""
    F, _, E = req.used_FLE.shape
    nxt_E, out = np.full(E, 1e9), np.empty((F, 2, E), dtype=np.float32)
    for f in range(F - 1, -1, -1):
        out[f, 1] = nxt_E  # (the next use after f + 1 of a key not used at f + 1)
        if f + 1 < F:
            used = req.used_FLE[f + 1, 0]
            out[f, 1][~used] = nxt_E[~used]
        nxt_E = nxt_E.copy()
        out[f, 0] = nxt_E
        nxt_E[req.used_FLE[f, 0]] = f
    return out


def test_learner_with_exact_forecasts_reaches_belady_where_routing_cannot():
    # uniform random routing: no recency or frequency signal, so no policy blind to the future
    # misses less than 1 - slots / E = 5/8 in expectation (the routing-only learner included);
    # told each expert's exact next use, the learner can evict (and bypass) as Belady
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 8, 600).tolist()
    req, val = _requests(seq[:400], E=8), _requests(seq[400:], E=8)
    req.forecast_F2K, val.forecast_F2K = _exact_forecasts(req), _exact_forecasts(val)
    belady = replay(val, NextUse(val.steps_by_key(), 1), 3, admission="predicted")
    lru = replay(val, LRU(), 3)["experts_per_token"]
    plain, _ = fit_evictor(req, req, cache_frac=3 / 8, rounds=1)
    told, _ = fit_evictor(req, req, cache_frac=3 / 8, rounds=1, groups=GROUPS + ("forecast",))
    got = {name: replay(val, Evictor(1, 8, m, m.meta["prior_K"]), 3, admission="policy")
           for name, m in (("plain", plain), ("told", told))}  # fmt: skip
    assert got["told"]["experts_per_token"] <= 1.05 * belady["experts_per_token"]
    assert got["plain"]["experts_per_token"] >= 0.9 * (1 - 3 / 8) and lru >= 0.9 * (1 - 3 / 8)
    assert got["told"]["experts_per_token"] < 0.85 * got["plain"]["experts_per_token"]


def test_learner_reproduces_belady_on_a_cycle():
    # Five experts in a cycle through four slots: LRU misses every use; Belady bypasses the
    # missed expert (the one used farthest ahead) and misses 1 in 5. The features (recency,
    # the incoming mark) determine the future, so the imitation must equal Belady.
    seq = [i % 5 for i in range(200)]
    train, test = _requests(seq, 5, per_request=50), _requests(seq[:120], 5, per_request=60)
    model, log = fit_evictor(train, train, cache_frac=4 / 5, rounds=1, groups=("recency",))
    ours = replay(test, Evictor(1, 5, model, model.meta["prior_K"]), 4, admission="policy")
    belady = replay(test, NextUse(test.steps_by_key(), 1), 4, admission="predicted")
    assert replay(test, LFRU(), 4)["experts_per_token"] == 1.0
    assert ours["experts_per_token"] == belady["experts_per_token"] < 0.25


def test_scan_policy_same_victims_in_both_resident_sets():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 8, 300).tolist()
    req = _requests(seq, 8, per_request=100)
    model, _ = fit_evictor(req, req, cache_frac=3 / 8, rounds=0)
    victims = []
    for cls in (ResidentSet, IndexedResidentSet):
        rs = cls(3, 1, Evictor(1, 8, model, model.meta["prior_K"]))
        for now, e in enumerate(seq):
            if not rs.use((0, e), now):
                victims.append(rs.place((0, e), now).victim)
    n = len(victims) // 2
    assert victims[:n] == victims[n:]


def test_shadow_guard_bound_on_an_adversarial_trace():
    # The learner of the cycle above learns to bypass every miss; on working sets that change
    # every 40 forwards that never admits the new set, while the shadow (LFRU + TinyLFU) does.
    # Guarded, the cache may fall behind the shadow only by lost windows x (window cost +
    # capacity) + one window cost (cache/evictor.py), a window's cost being its demands
    # (window x L x K uses).
    seq = [i % 5 for i in range(200)]
    cyc = _requests(seq, 5, per_request=50)
    model, _ = fit_evictor(cyc, cyc, cache_frac=4 / 5, rounds=1, groups=("recency",))
    adv = [4 * (f // 40) % 16 + f % 4 for f in range(400)]
    req = _requests(adv, 16, per_request=200)
    learner = lambda: Evictor(1, 16, model)  # noqa: E731
    alone = replay(req, learner(), 4, admission="policy")["experts_per_token"] * 400
    shadow = replay(req, LFRU(), 4, admission="frequency")["experts_per_token"] * 400
    window = 8
    out = replay(req, ShadowGuard(learner(), 4, 1, window=window), 4, admission="policy")
    guarded, g = out["experts_per_token"] * 400, out["guard"]
    assert alone > 3 * shadow  # adversarial: the learner alone misses most uses
    assert g["lost_windows"] >= 1
    assert guarded <= shadow + g["lost_windows"] * (window * 1 * 1 + 4) + window * 1 * 1
    assert guarded < alone


def test_groups_are_the_documented_ones():
    assert feature_names(GROUPS, 2)[-1] == "incoming"
    assert len(feature_names(GROUPS, 2)) == 1 + 4 + 3 + 2 + 3 + 1 + 1


def test_checkpoint_round_trip(tmp_path):
    req = _requests([i % 5 for i in range(100)], 5, per_request=50)
    model, _ = fit_evictor(req, req, cache_frac=4 / 5, rounds=0)
    model.save(str(tmp_path / "e.safetensors"))
    back = EvictorModel.load(str(tmp_path / "e.safetensors"))
    x_CX = np.random.default_rng(0).normal(size=(7, len(model.mean_X)))
    assert back.groups == model.groups and np.array_equal(back.score(x_CX), model.score(x_CX))
    assert np.array_equal(back.meta["prior_K"], model.meta["prior_K"])
    save_file({"w": np.zeros(2)}, str(tmp_path / "other.safetensors"), metadata={"kind": "horizon"})
    with pytest.raises(CheckpointError, match="expected an evictor checkpoint"):
        EvictorModel.load(str(tmp_path / "other.safetensors"))


@pytest.mark.parametrize("indexed", [False, True])
def test_the_key_being_placed_is_the_one_scored_as_incoming(indexed):
    """A runtime claims a layer's experts (uses) before its I/O threads place the misses, so
    the learner must mark the key being placed, not the last one used. A model that scores
    only the incoming mark, very high, bypasses every miss once the cache is full: no
    eviction at all, whatever order uses and placements come in."""
    L, E = 1, 8
    X = len(feature_names(GROUPS, L))
    w0 = np.zeros(X)
    w0[-1] = 100.0  # the incoming column
    model = EvictorModel(GROUPS, L, np.zeros(X), np.ones(X), w0, np.zeros((X, 2)), np.zeros(2),
                         np.zeros(2), meta={"prior_K": np.zeros(L * E)})  # fmt: skip
    cls = IndexedResidentSet if indexed else ResidentSet
    rs = cls(2, L, Evictor(L, E, model), admission=AdmitByPolicy())
    refused = 0
    for step, layer_keys in enumerate([[0, 1], [2, 3], [4, 5], [6, 7]]):
        keys = [(0, e) for e in layer_keys]
        missed = [k for k in keys if not rs.use(k, step)]  # the router hook claims them all
        for k in missed:  # then the I/O thread places them, in order
            refused += rs.place(k, step).outcome == "refused"
    assert rs.evictions == 0 and refused == 6 and sorted(rs) == [(0, 0), (0, 1)]


@pytest.mark.parametrize("groups", [GROUPS, ("recency", "history", "request"), ("layer",)])
def test_folded_score_equals_the_model_score(groups):
    """Run time scores through FoldedScore (normalisation folded into the weights, one-hot
    layer columns into a per-layer table): the same scores as EvictorModel.score on the full
    feature matrix, for random weights and a random history."""
    L, E = 3, 5
    rng = np.random.default_rng(1)
    X, H = len(feature_names(groups, L)), 6
    model = EvictorModel(groups, L, rng.normal(size=X), rng.uniform(0.5, 2, X), rng.normal(size=X),
                         rng.normal(size=(X, H)), rng.normal(size=H), rng.normal(size=H))  # fmt: skip
    f = Features(L, E, prior_K=rng.normal(size=L * E))
    for now in range(40):
        f.touch((now % L, int(rng.integers(E))), now)
    idx_C = np.array([0, 4, 7, 11, 14, 2])
    x_CX = f.matrix(idx_C, 41, groups)
    x_CX[4:, -1] = 1.0
    s0_K, s1_K = FoldedScore(model).score_all(f, 41)  # every key, as a resident / the missed key
    folded = np.r_[s0_K[idx_C[:4]], s1_K[idx_C[4:]]]
    np.testing.assert_allclose(folded, model.score(x_CX), rtol=1e-10, atol=1e-10)
    assert x_CX.shape == (6, X) and np.ptp(model.score(x_CX)) > 0  # not a constant score


@pytest.mark.parametrize("groups", [GROUPS, GROUPS + ("forecast",)])
def test_run_time_scoring_decides_as_the_full_matrix(groups):
    """The run-time path (every key scored once per step, only the keys used since rescored,
    a forecast invalidating all) takes the decisions the training path takes (each decision's
    candidates scored from the full feature matrix): the same victims, bypasses and misses."""
    L, E = 3, 6
    rng = np.random.default_rng(2)
    X, H = len(feature_names(groups, L)), 8
    model = EvictorModel(groups, L, rng.normal(size=X), rng.uniform(0.5, 2, X),
                         rng.normal(size=X), rng.normal(size=(X, H)), rng.normal(size=H),
                         rng.normal(size=H))  # fmt: skip
    F = 120
    used = np.zeros((F, L, E), dtype=bool)
    for f in range(F):
        for m in range(L):
            used[f, m, rng.choice(E, 2, replace=False)] = True
    fc = rng.uniform(0, 3 * F * L, (F, 2, L * E)).astype(np.float32)
    req = Requests(used, ["decode"] * F, [0, 40, 80], fc)
    prior = rng.normal(size=L * E)
    fast = replay(req, Evictor(L, E, model, prior), 7, admission="policy")
    slow_policy = Evictor(L, E, model, prior)
    slow_policy.log = []  # (the training path: features of each decision's candidates)
    slow = replay(req, slow_policy, 7, admission="policy")
    assert fast["evictions"] == slow["evictions"] > 20
    assert fast["experts_per_token"] == slow["experts_per_token"]
