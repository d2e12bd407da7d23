"""Run prompts through an HF MoE model and record exact routing to a trace.

Usage:
    >>> import tempfile
    >>> out = Path(tempfile.mkdtemp()) / "trace"
    >>> res = collect(CollectConfig(model="zoo:default", out=out, max_prompts=2,
    ...               decode=DecodeConfig(max_new_tokens=3)), progress=False)
    >>> res.prompts_run, res.tokens_added["decode"]
    (2, 6)

Prompts run one at a time through `hf.decode_prompt` (prefill, then one KV-cached forward per
decode step), with `capture.RoutingCapture` recording the chosen features per MoE layer. Every
finished prompt is on disk before the next starts (see `trace_writer.py`), so an interrupted
collection resumes with `--resume` losing nothing and duplicating nothing.

Data-parallel: `torchrun --nproc-per-node N [--nnodes M ...] -m tensorbend collect ...`
(torch.distributed, gloo): rank r collects the r-th contiguous block of the prompts into
`out/rank-NNN/` (shards on a shared filesystem), then rank 0 writes the one manifest at `out`
listing every rank's shards in rank order: the trace loads exactly as a single-process
collection of the same prompts (tested). An interrupted run resumes per rank with --resume.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from tensorbend.capture.hf import DTYPES, DecodeConfig, decode_prompt, encode_prompt, load_model
from tensorbend.capture.prompts import file_sha, load_prompts
from tensorbend.capture.ranks import DistContext
from tensorbend.capture.routing import RoutingCapture
from tensorbend.capture.trace import FEATURES, MANIFEST
from tensorbend.capture.writer import TraceWriter, merge_rank_traces
from tensorbend.errors import TensorbendError, TraceError
from tensorbend.memory import parse_bytes
from tensorbend.models import RouterHooks, describe_model
from tensorbend.routers import model_fingerprint, router_params
from tensorbend.zoo import resolve_model

# Test hook: seconds to sleep after each prompt, so a kill -9 test can land mid-collection.
_SLOW_PROMPT_S = float(os.environ.get("TENSORBEND_TEST_SLOW_PROMPT_S", "0"))


@dataclass(frozen=True)
class CollectConfig:
    model: str
    """Local HF checkpoint directory or zoo:NAME."""
    out: Path
    """Trace directory to write."""
    prompts: Path | None = None
    """Prompts JSONL (default: the shipped calibration prompts)."""
    split: Literal["train", "val", "test", "all"] = "all"
    """Which prompts of the file to run."""
    features: tuple[str, ...] = ("ids", "weights", "gate_input")
    """What to record per token and MoE layer: ids, weights, logits, gate_input, layer_input."""
    dtype: Literal["float32", "float16", "bfloat16"] = "float16"
    """Storage dtype of hidden states, logits and weights in the trace."""
    decode: DecodeConfig = field(default_factory=DecodeConfig, metadata={"group": "decoding"})
    """How prompts are run (decode mode, lengths, sampling)."""
    max_prompts: int | None = None
    """Stop after this many prompts (in file order)."""
    resume: bool = False
    """Continue an interrupted collection in --out."""
    overwrite: bool = False
    """Replace an existing trace in --out."""
    shard_tokens: int = 4096
    """Rows per merged shard (a shard holds whole prompts)."""
    model_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """Compute dtype of the model (float32 on CPU: bf16 matmuls are ~100x slower there)."""
    device: str = "cpu"
    """Where the model runs: cpu or cuda[:N]."""
    max_memory: str | None = None
    """Models larger than memory: hold at most this much of the model on --device (8GB,
    512MB, ...) and offload the rest with accelerate (to host memory from cuda, to disk from
    cpu), streamed in per forward; the trace is identical to a resident run (tested)."""
    offload_dir: Path | None = None
    """Where disk-offloaded weights go with --max-memory on cpu (default: OUT/.offload,
    deleted when the collection ends)."""
    engine: Literal["hf", "vllm"] = "hf"
    """Which engine runs the model: hf (transformers) or vllm (vLLM offline inference,
    `make vllm-env`; see docs/guide/vllm.md)."""

    def __post_init__(self) -> None:
        if self.max_memory is not None:
            parse_bytes(self.max_memory)  # a bad size fails before the model loads
        bad = set(self.features) - set(FEATURES)
        if bad:
            raise TensorbendError(
                f"--features {' '.join(sorted(bad))}: expected some of {', '.join(FEATURES)}"
            )
        for name in ("dtype", "model_dtype"):
            if getattr(self, name) not in DTYPES:
                raise TensorbendError(
                    f"--{name.replace('_', '-')} {getattr(self, name)!r}: expected one of "
                    f"{', '.join(DTYPES)}"
                )
        if self.shard_tokens < 1:
            raise TensorbendError(f"--shard-tokens {self.shard_tokens}: expected >= 1")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise TensorbendError(f"--max-prompts {self.max_prompts}: expected >= 1")
        if self.resume and self.overwrite:
            raise TensorbendError("--resume and --overwrite contradict each other: pass one")
        if self.engine not in ("hf", "vllm"):
            raise TensorbendError(f"--engine {self.engine!r}: expected hf or vllm")
        if self.engine == "vllm" and (self.max_memory or self.device != "cpu"):
            raise TensorbendError(
                "--engine vllm places the model itself: drop --max-memory and --device"
            )


@dataclass(frozen=True)
class CollectResult:
    """What `collect` did (printed by the CLI; `to_json()` keys are stable)."""

    trace: str
    model: str
    prompts_run: int
    prompts_skipped_done: int
    prompts_total: int
    tokens_added: dict
    decode_mode: str
    prompts_without_continuation: int
    shards: int
    seconds: float

    def to_json(self) -> dict:
        return asdict(self)


def collect(cfg: CollectConfig, progress: bool = True, engine=None) -> CollectResult:
    """Collect (or resume) a trace of `cfg.model` on `cfg.prompts`. Under torchrun
    (WORLD_SIZE > 1) each rank collects a contiguous block of the prompts into `out/rank-NNN/`
    and rank 0 then indexes them as one trace at `out` (trace_writer.merge_rank_traces).
    engine: for `cfg.engine="vllm"`, the engine that runs the model and captures its routing
    (`engines.vllm_engine.VllmEngine(cfg.model, cfg.model_dtype, cfg.decode)`, which the CLI
    builds): collection receives its engine, it does not import engines/."""
    t0 = time.perf_counter()
    prompts = load_prompts(cfg.prompts, cfg.split)[: cfg.max_prompts]
    if (Path(cfg.out) / MANIFEST).is_file() and not (cfg.resume or cfg.overwrite):
        raise TraceError(
            f"{cfg.out} already holds a trace: pass --resume to continue it or --overwrite to "
            "replace it (or choose another --out)"
        )
    ctx = DistContext.from_env()
    if cfg.engine == "vllm":
        if ctx.world_size > 1:
            raise TensorbendError("--engine vllm runs in one process: run it without torchrun")
        if engine is None:
            raise TensorbendError(
                "CollectConfig(engine='vllm'): expected collect(cfg, engine=VllmEngine(cfg.model, "
                "cfg.model_dtype, cfg.decode)) from tensorbend.engines.vllm_engine, as "
                "`tensorbend collect --engine vllm` does; found no engine"
            )
        out = Path(cfg.out)
        return _collect_loaded(
            cfg,
            ctx,
            prompts,
            (0, len(prompts)),
            out,
            engine.model,
            engine.tokenizer,
            progress,
            t0,
            engine,
        )
    lo, hi = ctx.share(len(prompts))
    out = Path(cfg.out) if ctx.world_size == 1 else Path(cfg.out) / f"rank-{ctx.rank:03d}"
    offload = cfg.offload_dir or out / ".offload"
    try:
        model, tok = load_model(
            cfg.model,
            cfg.model_dtype,
            cfg.device,
            progress,
            cfg.max_memory,
            offload if cfg.max_memory else None,
        )
        return _collect_loaded(cfg, ctx, prompts, (lo, hi), out, model, tok, progress, t0)
    finally:
        if cfg.max_memory and cfg.offload_dir is None:
            shutil.rmtree(offload, ignore_errors=True)


def _collect_loaded(cfg, ctx, prompts, block, out: Path, model, tok, progress, t0, engine=None):
    """collect() once the model is loaded: write this rank's block, then the merged manifest.
    engine: another engine's capture and prompt runner (engines/vllm_engine.py); default transformers."""
    lo, hi = block
    spec = engine.spec if engine is not None else describe_model(model)
    features = tuple(dict.fromkeys(("ids", *cfg.features)))
    writer = TraceWriter(
        out,
        model_meta=_model_meta(cfg, model, spec),
        spec=spec,
        features={f: ("int16" if f == "ids" else cfg.dtype) for f in features},
        collection=_collection_meta(cfg),
        router_params=router_params(model, spec),
        shard_tokens=cfg.shard_tokens,
        resume=cfg.resume,
        overwrite=cfg.overwrite,
        first_prompt_index=lo,
    )
    done = writer.done_ids
    todo = [(i, p) for i, p in enumerate(prompts[lo:hi], start=lo) if p.id not in done]
    counts, no_continuation = _collect_prompts(
        cfg, model, tok, spec, features, writer, todo, progress and ctx.is_main, engine
    )
    manifest = writer.manifest
    if ctx.world_size > 1:
        ctx.barrier()  # every rank's prompts are on disk
        if ctx.is_main:
            ranks = [Path(cfg.out) / f"rank-{r:03d}" for r in range(ctx.world_size)]
            manifest = merge_rank_traces(Path(cfg.out), ranks)
        ctx.barrier()
        ctx.close()
    return CollectResult(
        trace=str(cfg.out),
        model=manifest["model"]["name"],
        prompts_run=len(todo),
        prompts_skipped_done=(hi - lo) - len(todo),
        prompts_total=len(manifest["prompts"]),
        tokens_added=counts,
        decode_mode=cfg.decode.decode,
        prompts_without_continuation=int(no_continuation),
        shards=len(manifest["shards"]),
        seconds=round(time.perf_counter() - t0, 1),
    )


def _collect_prompts(cfg, model, tok, spec, features, writer, todo, progress: bool, engine=None):
    """Run `todo` [(global index, prompt)] and write each prompt; returns (token counts,
    prompts without a continuation)."""
    hooks = engine.hooks if engine is not None else RouterHooks
    capture = RoutingCapture(model, spec, features, DTYPES[cfg.dtype], hooks=hooks)
    counts = {"prefill": 0, "decode": 0}
    no_continuation = 0
    bar = tqdm(todo, desc="collect", unit="prompt", disable=not progress, file=sys.stderr)
    finished = False
    try:
        with capture as cap, torch.inference_mode():
            for i, p in bar:
                no_continuation += cfg.decode.decode == "teacher" and not p.continuation
                if engine is None:
                    record, rows = _run_prompt(model, tok, cap, p, i, cfg.decode)
                else:
                    record, rows = engine.run_prompt(cap, p, i)
                writer.add_prompt(record, rows)
                counts["prefill"] += record["prefill"]
                counts["decode"] += record["decode"]
                bar.set_postfix(tokens=counts["prefill"] + counts["decode"])
                if _SLOW_PROMPT_S:
                    time.sleep(_SLOW_PROMPT_S)
        finished = True
    finally:
        writer.close(complete=finished)  # finished prompts are on disk already, also on Ctrl-C
    return counts, no_continuation


def _run_prompt(model, tok, cap: RoutingCapture, prompt, index: int, dc: DecodeConfig):
    """Prefill + decode one prompt; returns (manifest record, rows {name: [T, ...]})."""
    cap.pop()  # drop anything left from an earlier exception
    chunks = []

    def forward(phase, **kw):
        out = model(**kw)
        chunks.append(cap.pop())
        return out

    run = decode_prompt(
        model,
        encode_prompt(tok, prompt, dc),
        dc,
        index=index,
        eos_id=tok.eos_token_id,
        forward=forward,
    )
    return prompt_rows(prompt, chunks, run.prompt_ids, run.fed_ids)


def prompt_rows(prompt, chunks: list[dict], prompt_ids: list[int], fed_ids: list[int]):
    """A prompt's manifest record and rows from its captured chunks (in token order) and the
    tokens it fed: prompt_ids prefill, then fed_ids decode (phase and position tagged)."""
    rows = {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}
    n_pre, n_dec = len(prompt_ids), len(fed_ids)
    T = n_pre + n_dec
    assert rows["expert_ids_TLK"].shape[0] == T, (rows["expert_ids_TLK"].shape, n_pre, n_dec)
    rows["token_ids_T"] = torch.tensor(prompt_ids + fed_ids, dtype=torch.int32)
    rows["positions_T"] = torch.arange(T, dtype=torch.int32)
    rows["phase_T"] = torch.cat(
        [torch.zeros(n_pre, dtype=torch.int8), torch.ones(n_dec, dtype=torch.int8)]
    )
    record = {"id": prompt.id, "split": prompt.split, "topic": prompt.topic}
    return {**record, "prefill": n_pre, "decode": n_dec}, rows


def _model_meta(cfg: CollectConfig, model, spec) -> dict:
    return {
        "name": cfg.model if str(cfg.model).startswith("zoo:") else Path(cfg.model).name,
        "path": str(resolve_model(cfg.model)),
        "fingerprint": model_fingerprint(model, spec),
        "family": spec.family,
    }


def _collection_meta(cfg: CollectConfig) -> dict:
    dc = cfg.decode
    return {
        "decode": dc.decode,
        "max_new_tokens": dc.max_new_tokens,
        "seed": dc.seed,
        "temperature": dc.temperature if dc.decode == "sample" else None,
        "max_prompt_tokens": dc.max_prompt_tokens,
        "prompts_file": str(cfg.prompts) if cfg.prompts else "(shipped calibration prompts)",
        "prompts_sha": file_sha(cfg.prompts),
        "split": cfg.split,
        "model_dtype": cfg.model_dtype,
        **({"engine": cfg.engine} if cfg.engine != "hf" else {}),  # (older traces: no key)
    }
