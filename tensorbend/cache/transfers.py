"""Moving experts: the link's parameters, the wire that serialises transfers, the request queue.

Usage:
    >>> link = parse_link("40MB/s,20us", layer_s=1e-3, expert_bytes=1000)
    >>> round(link.seconds(40_000), 6)              # 1 ms of bandwidth + 20 us latency
    0.00102
    >>> real = parse_link("h100-pcie5-kimi", layer_s=1e-3, expert_bytes=98_304)
    >>> round(real.seconds(98_304) / 1e-3, 2)       # one expert = 2.33 resident MoE layers
    2.33
    >>> parse_link("h100-pcie5-kimi", 1e-3, 98_304, speedup=4).name
    'h100-pcie5-kimi x4'
    >>> wire = Wire(Link(bandwidth_Bps=100.0, latency_s=0.5))
    >>> wire.book(at=0.0, nbytes=200), wire.book(at=1.0, nbytes=100)   # the second waits
    (2.5, 3.5)
    >>> wire.backlog(at=1.0)                        # seconds until the wire is free
    2.0
    >>> queue = RequestQueue()
    >>> queue.prefetch((1, 4), when=7, rank=1), queue.prefetch((1, 2), when=7, rank=0)
    (True, True)
    >>> queue.demand((0, 3))                        # demand loads go first
    >>> [queue.pop().key for _ in range(3)]         # then prefetches by (step, rank)
    [(0, 3), (1, 2), (1, 4)]

One `Link` (bandwidth, latency; parsed from `--link`) for the runtime and the simulator. The
`Wire` books transfers back to back: a transfer of n bytes occupies it for n / bandwidth after
it frees up and completes `latency_s` later. The runtime's `offload.store.ExpertStore` books
every real read on it with the wall clock (and sleeps until the booked end), so a CPU machine
reproduces the transfer/compute ratio of a real system; the simulator books in event time.
`h100-pcie5-kimi` keeps the ratio of one Kimi-K2.5-sized expert transfer over PCIe Gen5 x16 to
one H100 MoE layer of batch-1 decode compute (see `real_link`), scaled to this machine's
measured resident compute time per MoE layer. `speedup` makes any link N times faster.

The `RequestQueue` is what I/O threads serve (`offload.loader.Loader` with real threads,
`simulate.events.IOThreads` in event time): every demand load before any prefetch, prefetches by
the step they are needed at (soonest first: a prediction for the next token's layers waits
behind this token's), then by the prediction's rank, then first come. A demand for a queued
prefetch upgrades it; prefetches whose step has come are cancelled (`cancel_stale`); a prefetch
taken while the wire is booked more than `max_backlog_s` ahead goes back to the queue and its
thread waits until only that much is left (`deferral`, `put_back`), then takes the best request
again: a demand queued meanwhile goes first, and a prefetch never books the wire far ahead of
the demand loads that follow it, yet uses the link's idle time (dropping such prefetches, as
this queue once did, threw away nearly every within-token prefetch on a busy link). Each request carries the
time it was queued (`at`, never decreasing); `pop(t)` takes the best one queued by t.
"""

from __future__ import annotations

import heapq
import re
from collections import deque
from dataclasses import dataclass

from tensorbend.cache.policies import INF, Key
from tensorbend.errors import StoreError

DEMAND, PREFETCH = 0, 1
BUSY_LINK_PREFETCH = "deferred"  # what the queue does with a prefetch taken while the wire is
# booked more than the backlog ahead; bench JSON records it ("dropped" before this rule)
_TICK = 1e-9  # seconds: a shorter deferral is none (a wait never ends on a rounding error)

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


@dataclass(frozen=True)
class Link:
    """A transfer link: bandwidth (`None`: uncapped, the runtime reads at disk speed) and a
    fixed latency per transfer."""

    bandwidth_Bps: float | None = None
    latency_s: float = 0.0
    name: str = "none"
    note: str = ""
    target: str | None = None  # hardware profile an emulated link stands for (time_model)
    target_layer_s: float | None = None  # that target's MoE-layer decode compute, seconds

    def __post_init__(self) -> None:
        if self.bandwidth_Bps is not None and self.bandwidth_Bps <= 0:
            raise StoreError(f"link bandwidth: expected > 0 bytes/s, found {self.bandwidth_Bps}")
        if self.latency_s < 0:
            raise StoreError(f"link latency: expected >= 0 s, found {self.latency_s}")

    def seconds(self, nbytes: int) -> float:
        """One transfer on an idle wire: latency + bytes / bandwidth."""
        return self.latency_s + self.wire_s(nbytes)

    def wire_s(self, nbytes: int) -> float:
        """Seconds the wire is occupied by nbytes (0 when uncapped)."""
        bw = self.bandwidth_Bps
        return nbytes / bw if bw else 0.0

    @property
    def capped(self) -> bool:
        return self.bandwidth_Bps is not None or self.latency_s > 0

    def to_dict(self) -> dict:
        mbps = None if self.bandwidth_Bps is None else round(self.bandwidth_Bps / 1e6, 3)
        return {
            "name": self.name,
            "bandwidth_MBps": mbps,
            "latency_us": round(self.latency_s * 1e6, 2),
            "note": self.note,
        }


def real_link(layer_s: float, expert_bytes: int) -> Link:
    """The `h100-pcie5-kimi` link: PCIe Gen5 x16 feeding an H100, Kimi-K2.5-sized experts.

    Real system (per MoE layer, batch-1 decode): one routed expert is 3 x 7168 x 2048 weights
    in INT4 + bf16 scales per 32 (~24.8 MB), over ~52 GB/s effective PCIe Gen5 x16 plus ~10 us
    per transfer: ~0.49 ms. The H100 computes a whole MoE layer (8 experts INT4, the shared
    expert and MLA attention in bf16, ~490 MB of HBM reads at ~2.35 TB/s effective) in ~0.21 ms.
    We keep both ratios (expert transfer / layer compute, latency / layer compute) and scale
    them to this machine's measured resident compute time per MoE layer `layer_s`.
    """
    real_expert_bytes = 3 * 7168 * 2048 * 0.5625
    real_bw, real_lat = 52e9, 10e-6
    real_layer_s = 490e6 / 2.35e12
    ratio = (real_expert_bytes / real_bw) / real_layer_s
    bw = expert_bytes / (ratio * layer_s)
    lat = real_lat / real_layer_s * layer_s
    return Link(
        bw,
        lat,
        "h100-pcie5-kimi",
        f"expert transfer = {ratio:.2f} x resident MoE-layer compute "
        f"({layer_s * 1e3:.3f} ms here), latency = {real_lat / real_layer_s:.3f} x",
        target="h100-pcie5",
        target_layer_s=real_layer_s,
    )


def check_link(text: str) -> None:
    """Raise StoreError unless `text` is a link `parse_link` accepts (no calibration needed)."""
    _match_link(text)


def parse_link(text: str, layer_s: float, expert_bytes: int, speedup: float = 1.0) -> Link:
    """`none`, `h100-pcie5-kimi` (scaled to this machine), or `BW[,LAT]` like `40MB/s,20us`.

    `speedup` > 1 makes the link that many times faster (bandwidth x speedup, latency / speedup):
    the same system with a faster interconnect relative to compute."""
    name, m = _match_link(text)
    if name == "none":
        return Link()
    if name == "h100-pcie5-kimi":
        link = real_link(layer_s, expert_bytes)
    else:
        lat = float(m.group(3) or 0) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 0}[m.group(4)]
        link = Link(float(m.group(1)) * _UNITS[m.group(2)], lat, name)
    if speedup == 1.0:
        return link
    assert speedup > 0, speedup
    return Link(
        link.bandwidth_Bps * speedup,
        link.latency_s / speedup,
        f"{link.name} x{speedup:g}",
        f"{link.note}; {speedup:g}x faster".lstrip("; "),
        link.target,
        link.target_layer_s,
    )


class Wire:
    """One serialised wire: transfers booked back to back, in the driver's clock (not
    thread-safe: the runtime's store books under its own lock)."""

    def __init__(self, link: Link):
        self.link = link
        self.free_at = 0.0  # when the last booked transfer leaves the wire

    def book(self, at: float, nbytes: int) -> float:
        """Book nbytes from time `at` (or when the wire frees up); returns when they arrive."""
        begin = max(at, self.free_at)
        self.free_at = begin + self.link.wire_s(nbytes)
        return self.free_at + self.link.latency_s

    def backlog(self, at: float) -> float:
        """Seconds from `at` until the wire is free."""
        return max(0.0, self.free_at - at)


@dataclass(slots=True)
class Request:
    kind: int  # DEMAND or PREFETCH
    priority: tuple  # prefetch: (step needed at, predicted rank); demand: (0, 0)
    seq: int  # first come, first served among equals
    key: Key
    when: float  # step the prefetched expert is needed at (INF for demand)
    at: float  # time it was queued
    alive: bool = True  # False once taken, cancelled or upgraded


class RequestQueue:
    """Queued loads, best first (see the module docstring); not thread-safe."""

    def __init__(self, max_backlog_s: float = INF):
        self.max_backlog_s = max_backlog_s
        self.queued: dict[Key, Request] = {}  # alive requests by key
        self._heap: list[tuple] = []  # (kind, priority, seq, request) of requests a pop saw
        self._unreleased: deque[Request] = deque()  # queued after every pop's time, in order
        self._arrivals: deque[Request] = deque()  # all requests in order (dead ones dropped
        # from the front): the earliest queued one is the first alive
        self._seq = 0
        self._last_at = -INF

    def __len__(self) -> int:
        return len(self.queued)

    def __contains__(self, key: Key) -> bool:
        return key in self.queued

    def demand(self, key: Key, at: float = 0.0) -> None:
        """Queue a demand load of key (upgrading a queued prefetch of it)."""
        req = self.queued.get(key)
        if req is not None and req.kind == DEMAND:
            return
        if req is not None:
            req.alive = False  # upgraded: the demand below replaces it
        self._push(DEMAND, (0, 0), key, INF, at)

    def prefetch(self, key: Key, when: int, rank: float, at: float = 0.0) -> bool:
        """Queue a prefetch of key, used at step `when`; False if key is queued already."""
        if key in self.queued:
            return False
        self._push(PREFETCH, (when, rank), key, when, at)
        return True

    def cancel_stale(self, now: int) -> int:
        """Drop queued prefetches for steps that have started (their use is now or past)."""
        stale = [r for r in self.queued.values() if r.kind == PREFETCH and r.when <= now]
        for req in stale:
            req.alive = False
            del self.queued[req.key]
        return len(stale)

    def pop(self, t: float = INF) -> Request | None:
        """Take the best request queued by time t (None: there is none)."""
        while self._unreleased and self._unreleased[0].at <= t:
            r = self._unreleased.popleft()
            if r.alive:
                heapq.heappush(self._heap, (r.kind, r.priority, r.seq, r))
        later, found = [], None
        while self._heap:
            item = heapq.heappop(self._heap)
            r = item[-1]
            if not r.alive:
                continue
            if r.at > t:  # released by a pop at a later time: not queued yet at t
                later.append(item)
                continue
            r.alive, found = False, r
            del self.queued[r.key]
            break
        for item in later:
            heapq.heappush(self._heap, item)
        self.next_arrival()  # drops dead requests from the front of `_arrivals`
        return found

    def next_arrival(self) -> float:
        """When the earliest queued request was queued (INF when none is)."""
        while self._arrivals and not self._arrivals[0].alive:
            self._arrivals.popleft()
        return self._arrivals[0].at if self._arrivals else INF

    def deferral(self, req: Request, backlog_s: float) -> float:
        """Seconds the thread that took `req` waits before starting it: a prefetch taken while
        the wire is booked more than max_backlog_s ahead waits until only that much is left
        (0: start now; a demand never waits)."""
        wait = backlog_s - self.max_backlog_s
        return wait if req.kind == PREFETCH and wait > _TICK else 0.0

    def put_back(self, req: Request) -> None:
        """Return a request `pop` took (one that must wait) to the queue as it was."""
        assert not req.alive and req.key not in self.queued, req.key
        req.alive = True
        self.queued[req.key] = req
        heapq.heappush(self._heap, (req.kind, req.priority, req.seq, req))
        i = next((i for i, r in enumerate(self._arrivals) if r.at > req.at), len(self._arrivals))
        self._arrivals.insert(i, req)  # (kept in order of `at`: next_arrival reads the front)

    def _push(self, kind: int, priority: tuple, key: Key, when: float, at: float) -> None:
        assert at >= self._last_at, "requests are queued in time order"
        self._seq += 1
        self._last_at = at
        req = Request(kind, priority, self._seq, key, when, at)
        self.queued[key] = req
        self._unreleased.append(req)
        self._arrivals.append(req)


def _match_link(text: str):
    name = text.strip().lower()
    if name in ("none", "", "h100-pcie5-kimi"):
        return name or "none", None
    num = r"(\d+(?:\.\d*)?|\.\d+)"  # 40, 40., 0.5, .5; not ".", "1.2.3" or "1..2"
    m = re.fullmatch(num + r"\s*([kmg]?)b/s(?:\s*,\s*" + num + r"\s*(us|ms|s))?", name)
    if not m or float(m.group(1)) <= 0:
        raise StoreError(
            f"--link {text!r}: expected none, h100-pcie5-kimi, or BANDWIDTH[,LATENCY] with "
            f"decimal numbers like 40MB/s,20us, found {'a zero bandwidth' if m else 'neither'}; "
            "fix the --link value"
        )
    return name, m
