"""HF transformers plumbing: load a local model, and the ONE prefill/decode loop.

Usage:
    >>> from tensorbend.capture.prompts import Prompt
    >>> model, tok = load_model("zoo:default")
    >>> cfg = DecodeConfig(decode="greedy", max_new_tokens=4)
    >>> run = decode_prompt(model, encode_prompt(tok, Prompt("p", "In the beginning"), cfg), cfg)
    >>> len(run.fed_ids), run.n_forwards      # 4 decode tokens fed, 1 prefill + 4 decode forwards
    (4, 5)

Every user of a model's forward pass (`collect`, the offload runtime, the benches) runs
prompts through `decode_prompt`: one prefill forward over the (truncated) prompt, then one
forward per decode step with the KV cache, at batch 1, so decode rows are real single-token
steps. Decode tokens come from greedy argmax, seeded sampling (per prompt: `seed + index`), or
teacher forcing (the prompt's reference `continuation`, fed one token at a time; prompts
without one get no decode steps). Greedy and sampling stop at EOS; teacher forcing does not.

A caller that needs to act around each forward (hooks, timing, counters) passes
`forward(phase, **kwargs) -> output`; the default is `model(**kwargs)`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from tensorbend.capture.placement import align_offloaded, placement_kwargs
from tensorbend.errors import TensorbendError
from tensorbend.memory import check_device
from tensorbend.models import check_model_type
from tensorbend.zoo import resolve_model

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DecodeConfig:
    decode: Literal["greedy", "sample", "teacher"] = "greedy"
    """How decode tokens are produced: greedy argmax, seeded sampling, or teacher forcing
    (feed each prompt's `continuation`, one token per step)."""
    max_new_tokens: int = 32
    """Decode steps per prompt (greedy and sample stop earlier at EOS)."""
    max_prompt_tokens: int = 256
    """Prompts are truncated to this many tokens."""
    temperature: float = 0.8
    """Softmax temperature when sampling."""
    seed: int = 0
    """Sampling seed (prompt i uses seed + i)."""

    def __post_init__(self) -> None:
        if self.decode not in ("greedy", "sample", "teacher"):
            raise TensorbendError(
                f"--decode {self.decode!r}: expected one of greedy, sample, teacher"
            )
        if self.max_new_tokens < 0:
            raise TensorbendError(f"--max-new-tokens {self.max_new_tokens}: expected a count >= 0")
        if self.max_prompt_tokens < 1:
            raise TensorbendError(
                f"--max-prompt-tokens {self.max_prompt_tokens}: expected a count >= 1"
            )
        if not self.temperature > 0:
            raise TensorbendError(f"--temperature {self.temperature}: expected a number > 0")


@dataclass(frozen=True)
class PromptInput:
    """A tokenised prompt: ids [1, S] (truncated) and the teacher-forced tokens (or None)."""

    prompt_id: str
    ids_1S: torch.Tensor
    forced: list[int] | None


@dataclass
class Decoded:
    """What one prompt's run produced.

    fed_ids: the decode tokens fed to the model, in order (generated, sampled or forced).
    argmax_ids: argmax of the last position's logits after every forward (prefill first):
        what greedy decoding would emit next; the offload runtime compares these and the logits.
    """

    prompt_ids: list[int]
    fed_ids: list[int] = field(default_factory=list)
    argmax_ids: list[int] = field(default_factory=list)

    @property
    def n_prefill(self) -> int:
        return len(self.prompt_ids)

    @property
    def n_forwards(self) -> int:
        return 1 + len(self.fed_ids)


def load_model(
    spec: str,
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    progress: bool = False,
    max_memory: str | int | None = None,
    offload_dir: str | Path | None = None,
):
    """Load (model, tokenizer) from a local directory or zoo:NAME, offline, in eval mode.

    The experts run through transformers' per-expert `eager` implementation where the family
    supports a choice: several times faster on CPU than the default grouped_mm, and the
    implementation the offload runtime reproduces bit for bit. transformers' own loading bars
    show only with `progress`.

    Models larger than memory: with `max_memory` (bytes, or "8GB"/"512MB"), transformers +
    accelerate place what fits on `device` within that budget (`device_map="auto"`) and
    offload the rest (to CPU memory when `device` is cuda, to `offload_dir` on disk when it is
    cpu), streaming the weights in for every forward. On CPU a matmul's result depends on its
    weight's address alignment (another SIMD path: the 7th digit differs). Weights kept as in
    the checkpoint are memory-mapped from it in both the resident and the offloaded model;
    weights transformers converts at load (fused experts) live in fresh aligned memory when
    resident but come back from the offload folder at unaligned offsets, so
    `placement.align_offloaded` copies those to aligned memory per forward: the offloaded model computes bit for bit what
    the resident one does (tested).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if isinstance(dtype, str) and dtype != "auto":  # (auto: the checkpoint's own)
        dtype = DTYPES[dtype]
    path = resolve_model(spec)
    tok = load_tokenizer(path)  # (cheap checks before the weights load)
    kw = {"dtype": dtype, "local_files_only": True}
    if max_memory is not None:
        kw.update(placement_kwargs(device, max_memory, offload_dir))
    bars = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", **kw)
        except (TypeError, ValueError):  # families / versions without pluggable experts
            model = AutoModelForCausalLM.from_pretrained(path, **kw)
    except (OSError, ValueError) as e:
        raise TensorbendError(f"cannot load model from {path}: {e}") from e
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if max_memory is not None and device == "cpu":
        align_offloaded(model, offload_dir)
    elif max_memory is None and device != "cpu":
        check_device(device)
        model = model.to(device)
    model.eval()
    return model, tok


def load_tokenizer(path: Path):
    """The checkpoint's own tokenizer (offline); one-line TensorbendError if it has none, or
    if config.json's model_type is unknown (the tokenizer class may come from it)."""
    from transformers import AutoTokenizer

    check_model_type(path)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        found = sorted(p.name for p in Path(path).glob("*token*"))
        what = f"found only {found}" if found else "found no tokenizer files"
        why = str(e).strip().splitlines()[0] if found else ""
        raise TensorbendError(
            f"{path}: expected a tokenizer (tokenizer.json or tokenizer_config.json), {what}"
            f"{f' ({why})' if why else ''}; save the base model's tokenizer into it with "
            f"AutoTokenizer.from_pretrained(BASE).save_pretrained('{path}')"
        ) from None


def encode_prompt(tok, prompt, cfg: DecodeConfig) -> PromptInput:
    """Tokenise prompt.text (truncated to cfg.max_prompt_tokens) and, for teacher forcing,
    prompt.continuation (truncated to cfg.max_new_tokens)."""
    ids = tok(prompt.text, return_tensors="pt").input_ids[:, : cfg.max_prompt_tokens]
    if ids.shape[1] == 0:
        raise TensorbendError(
            f"prompt {prompt.id!r} tokenizes to nothing: remove it or give it text"
        )
    forced = None
    if cfg.decode == "teacher":
        text = prompt.continuation or ""
        forced = tok(text, add_special_tokens=False).input_ids[: cfg.max_new_tokens]
    return PromptInput(prompt.id, ids, forced)


def decode_prompt(
    model,
    inp: PromptInput,
    cfg: DecodeConfig,
    *,
    index: int = 0,
    eos_id: int | None = None,
    forward: Callable | None = None,
) -> Decoded:
    """Prefill `inp`, then decode per cfg; returns the tokens fed and the argmax after each
    forward. `forward(phase, **kwargs)` wraps every model call ("prefill" or "decode")."""
    forward = forward or (lambda phase, **kw: model(**kw))
    device = _device_of(model)
    cache_kw = cache_kwarg(model)
    gen = torch.Generator().manual_seed(cfg.seed + index) if cfg.decode == "sample" else None
    out = forward("prefill", input_ids=inp.ids_1S.to(device), use_cache=True)
    run = Decoded(prompt_ids=inp.ids_1S[0].tolist())
    logits_V = out.logits[0, -1]
    run.argmax_ids.append(int(logits_V.argmax()))
    n_steps = len(inp.forced) if inp.forced is not None else cfg.max_new_tokens
    for step in range(n_steps):
        nxt = _next_token(run, inp, logits_V, cfg, step, gen)
        if inp.forced is None and eos_id is not None and nxt == eos_id:
            break
        step_ids = torch.tensor([[nxt]], device=device)
        out = forward("decode", input_ids=step_ids, use_cache=True, **{cache_kw: cache_of(out)})
        run.fed_ids.append(nxt)
        logits_V = out.logits[0, -1]
        run.argmax_ids.append(int(logits_V.argmax()))
    return run


def decode_batch(
    model,
    inps: list[PromptInput],
    cfg: DecodeConfig,
    *,
    index: int = 0,
    pad_id: int = 0,
    forward: Callable | None = None,
) -> list[Decoded]:
    """B prompts in lockstep (static batching): one left-padded prefill forward (attention mask,
    positions counted from each prompt's first real token), then one forward per step with one
    token of every sequence. Every sequence runs the same number of steps: teacher forcing the
    shortest continuation (an empty one is refused: it would stop the whole batch), greedy and
    sampling `max_new_tokens` (EOS does not stop a batch).
    Returns one Decoded per prompt; `forward(phase, **kwargs)` wraps every model call."""
    empty = [i.prompt_id for i in inps if i.forced is not None and not i.forced]
    if empty:
        raise TensorbendError(
            f"teacher forcing a batch with prompts {empty} whose continuation is empty (or "
            "tokenizes to nothing): the batch would run zero decode steps; expected a "
            "continuation for every prompt of a batch: drop those prompts or decode them alone"
        )
    forward = forward or (lambda phase, **kw: model(**kw))
    device, cache_kw, B = _device_of(model), cache_kwarg(model), len(inps)
    S = max(i.ids_1S.shape[1] for i in inps)
    ids_BS = torch.full((B, S), pad_id, dtype=torch.long)
    mask_BS = torch.zeros(B, S, dtype=torch.long)
    for b, inp in enumerate(inps):
        n = inp.ids_1S.shape[1]
        ids_BS[b, S - n :], mask_BS[b, S - n :] = inp.ids_1S[0], 1
    runs = [Decoded(prompt_ids=i.ids_1S[0].tolist()) for i in inps]
    gens = [torch.Generator().manual_seed(cfg.seed + index + b) for b in range(B)]
    teacher = all(i.forced is not None for i in inps)
    n_steps = min(len(i.forced) for i in inps) if teacher else cfg.max_new_tokens
    kw = {
        "input_ids": ids_BS,
        "attention_mask": mask_BS,
        "position_ids": (mask_BS.cumsum(-1) - 1).clamp(min=0),
    }
    out = forward("prefill", **{k: v.to(device) for k, v in kw.items()}, use_cache=True)
    for step in range(n_steps + 1):
        logits_BV = out.logits[:, -1]
        for b, run in enumerate(runs):
            run.argmax_ids.append(int(logits_BV[b].argmax()))
        if step == n_steps:
            break
        nxt = [
            _next_token(run, inp, logits_BV[b], cfg, step, gens[b])
            for b, (run, inp) in enumerate(zip(runs, inps, strict=True))
        ]
        for run, t in zip(runs, nxt, strict=True):
            run.fed_ids.append(t)
        mask_BS = torch.cat([mask_BS, torch.ones(B, 1, dtype=torch.long)], dim=1)
        kw = {
            "input_ids": torch.tensor(nxt)[:, None],
            "attention_mask": mask_BS,
            "position_ids": mask_BS.sum(-1, keepdim=True) - 1,
        }
        out = forward(
            "decode",
            **{k: v.to(device) for k, v in kw.items()},
            use_cache=True,
            **{cache_kw: cache_of(out)},
        )
    return runs


def _next_token(run: Decoded, inp: PromptInput, logits_V, cfg: DecodeConfig, step: int, gen):
    """The token fed at decode step `step`: forced, greedy (the last argmax), or sampled."""
    if inp.forced is not None:
        return inp.forced[step]
    if cfg.decode == "greedy":
        return run.argmax_ids[-1]
    probs_V = torch.softmax(logits_V.float().cpu() / cfg.temperature, dim=-1)
    return int(torch.multinomial(probs_V, 1, generator=gen))


def cache_of(out):
    """The KV cache of a model output (`cache` since transformers 5.2x, `past_key_values` before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def cache_kwarg(model) -> str:
    """The forward() keyword that takes the KV cache in this transformers version."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _device_of(model) -> torch.device:
    return next(model.parameters()).device
