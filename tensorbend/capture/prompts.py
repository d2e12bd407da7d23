"""Prompt files (JSONL) and the deterministic train/val/test split by prompt id.

Usage:
    >>> from tensorbend.capture.prompts import load_prompts, split_of
    >>> prompts = load_prompts()                  # the shipped calibration prompts
    >>> len(prompts), {s: sum(p.split == s for p in prompts) for s in SPLITS}
    (336, {'train': 247, 'val': 30, 'test': 59})
    >>> split_of("any prompt id") in SPLITS       # a pure function of the id
    True

One JSON object per line: {"id": str, "text": str, "topic": str?, "continuation": str?}.
`continuation` feeds teacher-forced decode. Blank lines are ignored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from tensorbend.errors import PromptFileError

DEFAULT_PROMPTS = Path(__file__).parent.parent / "data" / "prompts.jsonl"
SPLITS = ("train", "val", "test")
# Percent of prompts per split (by hash of id): 70 / 10 / 20.
SPLIT_PERCENT = {"train": 70, "val": 10, "test": 20}


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    topic: str | None = None
    continuation: str | None = None

    @property
    def split(self) -> str:
        return split_of(self.id)


def split_of(prompt_id: str) -> str:
    """Deterministic split of a prompt id: train (70%), val (10%) or test (20%)."""
    bucket = int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16) % 100
    if bucket < SPLIT_PERCENT["train"]:
        return "train"
    if bucket < SPLIT_PERCENT["train"] + SPLIT_PERCENT["val"]:
        return "val"
    return "test"


def load_prompts(path: Path | None = None, split: str = "all") -> list[Prompt]:
    """Read a prompts JSONL file; `split` is train, val, test or all."""
    path = Path(path) if path else DEFAULT_PROMPTS
    if split not in (*SPLITS, "all"):
        raise PromptFileError(f"split {split!r}: expected one of train, val, test, all")
    if not path.is_file():
        raise PromptFileError(f"prompts file {path}: not found (expected a JSONL file)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise PromptFileError(
            f"{path}, line {line}: not UTF-8 text (byte {e.object[e.start]:#04x}); expected "
            f"UTF-8 JSONL: re-save the file as UTF-8"
        ) from None
    prompts, seen = [], set()
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(
                f"{where}: not valid JSON ({e.msg}); expected one object per line"
            ) from e
        if not isinstance(obj, dict):
            raise PromptFileError(f"{where}: expected a JSON object, found {type(obj).__name__}")
        for key in ("id", "text"):
            if not isinstance(obj.get(key), str) or not obj[key]:
                raise PromptFileError(
                    f"{where}: expected a non-empty string field {key!r}, found {obj.get(key)!r}"
                )
        for key in ("topic", "continuation"):
            if key in obj and obj[key] is not None and not isinstance(obj[key], str):
                raise PromptFileError(
                    f"{where}: field {key!r} must be a string, found {type(obj[key]).__name__}"
                )
        if obj["id"] in seen:
            raise PromptFileError(f"{where}: duplicate prompt id {obj['id']!r}; ids must be unique")
        seen.add(obj["id"])
        p = Prompt(obj["id"], obj["text"], obj.get("topic"), obj.get("continuation") or None)
        if split == "all" or p.split == split:
            prompts.append(p)
    if not prompts:
        raise PromptFileError(
            f"{path}: no prompts{'' if split == 'all' else f' in split {split!r}'}"
        )
    return prompts


def file_sha(path: Path | None = None) -> str:
    path = Path(path) if path else DEFAULT_PROMPTS
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
