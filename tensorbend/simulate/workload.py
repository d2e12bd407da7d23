"""The forwards a run performs over a trace's rows: prefill per prompt group, then decode steps.

Usage:
    >>> import torch
    >>> rows = {"prompt_index_T": torch.tensor([0, 0, 0, 1, 1, 1, 1]),
    ...         "phase_T": torch.tensor([0, 0, 1, 0, 1, 1, 1])}
    >>> [(f.phase, f.rows.tolist()) for f in forwards(rows, batch=1)]
    [(0, [0, 1]), (1, [2]), (0, [3]), (1, [4]), (1, [5]), (1, [6])]
    >>> [(f.phase, f.rows.tolist()) for f in forwards(rows, batch=2)]
    [(0, [0, 1, 3]), (1, [2, 4]), (1, [5]), (1, [6])]

Like `tensorbend run` at batch 1: each prompt's prefill is one forward over its prompt tokens,
then one forward per decode token (KV cache on). With `batch` B > 1, B prompts are prefilled
in one forward and decoded in lockstep, one token of each unfinished prompt per forward
(static batching: a finished sequence leaves a hole, it is not refilled). Rows are indices into
the loaded rows (whole prompts, prefill rows before decode rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Forward:
    phase: int  # 0 prefill, 1 decode
    rows: torch.Tensor  # [N] row indices processed together


def forwards(rows: dict[str, torch.Tensor], batch: int = 1) -> list[Forward]:
    prompt_T, phase_T = rows["prompt_index_T"], rows["phase_T"]
    order = list(dict.fromkeys(prompt_T.tolist()))  # prompts in row order
    by_prompt = {p: (prompt_T == p).nonzero().flatten() for p in order}
    out = []
    for g in range(0, len(order), batch):
        group = [by_prompt[p] for p in order[g : g + batch]]
        pre = [r[phase_T[r] == 0] for r in group]
        dec = [r[phase_T[r] == 1] for r in group]
        if sum(len(r) for r in pre):
            out.append(Forward(0, torch.cat(pre)))
        for s in range(max(len(d) for d in dec)):
            step = [d[s : s + 1] for d in dec if s < len(d)]
            out.append(Forward(1, torch.cat(step)))
    return out
