"""Predictor checkpoints: one safetensors file that describes itself.

Usage:
    >>> save_predictor(p, "pred.safetensors", fingerprint=trace.manifest["model"]["fingerprint"],
    ...                val_metrics={"recall_at_k": 0.9})
    >>> p = load_predictor("pred.safetensors", spec=trace.spec, fingerprint=fp)   # checks the match

Metadata: one key, `tensorbend_predictor`, holding sorted JSON with format_version, kind,
lookahead, config, routing (spec), fingerprint (model), features, val_metrics, params,
tensorbend_version. (One key because safetensors writes several keys in hash order, and the
same training run must give the same bytes.)
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tensorbend.errors import CheckpointError
from tensorbend.models import RoutingSpec
from tensorbend.predictors.base import get_lookahead

FORMAT_VERSION = 1
META_KEY = "tensorbend_predictor"


def _classes() -> dict:
    from tensorbend.predictors.baselines import FrequencyPredictor, TransitionPredictor
    from tensorbend.predictors.residual_gate import ResidualGatePredictor
    from tensorbend.predictors.seed_mlp import SeedMLPPredictor

    return {
        "tensorbend": ResidualGatePredictor,
        "seed_mlp": SeedMLPPredictor,
        "frequency": FrequencyPredictor,
        "transition": TransitionPredictor,
    }


def save_predictor(
    p,
    path: str | Path,
    *,
    fingerprint: str,
    val_metrics: dict | None = None,
    extra: dict | None = None,
) -> Path:
    from tensorbend import __version__

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "format_version": FORMAT_VERSION,
        "kind": p.kind,
        "lookahead": p.lookahead.name,
        "config": p.config_dict(),
        "routing": p.spec.to_dict(),
        "fingerprint": fingerprint,
        "features": list(p.lookahead.features),
        "val_metrics": val_metrics or {},
        "params": p.num_params(),
        "tensorbend_version": __version__,
        **(extra or {}),
    }
    tmp = path.with_name(path.name + ".tmp")
    save_file(
        {k: v.contiguous() for k, v in p.state_tensors().items()},
        str(tmp),
        metadata={META_KEY: json.dumps(meta, sort_keys=True)},
    )
    tmp.replace(path)
    return path


def read_metadata(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"predictor {path}: no such file (train one with `tensorbend train`)")
    try:
        with safe_open(str(path), "pt") as f:
            raw = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"predictor {path}: not a readable safetensors file ({e})") from e
    meta = json.loads(raw[META_KEY]) if META_KEY in raw else {}
    if meta.get("format_version") != FORMAT_VERSION or "kind" not in meta:
        raise CheckpointError(
            f"predictor {path}: expected a tensorbend predictor (format_version {FORMAT_VERSION}), found "
            f"metadata keys {sorted(raw)}; a seed checkpoint loads with ExpertPredictorSet.load"
        )
    return meta


def load_predictor(
    path: str | Path, spec: RoutingSpec | None = None, fingerprint: str | None = None
):
    """Load a predictor; with spec/fingerprint given, refuse one trained for another model."""
    path = Path(path)
    meta = read_metadata(path)
    saved_spec = RoutingSpec.from_dict(meta["routing"])
    if fingerprint is not None and meta["fingerprint"] != fingerprint:
        raise CheckpointError(
            f"predictor {path} was trained for model fingerprint {meta['fingerprint']}, found "
            f"{fingerprint}: train a predictor on a trace of this model (`tensorbend train`)"
        )
    if spec is not None:
        for field in ("num_experts", "top_k", "hidden_size", "moe_layer_ids", "family"):
            want, got = getattr(spec, field), getattr(saved_spec, field)
            if want != got:
                raise CheckpointError(
                    f"predictor {path} is for another model: {field} expected {want!r}, found {got!r}"
                )
    kinds = _classes()
    if meta["kind"] not in kinds:
        raise CheckpointError(
            f"predictor {path}: unknown kind {meta['kind']!r}, expected one of {sorted(kinds)}"
        )
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    p = kinds[meta["kind"]].from_state(
        saved_spec, get_lookahead(meta["lookahead"]), meta["config"], tensors
    )
    p.checkpoint = str(path)
    p.metadata = meta
    return p
