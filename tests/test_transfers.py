"""The request queue and the wire alone (cache/transfers.py), with answers worked out by hand.

The queue serves demand loads before any prefetch, prefetches by (step needed at, rank), then
first come; a demand upgrades a queued prefetch; prefetches whose step has come are cancelled;
`pop(t)` takes only what was queued by t. The wire books transfers back to back:
n bytes take n / bandwidth on the wire after it frees up and arrive `latency` later.
"""

from __future__ import annotations

import pytest

from tensorbend.cache.transfers import DEMAND, PREFETCH, Link, RequestQueue, Wire

INF = float("inf")


def drain(q: RequestQueue, t: float = INF) -> list:
    out = []
    while (req := q.pop(t)) is not None:
        out.append((req.kind, req.key))
    return out


def test_demand_first_then_soonest_step_then_rank_then_first_come():
    q = RequestQueue()
    assert q.prefetch((1, 0), when=10, rank=0)  # the next token's layer: needed later
    assert q.prefetch((0, 5), when=5, rank=3)  # this token: sooner, though ranked lower
    assert q.prefetch((0, 6), when=5, rank=1)
    assert q.prefetch((0, 8), when=5, rank=1)  # same step and rank as (0, 6): queued after it
    q.demand((0, 3))
    assert not q.prefetch((0, 6), when=4, rank=0)  # queued already: kept as it was
    assert len(q) == 5 and (0, 6) in q
    assert drain(q) == [
        (DEMAND, (0, 3)),
        (PREFETCH, (0, 6)),
        (PREFETCH, (0, 8)),
        (PREFETCH, (0, 5)),
        (PREFETCH, (1, 0)),
    ]
    assert q.pop() is None and len(q) == 0


def test_a_demand_upgrades_a_queued_prefetch_once():
    q = RequestQueue()
    q.prefetch((0, 7), when=9, rank=0)
    q.demand((0, 2))
    q.demand((0, 7))  # upgraded: now a demand, behind the earlier demand
    q.demand((0, 7))  # a second demand of it changes nothing
    assert len(q) == 2
    assert drain(q) == [(DEMAND, (0, 2)), (DEMAND, (0, 7))]


def test_cancel_stale_drops_prefetches_whose_step_has_come():
    q = RequestQueue()
    q.prefetch((0, 1), when=4, rank=0)
    q.prefetch((0, 2), when=5, rank=0)
    q.prefetch((0, 3), when=6, rank=0)
    q.demand((0, 9))
    assert q.cancel_stale(5) == 2  # steps 4 and 5 have started; demands are never stale
    assert q.cancel_stale(5) == 0
    assert drain(q) == [(DEMAND, (0, 9)), (PREFETCH, (0, 3))]
    assert q.prefetch((0, 1), when=8, rank=0)  # a cancelled key may be queued again


def test_pop_takes_only_what_was_queued_by_then():
    q = RequestQueue()
    q.prefetch((0, 1), when=9, rank=0, at=1.0)
    q.demand((0, 2), at=2.0)  # better, but queued later
    assert q.next_arrival() == 1.0
    assert q.pop(1.5).key == (0, 1)
    assert q.next_arrival() == 2.0 and q.pop(1.9) is None
    assert q.pop(2.0).key == (0, 2) and q.next_arrival() == INF
    with pytest.raises(AssertionError, match="time order"):
        q.demand((0, 3), at=1.0)


def test_a_prefetch_taken_while_the_wire_is_busy_is_dropped():
    q = RequestQueue(max_backlog_s=0.5)
    q.prefetch((0, 1), when=3, rank=0)
    q.demand((0, 2))
    demand, prefetch = q.pop(), q.pop()
    assert not q.drops(demand, backlog_s=9.0)  # demand loads are never dropped
    assert not q.drops(prefetch, backlog_s=0.5) and q.drops(prefetch, backlog_s=0.51)
    assert not RequestQueue().drops(prefetch, backlog_s=1e9)  # no limit by default


def test_the_wire_books_transfers_back_to_back():
    link = Link(bandwidth_Bps=100.0, latency_s=0.5)
    wire = Wire(link)
    assert wire.book(at=0.0, nbytes=200) == 2.5  # on the wire 0 -> 2, arrives 2.5
    assert wire.book(at=1.0, nbytes=100) == 3.5  # waits for the wire: 2 -> 3, arrives 3.5
    assert wire.backlog(at=1.0) == 2.0 and wire.backlog(at=5.0) == 0.0
    assert wire.book(at=10.0, nbytes=50) == 11.0  # idle wire: 10 -> 10.5, arrives 11
    assert wire.free_at == 10.5
    assert Wire(link).book(at=4.0, nbytes=300) == 4.0 + link.seconds(300)  # 4 + 0.5 + 3
    uncapped = Wire(Link(latency_s=0.25))  # no bandwidth cap: only the latency
    assert (uncapped.book(1.0, 10**9), uncapped.book(1.0, 10**9)) == (1.25, 1.25)
    assert not Link().capped and Link(latency_s=0.25).capped and link.capped
