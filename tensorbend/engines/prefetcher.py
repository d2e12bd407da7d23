"""The engine-neutral prefetch API's documented path; it lives in `tensorbend.predictors.prefetch`."""

from tensorbend.predictors.prefetch import Prediction, Prefetcher, RoutingHistory, StepClock

__all__ = ["Prediction", "Prefetcher", "RoutingHistory", "StepClock"]
