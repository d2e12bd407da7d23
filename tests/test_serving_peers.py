"""Serving with the peers that predict: `--baseline spec_gate` (the next layer's router on the
current router input, no training) and a `tensorbend train --predictor seed_mlp` checkpoint as
`--predictor`: each serves the text of no prediction, and spec_gate names what the next
router would pick."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_checkpoint, write_prompts

import tensorbend
from tensorbend.cli import main
from tensorbend.models import router_module

IDS = torch.tensor([[5, 17, 33, 2, 40, 8]])


def _generate(ckpt, tmp_path, **kw):
    """Greedy tokens (8 new) of the offloaded model at a quarter of the experts, and its
    counters."""
    model = tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "store", cache_frac=0.25,
                                      progress=False, **kw)  # fmt: skip
    try:
        with torch.inference_mode():
            out = model.generate(
                IDS, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=1
            )
        return out, model.tensorbend.counters()
    finally:
        model.tensorbend.close()


def test_spec_gate_prefetch_serves_the_text_of_no_prediction(tmp_path):
    ckpt = save_checkpoint("mixtral", tmp_path / "ckpt")
    want, _ = _generate(ckpt, tmp_path)
    got, c = _generate(ckpt, tmp_path, policy="prefetch", baseline="spec_gate")
    assert torch.equal(got, want)
    assert c["totals"]["prefetch_loaded"] > 0  # it did prefetch


def test_spec_gate_names_the_next_routers_top_k_of_the_current_router_input(tmp_path):
    """Known answer: at decode, router m's input x fires a prefetch of layer m + 1's top-K by
    that layer's router logits x @ W[m+1].T (softmax keeps the order). Exact when the two
    layers' post-attention norms are equal, as in this model (ones), so spec_gate's rescaling
    of x by their ratio is the identity."""
    ckpt = save_checkpoint("mixtral", tmp_path / "ckpt")
    model = tensorbend.load_offloaded(ckpt, store_dir=tmp_path / "store", cache_frac=0.25,
                                      policy="prefetch", baseline="spec_gate", progress=False)  # fmt: skip
    handle = model.tensorbend
    spec = handle.spec
    layers = model.model.layers
    assert all(torch.equal(x.post_attention_layernorm.weight, layers[0].post_attention_layernorm
                           .weight.new_ones(spec.hidden_size)) for x in layers)  # fmt: skip
    pf = handle.hooks.prefetcher
    seen, observe = [], pf.observe

    def recording(layer, hidden_TD=None, routed_ids_TK=None):
        out = observe(layer, hidden_TD, routed_ids_TK)
        if routed_ids_TK is not None and hidden_TD.reshape(-1, spec.hidden_size).shape[0] == 1:
            seen.append((layer, hidden_TD.reshape(1, -1).float().clone(), out))
        return out

    pf.observe = recording
    try:
        with torch.inference_mode():
            model.generate(IDS, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=1)
    finally:
        handle.close()
    L, K = spec.num_moe_layers, spec.top_k
    checked = 0
    for layer, x_1D, preds in seen:
        if layer + 1 >= L:
            assert preds == []  # the last router fires nothing (no horizon)
            continue
        w_ED = router_module(model, spec, layer + 1).weight.detach().float()
        want = torch.topk(x_1D @ w_ED.T, K, dim=-1).indices[0].tolist()
        assert [p.layer for p in preds] == [layer + 1] * K
        assert [p.expert for p in sorted(preds, key=lambda p: p.rank)] == want, layer
        checked += 1
    assert checked == 5 * (L - 1)  # every decode forward, every router but the last


def test_seed_mlp_checkpoint_prefetches_and_serves_the_text_of_no_prediction(tmp_path):
    """A seed_mlp trained on a tiny trace of this model loads as --predictor for serving."""
    ckpt = save_checkpoint("mixtral", tmp_path / "ckpt")
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    trace, seed = tmp_path / "trace", tmp_path / "seed.safetensors"
    assert main(["collect", "--model", str(ckpt), "--out", str(trace), "--prompts", str(prompts),
                 "--max-new-tokens", "4", "--quiet"]) == 0  # fmt: skip
    assert main(["train", "--trace", str(trace), "--out", str(seed), "--predictor", "seed_mlp",
                 "--lookahead", "d1", "--epochs", "2", "--quiet"]) == 0  # fmt: skip
    want, _ = _generate(ckpt, tmp_path)
    got, c = _generate(ckpt, tmp_path, policy="prefetch", predictor=seed)
    assert torch.equal(got, want)
    assert c["totals"]["prefetch_loaded"] > 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--policy", "prefetch", "--baseline", "transition"],  # (a table peer: `measure`'s)
         "argument --baseline: invalid choice: 'transition' (choose from 'spec_gate', 'random')"),
        (["--policy", "prefetch", "--baseline", "spec_gate", "--predictor", "x.safetensors"],
         "--predictor and --baseline both given"),
        (["--engine", "accelerate", "--policy", "prefetch", "--baseline", "spec_gate"],
         "--engine accelerate: expected no --predictor, --baseline or --horizon"),
    ],
)  # fmt: skip
def test_bad_baseline_flags_one_line(flags, message, capsys):
    assert main(["generate", "--model", "m", "--prompt", "hi", "--quiet", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_disk_bytes_per_token_count_storage_reads_not_page_cache_hits(tmp_path):
    """--io direct: every expert byte read is a disk byte (experts of 3 x 4096 bytes, so no
    partial block); buffered, just after the store was written: the page cache serves them."""
    ckpt = save_checkpoint("mixtral", tmp_path / "ckpt")
    _, direct = _generate(ckpt, tmp_path, io="direct")
    _, buffered = _generate(ckpt, tmp_path, io="buffered")
    assert direct["expert_stored_bytes"] % 4096 == 0
    d, b = direct["decode"], buffered["decode"]
    assert d["disk_read_bytes_per_token"] == d["bytes_read_per_token"] > 0
    assert b["disk_read_bytes_per_token"] < b["bytes_read_per_token"]
