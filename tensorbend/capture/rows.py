"""Rows of a loaded trace, as a run sees them: forwards, previous tokens, row selection.

Usage:
    >>> import torch
    >>> rows = {"prompt_index_T": torch.tensor([0, 0, 0, 1, 1, 1, 1]),
    ...         "phase_T": torch.tensor([0, 0, 1, 0, 1, 1, 1]),
    ...         "positions_T": torch.tensor([0, 1, 2, 0, 1, 2, 3]),
    ...         "prev_row_T": torch.tensor([-1, 0, 1, -1, 3, 4, 5]),
    ...         "expert_ids_TLK": torch.arange(7)[:, None, None]}
    >>> [(f.phase, f.rows.tolist()) for f in forwards(rows)]
    [(0, [0, 1]), (1, [2]), (0, [3]), (1, [4]), (1, [5]), (1, [6])]
    >>> sub = select_rows(rows, RowSelection(tokens_per_forward=1))   # drops row 1
    >>> sub["positions_T"].tolist(), sub["prev_phase_T"].tolist(), sub["prev_row_T"].tolist()
    ([0, 2, 0, 1, 2, 3], [-1, 0, -1, 0, 1, 1], [-1, -1, -1, 2, 3, 4])
    >>> sub["prev_expert_ids_TLK"][1].item()     # row 2's previous token (row 1) is kept aside
    1

Rows come from `Trace.load`: whole prompts in manifest order, prefill rows before decode rows,
and `prev_row_T` (the row of the previous token of the same prompt, -1 for none).
Row selection keeps each kept row's previous token's routing (`prev_expert_ids_TLK`,
`prev_phase_T`), taken before any row is dropped, so a predictor fed the previous token's
routing sees it even when that token's own row was not kept.

Shapes: T rows, L MoE layers, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Forward:
    """One forward pass of a run over trace rows (see `forwards`)."""

    phase: int  # 0 prefill, 1 decode
    rows: torch.Tensor  # [N] row indices processed together


def forwards(rows: dict[str, torch.Tensor], batch: int = 1) -> list[Forward]:
    """The forwards a run performs over loaded rows (whole prompts, prefill before decode).

    Like `tensorbend measure` at batch 1: each prompt's prefill is one forward over its prompt
    tokens, then one forward per decode token (KV cache on). With `batch` B > 1, B prompts are
    prefilled in one forward and decoded in lockstep, one token of each unfinished prompt per
    forward (static batching: a finished sequence leaves a hole, it is not refilled).

        >>> rows = {"prompt_index_T": torch.tensor([0, 0, 0, 1, 1, 1, 1]),
        ...         "phase_T": torch.tensor([0, 0, 1, 0, 1, 1, 1])}
        >>> [(f.phase, f.rows.tolist()) for f in forwards(rows, batch=1)]
        [(0, [0, 1]), (1, [2]), (0, [3]), (1, [4]), (1, [5]), (1, [6])]
        >>> [(f.phase, f.rows.tolist()) for f in forwards(rows, batch=2)]
        [(0, [0, 1, 3]), (1, [2, 4]), (1, [5]), (1, [6])]
    """
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


def previous_token(rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(prev_expert_ids_TLK, prev_phase_T): each row's previous token's routing at every layer,
    and its phase (-1: no previous token). Row selection stores both before dropping rows, so a
    kept row keeps its previous token even when that token's row was not kept."""
    if "prev_expert_ids_TLK" in rows:
        return rows["prev_expert_ids_TLK"], rows["prev_phase_T"]
    prev_T = rows["prev_row_T"]
    idx_T = prev_T.clamp(min=0)
    phase_T = torch.where(prev_T >= 0, rows["phase_T"].long()[idx_T], -1)
    return rows["expert_ids_TLK"][idx_T], phase_T


@dataclass(frozen=True)
class RowSelection:
    """Which train rows to fit on (None: no limit); see the module docstring."""

    max_prompts: int | None = None
    """Keep the first N prompts."""
    tokens_per_forward: int | None = None
    """Keep the first N prefill tokens of each prompt (decode steps are one token each)."""
    max_rows: int | None = None
    """Then keep a uniform random sample of N rows."""
    seed: int = 0
    """Seed of the sample."""


def select_rows(rows: dict[str, torch.Tensor], sel: RowSelection) -> dict[str, torch.Tensor]:
    """Rows kept by `sel`, each with its previous token's routing (prev_expert_ids_TLK, prev_phase_T)
    taken before any row is dropped; prev_row_T points into the kept rows (-1: not kept)."""
    prev_ids_TLK, prev_phase_T = previous_token(rows)
    rows = {**rows, "prev_expert_ids_TLK": prev_ids_TLK, "prev_phase_T": prev_phase_T}
    keep_T = keep_mask(rows, sel)
    if bool(keep_T.all()):
        return rows
    new_index_T = torch.cumsum(keep_T.long(), 0) - 1
    prev_T = rows["prev_row_T"]
    prev_kept_T = (prev_T >= 0) & keep_T[prev_T.clamp(min=0)]
    out = {k: v[keep_T] for k, v in rows.items()}
    remapped_T = torch.where(
        prev_kept_T, new_index_T[prev_T.clamp(min=0)], torch.full_like(prev_T, -1)
    )
    out["prev_row_T"] = remapped_T[keep_T]
    return out


def load_selected(trace, features, split: str, sel: RowSelection) -> dict[str, torch.Tensor]:
    """`select_rows(trace.load(features, split=split), sel)` in bounded memory: a first pass
    over the shards reads each row's token, prompt, phase and position (a few integers a row)
    and picks the rows; the second keeps only their features and their previous tokens'
    routing, shard by shard. Memory: the kept rows, one shard, and those few integers per row
    of the trace (tested equal).
    """
    keep_T = keep_mask(trace.load((), split=split), sel)
    return trace.load(features, split=split, keep_T=keep_T, prev_ids=True)


def keep_mask(rows: dict[str, torch.Tensor], sel: RowSelection) -> torch.Tensor:
    """[T] bool: the rows `sel` keeps (first prompts, first prefill tokens, then a sample)."""
    prompt_T = rows["prompt_index_T"]
    keep_T = torch.ones(prompt_T.shape[0], dtype=torch.bool)
    if sel.max_prompts is not None:
        first = torch.tensor(list(dict.fromkeys(prompt_T.tolist()))[: sel.max_prompts])
        keep_T &= torch.isin(prompt_T, first.to(prompt_T.dtype))
    if sel.tokens_per_forward is not None:  # positions count from a prompt's first token
        keep_T &= (rows["phase_T"] != 0) | (rows["positions_T"] < sel.tokens_per_forward)
    if sel.max_rows is not None and int(keep_T.sum()) > sel.max_rows:
        idx_N = keep_T.nonzero().flatten()
        gen = torch.Generator().manual_seed(sel.seed)
        chosen_N = idx_N[torch.randperm(idx_N.numel(), generator=gen)[: sel.max_rows]]
        keep_T = torch.zeros_like(keep_T)
        keep_T[chosen_N] = True
    return keep_T
