"""`tensorbend generate`: stream text from an offloaded model, then one summary line.

Usage:
    >>> cfg = GenerateConfig(model="zoo:default", prompt="In the beginning",
    ...                      decode=DecodeConfig(max_new_tokens=8))
    >>> summary = generate(cfg)                                  # doctest: +SKIP
    >>> summary["decode_tok_s"], summary["bytes_read_per_token"]  # doctest: +SKIP

The model goes through `serving.load_offloaded` (experts stay in the store; the cache, policy
and predictors of `ServeConfig`), and each prompt through transformers' own `generate()` with
a `TextStreamer`: text goes to stdout as it is produced; the summary line (decode tok/s,
expert bytes read per decode token, demand hit rate, peak memory) goes to stderr, so
`tensorbend generate ... > out.txt` keeps only the text. No reference run, no link cap: every
expert read is a real read (with `--io direct`, from the disk, past the page cache).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch
from transformers import TextStreamer

from tensorbend.capture.hf import DecodeConfig
from tensorbend.capture.prompts import load_prompts
from tensorbend.errors import TensorbendError
from tensorbend.host_load import BUSY_CORES, CpuMeter
from tensorbend.serving.budget import prefill_chunk
from tensorbend.serving.decoding import Decoding, encode, generate_kwargs, interactive
from tensorbend.serving.offloaded import ServeConfig, load_offloaded


@dataclass(frozen=True)
class GenerateConfig:
    model: str
    """Local HF checkpoint directory or zoo:NAME."""
    prompt: str | None = None
    """Text to continue (or --prompts FILE)."""
    prompts: Path | None = None
    """Prompts JSONL (`{"id", "text"}` per line): each is continued in turn."""
    decode: DecodeConfig = field(
        default_factory=lambda: DecodeConfig(max_new_tokens=64),
        metadata={"skip": ("decode", "max_prompt_tokens"), "group": "decoding"},
    )
    """Greedy, or sampled with --sample (decode="sample"), at most --max-new-tokens per prompt
    (fewer at EOS), with --temperature and --seed; prompts are not truncated."""
    top_p: float = field(default=1.0, metadata={"group": "decoding"})
    """Nucleus sampling mass with --sample."""
    text: Decoding = field(default_factory=Decoding, metadata={"group": "decoding"})
    """Chat template, system prompt, top-k, repetition penalty, stop strings, -i."""
    profile: bool = field(default=False, metadata={"group": "output"})
    """After the summary, where decode's time went and each MoE layer's hits and misses."""
    engine: Literal["tensorbend", "accelerate"] = "tensorbend"
    """Who offloads, tensorbend or the baseline without it: tensorbend (expert store, cache,
    policy, predictors) or accelerate
    (transformers' device_map="auto" within --max-memory, the rest streamed in from disk every
    forward, no cache or prediction: the baseline without tensorbend, to compare with)."""
    serve: ServeConfig = field(default_factory=ServeConfig, metadata={"group": "memory and store"})
    """Placement, cache, policy and predictors."""

    def __post_init__(self) -> None:
        given = [self.prompt is not None, self.prompts is not None, self.text.interactive]
        if sum(given) != 1:
            raise TensorbendError(
                "expected exactly one of --prompt TEXT, --prompts FILE or --interactive"
            )
        if self.prompts is not None and not Path(self.prompts).is_file():
            raise TensorbendError(f"--prompts {self.prompts}: expected a JSONL file, found none")
        if self.decode.max_new_tokens < 1:
            raise TensorbendError(
                f"--max-new-tokens {self.decode.max_new_tokens}: expected a count >= 1"
            )
        if self.decode.decode == "teacher":
            raise TensorbendError(
                'decode="teacher": expected greedy or sample (generate has no continuation to feed)'
            )
        if not 0 < self.top_p <= 1:
            raise TensorbendError(f"--top-p {self.top_p}: expected a value in (0, 1]")
        pred = self.serve.prediction
        if self.engine == "accelerate" and (pred.predictor or pred.baseline or pred.horizon):
            raise TensorbendError(
                "--engine accelerate: expected no --predictor, --baseline or --horizon "
                "(accelerate offloads whole layers and predicts nothing); drop them or use "
                "--engine tensorbend"
            )


def generate(cfg: GenerateConfig, out=None, err=None, stdin=None) -> dict:
    """Stream every prompt's continuation to `out` (stdout); returns the summary (also to err).
    The tokenizer loads and every prompt is tokenized first: a checkpoint without a tokenizer
    or a prompt of no tokens is refused before any store is built. With --interactive the
    prompts are read from `stdin` once the model is loaded."""
    from tensorbend.capture.hf import load_tokenizer
    from tensorbend.zoo import resolve_model

    out, err = out or sys.stdout, err or sys.stderr
    opts = cfg.text
    opts.check(cfg.decode.decode == "sample", cfg.top_p)  # (the CLI sets decode after building)
    tok = load_tokenizer(resolve_model(cfg.model))
    if cfg.prompt is not None:
        inputs = [encode(tok, cfg.prompt, opts, f"--prompt {cfg.prompt!r}")]
    elif cfg.prompts is not None:
        inputs = [
            encode(tok, p.text, opts, f"prompt {p.id!r} of {cfg.prompts}")
            for p in load_prompts(cfg.prompts, "all")
        ]
    else:
        if opts.chat:
            encode(tok, "x", opts, "--chat")  # (no template: refused before loading)
        inputs = interactive(tok, opts, stdin or sys.stdin, err)
    if not opts.interactive:
        _check_positions(resolve_model(cfg.model), inputs, cfg.decode.max_new_tokens)
    if cfg.engine == "accelerate":
        from tensorbend.serving import accelerate_baseline

        with accelerate_baseline.AccelerateRun(cfg.model, cfg.serve) as run:
            _continue(run.model, run.tok, inputs, cfg, out, on_prompt=run.new_prompt)
            summary = run.summary()
        err.write(accelerate_baseline.format_summary(summary) + "\n")
        return summary
    serve = cfg.serve
    if not opts.interactive:  # the reserve follows the request (typed prompts: the default)
        longest = max(ids.shape[1] for _, ids in inputs)
        serve = replace(serve, context_tokens=longest + cfg.decode.max_new_tokens)
    model = load_offloaded(cfg.model, serve)
    handle = model.tensorbend
    try:
        meter = CpuMeter()  # (the generation only: what others took from its cores)
        _continue(model, tok, inputs, cfg, out, chunked=True)
        load = meter.stop()
        summary = summarize(handle.counters(), cfg.serve)
        summary["memory_plan"] = handle.memory_plan
        summary["host_load"] = load.to_json()
        if cfg.profile:
            from tensorbend.serving.profile import profile

            summary["profile"] = profile(handle.counters())
    finally:
        handle.close()
    err.write(format_summary(summary) + "\n")
    if cfg.profile:
        err.write(summary["profile"] + "\n")
    return summary


def _check_positions(path, inputs: list, new_tokens: int) -> None:
    """Refuse, before loading, a prompt whose tokens plus --max-new-tokens pass the model's
    positions (config.json's max_position_embeddings)."""
    from tensorbend.models import max_positions

    limit = max_positions(path)
    longest = max(ids.shape[1] for _, ids in inputs)
    if limit and longest + new_tokens > limit:
        raise TensorbendError(
            f"a prompt of {longest} tokens + --max-new-tokens {new_tokens}: expected at most "
            f"{limit} positions (the model's max_position_embeddings); shorten the prompt or "
            f"lower --max-new-tokens"
        )


def _continue(
    model, tok, inputs: list, cfg: GenerateConfig, out, on_prompt=None, chunked=False
) -> None:
    """Each (text, ids), then its continuation streamed, through transformers' generate()
    (chunked: the prompt prefilled in chunks, `budget.prefill_chunk`)."""
    streamer = _Streamer(tok, out)
    dc = cfg.decode
    kw = generate_kwargs(cfg.text, dc, cfg.top_p, tok)
    for i, (text, ids) in enumerate(inputs):
        torch.manual_seed(dc.seed + i)  # (as hf.decode_prompt seeds prompt i)
        ids = ids.to(cfg.serve.device)
        out.write(text)
        if on_prompt is not None:
            on_prompt()
        if chunked:
            kw["prefill_chunk_size"] = prefill_chunk(ids.shape[1])
        with torch.inference_mode():
            model.generate(ids, streamer=streamer, pad_token_id=tok.eos_token_id, **kw)
        out.write("\n")
        out.flush()


def summarize(c: dict, serve: ServeConfig) -> dict:
    """The summary's numbers from `OffloadHandle.counters()`."""
    dec = c["decode"]
    return {
        "engine": "tensorbend",
        "policy": serve.offload.policy,
        "admission": serve.offload.admission_rule,
        "decode_tokens": dec["tokens"],
        "decode_tok_s": dec["tok_s"],
        "prefill_tok_s": c["prefill"]["tok_s"],
        "prefill_tokens": c["prefill"]["tokens"],
        "prefill_s": c["prefill"]["seconds"],
        "bytes_read_per_token": dec["bytes_read_per_token"],
        "disk_read_bytes_per_token": dec["disk_read_bytes_per_token"],
        "demand_hit_rate": dec["demand_hit_rate"],
        "stall_s_per_token": dec["stall_s_per_token"],
        "predict_s_per_token": c["predict_s_per_token"],
        "cache_slots": c["cache_slots"],
        "expert_bytes": c["expert_bytes"],
        "expert_stored_bytes": c["expert_stored_bytes"],
        "expert_dtype": c["expert_dtype"],
        "compute_dtype": c["compute_dtype"],
        "slot_dtype": c["slot_dtype"],
        "peak_rss_bytes": c["peak_rss_bytes"],
        "peak_device_bytes": c["peak_device_bytes"],
    }


def format_summary(s: dict) -> str:
    tok_s = f"{s['decode_tok_s']:.2f}" if s["decode_tok_s"] else "-"
    dev = f" | peak cuda {s['peak_device_bytes'] / 1e6:.0f} MB" if s["peak_device_bytes"] else ""
    stall, share = s["stall_s_per_token"], None
    if stall is not None and s["decode_tok_s"]:
        share = stall * s["decode_tok_s"]  # of decode's seconds: what prefetching could hide
    waited = f" | waited {stall * 1e3:.1f} ms/token for loads ({share:.0%})" if share else ""
    return (
        f"[tensorbend] {s['decode_tokens']} decode tokens at {tok_s} tok/s | "
        f"{s['bytes_read_per_token'] / 1e6:.2f} MB experts read/token | hit rate "
        f"{s['demand_hit_rate']:.2f}{waited} | cache {s['cache_slots']} experts of "
        f"{s['expert_bytes'] / 1e6:.2f} MB | experts stored in {s['expert_dtype']}, computed "
        f"in {s['compute_dtype']}{_int4_slots(s)} | "
        f"peak RSS {s['peak_rss_bytes'] / 1e6:.0f} MB{dev} | "
        f"policy {s['policy']}, admission {s['admission']}{_busy(s.get('host_load'))}"
        f"{_plan_line(s.get('memory_plan'))}"
    )


def _busy(load: dict | None) -> str:
    """A warning on the summary line when other processes took the cores while it generated."""
    other = (load or {}).get("other_cores")
    if other is None or other <= BUSY_CORES:
        return ""
    return (
        f" | warning: other processes used {other:.2f} of {load['cpus']} cores meanwhile "
        f"(above {BUSY_CORES} disturbs timing): this tok/s is not the machine's alone"
    )


def _int4_slots(s: dict) -> str:
    return " from int4 slots (torch's int4 kernel)" if s.get("slot_dtype") == "int4" else ""


def _plan_line(plan: dict | None) -> str:
    """Where --max-memory went (serving.memory_plan), as a second summary line."""
    if not plan:
        return ""
    mb = {k: f"{v / 1e6:.1f}" for k, v in plan.items() if isinstance(v, int)}
    onednn = f" (oneDNN {mb['onednn']})" if plan.get("onednn") else ""
    return (
        f"\n[tensorbend] --max-memory {mb['budget']} MB = model without experts {mb['model']} "
        f"+ staging {mb['staging']} + reserve {mb['reserve']}{onednn} + cache {mb['cache']} MB "
        f"(+ {plan['budget'] - sum(plan[k] for k in ('model', 'staging', 'reserve', 'cache')):,} "
        f"bytes unused); peak RSS counts the import baseline (~400 MB on CPU) on top"
    )


class _Streamer(TextStreamer):
    """transformers' TextStreamer, writing to a given stream instead of print()."""

    def __init__(self, tok, stream):
        super().__init__(tok, skip_prompt=True)
        self.stream = stream

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.stream.write(text)
        self.stream.flush()
