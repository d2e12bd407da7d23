"""The zoo trainer's resumable state: weights, AdamW state and RNG in one safetensors file.

Usage (inside `zoo.trainer`):
    stop = StopFlag()                      # Ctrl-C / SIGTERM: finish the step, save, stop
    save_state(out / "train_state" / CHECKPOINT, cfg, model, opt, run)
    run = load_state(path, cfg, model, opt)

The file is replaced atomically; the run's scalars and the producing config (a
`ZooTrainConfig`) travel in its safetensors metadata, so `--resume` refuses a checkpoint made
with another arch, size, seed or dense-layer count and says which flag to pass.
"""

from __future__ import annotations

import json
import signal
import threading
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tensorbend.atomic import atomic_save_tensors
from tensorbend.errors import ZooError

CHECKPOINT = "checkpoint.safetensors"
FORMAT_VERSION = "1"


class StopFlag:
    """SIGINT/SIGTERM set a flag; the loop checkpoints at the next step boundary and stops."""

    def __init__(self) -> None:
        self.requested = False
        self._old = {}
        if hasattr(signal, "SIGTERM") and _in_main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def save_state(path: Path, cfg, model, opt, run: dict) -> None:
    """Weights + AdamW state + RNG in one safetensors file, replaced atomically."""
    tensors = {f"model.{n}": p.detach().cpu().contiguous() for n, p in model.named_parameters()}
    tensors.update(
        {
            f"model.{n}": b.cpu().contiguous()
            for n, b in model.named_buffers()
            if "correction_bias" in n
        }
    )
    opt_sd = opt.state_dict()
    for idx, st in opt_sd["state"].items():
        for k, v in st.items():
            tensors[f"opt.{idx}.{k}"] = v.detach().cpu().reshape(v.shape).contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
    meta = {
        "format_version": FORMAT_VERSION,
        "run": json.dumps(run),
        "config": json.dumps({**asdict(cfg), "corpus": str(cfg.corpus), "out": str(cfg.out)}),
        "param_groups": json.dumps(opt_sd["param_groups"]),
    }
    atomic_save_tensors(tensors, path, meta)


def load_state(path: Path, cfg, model, opt) -> dict:
    """The run dict saved with the state at `path`, loaded into model and opt (and the RNG);
    one clear error when `cfg` differs from the checkpoint in what shapes the run."""

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    saved = json.loads(meta["config"])
    for key in ("arch", "size", "seed", "dense_layers"):
        if saved.get(key) != getattr(cfg, key):
            raise ZooError(
                f"zoo train --resume: expected {key}={getattr(cfg, key)!r} as in the checkpoint "
                f"{path}, found {key}={saved.get(key)!r} there (resume with the same "
                f"--{key.replace('_', '-')})"
            )
    tensors = load_file(str(path))
    model_sd = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(model_sd, strict=False)
    assert not unexpected, unexpected
    opt_state: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, idx, name = k.split(".", 2)
            opt_state.setdefault(int(idx), {})[name] = v
    opt.load_state_dict({"state": opt_state, "param_groups": json.loads(meta["param_groups"])})
    torch.set_rng_state(tensors["rng.torch"])
    return json.loads(meta["run"])


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
