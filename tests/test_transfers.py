"""The request queue and the wire alone (cache/transfers.py), with answers worked out by hand.

The queue serves demand loads before any prefetch, prefetches by (step needed at, rank), then
first come; a demand upgrades a queued prefetch; prefetches whose step has come are cancelled;
`pop(t)` takes only what was queued by t; a prefetch taken while the wire is booked too far
ahead goes back and waits (here and in the simulator's I/O threads, `simulate.events.IOThreads`). The wire books transfers back to back:
n bytes take n / bandwidth on the wire after it frees up and arrive `latency` later.
"""

from __future__ import annotations

import pytest

from tensorbend.cache.transfers import DEMAND, PREFETCH, Link, RequestQueue, Wire
from tensorbend.simulate.events import IOThreads

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


def test_a_prefetch_taken_while_the_wire_is_busy_waits_behind_later_demands():
    q = RequestQueue(max_backlog_s=0.5)
    q.prefetch((0, 1), when=3, rank=0)
    q.demand((0, 2))
    demand, prefetch = q.pop(), q.pop()
    assert q.deferral(demand, backlog_s=9.0) == 0.0  # demand loads never wait
    assert q.deferral(prefetch, backlog_s=0.5) == 0.0  # at the limit: start now
    assert q.deferral(prefetch, backlog_s=2.0) == 1.5  # until 0.5 s of booking is left
    assert RequestQueue().deferral(prefetch, backlog_s=1e9) == 0.0  # no limit by default
    q.put_back(prefetch)  # it waits in the queue as it was, not dropped
    assert len(q) == 1 and (0, 1) in q and q.next_arrival() == 0.0
    q.demand((0, 5))  # a demand queued meanwhile goes first
    q.prefetch((0, 0), when=3, rank=1)  # a prefetch queued later keeps its place behind it
    assert [q.pop().key for _ in range(3)] == [(0, 5), (0, 1), (0, 0)] and not q


def test_event_time_threads_defer_a_prefetch_until_the_backlog_allows_it():
    """2 threads, 2 s per transfer, backlog 1 s: demand A and prefetch P at 0, demand B at 0.5.
    A starts at 0 (wire 0-2); P's thread finds 2 s booked, waits until 1 s is left (t = 1) and
    then takes B, queued meanwhile (wire 2-4); A's thread, free at 2, finds P with 2 s booked
    and waits until t = 3 (wire 4-6). Dropping P would have left the wire idle from 4."""
    io = IOThreads(Link(bandwidth_Bps=5.0), 2, max_backlog_s=1.0)
    started = []

    def start(req, s):
        started.append((req.key, s))
        return io.wire.book(s, 10)

    io.queue.demand("A", at=0.0)
    io.queue.prefetch("P", when=9, rank=0, at=0.0)
    io.advance(0.5, start)
    io.queue.demand("B", at=0.5)
    io.advance(10.0, start)
    assert started == [("A", 0.0), ("B", 1.0), ("P", 3.0)] and io.wire.free_at == 6.0


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
