"""Offloaded generation: an on-disk expert store, a bounded expert cache, predictor-driven prefetch.

Usage:
    >>> from tensorbend.offload.runner import RunConfig, run
    >>> result = run(RunConfig(model="zoo:default", policy="lru", cache_frac=0.25))

See docs/offload.md; modules: store (disk + link cap), cache (slots, policies, counters),
prefetch (hooks -> prioritised loads), layer (the offloaded experts forward), runtime
(sessions: resident reference + one run per policy), runner (`tensorbend run`).
"""

POLICIES = ("resident", "on_demand", "lru", "lfu", "prefetch", "oracle")
