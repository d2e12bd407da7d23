"""One minibatch training loop for the learned predictors (all target layers at once).

Usage:
    >>> best_state, history = fit(module, data, loss_fn, val_fn, FitConfig(epochs=40))

`data` holds tensors stacked over target layers with the row dimension second ([Lt, N, ...]);
a minibatch takes the same rows from every layer. Deterministic for a seed: the shuffle uses
its own generator and the module is initialised by the caller under the same seed.
Early stopping keeps the state with the best validation score.
"""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm


@dataclass(frozen=True)
class FitConfig:
    epochs: int = 40  # upper bound; early stopping usually ends sooner
    min_steps: int = 0  # raise the epoch count until at least this many optimizer steps
    batch_rows: int = 512  # rows per minibatch (0 = full batch, as the seed trains)
    lr: float = 3e-3
    weight_decay: float = 1e-4
    cosine_to: float = 0.01  # final lr as a fraction of lr (cosine schedule over all steps)
    grad_clip: float = 1.0
    patience: int = 5  # epochs without val improvement before stopping (0 = never stop early)
    seed: int = 0
    optimizer: str = "adam"  # adam | adamw

    def __post_init__(self):
        assert self.epochs >= 1 and self.batch_rows >= 0 and self.lr > 0


def fit(
    module: torch.nn.Module,
    data: dict[str, torch.Tensor],
    loss_fn,
    val_fn,
    cfg: FitConfig,
    progress: bool = False,
    desc: str = "train",
):
    """Train `module`; loss_fn(module, batch) -> scalar, val_fn(module) -> float (higher is better)."""
    N = next(iter(data.values())).shape[1]
    bs = N if cfg.batch_rows == 0 else min(cfg.batch_rows, N)
    steps_per_epoch = math.ceil(N / bs)
    epochs = max(cfg.epochs, math.ceil(cfg.min_steps / steps_per_epoch))
    total = epochs * steps_per_epoch
    opt_cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    opt = opt_cls(module.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, T_max=max(total, 1), eta_min=cfg.lr * cfg.cosine_to
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    best, best_state, stale, history = -math.inf, None, 0, []
    bar = tqdm(
        range(epochs), desc=desc, unit="epoch", disable=not progress, file=sys.stderr, leave=False
    )
    for epoch in bar:
        module.train()
        perm = torch.randperm(N, generator=gen)
        for i in range(steps_per_epoch):
            idx = perm[i * bs : (i + 1) * bs]
            batch = {k: v[:, idx] for k, v in data.items()}
            loss = loss_fn(module, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
        module.eval()
        with torch.no_grad():
            score = float(val_fn(module))
        history.append({"epoch": epoch, "loss": float(loss.detach()), "val": score})
        bar.set_postfix(loss=f"{float(loss.detach()):.4f}", val=f"{score:.4f}")
        if score > best:
            best, best_state, stale = score, copy.deepcopy(module.state_dict()), 0
        else:
            stale += 1
            if cfg.patience and stale >= cfg.patience:
                break
    module.load_state_dict(best_state)
    module.eval()
    return best_state, history
