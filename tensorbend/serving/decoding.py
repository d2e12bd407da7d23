"""What a prompt becomes and how it decodes in `tensorbend generate`: the tokenizer's chat
template, a system prompt, top-k, repetition penalty, stop strings, interactive prompts.

Usage:
    opts = Decoding(chat=True, system="Be brief.", stop=("\\n\\n",))
    text, ids = encode(tok, "What is MoE?", opts, "--prompt")   # the template applied
    model.generate(ids, **generate_kwargs(opts, decode_cfg, tok))   # transformers' own options
    for text, ids in interactive(tok, opts, stdin, stderr): ...     # `-i`: until end of input

Everything goes through transformers: `apply_chat_template` (the tokenizer's
`chat_template`), and `generate()`'s `top_k`, `repetition_penalty`, `stop_strings`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from tensorbend.errors import TensorbendError


@dataclass(frozen=True)
class Decoding:
    chat: bool = False
    """Wrap each prompt in the tokenizer's chat template as a user turn (needs one)."""
    system: str | None = None
    """A system prompt before the user turn, with --chat."""
    top_k: int | None = None
    """Sample from the k likeliest tokens, with --sample."""
    repetition_penalty: float = 1.0
    """Penalise tokens already in the text (1: none; greedy too)."""
    stop: tuple[str, ...] = ()
    """Stop a continuation at any of these strings (repeatable)."""
    interactive: bool = field(default=False, metadata={"flags": ("-i",)})
    """Read prompts from standard input, one per line, on one loaded model (end: Ctrl-D)."""

    def check(self, sample: bool, top_p: float) -> None:
        """One error line for an option that would be ignored or is out of range."""
        if self.system is not None and not self.chat:
            raise TensorbendError("--system: expected --chat too (a system prompt is a chat turn)")
        if self.top_k is not None and self.top_k < 1:
            raise TensorbendError(f"--top-k {self.top_k}: expected a count >= 1")
        if not sample and (self.top_k is not None or top_p != 1.0):
            which = "--top-k" if self.top_k is not None else "--top-p"
            raise TensorbendError(
                f"{which}: expected --sample too (greedy decoding picks the likeliest token and "
                f"would ignore it)"
            )
        if self.repetition_penalty <= 0:
            raise TensorbendError(
                f"--repetition-penalty {self.repetition_penalty}: expected a value > 0 (1: none)"
            )
        if any(not s for s in self.stop):
            raise TensorbendError("--stop: expected non-empty strings")


def encode(tok, text: str, opts: Decoding, what: str) -> tuple[str, torch.Tensor]:
    """(what is shown of the prompt, its input ids [1, S]); TensorbendError naming `what` when
    it tokenizes to nothing or --chat finds no template."""
    if opts.chat:
        if not getattr(tok, "chat_template", None):
            raise TensorbendError(
                "--chat: expected a chat template in the tokenizer (tokenizer_config.json's "
                "`chat_template`), found none; drop --chat to continue plain text"
            )
        turns = [{"role": "system", "content": opts.system}] if opts.system else []
        turns.append({"role": "user", "content": text})
        shown = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        ids = tok(shown, return_tensors="pt", add_special_tokens=False).input_ids
    else:
        shown, ids = text, tok(text, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise TensorbendError(
            f"{what}: expected text of at least one token, found {ids.shape[1]} tokens "
            f"(the tokenizer adds no BOS token); give the prompt some text"
        )
    return shown, ids


def generate_kwargs(opts: Decoding, dc, top_p: float, tok) -> dict:
    """transformers `generate()` keyword arguments for these options and the DecodeConfig."""
    sample = dc.decode == "sample"
    kw = {"max_new_tokens": dc.max_new_tokens, "do_sample": sample}
    if sample:
        kw.update(temperature=dc.temperature, top_p=top_p)
        if opts.top_k is not None:
            kw["top_k"] = opts.top_k
    if opts.repetition_penalty != 1.0:
        kw["repetition_penalty"] = opts.repetition_penalty
    if opts.stop:
        kw.update(stop_strings=list(opts.stop), tokenizer=tok)
    return kw


def interactive(tok, opts: Decoding, stdin, stderr) -> Iterator[tuple[str, torch.Tensor]]:
    """Prompts typed on `stdin`, one per line, encoded as `encode` does; blank lines skipped,
    a prompt of no tokens said on `stderr` and skipped; ends at end of input."""
    while True:
        stderr.write("> ")
        stderr.flush()
        line = stdin.readline()
        if not line:
            stderr.write("\n")
            return
        text = line.rstrip("\n")
        if not text.strip():
            continue
        try:
            yield encode(tok, text, opts, "prompt")
        except TensorbendError as e:
            stderr.write(f"error: {e}\n")
