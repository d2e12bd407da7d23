"""Eviction + admission policies on the pure resident set: hand-counted sequences, the
bounded-foresight oracle against full Belady and LRU, per-layer pools."""

import random

import pytest
import torch

from tensorbend.cache.admission import AdmitAll, AdmitFrequent, AdmitPredicted, make_admission
from tensorbend.cache.policies import LFRU, LFU, LRU, NextUse
from tensorbend.cache.predicted import Predicted, Reuse
from tensorbend.cache.resident import ResidentSet


def _replay(rs, keys_by_step):
    """Demand each step's keys; returns (hits per step, victims in order)."""
    hits, victims = [], []
    for step, keys in enumerate(keys_by_step):
        for key in keys:
            if rs.use(key, step):
                hits.append(step)
            else:
                p = rs.place(key, step)
                if p.victim is not None:
                    victims.append(p.victim)
    return hits, victims


def _one_layer(seq):
    return [[(0, e)] for e in seq]


def _steps(keys_by_step):
    out = {}
    for step, keys in enumerate(keys_by_step):
        for k in keys:
            out.setdefault(k, []).append(step)
    return out


def test_lfru_counts_by_hand():
    # A A A B C B C B C, capacity 2 (A=0, B=1, C=2)
    # LFRU score = uses / (steps since last use + 1), all-time uses:
    # 4 (C): A=3/3, B=1/2 -> B out; 5 (B): A=3/4, C=1/2 -> C out;
    # 6 (C): A=3/5, B=2/2 -> A out; 7, 8: hits.
    seq = _one_layer([0, 0, 0, 1, 2, 1, 2, 1, 2])
    hits, victims = _replay(ResidentSet(2, 1, LFRU()), seq)
    assert hits == [1, 2, 7, 8]
    assert victims == [(0, 1), (0, 2), (0, 0)]
    # LFU keeps A (count 3) until B/C reach 3 and thrashes them; LRU drops A at once
    assert _replay(ResidentSet(2, 1, LFU()), seq)[0] == [1, 2]
    assert _replay(ResidentSet(2, 1, LRU()), seq)[0] == [1, 2, 5, 6, 7, 8]


def test_frequency_admission_counts_by_hand():
    # capacity 1, window 3 steps, A B A B C A B:
    # 0 A admitted (room); 1 B: count B=1 vs A=1 -> bypass; 2 A hit;
    # 3 B: B=2 (steps 1, 3) vs A=1 (step 2; step 0 left the window) -> admitted, A out;
    # 4 C: 1 vs B=1 -> bypass; 5 A: A=1 (step 5) vs B=1 (step 3) -> bypass; 6 B hit.
    seq = _one_layer([0, 1, 0, 1, 2, 0, 1])
    rs = ResidentSet(1, 1, LRU(), admission=AdmitFrequent(window_steps=3))
    hits, victims = _replay(rs, seq)
    assert hits == [2, 6] and victims == [(0, 0)] and list(rs) == [(0, 1)]
    # admitting every miss (plain LRU) hits nothing on this sequence
    assert _replay(ResidentSet(1, 1, LRU(), admission=AdmitAll()), seq)[0] == []


def test_predicted_admission_is_belady_with_bypass():
    # capacity 1, A B A C A: B and C are never used again, A is: bypass both, hit A twice
    seq = _one_layer([0, 1, 0, 2, 0])
    steps = _steps(seq)
    rs = ResidentSet(1, 1, NextUse(steps, 1), admission=AdmitPredicted())
    assert _replay(rs, seq) == ([2, 4], [])
    # admitting every miss: each miss evicts the one resident expert
    victims = [(0, 0), (0, 1), (0, 0), (0, 2)]
    assert _replay(ResidentSet(1, 1, NextUse(steps, 1)), seq) == ([], victims)


def _random_run(seed, L=3, E=6, K=2, forwards=12):
    rng = random.Random(seed)
    return [[(m, e) for e in rng.sample(range(E), K)] for _ in range(forwards) for m in range(L)]


@pytest.mark.parametrize("pool", ["global", "per_layer"])
@pytest.mark.parametrize("seed", range(4))
def test_bounded_foresight_spans_lru_to_belady(seed, pool):
    L, forwards = 3, 12
    seq = _random_run(seed, L=L, forwards=forwards)
    steps = _steps(seq)

    def run(policy):
        return _replay(ResidentSet(6, L, policy, pool=pool), seq)

    full = run(NextUse(steps, L))
    assert run(NextUse(steps, L, foresight=forwards)) == full  # the window covers the run
    assert run(NextUse(steps, L, foresight=0)) == run(LRU())  # nothing known: recency
    # a known answer in between: Belady never does worse than LRU on the same sequence
    assert len(full[0]) >= len(run(LRU())[0])


def test_foresight_window_is_counted_in_forwards():
    # L = 2: at step 3 (forward 1, layer 1) foresight 1 sees steps < 4, foresight 2 steps < 6
    nu = {(0, 0): [0, 4], (1, 0): [1, 5]}
    assert NextUse(nu, 2, foresight=1).next_use((0, 0), 3) == float("inf")
    assert NextUse(nu, 2, foresight=2).next_use((0, 0), 3) == 4
    assert NextUse(nu, 2, foresight=2).horizon(3) == 6
    assert NextUse(nu, 2).next_use((1, 0), 3) == 5


def test_per_layer_pool_never_evicts_across_layers():
    L = 3
    seq = _random_run(7, L=L, E=8, K=3, forwards=20)
    for policy in (LRU(), LFU(), LFRU(), Predicted(L), NextUse(_steps(seq), L, foresight=2)):
        rs = ResidentSet(7, L, policy, pool="per_layer")  # pools of 3, 2, 2 slots
        for step, keys in enumerate(seq):
            for key in keys:
                if not rs.use(key, step):
                    p = rs.place(key, step)
                    assert p.victim is None or p.victim[0] == key[0], (policy.name, key, p)
            sizes = [sum(1 for k in rs if k[0] == m) for m in range(L)]
            assert sizes == [min(s, c) for s, c in zip(sizes, (3, 2, 2), strict=True)]
    # and by hand: capacity 2 over 2 layers; (1, 0) would be the global LRU victim
    rs = ResidentSet(2, 2, LRU(), pool="per_layer")
    rs.access((1, 0), 1)
    rs.access((0, 0), 2)
    assert rs.place((0, 1), 4).victim == (0, 0) and sorted(rs) == [(0, 1), (1, 0)]
    rs = ResidentSet(2, 2, LRU())
    rs.access((1, 0), 1)
    rs.access((0, 0), 2)
    assert rs.place((0, 1), 4).victim == (1, 0)


def test_prefetch_takes_a_victim_only_if_needed_later():
    steps = {(0, 0): [5], (0, 1): [20]}
    rs = ResidentSet(1, 1, NextUse(steps, 1))
    rs.place((0, 0), 0, when=5)
    assert rs.place((0, 1), 1, when=20).outcome == "refused"  # (0, 0) is needed sooner
    rs = ResidentSet(1, 1, LRU())  # no notion of time: any victim
    rs.place((0, 0), 0, when=5)
    assert rs.place((0, 1), 1, when=20).victim == (0, 0)


def test_blocked_and_capacity_zero():
    rs = ResidentSet(1, 1, LRU())
    rs.place((0, 0), 0)
    assert rs.place((0, 1), 1, evictable=lambda k: False).outcome == "blocked"
    assert ResidentSet(0, 1, LRU()).place((0, 1), 1).outcome == "refused"  # on_demand


def test_make_admission_window_is_in_forwards():
    adm = make_admission("frequency", num_layers=4, window=2)
    assert isinstance(adm, AdmitFrequent) and adm.window == 8
    assert isinstance(make_admission("all", 4, window=2), AdmitAll)


def test_reuse_next_use_by_hand_and_victim_choice():
    """L = 2 layers, h = 2, forecast made after forward 1: class j of layer m is step
    (1 + j) * 2 + m; "later" is (1 + 2) * 2 + m + 2 * tail. Key (0, 0) with P = (0.5, 0.5, 0):
    ahead = 0.5 * 4 + 0.5 * 6 = 5; after class 1 passed = 6. Key (0, 1) with (0, 0, 1), tail 3:
    6 + 6 = 12. At now = 3 (forward 1, layer 1) class 1 of layer 0 (step 4) is ahead; at
    now = 5 it has passed. A hint for an exact step wins."""
    from tensorbend.predictors.horizon import Forecast

    first_use = torch.tensor(
        [[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], [[0.5, 0.5, 0.0], [0.25, 0.25, 0.5]]]
    )
    tail = torch.tensor([[3.0, 3.0], [3.0, 1.0]])
    ahead, after = Forecast(first_use, tail).next_use_steps(1, 2)
    assert ahead[0][0] == pytest.approx(5) and after[0][0] == pytest.approx(6)
    assert ahead[0][1] == pytest.approx(12) and after[0][1] == pytest.approx(12)
    # (1, 1): steps 5, 7 (0.25 each), later 7 + 2 * 1 = 9 (0.5): ahead 7.5, after (7*.25+9*.5)/.75
    assert ahead[1][1] == pytest.approx(7.5) and after[1][1] == pytest.approx(6.25 / 0.75)
    pol = Reuse(num_layers=2)
    pol.set_forecast(1, ahead, after)
    assert pol.next_use((0, 0), 3) == pytest.approx(5)
    assert pol.next_use((0, 0), 5) == pytest.approx(6)
    assert pol.next_use((1, 0), 5) == pytest.approx(7)  # layer 1's class 1 (step 5) not ahead
    pol.hint((0, 1), 6)
    assert pol.next_use((0, 1), 5) == 6
    rs = ResidentSet(capacity=2, num_layers=2, policy=Reuse(num_layers=2))
    rs.policy.set_forecast(1, ahead, after)
    for key, step in (((0, 0), 4), ((0, 1), 4), ((1, 1), 5)):
        rs.access(key, step)
    assert sorted(rs) == [(0, 0), (1, 1)]  # (0, 1), expected back last, left


@pytest.mark.parametrize("ranked", ["indexed", "resident"])
def test_hints_handed_over_at_once_evict_as_hints_one_by_one(ranked):
    """hint_many (a decode call's hints in one call) leaves the policy, and so every later
    victim, as hint() per (key, step) in order: a random workload with random hints, some
    earlier than a pending one, some later, some already passed."""
    from tensorbend.cache.victim_heap import IndexedResidentSet

    make = IndexedResidentSet if ranked == "indexed" else ResidentSet
    rng = random.Random(0)
    a, b = (make(capacity=6, num_layers=3, policy=Predicted(3)) for _ in range(2))
    for step in range(400):
        hints = [((rng.randrange(3), rng.randrange(8)), step + rng.randrange(-2, 6))
                 for _ in range(rng.randrange(5))]  # fmt: skip
        a.hint_many(hints)
        for key, when in hints:
            b.hint(key, when)
        assert a.policy.hints == b.policy.hints and a.policy.layer_hint == b.policy.layer_hint
        key = (step % 3, rng.randrange(8))
        for rs in (a, b):
            if not rs.use(key, step):
                rs.place(key, step)
        assert a._recency.keys() == b._recency.keys()
