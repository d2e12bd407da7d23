"""The zoo: small real MoE language models trained here, bundled under `zoo/bundled/NAME/`.

Usage:
    >>> from tensorbend.zoo import resolve_model, list_models
    >>> resolve_model("zoo:default").name      # an HF checkpoint directory, never downloaded
    'dsv3-tiny'
    >>> [m["name"] for m in list_models()]
    ['dsv3-deep', 'dsv3-tiny', 'dsv3-vllm', 'qwen3moe-tiny']

A bundled model is a standard HF checkpoint directory (config.json, model.safetensors or shards,
tokenizer files) plus `model_card.json`. `zoo:default` names DEFAULT_MODEL.
"""

from __future__ import annotations

import json
from pathlib import Path

from tensorbend.errors import TensorbendError, ZooError

BUNDLED_DIR = Path(__file__).parent / "bundled"
DEFAULT_MODEL = "dsv3-tiny"
ZOO_PREFIX = "zoo:"


def list_models() -> list[dict]:
    """One dict per bundled model: name, path, and the model card's summary fields."""
    rows = []
    if not BUNDLED_DIR.is_dir():
        return rows
    for d in sorted(p for p in BUNDLED_DIR.iterdir() if (p / "config.json").is_file()):
        card_path = d / "model_card.json"
        card = json.loads(card_path.read_text()) if card_path.is_file() else {}
        rows.append(
            {
                "name": d.name,
                "default": d.name == DEFAULT_MODEL,
                "path": str(d),
                "arch": card.get("arch"),
                "params": card.get("params"),
                "num_experts": card.get("num_experts"),
                "top_k": card.get("top_k"),
                "num_moe_layers": card.get("num_moe_layers"),
                "heldout_loss": card.get("heldout_loss"),
            }
        )
    return rows


def format_models(rows: list[dict]) -> str:
    """`tensorbend zoo list` as a terminal table."""
    cols = ("name", "arch", "params", "num_experts", "top_k", "num_moe_layers", "heldout_loss")
    lines = ["  ".join(f"{c:>14}" for c in cols)]
    for r in rows:
        loss = f"{r['heldout_loss']:.3f}" if r["heldout_loss"] is not None else "-"
        vals = [r[c] for c in cols[:-1]] + [loss]
        lines.append(
            "  ".join(f"{str(v):>14}" for v in vals) + (" (default)" if r["default"] else "")
        )
    return "\n".join(lines)


def model_path(name: str) -> Path:
    """Directory of bundled model `name` ("default" names DEFAULT_MODEL)."""
    if name == "default":
        name = DEFAULT_MODEL
    path = BUNDLED_DIR / name
    if not (path / "config.json").is_file():
        known = [m["name"] for m in list_models()] or ["(none bundled)"]
        raise ZooError(
            f"unknown zoo model {name!r}: expected one of {', '.join(known)} "
            f"(run `tensorbend zoo list`)"
        )
    return path


def resolve_model(spec: str | Path) -> Path:
    """Turn `zoo:NAME` or a local directory into a checkpoint directory; never downloads."""
    s = str(spec)
    if s.startswith(ZOO_PREFIX):
        return model_path(s[len(ZOO_PREFIX) :])
    path = Path(s)
    if not (path / "config.json").is_file():
        raise TensorbendError(
            f"model {s!r}: expected a local HF checkpoint directory with config.json or zoo:NAME, "
            f"found {'a directory without config.json' if path.is_dir() else 'no such directory'} "
            "(tensorbend never downloads; pass a local path or see `tensorbend zoo list`)"
        )
    return path
