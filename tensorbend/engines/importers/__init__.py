"""Importers: the routing an inference engine records (csv, vLLM, SGLang) -> a tensorbend trace.

>>> from tensorbend.engines.importers import ImportConfig, import_trace, SOURCES
>>> SOURCES
('csv', 'vllm', 'sglang')

source.py holds `ImportConfig` (the `trace import` flags); one reader module per format
(csv.py, vllm.py, sglang.py: `source_files`, `read_prompts`) yields reader.py's
`ImportedPrompt`s; sink.py checks their sizes and writes the trace; importer.py
(`import_trace`) ties them together. Formats and the engine versions they were read from:
docs/guide/import.md.
"""

from tensorbend.engines.importers.importer import ImportResult, import_trace
from tensorbend.engines.importers.source import SOURCES, ImportConfig, Source

__all__ = ["SOURCES", "ImportConfig", "ImportResult", "Source", "import_trace"]
