"""THE replay (cache/replay.py, its numba kernel cache/kernel.py) makes the placements of the
runtime's Python index (`IndexedResidentSet`) fed the same events (bench/index_replay.py).

Each test compares every placement (step, key, outcome, victim), the misses per forward and
the judge's counts, and checks that the work had evictions to decide.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from planted import router_trace

from bench.index_replay import index_replay
from tensorbend.cache.replay import (
    REPLAY_POLICIES,
    Forecasts,
    ReplayConfig,
    as_padded,
    exact_forecasts,
    named,
    planted_trace,
    replay,
    replay_named,
)
from tensorbend.capture.trace import Trace
from tensorbend.errors import TensorbendError


def _same(ids, cfg, E, seen=None, fc=None):
    got, want = replay(ids, cfg, E, seen, fc), index_replay(ids, cfg, E, seen, fc)
    assert got.victims() == want.victims(), cfg
    assert got.misses_F.tolist() == want.misses_F.tolist()
    assert (got.prefetches, got.evictions) == (want.prefetches, want.evictions)
    assert (got.good, got.judged) == (want.good, want.judged)
    return got


@pytest.mark.parametrize("pool", ["global", "per_layer"])
@pytest.mark.parametrize("name", [*REPLAY_POLICIES, "belady/h=0"])
def test_same_placements_on_planted_trace(name, pool):
    L, E, K = 4, 12, 3
    ids = planted_trace(prompts=4, tokens=24, layers=L, experts=E, top_k=K, seed=1)
    fc = exact_forecasts(*as_padded(ids), E) if name == "reuse" else None
    got = _same(ids, named(name, 14, pool), E, fc=fc)
    assert got.evictions > 100
    assert replay_named(ids, name, 14, E, pool).victims() == got.victims()


def _random_forecasts(F, L, E, seed):
    """Expected next uses with ties (rounded), never (inf), and a switch at the next forward."""
    rng = np.random.default_rng(seed)
    ahead = (np.arange(F)[:, None] * L + rng.uniform(0, 5 * L, (F, L * E))).round(1)
    ahead[rng.random((F, L * E)) < 0.2] = np.inf
    return Forecasts(ahead, ahead + rng.choice([0, 0, L], (F, L * E)))


def _configs():
    """Every eviction x admission (+ fallback) x pool, Belady's sights and rules beyond."""
    for ev, adm, pool in itertools.product(
        ["lru", "lfu", "lfru", "predicted", "reuse", "next_use"],
        ["all", "frequency", "predicted"],
        ["global", "per_layer"],
    ):
        if adm == "predicted" and ev in ("lru", "lfu", "lfru"):
            continue
        fallbacks = (None, "frequency") if adm == "predicted" else (None,)
        sights = [(None, "lru")]
        if ev == "next_use":
            sights += [(h, b) for h in (1, 2) for b in ("lru", "lfu", "lfru", "predicted")]
        for fb, (h, beyond) in itertools.product(fallbacks, sights):
            yield ReplayConfig(ev, 7, pool, adm, 2, fb, h, beyond, judge=True)


@pytest.mark.parametrize("cfg", list(_configs()), ids=str)
def test_same_placements_for_every_rule_admission_and_sight(cfg):
    L, E = 3, 10
    ids = planted_trace(prompts=3, tokens=30, layers=L, experts=E, top_k=2, seed=2)
    fc = _random_forecasts(len(ids), L, E, 0) if cfg.eviction == "reuse" else None
    got = _same(ids, cfg, E, fc=fc)
    assert got.evictions > 50 and got.judged > 0
    if cfg.admission == "frequency":  # (predicted admits ties of two unseen uses)
        assert {v[2] for v in got.victims()} >= {"admitted", "refused"}


@pytest.mark.parametrize("name", REPLAY_POLICIES)
@pytest.mark.parametrize("slots", [0, 2, 5, 9])
def test_same_placements_on_random_routing_of_uneven_width(name, slots):
    """Layer-steps routing 1..3 experts (padded rows), per-layer pools of 0-3 slots: demands
    refused (no slot) and blocked (every slot pinned by the step) as well as admitted."""
    rng = random.Random(slots)
    L, E = 3, 6
    ids = [[sorted(rng.sample(range(E), rng.randint(1, 3))) for _ in range(L)] for _ in range(150)]
    fc = exact_forecasts(*as_padded(ids), E) if name == "reuse" else None
    got = _same(ids, named(name, slots, "per_layer"), E, fc=fc)
    outcomes = {v[2] for v in got.victims()}
    assert outcomes == {"refused"} if slots == 0 else "admitted" in outcomes
    if slots == 5:  # pools of 2, 2, 1: a layer-step of 3 pins them all
        assert "blocked" in outcomes


def test_belady_seeing_another_trace_and_arrays_like_lists():
    """Belady ranking by a different routing than the demands (the zoo card's token-table
    foresight); an array trace replays as its list."""
    L, E = 3, 10
    ids = planted_trace(prompts=3, tokens=20, layers=L, experts=E, top_k=2, seed=4)
    seen = planted_trace(prompts=3, tokens=20, layers=L, experts=E, top_k=2, seed=5)
    for h in (None, 1, 3):
        _same(ids, ReplayConfig("next_use", 8, "per_layer", foresight=h), E, seen)
    cfg = ReplayConfig("lfru", 6)
    assert replay(np.array(ids), cfg).victims() == replay(ids, cfg).victims()


def test_same_placements_on_a_real_trace(tmp_path):
    """A collected-format trace (tests/planted.py's router trace: prefill forwards routing
    many experts per layer), as eval's foresight report replays it."""
    router_trace(tmp_path / "t", L=4, E=16, K=2, prompts=8)
    rows = Trace.open(tmp_path / "t").load(("ids",))
    ids_TLK = rows["expert_ids_TLK"].long().numpy()
    ids = [[sorted(set(ids_TLK[t, m].tolist())) for m in range(4)] for t in range(len(ids_TLK))]
    for cfg in (ReplayConfig("lfru", 16, admission="frequency"),
                ReplayConfig("next_use", 16, foresight=1, beyond="lfu", admission="predicted",
                             fallback="frequency")):  # fmt: skip
        assert _same(ids, cfg, 16).evictions > 20


def test_exact_forecasts_by_hand():
    # 1 layer x 3 experts over 3 forwards: e0 at forwards 0 and 2, e1 at 1
    fc = exact_forecasts(np.array([[[0]], [[1]], [[0]]]), np.ones((3, 1), np.int64), 3)
    inf = np.inf
    assert fc.ahead_FK.tolist() == [[2, 1, inf], [2, inf, inf], [inf, inf, inf]]
    assert fc.after_FK.tolist() == [[2, inf, inf], [inf, inf, inf], [inf, inf, inf]]


def test_bad_names_and_shapes_are_refused():
    ids = planted_trace(prompts=1, tokens=4, layers=2, experts=4, top_k=1)
    with pytest.raises(TensorbendError, match="unknown replay policy 'fifo'.*lru, lfu"):
        named("fifo", 2)
    with pytest.raises(TensorbendError, match="pool global or per_layer, found 'lru', 'layer'"):
        ReplayConfig("lru", 2, "layer")
    with pytest.raises(TensorbendError, match="admission predicted with eviction lfu"):
        ReplayConfig("lfu", 2, admission="predicted")
    with pytest.raises(
        TensorbendError, match="seen_FLK covers 3 forwards x 2 layers; the demands 4"
    ):
        replay(ids, ReplayConfig("next_use", 2), seen_FLK=ids[:3])
