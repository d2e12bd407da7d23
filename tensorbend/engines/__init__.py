"""Inference engines: the documented path of the engine-neutral prefetch API.

`tensorbend.engines.prefetcher` re-exports `tensorbend.predictors.prefetch` (where `Prefetcher` lives);
importing an engine's recorded routing as a trace is `tensorbend.engines.importers`.
"""
