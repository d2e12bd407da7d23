"""Train a small MoE causal LM from scratch with the real transformers architectures.

Usage:
    tensorbend zoo train --arch deepseek_v3 --corpus corpus/ --out runs/zoo/dsv3 --minutes 50
    from tensorbend.zoo.trainer import ZooTrainConfig, train_zoo_model
    train_zoo_model(ZooTrainConfig("qwen3_moe", Path("corpus"), Path("out"), tokens=10**6))

What it does, in order: trains a byte-level BPE tokenizer on the corpus train split, caches
train/held-out token ids (uint16), builds the model from a size preset (`recipes.SIZES`), trains
with AdamW and a warmup + cosine schedule in fp32 (GPU when present), balancing experts the
way the architecture does, and finally writes a standard HF checkpoint directory plus
`model_card.json`/`model_card.md` (see `card.py`).

Balancing:
    deepseek_v3  aux-loss-free: after every step the trainer nudges each layer's
                 `e_score_correction_bias` by `bias_gamma * sign(mean_load - load)`
                 (transformers does not update it).
    qwen3_moe,   Switch-style aux loss `E * sum_e f_e * P_e` per MoE layer, summed over layers,
    mixtral      times `aux_loss_coef` (as Megatron applies it). transformers' own aux loss
                 (`output_router_logits=True`) pools all layers' tokens before balancing, which
                 let single layers collapse on this corpus, so training computes it per layer;
                 the saved config keeps `output_router_logits=True` and the coefficient.

Checkpoints (`OUT/train_state/checkpoint.safetensors`, see `train_state.py`: weights, AdamW
state, RNG; scalars and the producing config in the safetensors metadata) are written
atomically every `checkpoint_minutes`, at the end, and on Ctrl-C / SIGTERM; `--resume`
continues from them.
Batches are a pure function of (seed, step), so an interrupted and resumed run sees the same
data as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

from tensorbend.atomic import atomic_write
from tensorbend.errors import ZooError
from tensorbend.zoo import card as zoo_card
from tensorbend.zoo import textdata
from tensorbend.zoo.balance import RouterLoad
from tensorbend.zoo.recipes import ARCHS, SIZES, ZooSize, build_config, register_sorted_experts
from tensorbend.zoo.train_state import CHECKPOINT, StopFlag, load_state, save_state

STATE_DIR = "train_state"


@dataclass(frozen=True)
class ZooTrainConfig:
    """One training run. At least one of `minutes` and `tokens` bounds it; the first reached wins."""

    arch: str = field(metadata={"choices": ARCHS})
    """Architecture (a transformers model family)."""
    corpus: Path
    """Corpus directory written by `tensorbend zoo corpus` (train/ and heldout/)."""
    out: Path
    """Output directory: the HF checkpoint, model cards, and `train_state/`."""
    minutes: float | None = None
    """Wall-clock budget of the training loop (tokenizer and evaluation not included)."""
    tokens: int | None = None
    """Budget in training tokens (steps * batch_size * seq_len)."""
    size: str = "small"
    """Size preset, a key of `recipes.SIZES`."""
    seed: int = 0
    """Seed of the weight init and of the data order."""
    resume: bool = False
    """Continue from `out/train_state/checkpoint.safetensors` when it exists."""
    bias_gamma: float = 1e-2
    """DeepSeek-V3 bias update speed per step (aux-loss-free balancing)."""
    aux_loss_coef: float = 0.01
    """Qwen3-MoE / Mixtral router aux loss coefficient."""
    checkpoint_minutes: float = 5.0
    """Minutes between periodic checkpoints."""
    eval_tokens: int = 131_072
    """Held-out tokens evaluated for the model card."""
    threads: int | None = None
    """torch CPU threads (default: all cores)."""
    dense_layers: int | None = None
    """DeepSeek-V3 style: dense layers before the MoE layers (`first_k_dense_replace`; DeepSeek-V3
    has 3); default: the size preset's."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ZooError(f"unknown arch {self.arch!r}: expected one of {', '.join(ARCHS)}")
        if self.size not in SIZES:
            raise ZooError(
                f"unknown size preset {self.size!r}: expected one of {', '.join(SIZES)} "
                "(see tensorbend.zoo.recipes.SIZES)"
            )
        if self.dense_layers is not None and (self.arch != "deepseek_v3" or self.dense_layers < 0):
            raise ZooError(
                f"zoo train: expected --dense-layers >= 0 with --arch deepseek_v3 (the only "
                f"architecture with leading dense layers), found {self.dense_layers} with "
                f"--arch {self.arch}"
            )
        if self.minutes is None and self.tokens is None:
            raise ZooError(
                "zoo train: expected a budget, found neither --minutes nor --tokens (pass one)"
            )
        if (self.minutes is not None and self.minutes <= 0) or (
            self.tokens is not None and self.tokens <= 0
        ):
            raise ZooError(
                f"zoo train: expected a positive budget, found minutes={self.minutes}, "
                f"tokens={self.tokens}"
            )

    def size_preset(self) -> ZooSize:
        """The size preset with this run's overrides (`dense_layers`)."""
        size = SIZES[self.size]
        if self.dense_layers is None:
            return size
        return replace(size, dense_layers_deepseek=self.dense_layers)


def train_zoo_model(cfg: ZooTrainConfig, progress: bool = True) -> Path:
    """Train (or resume) and write the HF checkpoint + model cards to `cfg.out`; returns it."""
    size = cfg.size_preset()
    out = Path(cfg.out)
    state_dir = out / STATE_DIR
    ckpt_path = state_dir / CHECKPOINT
    if ckpt_path.exists() and not cfg.resume:
        raise ZooError(
            f"zoo train: expected an empty --out, found a training checkpoint in {out} "
            "(pass --resume to continue it, or choose another --out)"
        )
    state_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    tok, train_ids_N, heldout_ids_N = _prepare_data(cfg, size.vocab_size, state_dir, progress)
    model, opt = _build_model(cfg, size, tok, device)
    run = {"step": 0, "tokens_seen": 0, "train_seconds": 0.0, "last_loss": None}
    if cfg.resume and ckpt_path.exists():
        run = load_state(ckpt_path, cfg, model, opt)
    _train_loop(cfg, model, opt, run, train_ids_N, state_dir, progress)
    save_state(ckpt_path, cfg, model, opt, run)

    model.eval()
    stats = zoo_card.evaluate(
        model, tok, train_ids_N, heldout_ids_N, size.seq_len, cfg.eval_tokens, progress=progress
    )
    _save_hf(model, tok, out)
    zoo_card.write_cards(out, model, cfg, run, stats)
    return out


def _build_model(cfg: ZooTrainConfig, size, tok, device: torch.device):
    """The model from the size preset (seeded init) and AdamW (no decay on norms and routers)."""
    torch.manual_seed(cfg.seed)
    hf_config = build_config(
        cfg.arch, size, len(tok), tok.eos_token_id, aux_loss_coef=cfg.aux_loss_coef
    )
    model = AutoModelForCausalLM.from_config(hf_config).to(device)
    model.set_experts_implementation(register_sorted_experts())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "gate.weight" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "gate.weight" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=size.lr,
        betas=(0.9, 0.95),
    )
    return model, opt


def _train_loop(
    cfg: ZooTrainConfig, model, opt, run: dict, train_ids_N, state_dir: Path, progress: bool
) -> None:
    """Steps until the budget; checkpoints periodically and on Ctrl-C / SIGTERM (then raises)."""
    size, device = cfg.size_preset(), next(model.parameters()).device
    ckpt_path = state_dir / CHECKPOINT
    aux_coef = 0.0 if cfg.arch == "deepseek_v3" else cfg.aux_loss_coef
    routers = RouterLoad(model, keep_logits=aux_coef > 0)
    tokens_per_step = size.batch_size * size.seq_len
    total_steps = math.ceil(cfg.tokens / tokens_per_step) if cfg.tokens else None
    budget_s = cfg.minutes * 60 if cfg.minutes else None
    log = open(state_dir / "train_log.jsonl", "a")
    bar = tqdm(
        total=total_steps,
        initial=run["step"],
        desc=f"train {cfg.arch}",
        unit="step",
        disable=not progress,
        file=sys.stderr,
    )
    stop = StopFlag()
    t_start, t_ckpt = time.monotonic() - run["train_seconds"], time.monotonic()
    model.train()
    try:
        while True:
            run["train_seconds"] = time.monotonic() - t_start
            done = [
                run["step"] / total_steps if total_steps else 0.0,
                run["train_seconds"] / budget_s if budget_s else 0.0,
            ]
            if max(done) >= 1.0:
                break
            lr = size.lr * _lr_factor(run["step"], max(done))
            for group in opt.param_groups:
                group["lr"] = lr
            batch_BS = textdata.sample_batch(
                train_ids_N, size.batch_size, size.seq_len, cfg.seed, run["step"]
            ).to(device)
            lm_loss, load_LE = _train_step(model, opt, routers, batch_BS, aux_coef)
            if cfg.arch == "deepseek_v3":
                routers.update_bias(load_LE, cfg.bias_gamma)
            run["step"] += 1
            run["tokens_seen"] += tokens_per_step
            run["last_loss"] = lm_loss
            _report(bar, log, run, lr, load_LE, time.monotonic() - t_start)
            if stop.requested:
                raise KeyboardInterrupt
            if time.monotonic() - t_ckpt > cfg.checkpoint_minutes * 60:
                save_state(ckpt_path, cfg, model, opt, run)
                t_ckpt = time.monotonic()
    except KeyboardInterrupt:
        run["train_seconds"] = time.monotonic() - t_start
        save_state(ckpt_path, cfg, model, opt, run)
        raise
    finally:
        stop.restore()
        bar.close()
        log.close()
        routers.remove()


def _report(bar, log, run: dict, lr: float, load_LE: torch.Tensor, seconds: float) -> None:
    """Progress bar every step; a JSON line in train_log.jsonl every 25 steps."""
    imbalance = float((load_LE.max(1).values / load_LE.mean(1)).max())
    bar.update(1)
    bar.set_postfix(
        loss=f"{run['last_loss']:.3f}", lr=f"{lr:.1e}", max_over_mean=f"{imbalance:.2f}"
    )
    if run["step"] % 25 == 0:
        log.write(
            json.dumps(
                {
                    "step": run["step"],
                    "tokens": run["tokens_seen"],
                    "seconds": round(seconds, 1),
                    "loss": round(run["last_loss"], 4),
                    "lr": lr,
                    "max_over_mean_load": round(imbalance, 3),
                }
            )
            + "\n"
        )
        log.flush()


# ---------------------------------------------------------------- one step


def _train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    routers: RouterLoad,
    batch_BS: torch.Tensor,
    aux_coef: float,
) -> tuple[float, torch.Tensor]:
    """Forward, backward, clip, AdamW step; returns the LM loss and the step's load [L, E]."""
    routers.clear()
    if aux_coef > 0:
        out = model(input_ids=batch_BS, labels=batch_BS, output_router_logits=False)
        lm_loss = out.loss
        loss = lm_loss + aux_coef * routers.aux_loss()
    else:
        out = model(input_ids=batch_BS, labels=batch_BS)
        lm_loss = loss = out.loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(lm_loss.detach()), routers.load_LE()


def _lr_factor(step: int, done: float, warmup_steps: int = 100) -> float:
    """Linear warmup over the first steps, then cosine from 1 to 0.1 over the budget."""
    warm = min(1.0, (step + 1) / warmup_steps)
    return warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, done))))


# ---------------------------------------------------------------- data and files


def _prepare_data(cfg: ZooTrainConfig, vocab_size: int, state_dir: Path, progress: bool):
    """Tokenizer and token caches, reused from `state_dir` when they exist (resume)."""
    tok_dir = state_dir / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    else:
        if progress:
            tqdm.write(f"training a byte-level BPE tokenizer (vocab {vocab_size})", file=sys.stderr)
        tok = textdata.train_tokenizer(cfg.corpus, vocab_size)
        tok.save_pretrained(tok_dir)
    ids = {}
    for split in ("train", "heldout"):
        path = state_dir / f"tokens_{split}.npy"
        if not path.exists():
            arr = textdata.tokenize_split(tok, cfg.corpus, split, progress=progress)
            atomic_write(path, lambda f, arr=arr: np.save(f, arr))
        ids[split] = np.load(path, mmap_mode="r")
    return tok, ids["train"], ids["heldout"]


def _save_hf(model, tok: PreTrainedTokenizerFast, out: Path) -> None:
    """Standard HF directory: loads with AutoModelForCausalLM/AutoTokenizer.from_pretrained."""
    model.set_experts_implementation("eager")
    model.config._experts_implementation = None  # let loaders pick their default
    model.config.use_cache = True
    model.save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig(
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        max_new_tokens=64,
    ).save_pretrained(out)
