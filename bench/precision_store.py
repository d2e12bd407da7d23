"""One checkpoint served in float32, bf16 and fp8 blocks, and a gpt_oss one in bf16 and
MXFP4: store bytes, cache slots and decode tok/s at the same --max-memory.

Usage:
    python -m bench.precision_store [--hidden 512] [--moe-intermediate 256] [--experts 32] \\
        [--layers 4] [--max-memory 250MB] [--tokens 32] [--repeats 3] [--ways W,..] [--json OUT]

A Qwen3-MoE checkpoint (transformers' own config class, random weights, zoo:default's
tokenizer) is written in bf16, and a copy in DeepSeek-V3's FP8 format (every 2-D `*proj.weight`
whose dims are multiples of 128 as float8_e4m3fn + a float32 `weight_scale_inv` per 128x128
block, `quantization_config` fp8). Three ways to serve them: the bf16 checkpoint with
`--dtype float32` (what tensorbend did before dtype="auto"), the bf16 one with the default
auto (bf16 store), the fp8 one (fp8 store, bf16 slots). Each is `tensorbend generate` in a
fresh process (greedy, --tokens new tokens, the same prompt), interleaved `--repeats` times;
per way: the store file's bytes, the slots the budget holds, an expert's bytes in the store
and in its slot, the median decode tok/s with its range, and the text (equal for the two bf16
ways' slots only if the weights are; fp8's are the dequantized weights). The gpt_oss ways: a
GPT-OSS checkpoint of the same sizes written in bf16, and a copy in gpt-oss's MXFP4 format
(`quantize_mxfp4_experts`: expert blocks + e8m0 scales, the rest bf16), each served with
auto (bf16 store; mxfp4 store, bf16 slots). --ways picks some (default: all). Timings need a
quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.record import command, emit

WAYS = {
    "float32": ("bf16", "float32"),
    "bfloat16": ("bf16", "auto"),
    "fp8": ("fp8", "auto"),
    "gpt_oss-bfloat16": ("gpt_oss-bf16", "auto"),
    "gpt_oss-mxfp4": ("gpt_oss-mxfp4", "auto"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--moe-intermediate", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-memory", default="250MB")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ways", default=",".join(WAYS), help=f"some of {', '.join(WAYS)}")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not set(args.ways.split(",")) <= set(WAYS):
        ap.error(f"--ways {args.ways}: expected some of {', '.join(WAYS)}")
    ways = {w: WAYS[w] for w in args.ways.split(",")}
    with tempfile.TemporaryDirectory(prefix="precision-store-") as tmp:
        tmp = Path(tmp)
        ckpts = _checkpoints(tmp, {ck for ck, _ in ways.values()}, args)
        runs: dict[str, list[dict]] = {w: [] for w in ways}
        for rep in range(args.repeats):
            for way, (ck, dtype) in ways.items():
                s = _generate(ckpts[ck], dtype, tmp / f"store-{way}", tmp / "s.json", args)
                runs[way].append(s)
                print(f"repeat {rep} {way}: {s['decode_tok_s']:.1f} tok/s, "
                      f"{s['cache_slots']} slots", file=sys.stderr)  # fmt: skip
        rows = []
        for way, got in runs.items():
            tok_s = [s["decode_tok_s"] for s in got]
            store = next(
                (tmp / f"store-{way}").glob("*/experts-*.safetensors")
            )  # (root/checkpoint/)
            rows.append({"way": way, "checkpoint": WAYS[way][0], "dtype": WAYS[way][1],
                         "store_file": store.name, "store_bytes": store.stat().st_size,
                         "cache_slots": got[0]["cache_slots"],
                         "expert_slot_bytes": got[0]["expert_bytes"],
                         "expert_stored_bytes": got[0]["expert_stored_bytes"],
                         "bytes_read_per_token": got[0]["bytes_read_per_token"],
                         "decode_tok_s": statistics.median(tok_s),
                         "decode_tok_s_range": [min(tok_s), max(tok_s)],
                         "text": got[0]["text"]})  # fmt: skip
        ckpt_bytes = {k: sum(f.stat().st_size for f in p.glob("*.safetensors"))
                      for k, p in ckpts.items()}  # fmt: skip
    res = {"bench": "precision_store", "command": command("precision_store", argv),
           "max_memory": args.max_memory, "tokens": args.tokens, "repeats": args.repeats,
           "checkpoint_bytes": ckpt_bytes, "results": rows}  # fmt: skip
    return emit(res, args.json)


def _checkpoints(tmp: Path, names: set[str], args) -> dict[str, Path]:
    """The checkpoints `names` need: bf16 (Qwen3-MoE), its fp8 copy, gpt_oss-bf16, its mxfp4 copy."""
    import shutil

    out = {}
    for family, bf16, quantized in (("qwen3_moe", "bf16", "fp8"),
                                    ("gpt_oss", "gpt_oss-bf16", "gpt_oss-mxfp4")):  # fmt: skip
        if names & {bf16, quantized}:
            out[bf16] = _checkpoint(tmp / bf16, args, family)
        if quantized in names:
            shutil.copytree(out[bf16], tmp / quantized)
            out[quantized] = (quantize_fp8_blocks(tmp / quantized, 128) if quantized == "fp8"
                              else quantize_mxfp4_experts(tmp / quantized))  # fmt: skip
    return out


def _checkpoint(path: Path, args, family: str) -> Path:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tensorbend.zoo import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("zoo:default"))
    sizes = dict(vocab_size=len(tok), hidden_size=args.hidden, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=args.hidden // 4, num_hidden_layers=args.layers,
                 num_experts_per_tok=2, eos_token_id=tok.eos_token_id)  # fmt: skip
    if family == "gpt_oss":  # (its intermediate_size is the experts')
        config = transformers.GptOssConfig(**sizes, intermediate_size=args.moe_intermediate,
                                           num_local_experts=args.experts)  # fmt: skip
    else:
        config = transformers.Qwen3MoeConfig(**sizes, intermediate_size=2 * args.hidden,
                                             moe_intermediate_size=args.moe_intermediate,
                                             num_experts=args.experts)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")):
                p.normal_(0, 0.5)  # decisive routers, as tests/tiny_models.py does
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def quantize_fp8_blocks(path: Path, block: int) -> Path:
    """Checkpoint `path` rewritten in place as DeepSeek-V3's FP8 checkpoints are: every 2-D
    `*proj.weight` whose dims are multiples of `block` becomes float8_e4m3fn (safetensors
    F8_E4M3) with a float32 `weight_scale_inv` per block x block (the block's max |w| / 448),
    and config.json gains the `quantization_config` real checkpoints carry."""
    from safetensors.torch import load_file, save_file

    for shard in Path(path).glob("*.safetensors"):
        out = {}
        for key, w in load_file(shard).items():
            R, C = w.shape if w.dim() == 2 else (1, 1)
            if key.endswith("proj.weight") and w.dim() == 2 and not R % block and not C % block:
                blocks = w.float().reshape(R // block, block, C // block, block)
                scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
                q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(R, C)
                out[key], out[key + "_scale_inv"] = q, scale.contiguous()
            else:
                out[key] = w
        save_file(out, shard, metadata={"format": "pt"})
    config = json.loads((Path(path) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}  # fmt: skip
    (Path(path) / "config.json").write_text(json.dumps(config))
    return Path(path)


FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of a nibble's low 3 bits


def quantize_mxfp4_experts(path: Path) -> Path:
    """gpt_oss checkpoint `path` rewritten in place as gpt-oss's MXFP4 checkpoints are: each
    `mlp.experts.{gate_up_proj,down_proj}` ([E, A, B] as the model holds it) becomes U8
    `{proj}_blocks` [E, B, A / 32, 16] (two fp4 e2m1 values a byte, the even one in the low
    nibble) and `{proj}_scales` [E, B, A / 32] (e8m0: 2 ** (s - 127) per block of 32, the
    smallest that fits the block's max |w| in 6), what transformers' `Mxfp4Dequantize` reads
    back; the biases stay, and config.json gains quantization_config {"quant_method": "mxfp4"}."""
    from safetensors.torch import load_file, save_file

    mags = torch.tensor(FP4_E2M1)
    for shard in Path(path).glob("*.safetensors"):
        out = {}
        for key, w in load_file(shard).items():
            if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                out[key] = w
                continue
            E, A, B = w.shape
            g = w.float().transpose(1, 2).reshape(E, B, A // 32, 32)
            amax = g.abs().amax(-1, keepdim=True).clamp(min=2.0**-126)
            s = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
            q = g / torch.pow(2.0, s)
            idx = (q.abs()[..., None] - mags).abs().argmin(-1) | ((q < 0).long() << 3)
            out[key + "_blocks"] = (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8)
            out[key + "_scales"] = (s[..., 0] + 127).to(torch.uint8)
        save_file(out, shard, metadata={"format": "pt"})
    config = json.loads((Path(path) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}  # fmt: skip
    (Path(path) / "config.json").write_text(json.dumps(config))
    return Path(path)


KIMI_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
]
"""What Kimi-K2-Thinking's compressed-tensors config leaves unquantized: only routed experts are
int4 (its dense MLPs' projections match the last pattern, its routed experts' do not)."""


def quantize_int4_experts(path: Path, ignore=tuple(KIMI_IGNORE), group: int = 32) -> Path:
    """Checkpoint `path` rewritten in place as Kimi-K2-Thinking's INT4 checkpoints are, by the
    compressed-tensors library: every `*proj.weight` of a Linear that `ignore` (compressed-
    tensors' own matching: names, "re:" patterns) does not match becomes `weight_packed` int32
    [N, K/8] + `weight_scale` bf16 [N, K/group] + `weight_shape` (round to nearest, symmetric:
    the library's scale and `PackedQuantizationCompressor`), and config.json gains its
    `quantization_config` (W4A16, pack-quantized, that ignore list)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from compressed_tensors.utils import is_match
    from safetensors.torch import load_file, save_file

    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights.group_size = group
    for shard in Path(path).glob("*.safetensors"):
        out = {}
        for key, w in load_file(shard).items():
            module = key.removesuffix(".weight")
            if not (key.endswith("proj.weight") and w.dim() == 2) or not is_match(
                module, _Linear(), scheme.targets, ignore
            ):
                out[key] = w
                continue
            scale, zero = compute_dynamic_scales_and_zp(w, scheme.weights, None)
            sd = {"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero}
            for name, t in PackedQuantizationCompressor.compress(sd, scheme).items():
                out[f"{module}.{name}"] = t.contiguous()
        save_file(out, shard, metadata={"format": "pt"})
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        quant_method="compressed-tensors",
        format="pack-quantized",
        quantization_status="compressed",
        ignore=list(ignore),
    )
    config = json.loads((Path(path) / "config.json").read_text())
    config["quantization_config"] = qc.model_dump(mode="json", exclude_none=True)
    (Path(path) / "config.json").write_text(json.dumps(config, indent=1))
    return Path(path)


class _Linear(torch.nn.Linear):
    def __init__(self):  # (what compressed-tensors' is_match sees: a Linear, no weights)
        torch.nn.Module.__init__(self)


def _generate(ckpt: Path, dtype: str, store: Path, out: Path, args) -> dict:
    cmd = [sys.executable, "-m", "tensorbend", "generate", "--model", str(ckpt), "--prompt",
           "The river", "--max-new-tokens", str(args.tokens), "--dtype", dtype,
           "--max-memory", args.max_memory, "--store-dir", str(store), "--quiet",
           "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return {**json.loads(out.read_text()), "text": done.stdout}


if __name__ == "__main__":
    sys.exit(main())
