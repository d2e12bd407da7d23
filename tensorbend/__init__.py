"""tensorbend: predict MoE routing before the router runs, and prefetch experts with it.

Example:
    >>> from tensorbend.models import describe_model        # find MoE layers and routers
    >>> from tensorbend.collect import collect, CollectConfig # capture exact routing to a trace
    >>> from tensorbend.trace import Trace                    # read a trace back
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "ExpertPredictorSet":  # the seed's API, imported lazily (pulls in torch)
        from tensorbend.predictors.seed_api import ExpertPredictorSet

        return ExpertPredictorSet
    raise AttributeError(f"module 'tensorbend' has no attribute {name!r}")
