"""User-facing errors. Each message says what was expected, what was found, and how to fix it.

The CLI turns any `TensorbendError` into a one-line `error: ...` on stderr and exit code 2.
Bugs are `assert`s and are allowed to raise tracebacks.
"""


class TensorbendError(Exception):
    """Base class for every error caused by user input or the environment."""


class UnsupportedModelError(TensorbendError):
    """The model has no MoE layers we can find, or its family is unknown."""


class TraceError(TensorbendError):
    """A trace directory or shard is missing, corrupt, truncated, or of another model."""


class PromptFileError(TensorbendError):
    """A prompts JSONL file is malformed."""


class CheckpointError(TensorbendError):
    """A predictor checkpoint does not match the model, trace or format expected."""


class ZooError(TensorbendError):
    """A zoo model name is unknown or its files are missing."""


class PredictorConfigError(TensorbendError):
    """A predictor or training option is unknown or out of range."""


class PredictorInputError(TensorbendError):
    """A tensor or trace handed to a predictor does not fit it (shape, phases, features)."""


class StoreError(TensorbendError):
    """The on-disk expert store is missing, truncated or unreadable."""


class TensorbendWarning(UserWarning):
    """Input that runs but likely not as meant; the CLI prints it as one `warning: ...` line."""
