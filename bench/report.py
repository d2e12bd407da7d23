"""Where every bench's JSON goes: stdout always, and a file when asked."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, path: str | None) -> int:
    """Print `result` as JSON and write it to `path` (parents created); returns exit code 0."""
    text = json.dumps(result, indent=2)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    print(text)
    return 0
