"""Model cards for zoo models: held-out quality and routing statistics, as JSON and Markdown.

Usage (the trainer calls these after training; tests/test_zoo.py runs them on a tiny corpus):
    stats = evaluate(model, tok, train_ids_N, heldout_ids_N, seq_len=256, eval_tokens=131072)
    write_cards(out_dir, model, train_cfg, run, stats)

Statistics, all on held-out text (documents never seen in training):
    heldout_loss / perplexity   mean next-token cross-entropy (nats) of the model
    unigram_loss / perplexity   the same targets under the train split's unigram distribution
                                (add-one smoothed): the floor any LM must beat
    per MoE layer:
      max_over_mean_load        busiest expert's share of assignments / the mean share
      dead_experts              experts never selected
      load_entropy_norm         entropy of the load distribution / log(E) (1 = perfectly even)
      cross_layer_overlap       mean |S_m ∩ S_{m-1}| / K of one token's expert sets at consecutive
                                MoE layers (expert ids are per layer, so chance is K/E)
      prev_token_overlap        mean |S_t ∩ S_{t-1}| / K at the same layer for consecutive tokens

Shapes: W held-out windows, S window length, T tokens, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import transformers
from tqdm import tqdm

from tensorbend.atomic import atomic_write_text
from tensorbend.models import RouterCall, RouterHooks, describe_model
from tensorbend.zoo import textdata

GENERATION_PROMPTS = ("In the beginning", "The kernel", "def main():", "To be, or not to be")


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    tok,
    train_ids_N: np.ndarray,
    heldout_ids_N: np.ndarray,
    seq_len: int,
    eval_tokens: int,
    progress: bool = False,
) -> dict:
    """Held-out loss next to the unigram baseline, routing statistics and sample generations."""
    windows_WS = textdata.heldout_windows(heldout_ids_N, seq_len, eval_tokens)
    spec = describe_model(model)
    captured: list[list[torch.Tensor]] = [[] for _ in range(spec.num_moe_layers)]

    def on_route(call: RouterCall) -> None:
        captured[call.m].append(call.ids_TK.detach().reshape(-1, spec.top_k).cpu())

    device = next(model.parameters()).device
    nll_sum, n_targets = 0.0, 0
    with RouterHooks(model, spec, on_route=on_route):
        for i in tqdm(
            range(0, len(windows_WS), 8),
            desc="evaluate held-out",
            unit="batch",
            disable=not progress,
            file=sys.stderr,
        ):
            ids_BS = windows_WS[i : i + 8].to(device)
            logits_BSV = model(input_ids=ids_BS).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits_BSV[:, :-1].reshape(-1, logits_BSV.shape[-1]),
                ids_BS[:, 1:].reshape(-1),
                reduction="sum",
            )
            nll_sum += float(nll)
            n_targets += ids_BS[:, 1:].numel()
    vocab = model.config.vocab_size
    counts_V = np.bincount(np.asarray(train_ids_N), minlength=vocab).astype(np.float64) + 1.0
    logp_V = np.log(counts_V / counts_V.sum())
    targets = windows_WS[:, 1:].reshape(-1).numpy()
    unigram_loss = float(-logp_V[targets].mean())
    loss = nll_sum / n_targets

    W, S = windows_WS.shape
    ids_LTK = torch.stack([torch.cat(c) for c in captured])  # [L, W*S, K]
    layers = [_layer_stats(ids_LTK, m, W, S, spec.num_experts) for m in range(spec.num_moe_layers)]
    K, E = spec.top_k, spec.num_experts
    return {
        "heldout_loss": round(loss, 4),
        "heldout_perplexity": round(math.exp(loss), 2),
        "unigram_loss": round(unigram_loss, 4),
        "unigram_perplexity": round(math.exp(unigram_loss), 2),
        "heldout_eval_tokens": int(n_targets),
        "routing": {
            "chance_overlap": round(K / E, 4),
            "max_over_mean_load_worst": max(r["max_over_mean_load"] for r in layers),
            "dead_experts_total": sum(r["dead_experts"] for r in layers),
            "per_layer": layers,
        },
        "samples": _generate_samples(model, tok),
    }


def _layer_stats(ids_LTK: torch.Tensor, m: int, W: int, S: int, E: int) -> dict:
    """Load balance and overlaps of MoE layer m over W held-out windows of S tokens."""
    K = ids_LTK.shape[-1]
    load_E = torch.bincount(ids_LTK[m].reshape(-1), minlength=E).double()
    share_E = load_E / load_E.sum()
    nz = share_E[share_E > 0]
    row = {
        "max_over_mean_load": round(float(load_E.max() / load_E.mean()), 3),
        "min_over_mean_load": round(float(load_E.min() / load_E.mean()), 3),
        "dead_experts": int((load_E == 0).sum()),
        "load_entropy_norm": round(float(-(nz * nz.log()).sum() / math.log(E)), 4),
        "prev_token_overlap": round(_prev_token_overlap(ids_LTK[m].view(W, S, K), E), 4),
    }
    if m > 0:
        row["cross_layer_overlap"] = round(_set_overlap(ids_LTK[m - 1], ids_LTK[m], E), 4)
    return row


def write_cards(out: Path, model: torch.nn.Module, cfg, run: dict, stats: dict) -> None:
    """`model_card.json` (fields `tensorbend.zoo.list_models` reads) and `model_card.md`."""
    hf = model.config
    corpus_json = Path(cfg.corpus) / "corpus.json"
    corpus = json.loads(corpus_json.read_text()) if corpus_json.is_file() else {}
    spec = describe_model(model)
    card = {
        "name": Path(out).name,
        "arch": cfg.arch,
        "model_type": hf.model_type,
        "params": sum(p.numel() for p in model.parameters()),
        "num_layers": hf.num_hidden_layers,
        "num_moe_layers": spec.num_moe_layers,
        "num_experts": spec.num_experts,
        "top_k": hf.num_experts_per_tok,
        "shared_experts": getattr(hf, "n_shared_experts", 0),
        "hidden_size": hf.hidden_size,
        "vocab_size": hf.vocab_size,
        "routing_style": _ROUTING_STYLE[cfg.arch],
        "balancing": _balancing(cfg),
        "weights_dtype": "float32",
        "size_preset": cfg.size,
        "seed": cfg.seed,
        "steps": run["step"],
        "tokens_seen": run["tokens_seen"],
        "train_wall_seconds": round(run["train_seconds"], 1),
        "train_config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        **{k: v for k, v in stats.items() if k != "samples"},
        "samples": stats["samples"],
        "corpus": {
            "sources": {
                name: {
                    "licence": s["licence"],
                    "origin": s["origin"],
                    "train_bytes": s["train"]["bytes"],
                    "heldout_bytes": s["heldout"]["bytes"],
                }
                for name, s in corpus.get("sources", {}).items()
            },
            "heldout": "about 2% of documents, chosen by hash of the document name",
        },
        "software": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
    }
    atomic_write_text(out / "model_card.json", json.dumps(card, indent=2) + "\n")
    atomic_write_text(out / "model_card.md", _markdown(card))


_ROUTING_STYLE = {
    "deepseek_v3": "sigmoid scores + e_score_correction_bias, top-k, normalised, shared expert",
    "qwen3_moe": "softmax top-k, normalised weights",
    "mixtral": "softmax top-k",
}


def _balancing(cfg) -> str:
    if cfg.arch == "deepseek_v3":
        return (
            f"aux-loss-free: bias += {cfg.bias_gamma:g} * sign(mean_load - load) after every step"
        )
    return (
        f"Switch aux loss per MoE layer (E * sum f_e * P_e), summed over layers, "
        f"coefficient {cfg.aux_loss_coef:g}"
    )


def _set_overlap(a_TK: torch.Tensor, b_TK: torch.Tensor, num_experts: int) -> float:
    """Mean |a ∩ b| / K over rows."""
    T, K = a_TK.shape
    hot_a = torch.zeros(T, num_experts, dtype=torch.bool).scatter_(1, a_TK, True)
    hot_b = torch.zeros(T, num_experts, dtype=torch.bool).scatter_(1, b_TK, True)
    return float((hot_a & hot_b).sum()) / (T * K)


def _prev_token_overlap(ids_WSK: torch.Tensor, num_experts: int) -> float:
    W, S, K = ids_WSK.shape
    prev = ids_WSK[:, :-1].reshape(-1, K)
    cur = ids_WSK[:, 1:].reshape(-1, K)
    return _set_overlap(prev, cur, num_experts)


def _generate_samples(model: torch.nn.Module, tok, new_tokens: int = 40) -> list[dict]:
    device = next(model.parameters()).device
    samples = []
    for prompt in GENERATION_PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        gen = model.generate(
            ids,
            max_new_tokens=new_tokens,
            do_sample=False,
            repetition_penalty=1.3,
            pad_token_id=tok.eos_token_id,
        )
        samples.append({"prompt": prompt, "greedy_rep1.3": tok.decode(gen[0, ids.shape[1] :])})
    return samples


def _markdown(card: dict) -> str:
    r = card["routing"]
    lines = [
        f"# {card['name']}",
        "",
        f"A small {card['model_type']} mixture-of-experts causal LM trained from scratch by "
        "`tensorbend zoo train` on offline English prose and technical text. It exists so "
        "tensorbend can measure routing on a *trained* model; it is not a useful chatbot.",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | {card['model_type']} ({card['routing_style']}) |",
        f"| parameters | {card['params']:,} ({card['weights_dtype']}) |",
        f"| layers | {card['num_layers']} ({card['num_moe_layers']} MoE), hidden {card['hidden_size']} |",
        f"| experts | {card['num_experts']} routed, top-{card['top_k']}, "
        f"{card['shared_experts']} shared |",
        f"| balancing | {card['balancing']} |",
        f"| vocabulary | {card['vocab_size']} (byte-level BPE trained on the train split) |",
        f"| training | {card['tokens_seen']:,} tokens, {card['steps']} steps, "
        f"{card['train_wall_seconds'] / 60:.1f} min, seed {card['seed']} |",
        f"| held-out loss | {card['heldout_loss']:.3f} nats/token "
        f"(perplexity {card['heldout_perplexity']:.1f}) on {card['heldout_eval_tokens']:,} tokens |",
        f"| unigram baseline | {card['unigram_loss']:.3f} nats/token "
        f"(perplexity {card['unigram_perplexity']:.1f}), same held-out targets |",
        "",
        "## Routing on held-out text",
        "",
        f"Chance level of the overlaps is K/E = {r['chance_overlap']}.",
        "",
        "| MoE layer | max/mean load | min/mean load | dead experts | load entropy / log E "
        "| cross-layer overlap | prev-token overlap |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, row in enumerate(r["per_layer"]):
        lines.append(
            f"| {m} | {row['max_over_mean_load']:.2f} | {row['min_over_mean_load']:.2f} | "
            f"{row['dead_experts']} | {row['load_entropy_norm']:.3f} | "
            f"{row.get('cross_layer_overlap', '-')} | {row['prev_token_overlap']} |"
        )
    lines += [
        "",
        "## Corpus",
        "",
        "| source | licence | train bytes | held-out bytes |",
        "|---|---|---|---|",
    ]
    for name, s in card["corpus"]["sources"].items():
        lines.append(
            f"| {name} ({s['origin']}) | {s['licence']} | {s['train_bytes']:,} | "
            f"{s['heldout_bytes']:,} |"
        )
    lines += [
        "",
        "Held-out text: " + card["corpus"]["heldout"] + ".",
        "",
        "## Samples (greedy, repetition penalty 1.3)",
        "",
    ]
    for s in card["samples"]:
        text = s["greedy_rep1.3"].replace("\n", " ⏎ ")
        lines.append(f"- **{s['prompt']}** → {text}")
    lines += [
        "",
        "## Load",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "from tensorbend.zoo import model_path",
        "",
        f"path = model_path({json.dumps(card['name'])})",
        'model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")',
        "tok = AutoTokenizer.from_pretrained(path)",
        "```",
        "",
    ]
    return "\n".join(lines)
