"""One minibatch training loop for the learned predictors (all target layers at once, or each
target layer on its own and spread over torch.distributed ranks).

Usage:
    best_state, history = fit(module, data, loss_fn, val_fn, FitConfig(epochs=40))

loss_fn(module, batch, layers) and val_fn(module, layers) take the slice of target layers the
module and batch hold (all of them with layers="joint", one with layers="separate"), so
closures over per-layer tensors can slice them alike.

`data` holds tensors stacked over target layers with the row dimension second ([Lt, N, ...]);
a minibatch takes the same rows from every layer (a full batch keeps the rows in order). Every parameter of `module` is stacked over
target layers too (dimension 0), so `clip="per_layer"` clips each layer's gradient on its own,
as if each layer were trained separately (the seed's recipe). Deterministic for a seed: the
shuffle uses its own generator and the module is initialised by the caller under the same seed.
`keep="best_val"` restores the state with the best validation score; `keep="last"` keeps the
final epoch (the seed had no validation split).

`layers="separate"` fits each target layer alone (its own shuffle from the same seed, its own
early stopping and best epoch, per-layer clipping by construction), so one layer's result
does not depend on which other layers are trained with it. That makes training parallel over
ranks: under torchrun (an initialised process group) rank r fits target layers r, r + W, ...,
the ranks exchange their layers' states, and every rank holds the same merged module, byte
for byte the module of a single-process `layers="separate"` run (tested).
"""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass, replace
from typing import Literal

import torch
from tqdm import tqdm

from tensorbend.errors import PredictorConfigError


@dataclass(frozen=True)
class FitConfig:
    epochs: int = 40
    """Epochs (an upper bound with early stopping)."""
    min_steps: int = 0
    """Raise the epoch count until at least this many optimizer steps are taken."""
    batch_rows: int = 512
    """Rows per minibatch (0: the full batch, as the seed trains)."""
    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 1e-4
    """Weight decay of the optimizer."""
    cosine_to: float = 0.01
    """Final learning rate as a fraction of lr (cosine schedule over all steps)."""
    grad_clip: float = 1.0
    """Maximum gradient norm (0: no clipping)."""
    clip: Literal["global", "per_layer"] = "global"
    """Clip the norm over all parameters, or over each target layer's slice (the seed)."""
    patience: int = 5
    """Epochs without a better val score before stopping (0: never stop early)."""
    keep: Literal["best_val", "last"] = "best_val"
    """Which state to return: the best val epoch, or the last epoch (the seed)."""
    seed: int = 0
    """Seed of the shuffle (and of the caller's initialisation)."""
    optimizer: Literal["adam", "adamw"] = "adam"
    """Adam (L2 weight decay) or AdamW (decoupled weight decay, the seed)."""
    layers: Literal["joint", "separate"] = "joint"
    """Fit all target layers in one loop, or each alone (the mode training over ranks needs)."""

    def __post_init__(self):
        if self.epochs < 1 or self.batch_rows < 0 or self.lr <= 0 or self.min_steps < 0:
            raise PredictorConfigError(
                f"fit: expected epochs >= 1, batch_rows >= 0, lr > 0, min_steps >= 0; found "
                f"epochs={self.epochs}, batch_rows={self.batch_rows}, lr={self.lr}, "
                f"min_steps={self.min_steps}"
            )
        for name, value, choices in (
            ("clip", self.clip, ("global", "per_layer")),
            ("keep", self.keep, ("best_val", "last")),
            ("optimizer", self.optimizer, ("adam", "adamw")),
            ("layers", self.layers, ("joint", "separate")),
        ):
            if value not in choices:
                raise PredictorConfigError(
                    f"fit.{name}: expected one of {', '.join(choices)}, found {value!r}"
                )


def fit_options(base: FitConfig, t) -> FitConfig:
    """`base` with `tensorbend train`'s fit options (a train.TrainConfig; None keeps base's)."""
    layers = t.fit_layers or base.layers
    return replace(base, seed=t.seed, epochs=t.epochs or base.epochs, layers=layers)


def fit(
    module: torch.nn.Module,
    data: dict[str, torch.Tensor],
    loss_fn,
    val_fn,
    cfg: FitConfig,
    progress: bool = False,
    desc: str = "train",
):
    """Train `module`; loss_fn(module, batch, layers) -> scalar, val_fn(module, layers) -> float
    (higher is better), `layers` the slice of target layers in play.

    Returns (the kept state dict, history: [{"epoch", "loss", "val"}], val None where unscored;
    with layers="separate" one entry per target layer: {"layer", "val", "epochs"} and a last
    {"epoch": None, "loss": None, "val": val of the merged module}).
    """
    if cfg.layers == "joint":
        everything = slice(None)
        return _fit_loop(
            module,
            data,
            lambda m, b: loss_fn(m, b, everything),
            lambda m: val_fn(m, everything),
            cfg,
            progress,
            desc,
        )
    return _fit_separate(module, data, loss_fn, val_fn, cfg, progress, desc)


def _fit_separate(module, data, loss_fn, val_fn, cfg: FitConfig, progress: bool, desc: str):
    """Each target layer alone; this rank's layers, then every rank's states merged."""
    import torch.distributed as dist

    Lt = next(module.parameters()).shape[0]
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = {}
    for li in range(rank, Lt, world):
        sl = slice(li, li + 1)
        sub = _layer_slice(module, sl)
        with torch.random.fork_rng():  # dropout draws: the layer's own, whichever rank runs it
            torch.manual_seed(cfg.seed * 100_003 + li)
            state, hist = _fit_loop(
                sub,
                {k: v[sl] for k, v in data.items()},
                lambda m, b, sl=sl: loss_fn(m, b, sl),
                lambda m, sl=sl: val_fn(m, sl),
                cfg,
                progress and rank == 0,
                f"{desc} layer {li}",
            )
        scored = [h["val"] for h in hist if h["val"] is not None]
        mine[li] = (state, {"layer": li, "val": max(scored), "epochs": len(hist)})
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine)
        mine = {li: v for part in every for li, v in part.items()}
    merged = {k: torch.cat([mine[li][0][k] for li in range(Lt)]) for k in module.state_dict()}
    module.load_state_dict(merged)
    module.eval()
    with torch.no_grad():
        val = float(val_fn(module, slice(None)))
    history = [mine[li][1] for li in range(Lt)] + [{"epoch": None, "loss": None, "val": val}]
    return merged, history


def max_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """Elementwise max over the ranks of a separate-layers fit (each rank filled in its own
    layers' entries of a zero-initialised per-layer tensor); x itself on a single process."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def _layer_slice(module: torch.nn.Module, sl: slice) -> torch.nn.Module:
    """A copy of a layer-stacked module holding only target layers `sl` (dimension 0)."""
    sub = copy.deepcopy(module)
    Lt = next(module.parameters()).shape[0]
    for t in sub.state_dict(keep_vars=True).values():
        assert t.shape[0] == Lt, "layers='separate' needs every tensor stacked over layers"
        t.data = t.data[sl].clone()
    return sub


def _fit_loop(module, data, loss_fn, val_fn, cfg: FitConfig, progress: bool, desc: str):
    """The minibatch loop over `module`'s layers together (see fit)."""
    N = next(iter(data.values())).shape[1]
    bs = N if cfg.batch_rows == 0 else min(cfg.batch_rows, N)
    steps_per_epoch = math.ceil(N / bs)
    epochs = max(cfg.epochs, math.ceil(cfg.min_steps / steps_per_epoch))
    opt, sched = _optimizer(module, cfg, epochs * steps_per_epoch)
    gen = torch.Generator().manual_seed(cfg.seed)
    best, best_state, stale, history = -math.inf, None, 0, []
    bar = tqdm(
        range(epochs), desc=desc, unit="epoch", disable=not progress, file=sys.stderr, leave=False
    )
    for epoch in bar:
        module.train()
        perm = torch.arange(N) if bs == N else torch.randperm(N, generator=gen)  # full: in order
        for i in range(steps_per_epoch):
            idx = perm[i * bs : (i + 1) * bs]
            loss = loss_fn(module, {k: v[:, idx] for k, v in data.items()})
            opt.zero_grad(set_to_none=True)
            loss.backward()
            _clip(module, cfg)
            opt.step()
            sched.step()
        module.eval()
        if not _needs_val(cfg, epoch, epochs):
            history.append({"epoch": epoch, "loss": float(loss.detach()), "val": None})
            continue
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
    if cfg.keep == "last":
        best_state = copy.deepcopy(module.state_dict())
    module.load_state_dict(best_state)
    module.eval()
    return best_state, history


def _optimizer(module: torch.nn.Module, cfg: FitConfig, total_steps: int):
    """(optimizer, cosine schedule over all steps)."""
    opt_cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    opt = opt_cls(module.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, T_max=max(total_steps, 1), eta_min=cfg.lr * cfg.cosine_to
    )
    return opt, sched


def _needs_val(cfg: FitConfig, epoch: int, epochs: int) -> bool:
    """The val score only matters for selection and early stopping; keep="last" without early
    stopping needs it once, at the end."""
    return cfg.keep == "best_val" or cfg.patience > 0 or epoch == epochs - 1


def _clip(module: torch.nn.Module, cfg: FitConfig) -> None:
    """Gradient-norm clipping over all parameters, or per target layer (dimension 0)."""
    if not cfg.grad_clip:
        return
    params = [p for p in module.parameters() if p.grad is not None]
    if cfg.clip == "global":
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        return
    sq_L = sum(p.grad.reshape(p.shape[0], -1).pow(2).sum(1) for p in params)
    coef_L = (cfg.grad_clip / (sq_L.sqrt() + 1e-6)).clamp(max=1.0)  # as clip_grad_norm_
    for p in params:
        p.grad.mul_(coef_L.view(-1, *([1] * (p.dim() - 1))))
