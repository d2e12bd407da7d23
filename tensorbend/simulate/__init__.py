"""Simulate offloaded MoE inference from a routing trace on a model geometry and hardware.

>>> from tensorbend.simulate import SimulateConfig, simulate, HARDWARE_NAMES, GEOMETRY_NAMES
>>> "dgx-spark" in HARDWARE_NAMES and "kimi-k2.5" in GEOMETRY_NAMES
True

Modules: hardware.py and geometry.py (profiles, every number cited), mapping.py (trace ->
geometry), costs.py (seconds per action; calibration), the forwards from trace.forwards,
predictions.py (predictors run offline), plan.py (work per forward and layer), events.py (the
discrete-event run: compute and I/O threads in event time over the runtime's own slot table,
request queue and wire, cache/slots.py and cache/transfers.py, and its policies), ep.py
(expert-parallel pre-staging), simulator.py (`simulate`), plots.py. See docs/guide/simulate.md.
"""

from tensorbend.simulate.geometry import GEOMETRY_NAMES
from tensorbend.simulate.simulator import (
    POLICIES,
    SimulateConfig,
    SimulateResult,
    format_table,
    simulate,
    simulate_peers,
)
from tensorbend.timing.hardware import HARDWARE_NAMES

__all__ = [
    "GEOMETRY_NAMES",
    "HARDWARE_NAMES",
    "POLICIES",
    "SimulateConfig",
    "SimulateResult",
    "format_table",
    "simulate",
    "simulate_peers",
]
