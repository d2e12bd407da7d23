"""Where every bench's JSON goes: stdout always, and a file when asked."""

from __future__ import annotations

import json
from pathlib import Path

from tensorbend.atomic import atomic_write_text


def emit(result: dict, path: str | None) -> int:
    """Print `result` as JSON and write it to `path` (parents created); returns exit code 0."""
    text = json.dumps(result, indent=2)
    if path:
        atomic_write_text(Path(path), text + "\n")
    print(text)
    return 0
