"""One offloaded run's plan: the policy and cache options, and the ExpertCache they build.

Usage:
    >>> from tensorbend.offload.plan import PolicyConfig
    >>> pc = PolicyConfig("oracle", cache_frac=0.25, foresight=2, pool="per_layer")
    >>> PolicyConfig("lru", foresight=2)
    Traceback (most recent call last):
    ...
    tensorbend.errors.TensorbendError: --foresight 2 with --policy lru: expected a count >= 0 with --policy oracle; drop --foresight otherwise

    cache = build_cache(pc, spec, layout, predictor, device="cpu")     # session.run_policy does this

Policy -> eviction rule (policies.py): lru and on_demand LRU (on_demand keeps nothing: a
resident set of capacity 0, every miss read into a staging slot), lfu LFU, lfru LFRU, prefetch
Predicted (the predictor's hints), oracle NextUse over the recorded routing within its
foresight. Pool and admission apply to every policy that keeps experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorbend.cache.victim_heap import IndexedResidentSet
from tensorbend.errors import TensorbendError
from tensorbend.models import RoutingSpec
from tensorbend.offload import NO_PREDICTION_CACHES, PolicyName
from tensorbend.offload.cache import CacheConfig, ExpertCache
from tensorbend.offload.policies import (
    LFRU,
    LFU,
    LRU,
    AdmissionName,
    Predicted,
    Reuse,
    make_admission,
)
from tensorbend.offload.resident import PoolName
from tensorbend.offload.store import ExpertLayout
from tensorbend.predictors.base import LOOKAHEADS, get_lookahead


@dataclass(frozen=True)
class PolicyConfig:
    policy: PolicyName = "lru"
    """resident (every expert in memory), on_demand (load when asked, keep nothing), lru, lfu,
    lfru (caches without prediction), prefetch (a predictor's prefetches + Predicted eviction),
    oracle (the resident run's routing: exact prefetches + Belady eviction within --foresight)."""
    cache_frac: float = 0.25
    """Cache capacity as a fraction of all routed experts (MoE layers x experts)."""
    cache_bytes: int | None = None
    """Cache capacity in bytes (overrides --cache-frac)."""
    pool: PoolName = "global"
    """One slot pool for all layers (global), or capacity split evenly per MoE layer."""
    admission: AdmissionName = "all"
    """Which misses the cache keeps: all; frequency (TinyLFU-style: used more often than the
    victim within --admission-window forwards); predicted (not if predicted back later than the
    victim; prefetch and oracle only). A refused miss is computed from a staging slot."""
    admission_window: int = 8
    """Forwards of use counts for --admission frequency."""
    foresight: int | None = None
    """Oracle only: forwards (tokens at decode) of exact routing it knows, counting the
    current one (0: nothing, LRU); default: the whole run."""
    lookahead: str = field(default="d1", metadata={"choices": tuple(LOOKAHEADS)})
    """Source point of a --baseline predictor and of the oracle's prefetches (a checkpoint
    brings its own)."""
    prefetch_extra: int = 0
    """Batch-1 decode prefetches the top-(K + extra) predicted experts."""
    prefetch_backlog: float = 0.5
    """Start a prefetch only while the link is busy for at most this many expert transfers
    (inf: always)."""
    token_ahead_layers: int = 1
    """With --horizon: during a forward's last MoE layer, prefetch the likeliest experts of the
    next forward's first N MoE layers (0: none; its forecast then drives eviction only)."""

    def __post_init__(self) -> None:
        _check_policy(self)

    def slots(self, spec: RoutingSpec, expert_bytes: int) -> int:
        """Cache slots for this model; raises when too few to be meaningful."""
        n_routed = spec.num_moe_layers * spec.num_experts
        if self.policy == "resident":
            return n_routed
        if self.cache_bytes is not None:
            slots = min(self.cache_bytes // expert_bytes, n_routed)
            what = f"--cache-bytes {self.cache_bytes} ({expert_bytes} bytes per expert)"
        else:
            slots = round(self.cache_frac * n_routed)
            what = f"--cache-frac {self.cache_frac} of {n_routed} experts"
        need = max(spec.top_k, spec.num_moe_layers if self.pool == "per_layer" else 1)
        if slots < need and self.policy != "on_demand":
            raise TensorbendError(
                f"{what} gives {slots} cache slots: expected at least {need} (top_k"
                f"{' and one per MoE layer for --pool per_layer' if self.pool == 'per_layer' else ''}"
                f"); raise the cache size"
            )
        return slots


def build_cache(
    pc: PolicyConfig,
    spec: RoutingSpec,
    layout: ExpertLayout,
    predictor,
    device: str,
    horizon=None,
) -> ExpertCache:
    """A fresh ExpertCache for one run of `pc` (the oracle's predictor brings its eviction; a
    cross-token `horizon` predictor's forecasts drive `Reuse`)."""
    L = spec.num_moe_layers
    slots = 0 if pc.policy == "on_demand" else pc.slots(spec, layout.nbytes)
    if pc.policy == "oracle":
        policy = predictor.eviction_policy()
    elif pc.policy == "prefetch":
        policy = Reuse(L) if horizon is not None else Predicted(L)
    else:
        policy = {"lfu": LFU, "lfru": LFRU}.get(pc.policy, LRU)()
    admission = make_admission(pc.admission, L, pc.admission_window)
    rs = IndexedResidentSet(slots, L, policy, pool=pc.pool, admission=admission)
    cfg = CacheConfig(scratch=spec.top_k, device=device)
    return ExpertCache(cfg, rs, layout.numel, layout.dtype, layout.nbytes)


def _check_policy(pc: PolicyConfig) -> None:
    """PolicyConfig validation: one-line errors naming the flag, before any model loads."""
    if not 0 < pc.cache_frac <= 1:
        raise TensorbendError(f"--cache-frac {pc.cache_frac}: expected a fraction in (0, 1]")
    if pc.cache_bytes is not None and pc.cache_bytes < 1:
        raise TensorbendError(
            f"--cache-bytes {pc.cache_bytes}: expected a positive byte count "
            f"(or leave it out and use --cache-frac)"
        )
    get_lookahead(pc.lookahead)
    if pc.foresight is not None and (pc.policy != "oracle" or pc.foresight < 0):
        raise TensorbendError(
            f"--foresight {pc.foresight} with --policy {pc.policy}: expected a count >= 0 "
            f"with --policy oracle; drop --foresight otherwise"
        )
    if pc.admission == "predicted" and pc.policy not in ("prefetch", "oracle"):
        raise TensorbendError(
            f"--admission predicted with --policy {pc.policy}: expected --policy prefetch or "
            f"oracle (a policy that predicts); use --admission frequency for "
            f"{', '.join(NO_PREDICTION_CACHES)}"
        )
    for name in ("admission_window", "prefetch_extra", "prefetch_backlog", "token_ahead_layers"):
        low = 1 if name == "admission_window" else 0
        if not getattr(pc, name) >= low:
            flag = "--" + name.replace("_", "-")
            raise TensorbendError(f"{flag} {getattr(pc, name)}: expected a number >= {low}")
