"""The resident set: which experts occupy the cache's slots, and who leaves when room is needed.

Usage (what the simulator does per demanded expert; `cache.ExpertCache` calls the same methods
under its lock, passing `evictable` to skip entries that are loading or pinned):
    >>> from tensorbend.cache.policies import LRU
    >>> rs = ResidentSet(capacity=2, num_layers=1, policy=LRU())
    >>> [rs.access((0, e), step) for step, e in enumerate([0, 1, 0, 2, 1])]   # hit?
    [False, False, True, False, False]
    >>> sorted(rs), rs.evictions
    ([(0, 1), (0, 2)], 2)
    >>> p = rs.place((0, 3), now=5, when=9)   # a prefetch for step 9: LRU takes any victim
    >>> p.outcome, p.victim
    ('admitted', (0, 2))

Pure bookkeeping (no threads, no tensors), shared by `ExpertCache` and the simulator so that
victims are chosen by the same code in both. Time is the logical clock step = forward * L + m.

Pools: `global` (one pool of `capacity` slots for every layer) or `per_layer` (capacity split
evenly over the L MoE layers, the first capacity % L layers get one more; a key only ever
evicts a key of its own layer). Capacity 0 is allowed: every miss bypasses (policy on_demand).

A demand miss or a prefetch asks `place(key, now, when)`; the outcome is one of
  admitted  key now holds a slot of its pool (`victim` left to make room, or None)
  refused   the pool is full and the admission rule (demand) or the victim's next use (a
            prefetch, `policies.prefetch_worth`) says no: a demand is computed from a staging
            buffer and not kept (bypass); a prefetch is dropped
  blocked   the pool is full and nothing in it is evictable right now (a demand waits, a
            prefetch is dropped)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from tensorbend.cache.admission import AdmitAll, prefetch_worth
from tensorbend.cache.policies import LRU, Key

PoolName = Literal["global", "per_layer"]
Evictable = Callable[[Key], bool] | None  # which entries a placement may evict (None: any)


@dataclass(frozen=True)
class Placement:
    outcome: Literal["admitted", "refused", "blocked"]
    victim: Key | None = None  # admitted: the key evicted to make room (None: there was room)


class ResidentSet:
    """Keys holding cache slots, per pool; recency; victim choice and admission."""

    def __init__(
        self,
        capacity: int,
        num_layers: int,
        policy: LRU,
        pool: PoolName = "global",
        admission: AdmitAll | None = None,
    ):
        assert capacity >= 0 and num_layers >= 1 and pool in ("global", "per_layer"), pool
        self.capacity, self.L, self.pool = capacity, num_layers, pool
        self.policy = policy
        self.admission = admission or AdmitAll()
        self.evictions = 0
        self._recency: dict[Key, int] = {}  # resident key -> sequence number of its last use
        self._missed: dict[Key, int] = {}  # missed key -> sequence number of that use
        self._seq = 0
        n_pools = num_layers if pool == "per_layer" else 1
        self._size = [0] * n_pools

    def __contains__(self, key: Key) -> bool:
        return key in self._recency

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._recency))

    def __len__(self) -> int:
        return len(self._recency)

    def pool_of(self, key: Key) -> int:
        return key[0] if self.pool == "per_layer" else 0

    def pool_capacity(self, p: int) -> int:
        if self.pool == "global":
            return self.capacity
        return self.capacity // self.L + (1 if p < self.capacity % self.L else 0)

    def has_room(self, key: Key) -> bool:
        p = self.pool_of(key)
        return self._size[p] < self.pool_capacity(p)

    # ------------------------------------------------------------ events

    def use(self, key: Key, now: int) -> bool:
        """A demand use of key at step now; returns whether it is resident (a hit)."""
        self.policy.touch(key, now)
        self.admission.touch(key, now)
        self._seq += 1
        if key in self._recency:
            self._recency[key] = self._seq
            return True
        self._missed[key] = self._seq  # its recency once placed: the order of demands
        return False

    def hint(self, key: Key, when: int) -> None:
        """A prediction that key is used at step `when` (passed to the policy)."""
        self.policy.hint(key, when)

    def hint_many(self, hints: list[tuple[Key, int]]) -> None:
        """hint() for each (key, when) in order."""
        self.policy.hint_many(hints)

    def set_forecast(self, forward: int, ahead_LE: list, after_first_LE: list) -> None:
        """A cross-token forecast (passed to the policy: `predicted.Reuse.set_forecast`)."""
        self.policy.set_forecast(forward, ahead_LE, after_first_LE)

    def place(
        self,
        key: Key,
        now: int,
        when: float | None = None,
        evictable: Callable[[Key], bool] | None = None,
    ) -> Placement:
        """Find key a slot: a demand miss (`when` None) or a prefetch used at step `when`."""
        assert key not in self._recency, f"{key} is resident already"
        if self.has_room(key):
            self._add(key)
            return Placement("admitted")
        if self.pool_capacity(self.pool_of(key)) == 0:
            self._missed.pop(key, None)
            return Placement("refused")
        victim = self.victim(key, now, evictable)
        if victim is None:
            return Placement("blocked")
        if when is None:
            ok = self.admission.admit(key, victim, self.policy, now)
        else:
            ok = prefetch_worth(self.policy, victim, when, now)
        if not ok:
            self._missed.pop(key, None)
            return Placement("refused")
        self.remove(victim)
        self.evictions += 1
        self._add(key)
        return Placement("admitted", victim)

    def access(self, key: Key, now: int) -> bool:
        """use + place on a miss (a simulator's demand with every entry evictable); hit?"""
        if self.use(key, now):
            return True
        self.place(key, now)
        return False

    def victim(
        self, key: Key, now: int, evictable: Callable[[Key], bool] | None = None
    ) -> Key | None:
        """The policy's highest-ranked evictable entry of key's pool (None: nothing evictable)."""
        p, rank = self.pool_of(key), self.policy.rank
        cands = [
            k for k in self._recency if self.pool_of(k) == p and (evictable is None or evictable(k))
        ]
        if not cands:
            return None
        return max(cands, key=lambda k: rank(k, self._recency[k], now))

    def remove(self, key: Key) -> None:
        """Key leaves its slot (evicted, or a failed load)."""
        del self._recency[key]
        self._size[self.pool_of(key)] -= 1

    # ------------------------------------------------------------ helpers

    def _add(self, key: Key) -> None:
        """Insert: a demand miss ranks by when it was demanded, a prefetch by now."""
        self._size[self.pool_of(key)] += 1
        seq = self._missed.pop(key, None)
        if seq is None:
            self._seq += 1
            seq = self._seq
        self._recency[key] = seq


def inherited(method, base) -> bool:
    """Whether a bound method is `base` itself, not overridden (a no-op a caller may skip)."""
    return getattr(method, "__func__", None) is base
