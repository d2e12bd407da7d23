"""What a 4-bit store costs in quality: held-out perplexity of the bundled models in float32,
bf16 and int4 (--store-dtype int4: round to nearest, symmetric, a bf16 scale per 32), dense and
in int4 slots.

Usage:
    python -m bench.int4_quality [--models default qwen3moe-tiny dsv3-deep] [--split test] \\
        [--max-tokens 256] [--json OUT]

Text: the shipped prompts of `--split` (test: prompts no predictor was fitted on; the zoo
models were trained on other text), each prompt's text and continuation, at most
`--max-tokens` tokens. Per model, one forward per prompt (teacher forcing), the mean
next-token cross-entropy over every predicted token, exp'd. Ways:
- float32: transformers' model as bundled (float32, eager experts);
- bfloat16: the same in bf16;
- int4 dense f32: `load_offloaded(store_dtype="int4", slots="dense", dtype="float32")`: the
  int4 weights dequantized into float32 slots (the quantization's own cost);
- int4 slots bf16: `load_offloaded(store_dtype="int4")` with `--dtype bf16` on the CPU: int4
  slots computed by torch's int4 kernel in bf16 (what `generate --store-dtype int4 --dtype bf16`
  serves);
each with its cache holding every expert (quality does not depend on the cache). Also the
share of next-token argmaxes equal to float32's (greedy agreement per position).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile

import torch

from bench.record import command, emit
from tensorbend.host_load import CpuMeter

WAYS = ("float32", "bfloat16", "int4 dense f32", "int4 slots bf16")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["default", "qwen3moe-tiny", "dsv3-deep"])
    ap.add_argument("--split", default="test")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from tensorbend.capture.prompts import load_prompts

    prompts = load_prompts(split=args.split)
    meter, rows = CpuMeter(), []
    for name in args.models:
        rows.append(_model_row(name, prompts, args))
        print(
            f"zoo:{name}: " + ", ".join(f"{w} {rows[-1]['perplexity'][w]:.3f}" for w in WAYS),
            file=sys.stderr,
        )
    res = {
        "bench": "int4_quality",
        "command": command("int4_quality", argv),
        "split": args.split,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "ways": list(WAYS),
        "results": rows,
        "host_load": meter.stop().to_json(),
    }
    return emit(res, args.json)


def _model_row(name: str, prompts, args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tensorbend
    from tensorbend.zoo import resolve_model

    path = resolve_model(f"zoo:{name}")
    tok = AutoTokenizer.from_pretrained(path)
    texts = [p.text + (p.continuation or "") for p in prompts]
    ids = [tok(t, return_tensors="pt").input_ids[:, : args.max_tokens] for t in texts]
    out, argmax = {}, {}
    for way in WAYS:
        with tempfile.TemporaryDirectory() as store:
            if way in ("float32", "bfloat16"):
                model = AutoModelForCausalLM.from_pretrained(
                    path, dtype=getattr(torch, way), experts_implementation="eager"
                ).eval()
                handle = None
            else:
                dense = way == "int4 dense f32"
                model = tensorbend.load_offloaded(
                    path,
                    store_dir=store,
                    store_dtype="int4",
                    cache_frac=1.0,
                    progress=False,
                    slots="dense" if dense else "int4",
                    dtype="float32" if dense else "bf16",
                )
                handle = model.tensorbend
            out[way], argmax[way] = _perplexity(model, ids)
            if handle is not None:
                handle.close()
    agree = {
        w: round(
            sum(int((a == b).sum()) for a, b in zip(argmax[w], argmax["float32"], strict=True))
            / sum(a.numel() for a in argmax[w]),
            4,
        )
        for w in WAYS
    }
    return {
        "model": f"zoo:{name}",
        "tokens": sum(i.shape[1] - 1 for i in ids),
        "perplexity": {w: round(v, 4) for w, v in out.items()},
        "vs_float32": {w: round(v / out["float32"], 4) for w, v in out.items()},
        "argmax_equal_to_float32": agree,
    }


def _perplexity(model, ids) -> tuple[float, list[torch.Tensor]]:
    nll, n, argmax = 0.0, 0, []
    with torch.inference_mode():
        for x in ids:
            logits = model(x).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
            n += x.shape[1] - 1
            argmax.append(logits.argmax(-1))
    return math.exp(nll / n), argmax


if __name__ == "__main__":
    sys.exit(main())
