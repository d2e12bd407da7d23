"""Predictor checkpoints: one safetensors file that describes itself.

Usage:
    save_predictor(p, "pred.safetensors", fingerprint=trace.manifest["model"]["fingerprint"],
                   val_metrics={"decode": {"recall_at_k": 0.9}})
    p = load_predictor("pred.safetensors", spec=trace.spec, fingerprint=fp)   # checks the match

Metadata: one key, `tensorbend_predictor`, holding sorted JSON with format_version, kind,
lookahead, config (the kind's config class, asdict), routing (spec), fingerprint (model),
features, val_metrics, params, tensorbend_version, plus what `train` adds (train_prompts,
seen_prompts, trace, and the predictor's fit_summary). One key because safetensors writes
several keys in hash order, and the same training run must give the same bytes. Every
problem with a file (missing, not safetensors, corrupt metadata, unknown kind, tensors whose
names or shapes do not match the metadata, another model) raises CheckpointError.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from tensorbend.atomic import atomic_save_tensors
from tensorbend.errors import CheckpointError
from tensorbend.models import RoutingSpec
from tensorbend.predictors.base import LOOKAHEADS
from tensorbend.predictors.recency import NAME as PEER_HORIZON
from tensorbend.predictors.recency import RecencyForecaster
from tensorbend.predictors.registry import KINDS

FORMAT_VERSION = 1
META_KEY = "tensorbend_predictor"
_SPEC_FIELDS = ("num_experts", "top_k", "hidden_size", "moe_layer_ids", "family")


def save_predictor(
    p,
    path: str | Path,
    *,
    fingerprint: str,
    val_metrics: dict | None = None,
    extra: dict | None = None,
) -> Path:
    from tensorbend.version import __version__

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
    return atomic_save_tensors(
        p.state_tensors(), path, metadata={META_KEY: json.dumps(meta, sort_keys=True)}
    )


def read_metadata(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"predictor {path}: no such file (train one with `tensorbend train`)")
    try:
        with safe_open(str(path), "pt") as f:
            raw = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"predictor {path}: not a readable safetensors file ({e})") from e
    try:
        meta = json.loads(raw[META_KEY]) if META_KEY in raw else {}
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"predictor {path}: metadata {META_KEY} is not valid JSON ({e}); the file is "
            "corrupt: retrain it with `tensorbend train`"
        ) from e
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"predictor {path}: expected a tensorbend predictor (format_version {FORMAT_VERSION}), "
            f"found metadata keys {sorted(raw)}; a seed checkpoint loads with ExpertPredictorSet.load"
        )
    _check_fields(path, meta)
    return meta


def load_predictor(
    path: str | Path, spec: RoutingSpec | None = None, fingerprint: str | None = None
):
    """Load a predictor; with spec/fingerprint given, refuse one trained for another model.
    `recency` (no file: nothing is trained) is the training-free cross-token peer for `spec`."""
    if is_peer_name(path):
        assert spec is not None, "the peer is built for a model: pass its spec"
        return RecencyForecaster(spec)
    path = Path(path)
    meta = read_metadata(path)
    saved_spec = RoutingSpec.from_dict(meta["routing"])
    if fingerprint is not None and meta["fingerprint"] != fingerprint:
        raise CheckpointError(
            f"predictor {path} was trained for model fingerprint {meta['fingerprint']}, found "
            f"{fingerprint}: train a predictor on a trace of this model (`tensorbend train`)"
        )
    if spec is not None:
        for field in _SPEC_FIELDS:
            want, got = getattr(spec, field), getattr(saved_spec, field)
            if want != got:
                raise CheckpointError(
                    f"predictor {path} is for another model: {field} expected {want!r}, found {got!r}"
                )
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    kind = KINDS[meta["kind"]]
    la = LOOKAHEADS.get(meta["lookahead"])  # None for a cross-token kind (its own)
    p = kind.cls.from_state(saved_spec, la, meta["config"], tensors)
    p.checkpoint = str(path)
    p.metadata = meta
    return p


def check_held_out(
    path: str | Path, prompt_ids, split: str, fingerprint: str | None = None
) -> None:
    """Refuse to use checkpoint `path` on prompts it was trained or early-stopped on.

    `prompt_ids`: the prompts about to be scored, run or replayed, of split `split`. The
    checkpoint's metadata lists the prompts it saw (`seen_prompts`); an older one without that
    list may have seen any non-test prompt of its model (`fingerprint` None: unknown yet, so
    assumed the same). Callers skip this when the user passes `--allow-seen-split`."""
    if is_peer_name(path):  # trained on nothing
        return
    meta = read_metadata(path)
    ids = set(prompt_ids)
    if "seen_prompts" in meta:
        seen = ids & set(meta["seen_prompts"])
    else:
        same = fingerprint is None or meta["fingerprint"] == fingerprint
        seen = ids if same and split != "test" else set()
    if seen:
        raise CheckpointError(
            f"predictor {path} was trained or early-stopped on {len(seen)} of the {len(ids)} "
            f"prompts of split {split!r}: expected held-out prompts (found {sorted(seen)[0]!r} "
            "among them); use --split test, or pass --allow-seen-split to use them anyway"
        )


def _check_fields(path: Path, meta: dict) -> None:
    """The metadata names a trainable kind, a lookahead, a config and a routing spec."""
    trainable = [k for k, v in KINDS.items() if v.trainable]
    kind = KINDS.get(meta.get("kind"))
    lookaheads = [kind.cls.lookahead.name] if kind and kind.cross_token else list(LOOKAHEADS)
    checks = (
        ("kind", meta.get("kind") in trainable, f"one of {trainable}"),
        ("lookahead", meta.get("lookahead") in lookaheads, f"one of {lookaheads}"),
        ("config", isinstance(meta.get("config"), dict), "a JSON object"),
        ("routing", isinstance(meta.get("routing"), dict), "a JSON object"),
        ("fingerprint", isinstance(meta.get("fingerprint"), str), "a string"),
    )
    for name, ok, want in checks:
        if not ok:
            raise CheckpointError(
                f"predictor {path}: metadata {name} expected {want}, found {meta.get(name)!r}; "
                "the file is corrupt or from another version: retrain it"
            )
    try:
        RoutingSpec.from_dict(meta["routing"])
    except (TypeError, KeyError, ValueError) as e:
        raise CheckpointError(
            f"predictor {path}: metadata routing is not a routing spec ({e}); retrain it"
        ) from e


def is_peer_name(path) -> bool:
    """`path` names the training-free cross-token peer (`--horizon recency`), not a file."""
    return path is not None and str(path) == PEER_HORIZON
