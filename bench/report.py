"""Where every bench's JSON goes (kept for scripts that import it from here): `tensorbend.results`."""

from tensorbend.results import emit

__all__ = ["emit"]
