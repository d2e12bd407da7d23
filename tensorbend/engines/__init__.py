"""Inference engines: import the routing they record (csv, vLLM, SGLang) as tensorbend traces.

>>> from tensorbend.engines import ImportConfig, import_trace, SOURCES
>>> SOURCES
('csv', 'vllm', 'sglang')

One reader module per format (csv.py, vllm.py, sglang.py: `source_files`, `read_prompts`);
importer.py checks sizes and writes the trace. Formats and the engine versions they were read
from: docs/import.md.
"""

from typing import get_args

from tensorbend.engines.importer import ImportConfig, ImportResult, Source, import_trace

SOURCES = get_args(Source)

__all__ = ["SOURCES", "ImportConfig", "ImportResult", "import_trace"]
