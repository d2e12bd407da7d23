"""The package version, one home (`tensorbend.__version__` and every artifact that records it)."""

__version__ = "0.1.0"
