"""Run prompts through an HF MoE model with a KV cache and record exact routing to a trace.

Usage:
    >>> from tensorbend.collect import CollectConfig, collect
    >>> collect(CollectConfig(model="zoo:default", out=Path("runs/trace"), max_new_tokens=16))

Each prompt is processed at batch 1: one prefill forward over the prompt, then one forward per
decode step with the KV cache, so decode rows are real single-token steps. Decode tokens come
from greedy generation, seeded sampling, or teacher forcing (the prompt's reference
`continuation`, fed one token at a time; prompts without one contribute prefill rows only).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tensorbend.capture import FEATURES, RoutingCapture
from tensorbend.errors import TensorbendError
from tensorbend.models import describe_model, model_fingerprint, router_params
from tensorbend.prompts import file_sha, load_prompts
from tensorbend.trace import TraceWriter
from tensorbend.zoo import resolve_model

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DECODE_MODES = ("greedy", "sample", "teacher")
# Test hook: seconds to sleep after each prompt, so a kill -9 test can land mid-collection.
_SLOW_PROMPT_S = float(os.environ.get("TENSORBEND_TEST_SLOW_PROMPT_S", "0"))


@dataclass(frozen=True)
class CollectConfig:
    model: str  # local HF checkpoint directory or zoo:NAME
    out: Path  # trace directory
    prompts: Path | None = None  # prompts JSONL; None = the shipped calibration prompts
    split: str = "all"  # which prompts of the file to run: train, val, test, all
    max_new_tokens: int = 32  # decode steps per prompt
    features: tuple[str, ...] = ("ids", "weights", "gate_input")  # see capture.FEATURES
    dtype: str = "float16"  # storage dtype of hidden states / logits / weights in the trace
    decode: str = "greedy"  # greedy | sample | teacher
    seed: int = 0  # sampling seed (per prompt: seed + prompt index)
    temperature: float = 0.8  # for decode=sample
    max_prompts: int | None = None  # stop after this many prompts (in file order)
    max_prompt_tokens: int = 256  # prompts are truncated to this many tokens
    resume: bool = False
    overwrite: bool = False
    shard_tokens: int = 4096  # rows per shard (a shard holds whole prompts)
    model_dtype: str = "float32"  # compute dtype of the model (fp32 on CPU: bf16 is ~100x slower)

    def __post_init__(self):
        if self.decode not in DECODE_MODES:
            raise TensorbendError(
                f"--decode {self.decode!r}: expected one of {', '.join(DECODE_MODES)}"
            )
        if self.dtype not in DTYPES or self.model_dtype not in DTYPES:
            raise TensorbendError(f"dtype: expected one of {', '.join(DTYPES)}")
        bad = set(self.features) - set(FEATURES)
        if bad:
            raise TensorbendError(
                f"--features {sorted(bad)}: expected some of {', '.join(FEATURES)}"
            )
        if self.max_new_tokens < 0 or self.shard_tokens < 1:
            raise TensorbendError("--max-new-tokens must be >= 0 and --shard-tokens >= 1")
        if self.resume and self.overwrite:
            raise TensorbendError("--resume and --overwrite contradict each other: pass one")


def load_model(spec: str, dtype: torch.dtype = torch.float32):
    """Load (model, tokenizer) from a local directory or zoo:NAME, offline, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(spec)
    try:
        try:  # the per-expert loop: several times faster on CPU than the default grouped_mm
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, local_files_only=True, experts_implementation="eager"
            )
        except (TypeError, ValueError):  # families / versions without pluggable experts
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise TensorbendError(f"cannot load model from {path}: {e}") from e
    model.eval()
    return model, tok


def collect(cfg: CollectConfig, progress: bool = True) -> dict:
    """Collect a trace; returns a summary dict (also printed by the CLI)."""
    t0 = time.perf_counter()
    model, tok = load_model(cfg.model, DTYPES[cfg.model_dtype])
    spec = describe_model(model)
    prompts = load_prompts(cfg.prompts, cfg.split)
    if cfg.max_prompts is not None:
        prompts = prompts[: cfg.max_prompts]
    features = tuple(dict.fromkeys(("ids", *cfg.features)))
    store = DTYPES[cfg.dtype]
    feature_dtypes = {f: ("int16" if f == "ids" else cfg.dtype) for f in features}
    collection = {
        "decode": cfg.decode,
        "max_new_tokens": cfg.max_new_tokens,
        "seed": cfg.seed,
        "temperature": cfg.temperature if cfg.decode == "sample" else None,
        "max_prompt_tokens": cfg.max_prompt_tokens,
        "prompts_file": str(cfg.prompts) if cfg.prompts else "(shipped calibration prompts)",
        "prompts_sha": file_sha(cfg.prompts),
        "split": cfg.split,
        "model_dtype": cfg.model_dtype,
    }
    model_meta = {
        "name": cfg.model if str(cfg.model).startswith("zoo:") else Path(cfg.model).name,
        "path": str(resolve_model(cfg.model)),
        "fingerprint": model_fingerprint(model, spec),
        "family": spec.family,
    }
    writer = TraceWriter(
        cfg.out,
        model_meta=model_meta,
        spec=spec,
        features=feature_dtypes,
        collection=collection,
        router_params=router_params(model, spec),
        shard_tokens=cfg.shard_tokens,
        resume=cfg.resume,
        overwrite=cfg.overwrite,
    )
    done = writer.done_ids
    todo = [(i, p) for i, p in enumerate(prompts) if p.id not in done]
    no_continuation = []
    counts = {"prefill": 0, "decode": 0}
    bar = tqdm(todo, desc="collect", unit="prompt", disable=not progress, file=sys.stderr)
    finished = False
    try:
        with (
            RoutingCapture(model, spec, features, store_dtype=store) as cap,
            torch.inference_mode(),
        ):
            for i, p in bar:
                if cfg.decode == "teacher" and not p.continuation:
                    no_continuation.append(p.id)
                rows, n_pre, n_dec = _run_prompt(model, tok, cap, p, i, cfg)
                writer.add_prompt(
                    {
                        "id": p.id,
                        "split": p.split,
                        "topic": p.topic,
                        "prefill": n_pre,
                        "decode": n_dec,
                    },
                    rows,
                )
                counts["prefill"] += n_pre
                counts["decode"] += n_dec
                bar.set_postfix(tokens=counts["prefill"] + counts["decode"])
                if _SLOW_PROMPT_S:
                    time.sleep(_SLOW_PROMPT_S)
        finished = True
    finally:
        writer.close(complete=finished)  # whole prompts buffered so far are kept, also on Ctrl-C
    return {
        "trace": str(cfg.out),
        "model": model_meta["name"],
        "prompts_run": len(todo),
        "prompts_skipped_done": len(prompts) - len(todo),
        "prompts_total": len(writer.manifest["prompts"]),
        "tokens_added": counts,
        "decode_mode": cfg.decode,
        "prompts_without_continuation": len(no_continuation),
        "shards": len(writer.manifest["shards"]),
        "seconds": round(time.perf_counter() - t0, 1),
    }


# ---------------------------------------------------------------- one prompt


def _run_prompt(model, tok, cap: RoutingCapture, prompt, index: int, cfg: CollectConfig):
    """Prefill + decode one prompt; returns (rows {name: [T, ...]}, n_prefill, n_decode)."""
    ids = tok(prompt.text, return_tensors="pt").input_ids[:, : cfg.max_prompt_tokens]
    if ids.shape[1] == 0:
        raise TensorbendError(
            f"prompt {prompt.id!r} tokenizes to nothing; remove it or give it text"
        )
    forced: list[int] = []
    if cfg.decode == "teacher" and prompt.continuation:
        forced = tok(prompt.continuation, add_special_tokens=False).input_ids[: cfg.max_new_tokens]
    gen = torch.Generator().manual_seed(cfg.seed + index) if cfg.decode == "sample" else None
    eos = tok.eos_token_id

    cap.pop()  # drop anything left from an earlier exception
    out = model(input_ids=ids, use_cache=True)
    chunks = [cap.pop()]
    tokens = [ids[0]]
    n_pre = ids.shape[1]
    cache, logits = cache_of(out), out.logits[0, -1]
    cache_kw = cache_kwarg(model)
    n_steps = len(forced) if cfg.decode == "teacher" else cfg.max_new_tokens
    for step in range(n_steps):
        if cfg.decode == "teacher":
            nxt = forced[step]
        elif cfg.decode == "greedy":
            nxt = int(logits.argmax())
        else:
            probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        if cfg.decode != "teacher" and eos is not None and nxt == eos:
            break
        step_ids = torch.tensor([[nxt]])
        out = model(input_ids=step_ids, use_cache=True, **{cache_kw: cache})
        cache, logits = cache_of(out), out.logits[0, -1]
        chunks.append(cap.pop())
        tokens.append(step_ids[0])
    rows = {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}
    T = sum(t.shape[0] for t in tokens)
    n_dec = T - n_pre
    rows["token_ids_T"] = torch.cat(tokens).to(torch.int32)
    rows["positions_T"] = torch.arange(T, dtype=torch.int32)
    rows["phase_T"] = torch.cat(
        [torch.zeros(n_pre, dtype=torch.int8), torch.ones(n_dec, dtype=torch.int8)]
    )
    return rows, n_pre, n_dec


def cache_of(out):
    """The KV cache of a model output (`cache` since transformers 5.2x, `past_key_values` before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def cache_kwarg(model) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
