"""The benches: thin scripts, each run from the repository root as `python -m bench.NAME`.

Their logic lives in the package (renderers: `tensorbend.results`); `make bench` runs them all.
"""
