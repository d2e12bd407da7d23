"""A bundled model with wider experts: the same routers, routing and text, N times the expert
bytes. What the larger-than-memory bench serves (a multi-GB checkpoint with trained routing).

Usage:
    inflate(resolve_model("zoo:default"), Path("runs/big"), factor=184)   # 19 MB -> 3.5 GB

Every routed (and shared) expert's intermediate size I grows to I x factor by zero rows: `gate_proj` and
`up_proj` [I, D] gain zero rows, `down_proj` [D, I] zero columns. A zero row gives
act(0) * 0 = 0 (SiLU(0) = 0), and a zero column adds exact zeros, so each expert computes
the same function; only the matmuls' inner length changes, which may move the last bits of
a sum. The routers and embeddings are untouched, so predictors trained on the source model
load on the inflated one (same fingerprint) and see the same routing up to those last bits.
Written shard by shard (one MoE layer's experts at a time), so memory stays near one layer.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tensorbend.errors import ZooError

_EXPERT = re.compile(r"\.(shared_experts|experts\.\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def inflate(src: Path, out: Path, factor: int) -> Path:
    """Write `src` (a per-expert-layout checkpoint) with experts `factor` times wider to `out`."""
    src, out = Path(src), Path(out)
    config = json.loads((src / "config.json").read_text())
    key = "moe_intermediate_size"
    if key not in config or factor < 1:
        raise ZooError(f"{src}: expected a config with {key} and factor >= 1, got {factor}")
    if (out / "config.json").is_file():
        return out  # done before (config.json is written last)
    out.mkdir(parents=True, exist_ok=True)
    big = config[key] * factor
    shards = sorted(src.glob("*.safetensors"))
    index = {}
    for shard in shards:
        with safe_open(shard, "pt") as f:
            keys = list(f.keys())
            layers = sorted({_layer(k) for k in keys})
            for layer in layers:
                tensors = {}
                for k in keys:
                    if _layer(k) != layer:
                        continue
                    t = f.get_tensor(k)
                    match = _EXPERT.search(k)
                    if match is not None:
                        t = _widen(t, factor, columns=match.group(2) == "down_proj")
                    tensors[k] = t.contiguous()
                name = f"model-{shard.stem}-{layer}.safetensors"
                save_file(tensors, out / name, metadata={"format": "pt"})
                index.update(dict.fromkeys(tensors, name))
    total = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    index_json = {"metadata": {"total_size": total}, "weight_map": index}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=1))
    for p in src.iterdir():
        if p.suffix != ".safetensors" and p.name not in ("config.json",) and p.is_file():
            shutil.copy(p, out / p.name)
    (out / "config.json").write_text(json.dumps({**config, key: big}, indent=2))
    return out


def _layer(key: str) -> str:
    m = re.search(r"layers\.(\d+)\.", key)
    return f"layer{int(m.group(1)):03d}" if m else "other"


def _widen(t: torch.Tensor, factor: int, columns: bool) -> torch.Tensor:
    if columns:  # down_proj [D, I] -> [D, I * factor]
        return torch.cat([t, t.new_zeros(t.shape[0], t.shape[1] * (factor - 1))], dim=1)
    return torch.cat([t, t.new_zeros(t.shape[0] * (factor - 1), t.shape[1])], dim=0)
