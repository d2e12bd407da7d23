"""Inference engines: the engine-neutral prefetch API (`engines.prefetcher.Prefetcher`).

The API itself lives in `tensorbend.prefetch`; this package keeps its documented import path.
Importing an engine's recorded routing as a trace is `tensorbend.importers`.
"""
