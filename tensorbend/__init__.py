"""tensorbend serves Mixture-of-Experts checkpoints larger than memory: the routed experts stay
on disk, a bounded cache holds the ones in use, and routing predicted ahead of the router
prefetches them.

Usage (public names import lazily from the package; torch loads on first use):
    >>> from pathlib import Path
    >>> from tensorbend import CollectConfig, DecodeConfig, Trace, describe_model
    >>> from tensorbend.capture.collect import collect        # each verb's function lives in its module
    >>> CollectConfig(model="zoo:default", out=Path("runs/t")).decode == DecodeConfig()
    True

The data flow: `collect.collect` (model -> trace) -> `train.train` (trace -> predictor) ->
`evaluate.evaluate` (held-out report); `offload.runner.run` generates with offloaded experts;
`simulate.simulate` projects a trace onto another model geometry and hardware;
`importers.import_trace` turns a serving engine's routing dump into a trace.
Each takes one config dataclass and returns a result dataclass with `to_json()`; the keys are
documented in docs/guide/formats.md. (The verb functions are not re-exported here because their
names are also module names: `tensorbend.capture.collect` must stay the module.)
"""

from __future__ import annotations

import importlib

from tensorbend.version import __version__  # noqa: F401  (re-exported)

# public name -> module that defines it
_EXPORTS = {
    "TensorbendError": "tensorbend.errors",
    "load_model": "tensorbend.capture.hf",
    "DecodeConfig": "tensorbend.capture.hf",
    "describe_model": "tensorbend.models",
    "RoutingSpec": "tensorbend.models",
    "RouterHooks": "tensorbend.models",
    "RoutingCapture": "tensorbend.capture.routing",
    "Trace": "tensorbend.capture.trace",
    "TraceWriter": "tensorbend.capture.writer",
    "load_prompts": "tensorbend.capture.prompts",
    "CollectConfig": "tensorbend.capture.collect",
    "CollectResult": "tensorbend.capture.collect",
    "TrainConfig": "tensorbend.predictors.train",
    "TrainResult": "tensorbend.predictors.train",
    "EvalConfig": "tensorbend.predictors.evaluate",
    "EvalReport": "tensorbend.predictors.evaluate",
    "LOOKAHEADS": "tensorbend.predictors",
    "KINDS": "tensorbend.predictors",
    "load_predictor": "tensorbend.predictors",
    "build_baseline": "tensorbend.predictors",
    "RunConfig": "tensorbend.offload.runner",
    "RunResult": "tensorbend.offload.result",
    "PolicyConfig": "tensorbend.cache.config",
    "SimulateConfig": "tensorbend.simulate.simulator",
    "SimulateResult": "tensorbend.simulate.simulator",
    "ImportConfig": "tensorbend.engines.importers",
    "import_trace": "tensorbend.engines.importers",
    "ExpertPredictorSet": "tensorbend.predictors.seed_api",
    "load_offloaded": "tensorbend.serving.offloaded",
    "ServeConfig": "tensorbend.serving.offloaded",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tensorbend' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
