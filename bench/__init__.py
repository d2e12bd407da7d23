"""The benches: thin scripts, each run from the repository root as `python -m bench.NAME`.

Beside them their harness (record.py: JSON + rerun command; timing.py, memory_cap.py,
prediction_cost.py) and pages/ (a bench's JSON rendered as its markdown page);
`make bench` runs them all, `make docs` re-renders what is rendered from committed JSON.
"""
