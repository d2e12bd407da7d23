"""The cache's options and its one policy table: every default once, every policy's properties once.

Usage:
    >>> from tensorbend.cache.config import POLICIES, PolicyConfig, make_eviction, no_prediction
    >>> pc = PolicyConfig("oracle", cache_frac=0.25, foresight=2, pool="per_layer")
    >>> PolicyConfig("lru", foresight=2)
    Traceback (most recent call last):
    ...
    tensorbend.errors.TensorbendError: --foresight 2 with --policy lru: expected a count >= 0 with --policy oracle; drop --foresight otherwise
    >>> POLICIES["lfru"].uses_prediction, POLICIES["on_demand"].keeps_experts
    (False, False)
    >>> no_prediction()                  # the caches that never read a predictor
    ('lru', 'lfu', 'lfru')
    >>> type(make_eviction("prefetch", num_layers=4)).__name__   # fed no predictions: no_prediction too
    'Predicted'

`POLICIES` maps a policy name (`--policy`) to a `PolicySpec`: the eviction rule it builds
(policies.py) and its declared properties, which every driver reads instead of testing names:
  uses_prediction  its decisions read a predictor when one is given (prefetch: a within-token
                   and/or horizon predictor, none = `Predicted` eviction alone; oracle: the
                   recorded routing). A run with prediction-reading policy but no predictor
                   uses none: `report.uses_prediction(row)` decides per run.
  keeps_experts    it holds experts in slots (on_demand keeps nothing: capacity 0)
  bounded          its capacity is the configured cache (resident holds every expert)
  recorded_routing its rule reads the resident run's routing (the oracle's steps_by_key)
  admission        the admission rule `--admission auto` gives it (frequency for the caches
                   without prediction, predicted for prefetch, all otherwise)
Pool and admission apply to every policy that keeps experts. `PolicyConfig` (the `run` flags)
is the one home of the policy and cache-option defaults; `tensorbend simulate` takes its
defaults from it, and `SERVING` (lfru, admission auto) is `tensorbend generate`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

from tensorbend.cache.admission import AdmissionName, make_admission
from tensorbend.cache.policies import LFRU, LFU, LRU, NextUse
from tensorbend.cache.predicted import Predicted, Reuse
from tensorbend.cache.resident import PoolName, ResidentSet
from tensorbend.cache.victim_heap import IndexedResidentSet
from tensorbend.errors import TensorbendError
from tensorbend.lookahead import LOOKAHEADS, get_lookahead

if TYPE_CHECKING:
    from tensorbend.models import RoutingSpec

PolicyName = Literal["resident", "on_demand", "lru", "lfu", "lfru", "prefetch", "oracle"]
AdmissionChoice = Literal["all", "frequency", "predicted", "auto"]
"""`--admission`: a rule (cache/admission.py), or auto: the policy's own (`PolicySpec.admission`)."""
BeyondName = Literal["lru", "lfu", "lfru", "predicted"]
"""What the bounded oracle ranks by beyond its sight: a rule that reads no prediction."""


@dataclass(frozen=True)
class PolicySpec:
    """One policy of the table (see the module docstring for the properties)."""

    name: str
    eviction: Callable[..., LRU]  # (num_layers, steps, foresight, horizon, beyond) -> rule
    uses_prediction: bool
    keeps_experts: bool = True
    bounded: bool = True
    recorded_routing: bool = False  # its rule reads the resident run's routing (steps_by_key)
    admission: AdmissionName = "all"  # what `--admission auto` keeps with it


_BEYOND: dict[str, Callable[[int], LRU]] = {
    "lru": lambda L: LRU(),
    "lfu": lambda L: LFU(),
    "lfru": lambda L: LFRU(),
    "predicted": Predicted,  # fed no predictions: a layer-cycle-aware LFU
}


def _oracle(L, steps, foresight, horizon, beyond) -> NextUse:
    assert steps is not None, "the oracle's eviction needs the recorded routing (steps_by_key)"
    return NextUse(steps, L, foresight, beyond=_BEYOND[beyond](L))


POLICIES: dict[str, PolicySpec] = {
    "resident": PolicySpec("resident", lambda L, *_: LRU(), False, bounded=False),
    "on_demand": PolicySpec("on_demand", lambda L, *_: LRU(), False, keeps_experts=False),
    "lru": PolicySpec("lru", lambda L, *_: LRU(), False, admission="frequency"),
    "lfu": PolicySpec("lfu", lambda L, *_: LFU(), False, admission="frequency"),
    "lfru": PolicySpec("lfru", lambda L, *_: LFRU(), False, admission="frequency"),
    "prefetch": PolicySpec(
        "prefetch",
        lambda L, s, f, horizon, b: Reuse(L) if horizon else Predicted(L),
        True,
        admission="predicted",
    ),
    "oracle": PolicySpec("oracle", _oracle, True, recorded_routing=True),
}
assert tuple(POLICIES) == get_args(PolicyName)


def make_eviction(
    name: str,
    num_layers: int,
    steps: dict | None = None,
    foresight: int | None = None,
    horizon: bool = False,
    beyond: BeyondName = "lru",
) -> LRU:
    """The eviction rule of policy `name` (steps: the oracle's recorded routing, steps_by_key;
    horizon: a cross-token forecast drives `prefetch`; beyond: the oracle's rule past its sight)."""
    return POLICIES[name].eviction(num_layers, steps, foresight, horizon, beyond)


def make_resident_set(
    policy: str,
    capacity: int,
    num_layers: int,
    pool: PoolName = "global",
    admission: AdmissionName = "all",
    admission_window: int = 8,
    steps: dict | None = None,
    foresight: int | None = None,
    horizon: bool = False,
    beyond: BeyondName = "lru",
) -> ResidentSet:
    """The cache of policy `policy`, as the runtime (offload/build.py) and the simulator both
    build it: the table's eviction rule, capacity 0 for a policy that keeps nothing; pool and
    admission; victims through the index (cache/victim_heap.py)."""
    cap = capacity if POLICIES[policy].keeps_experts else 0
    ev = make_eviction(policy, num_layers, steps, foresight, horizon, beyond)
    adm = make_admission(admission, num_layers, admission_window)
    return IndexedResidentSet(cap, num_layers, ev, pool=pool, admission=adm)


def no_prediction() -> tuple[str, ...]:
    """Bounded caches that never read a predictor (prefetch with none is one too, per run)."""
    return tuple(
        n for n, p in POLICIES.items() if p.bounded and p.keeps_experts and not p.uses_prediction
    )


@dataclass(frozen=True)
class PolicyConfig:
    policy: PolicyName = "lru"
    """What loads and keeps experts, from holding all to knowing the future: resident (every
    expert in memory), on_demand (load when asked, keep nothing), lru, lfu, lfru (caches without
    prediction), prefetch (a predictor's prefetches + Predicted eviction), oracle (the resident
    run's routing: exact prefetches + Belady eviction within --foresight)."""
    cache_frac: float = 0.25
    """Cache capacity as a fraction of all routed experts (MoE layers x experts)."""
    cache_bytes: int | None = None
    """Cache capacity in bytes (overrides --cache-frac)."""
    pool: PoolName = "global"
    """One slot pool for all layers (global), or capacity split evenly per MoE layer."""
    admission: AdmissionChoice = "all"
    """Which misses the cache keeps: all; frequency (TinyLFU-style: used more often than the
    victim within --admission-window forwards); predicted (not if predicted back later than the
    victim; prefetch and oracle only); auto: frequency for lru, lfu and lfru, predicted for
    prefetch, all otherwise (what measured best). A refused miss is computed from a staging
    slot."""
    admission_window: int = 8
    """Forwards of use counts for --admission frequency."""
    foresight: int | None = None
    """Oracle only: forwards (tokens at decode) of exact routing it knows, counting the
    current one (0: nothing, LRU); default: the whole run."""
    oracle_beyond: BeyondName = "lru"
    """How the oracle ranks the experts it cannot see used within --foresight (oracle only): a
    rule without prediction, or predicted (Predicted eviction fed no predictions)."""
    lookahead: str = field(default="d1", metadata={"choices": tuple(LOOKAHEADS)})
    """Source point of a --baseline predictor and of the oracle's prefetches (a checkpoint
    brings its own)."""
    prefetch_backlog: float = 0.5
    """Start a prefetch only while the link has at most this many expert transfers booked
    ahead; until then it waits in the queue, behind any demand load that comes (inf: at once)."""
    token_ahead_layers: int = 1
    """Next-forward layers prefetched with --horizon: during a forward's last MoE layer, the
    likeliest experts of the next forward's first N MoE layers (0: none; its forecast then
    drives eviction only)."""
    staging_slots: int | None = None
    """Staging slots beside the cache, each one expert: a miss the admission refuses (or that
    finds every slot pinned) is read into one, computed, and dropped; default the model's top-k
    (a layer's refused misses all load at once). Fewer leave their bytes to the cache (with
    --max-memory) at the cost of loading more than that many refused misses of a layer one
    after another."""

    def __post_init__(self) -> None:
        if isinstance(self.policy, str) and self.policy.lower() in POLICIES:  # "LRU" from Python
            object.__setattr__(self, "policy", self.policy.lower())
        _check_policy(self)

    @property
    def admission_rule(self) -> AdmissionName:
        """The admission rule this config runs (`auto` resolved for its policy)."""
        return admission_rule(self.admission, self.policy)

    def staging(self, top_k: int) -> int:
        """Staging slots for a model routing top_k experts (`staging_slots`, default top_k)."""
        return top_k if self.staging_slots is None else self.staging_slots

    def slots(self, spec: RoutingSpec, expert_bytes: int) -> int:
        """Cache slots for this model: where a byte budget becomes slots (sizes stay in bytes
        until here); raises when too few to be meaningful."""
        n_routed = spec.num_moe_layers * spec.num_experts
        if not POLICIES[self.policy].bounded:
            return n_routed
        if self.cache_bytes is not None:
            slots = min(self.cache_bytes // expert_bytes, n_routed)
            what = f"--cache-bytes {self.cache_bytes} ({expert_bytes} bytes per expert)"
        else:
            slots = round(self.cache_frac * n_routed)
            what = f"--cache-frac {self.cache_frac} of {n_routed} experts"
        if not POLICIES[self.policy].keeps_experts:
            return slots
        return check_slots(slots, what, spec.top_k, spec.num_moe_layers, self.pool)


def admission_rule(admission: str, policy: str) -> AdmissionName:
    """`admission`, or for `auto` the admission policy `policy` runs with (`PolicySpec`).

    >>> admission_rule("auto", "lfru"), admission_rule("auto", "prefetch"), admission_rule("all", "lfru")
    ('frequency', 'predicted', 'all')
    """
    return POLICIES[policy].admission if admission == "auto" else admission


def min_slots(top_k: int, num_layers: int, pool: str) -> int:
    """The fewest cache slots a policy that keeps experts runs with: one layer's top-k, and one
    per MoE layer with a per-layer pool (the runtime, the simulator and --max-memory's minimum)."""
    return max(top_k, num_layers if pool == "per_layer" else 1)


def check_slots(slots: int, what: str, top_k: int, num_layers: int, pool: str) -> int:
    """`slots`, or TensorbendError naming `what` gave them when fewer than `min_slots`."""
    need = min_slots(top_k, num_layers, pool)
    if slots < need:
        per_layer = " and one per MoE layer for --pool per_layer" if pool == "per_layer" else ""
        raise TensorbendError(
            f"{what} gives {slots} cache slots: expected at least {need} (top_k{per_layer}); "
            f"raise the cache size"
        )
    return slots


def _check_policy(pc: PolicyConfig) -> None:
    """PolicyConfig validation: one-line errors naming the flag, before any model loads."""
    if pc.policy not in POLICIES:
        raise TensorbendError(f"--policy {pc.policy!r}: expected one of {', '.join(POLICIES)}")
    if not 0 < pc.cache_frac <= 1:
        raise TensorbendError(f"--cache-frac {pc.cache_frac}: expected a fraction in (0, 1]")
    if pc.cache_bytes is not None and pc.cache_bytes < 1:
        raise TensorbendError(
            f"--cache-bytes {pc.cache_bytes}: expected a positive byte count "
            f"(or leave it out and use --cache-frac)"
        )
    get_lookahead(pc.lookahead)
    if pc.foresight is not None and (not POLICIES[pc.policy].recorded_routing or pc.foresight < 0):
        raise TensorbendError(
            f"--foresight {pc.foresight} with --policy {pc.policy}: expected a count >= 0 "
            f"with --policy oracle; drop --foresight otherwise"
        )
    if pc.oracle_beyond not in _BEYOND:
        raise TensorbendError(
            f"--oracle-beyond {pc.oracle_beyond}: expected one of {', '.join(_BEYOND)}"
        )
    if pc.admission not in get_args(AdmissionChoice):
        raise TensorbendError(
            f"--admission {pc.admission!r}: expected one of {', '.join(get_args(AdmissionChoice))}"
        )
    if pc.admission == "predicted" and not POLICIES[pc.policy].uses_prediction:
        raise TensorbendError(
            f"--admission predicted with --policy {pc.policy}: expected --policy prefetch or "
            f"oracle (a policy that predicts); use --admission frequency for "
            f"{', '.join(no_prediction())}"
        )
    for name in ("admission_window", "prefetch_backlog", "token_ahead_layers", "staging_slots"):
        low = 1 if name in ("admission_window", "staging_slots") else 0
        if getattr(pc, name) is None:
            continue
        if not getattr(pc, name) >= low:
            flag = "--" + name.replace("_", "-")
            raise TensorbendError(f"{flag} {getattr(pc, name)}: expected a number >= {low}")


SERVING = PolicyConfig("lfru", admission="auto")
"""`tensorbend generate`'s and `load_offloaded`'s cache (`serving.ServeConfig.offload`): the
fastest cache without prediction on the real disk (lfru with frequency admission: 1.23x lru
there, docs/results/serve_memory.md); with `--policy P`, P's own admission (auto)."""
