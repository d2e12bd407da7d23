"""The prompts through `hf.decode_prompt` (or `hf.decode_batch`: B sequences in lockstep), with
every forward timed and counted per phase.

Usage (the session does this for the resident reference and for every policy run):
    rec = Recorder(model, clock, history, cache=None, record_routing=True)
    gen = generate(model, inputs, DecodeConfig(max_new_tokens=8), eos_id, rec)
    gen.tokens["decode"], gen.tok_s("decode"), gen.logits[f], gen.ids[f]   # f: a forward

Shape legend: T tokens of a forward, L MoE layers, K top-k, V vocabulary.

Per forward the recorder advances the logical clock and the routing history, times the model
call (synchronising CUDA first, so the time is the computation's), keeps the last position's
logits of every sequence ([B, V], fp32, CPU) for the comparison with the resident run, counts
real tokens (padding excluded), the routing [T, L, K] when asked
(the oracle replays it), and adds the cache's counters of that forward to its phase's. The
whole pass records the CPU cores other processes used meanwhile (`host_load.HostLoad`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from tensorbend.cache.slots import CacheStats
from tensorbend.capture.hf import DecodeConfig, Decoded, PromptInput, decode_batch, decode_prompt
from tensorbend.host_load import CpuMeter, HostLoad
from tensorbend.offload.hooks import RoutingHistory, StepClock

PHASES = ("prefill", "decode")


@dataclass
class Generation:
    """What one pass over the prompts produced."""

    decoded: list[Decoded] = field(default_factory=list)  # per prompt: tokens fed, argmax ids
    logits: list[torch.Tensor] = field(default_factory=list)  # per forward: logits_BV (fp32 CPU)
    ids: list[torch.Tensor] = field(default_factory=list)  # per forward: ids_TLK (if recorded)
    decode_times: list[float] = field(default_factory=list)  # seconds per decode forward
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    stats: dict[str, CacheStats] = field(default_factory=lambda: {p: CacheStats() for p in PHASES})
    disk_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    # storage bytes the process read (memory.disk_read_bytes) from a forward's start to the
    # next's, per phase (serving's handle counts them; page-cache hits are not disk reads)
    host_load: HostLoad | None = None  # the cores this and other processes used over the pass

    @property
    def forwards(self) -> int:
        return len(self.logits)

    def tok_s(self, phase: str) -> float | None:
        return self.tokens[phase] / self.seconds[phase] if self.seconds[phase] else None


class Recorder:
    """The `forward=` wrapper handed to `decode_prompt`: clock, history, timing, counters."""

    def __init__(
        self,
        model,
        clock: StepClock,
        history: RoutingHistory,
        cache=None,
        record_routing: bool = False,
        hooks=None,
    ):
        self.model, self.clock, self.history = model, clock, history
        self.cache, self.record_routing = cache, record_routing
        self.hooks = hooks  # PredictionHooks: told each forward's phase
        self.cuda = next(model.parameters()).device.type == "cuda"
        self.gen = Generation()

    def forward(self, phase: str, **kwargs):
        gen = self.gen
        self.clock.begin_forward()
        self.history.begin_forward()
        before = self.cache.stats.copy() if self.cache is not None else None
        if self.hooks is not None:
            self.hooks.phase = phase
        self._sync()
        t0 = time.perf_counter()
        out = self.model(**kwargs)
        self._sync()
        dt = time.perf_counter() - t0
        gen.seconds[phase] += dt
        if phase == "decode":
            gen.decode_times.append(dt)
        mask = kwargs.get("attention_mask")
        real = kwargs["input_ids"].numel() if mask is None or phase == "decode" else mask.sum()
        gen.tokens[phase] += int(real)
        gen.logits.append(out.logits[:, -1].float().cpu())
        if self.record_routing:
            gen.ids.append(self.history.ids_TLK())
        if before is not None:
            gen.stats[phase].add(self.cache.stats, minus=before)
        return out

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def generate(
    model,
    inputs: list[PromptInput],
    cfg: DecodeConfig,
    eos_id: int | None,
    recorder: Recorder,
    progress: bool = False,
    batch: int = 1,
    pad_id: int = 0,
) -> Generation:
    """Run every prompt (prefill, then decode per cfg) through `recorder.forward`, one at a
    time or `batch` at a time in lockstep (`hf.decode_batch`)."""
    groups = [inputs[i : i + batch] for i in range(0, len(inputs), batch)]
    bar = tqdm(
        total=len(inputs), desc="generate", unit="prompt", disable=not progress, file=sys.stderr
    )
    meter = CpuMeter()
    with torch.inference_mode():
        for g, group in enumerate(groups):
            recorder.history.begin_prompt()
            recorder.history.batch = len(group)
            if batch == 1:
                runs = [
                    decode_prompt(
                        model, group[0], cfg, index=g, eos_id=eos_id, forward=recorder.forward
                    )
                ]
            else:
                runs = decode_batch(
                    model, group, cfg, index=g * batch, pad_id=pad_id, forward=recorder.forward
                )
            recorder.gen.decoded += runs
            bar.update(len(group))
    bar.close()
    recorder.gen.host_load = meter.stop()
    return recorder.gen
