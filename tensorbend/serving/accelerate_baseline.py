"""The baseline without tensorbend: transformers + accelerate's own offloading, timed the way
`tensorbend generate` times itself.

Usage:
    tensorbend generate --model DIR --prompt TEXT --max-memory 1GB --engine accelerate
    >>> with AccelerateRun("zoo:default", ServeConfig(max_memory="20MB")) as run:  # doctest: +SKIP
    ...     run.new_prompt()                     # before each prompt: its first forward is prefill
    ...     run.model.generate(run.tok("In the beginning", return_tensors="pt").input_ids)
    ...     summary = run.summary()
    >>> summary["decode_tok_s"], summary["load_peak_rss_bytes"]  # doctest: +SKIP

What a user of transformers does when a model does not fit: `from_pretrained(...,
device_map="auto", max_memory=..., offload_folder=...)` (`hf.load_model` with `max_memory`).
accelerate keeps whole modules on the device within the budget and offloads the rest (to disk
on CPU, to host memory from CUDA); every forward streams every offloaded module's weights in
and drops them again. No expert cache, no prediction: each decode token reads all the
offloaded weights, whichever experts the routers pick.

Counted per phase like `OffloadHandle.counters()` (the first forward of each prompt is its
prefill, every later one a decode token), plus what only this path has:
- `offloaded_bytes`: the weights accelerate placed off the device (disk on CPU); each forward
  streams them in, so `bytes_read_per_token` is that figure for a decode token (through the
  page cache: RAM the budget does not count serves it when the machine has it to spare);
- `disk_read_bytes_per_token`: what the process read from storage per decode token
  (/proc/self/io `read_bytes`; 0 when the page cache held the offloaded files);
- `load_peak_rss_bytes`: the peak RSS of loading (transformers converts the checkpoint's
  tensors in memory before accelerate offloads them), then the peak is reset
  (/proc/self/clear_refs) so `peak_rss_bytes` is generation's own.
The text is transformers' greedy (or sampled) output as with `--engine tensorbend`; placement
computes bit for bit what the resident model does (`placement.align_offloaded`), so greedy text
is the resident model's.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from tensorbend.errors import TensorbendError
from tensorbend.memory import disk_read_bytes, peak_rss_bytes

PHASES = ("prefill", "decode")


class AccelerateRun:
    """The model placed by accelerate within `serve.max_memory` (a context manager: its offload
    folder is removed on exit), its forwards timed; `summary()` after generating (keys of
    `generate.summarize`, plus the ones of the module docstring)."""

    def __init__(self, model: str, serve):
        if serve.max_memory is None:
            raise TensorbendError(
                "--engine accelerate: expected --max-memory (the budget accelerate places the "
                "model in), found none"
            )
        self.spec, self.serve = model, serve

    def __enter__(self) -> AccelerateRun:
        from tensorbend.capture.hf import load_model

        serve = self.serve
        parent = Path(serve.store_dir) if serve.store_dir else None
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
        self._dir = tempfile.TemporaryDirectory(prefix="accelerate-offload-", dir=parent)
        try:
            self.model, self.tok = load_model(
                self.spec,
                serve.dtype,
                serve.device,
                progress=serve.progress,
                max_memory=serve.max_memory,
                offload_dir=self._dir.name,
            )
        except BaseException:
            self._dir.cleanup()
            raise
        self.load_peak = peak_rss_bytes()
        _reset_peak_rss()
        self.offloaded = offloaded_bytes(self.model)
        self.timer = _ForwardTimer(self.model, cuda=serve.device != "cpu")
        self.new_prompt = self.timer.new_prompt
        return self

    def __exit__(self, *exc) -> None:
        self.timer.remove()
        self._dir.cleanup()

    def summary(self) -> dict:
        timer = self.timer
        dec_tokens, dec_s = timer.tokens["decode"], timer.seconds["decode"]
        pre_tokens, pre_s = timer.tokens["prefill"], timer.seconds["prefill"]
        return {
            "engine": "accelerate",
            "policy": "accelerate",
            "decode_tokens": dec_tokens,
            "decode_tok_s": dec_tokens / dec_s if dec_s else None,
            "prefill_tok_s": pre_tokens / pre_s if pre_s else None,
            "prefill_tokens": pre_tokens,
            "prefill_s": pre_s,
            "bytes_read_per_token": self.offloaded,
            "disk_read_bytes_per_token": timer.disk_bytes / dec_tokens if dec_tokens else None,
            "demand_hit_rate": None,
            "stall_s_per_token": None,
            "predict_s_per_token": None,
            "cache_slots": None,
            "expert_bytes": None,
            "offloaded_bytes": self.offloaded,
            "load_peak_rss_bytes": self.load_peak,
            "peak_rss_bytes": peak_rss_bytes(),
            "peak_device_bytes": torch.cuda.max_memory_allocated() if timer.cuda else None,
            "memory_plan": None,
        }


def offloaded_bytes(model) -> int:
    """Bytes of the weights accelerate placed off the compute device ("disk", or "cpu" when the
    device is cuda): what every forward streams in."""
    device_map = getattr(model, "hf_device_map", None) or {}
    compute = {v for v in device_map.values() if v not in ("cpu", "disk")}
    off = {"disk", "cpu"} if compute else {"disk"}
    names = [k for k, v in device_map.items() if v in off]
    total = 0
    for name, t in model.state_dict().items():  # offloaded weights are meta: shape and dtype
        if any(name == n or name.startswith(n + ".") or n == "" for n in names):
            total += t.numel() * t.element_size()
    return total


def format_summary(s: dict) -> str:
    tok_s = f"{s['decode_tok_s']:.2f}" if s["decode_tok_s"] else "-"
    disk = s["disk_read_bytes_per_token"]
    return (
        f"[accelerate] {s['decode_tokens']} decode tokens at {tok_s} tok/s | "
        f"{s['bytes_read_per_token'] / 1e6:.1f} MB offloaded weights streamed in per token "
        f"({'-' if disk is None else f'{disk / 1e6:.1f}'} MB of it from the disk) | "
        f"peak RSS {s['peak_rss_bytes'] / 1e6:.0f} MB generating, "
        f"{s['load_peak_rss_bytes'] / 1e6:.0f} MB loading"
    )


# ------------------------------------------------------------ helpers


class _ForwardTimer:
    """Times every forward of the model (the first of each prompt is prefill) and the storage
    bytes the process reads during decode forwards."""

    def __init__(self, model, cuda: bool):
        self.cuda = cuda
        self.tokens = dict.fromkeys(PHASES, 0)
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.disk_bytes = 0
        self._first = True
        self._t0 = self._io0 = None
        self._handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, with_kwargs=True),
        ]

    def new_prompt(self) -> None:
        self._first = True

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._phase = "prefill" if self._first else "decode"
        self._n = int(ids.shape[-1]) if ids is not None else 1
        self._first = False
        self._io0 = disk_read_bytes()
        self._t0 = time.perf_counter()

    def _post(self, module, args, kwargs, output):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds[self._phase] += time.perf_counter() - self._t0
        self.tokens[self._phase] += self._n
        if self._phase == "decode":
            self.disk_bytes += disk_read_bytes() - self._io0


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0: /proc/self/clear_refs "5"); a no-op
    elsewhere."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
