"""The engine-neutral prefetch API's documented path; it lives in `tensorbend.prefetch`."""

from tensorbend.prefetch import Prediction, Prefetcher, RoutingHistory, StepClock

__all__ = ["Prediction", "Prefetcher", "RoutingHistory", "StepClock"]
