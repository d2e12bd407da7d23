"""Offloaded generation: an on-disk expert store, a bounded expert cache, predictor-driven prefetch.

Usage:
    >>> from tensorbend.offload.runner import RunConfig, run
    >>> from tensorbend.cache.config import PolicyConfig
    >>> result = run(RunConfig(model="zoo:default", offload=PolicyConfig("lru")))  # doctest: +SKIP
    >>> result.to_json()["output_matches_resident"]                                       # doctest: +SKIP
    True

See docs/guide/offload.md. Modules, in the order a run uses them:
  store     on-disk expert store: one contiguous read per expert, booked on the link's wire
  shards, expert_plan  a HF checkpoint read tensor by tensor; the store streamed from it
  cache     ExpertCache: tensor slots, lock and waiting over cache/slots.py's slot table
  loader    Loader: I/O threads on cache/transfers.py's request queue
  hooks     PredictionHooks: router hooks -> predictor inputs -> prefetches + cache hints
  recorded  RecordedRouting: the resident run's routing as predictions, with bounded foresight
  layer     OffloadedExperts: the experts forward on weights from the cache
  generation  the prompts through hf.decode_prompt, timed and counted per phase
  build     PolicyConfig (cache/config.py: policy table, cache size, pool, admission,
            foresight) -> the ExpertCache
  session   OffloadSession: resident reference, store, one run per policy
  result    RunResult: the `run --json` keys, output comparison
  runner    RunConfig + run(): what `tensorbend measure` calls
  handle    OffloadHandle: store, cache, loader, hooks and counters attached to a model in place
            (what `tensorbend.load_offloaded` and the session use)
The pure decisions (policies, resident sets, slot table, queue and wire) live in cache/.
"""
