"""Capture: router hooks -> per-token rows -> an on-disk trace (collect, the trace format and its
writer, prompts and their splits, data-parallel ranks, the model loading and decode loop)."""
