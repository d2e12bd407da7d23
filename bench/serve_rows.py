"""The rows of bench/serve_memory.py: each a name and the `tensorbend generate` flags that make
it, the long prefill prompt, the page-cache reset, and the hook for peers outside tensorbend.

Usage:
    rows = policies(predictor, horizon, seed_mlp, accelerate=True)   # name -> generate flags
    long = prefill_prompt(workdir / "prefill.jsonl", tokenizer_dir, 512)
    EXTERNAL["llama.cpp"] = bench.llama_cpp.row   # (the lead wires it): see `external_row`

Rows (every tensorbend row but the page cache reads with `--io direct`, from the disk):
- the caches without prediction (NO_PREDICTION);
- PEERS that predict, each with the cache and admission ours uses (`--policy prefetch
  --admission predicted`, global pool and per_layer): `spec_gate` (`--baseline spec_gate`: the
  next layer's router applied to the current router input, the training-free prefetcher of
  mixtral-offloading, FATE, HOBBIT, AdapMoE, DAOP) and `seed_mlp` (`--predictor` a
  `tensorbend train --predictor seed_mlp` checkpoint);
- PAGE_CACHE, the plain thing without tensorbend's cache: `--policy on_demand --io buffered`.
  No expert is kept by tensorbend (capacity 0: every routed expert of every token is a
  `preadv` of its bytes into a staging slot, then computed), so the OS page cache is the only
  expert cache: an expert the kernel still holds is copied from RAM, one it dropped is read
  from the disk. Under `--memory-cap` the page cache is charged to the run's cgroup, so it
  holds what the budget leaves beside the model (the budget's cache share is not allocated);
  the kernel's LRU (active/inactive lists, readahead) is the policy. It differs from a
  memory-mapped engine (llama.cpp) only by that copy from the page cache into the slot.
  The store's pages are dropped before each of its runs (posix_fadvise DONTNEED), so every
  run starts cold, as the O_DIRECT rows' caches do; without --memory-cap the page cache is
  bounded only by the machine's RAM and the row measures that machine, not the budget;
- ours (`ours: ...`), and `--accelerate`'s ACCELERATE;
- with `staging`, each tensorbend row that keeps experts again with `--staging-slots N`,
  for each N.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

ALL = ["--admission", "all"]  # (generate's default admission is auto: a row names its own)
NO_PREDICTION = {
    "lru": ["--policy", "lru", *ALL],
    "lfu": ["--policy", "lfu", *ALL],
    "lfru": ["--policy", "lfru", *ALL],
    "lfru/adm=frequency": ["--policy", "lfru", "--admission", "frequency"],
    "lru/per_layer": ["--policy", "lru", "--pool", "per_layer", *ALL],
}
PAGE_CACHE = "page cache (on_demand, --io buffered)"
ACCELERATE = "accelerate (device_map, rest on disk)"
PREFETCH = ["--policy", "prefetch", "--admission", "predicted"]  # ours' cache and admission
ROW_KEYS = (
    "engine", "decode_tok_s", "decode_tokens", "bytes_read_per_token",
    "disk_read_bytes_per_token", "demand_hit_rate", "stall_s_per_token", "predict_s_per_token",
    "cache_slots", "peak_rss_bytes", "prefill_s", "prefill_tokens", "text",
)  # fmt: skip
"""What one run of a row gives the aggregate (a tensorbend row's `generate --json` has more;
None where a peer cannot tell, e.g. a hit rate without a cache)."""

EXTERNAL: dict[str, Callable[[str, dict, bool], dict]] = {}
"""Rows run by engines outside tensorbend (e.g. "llama.cpp": bench/llama_cpp.py), name ->
`row(name, ctx, prefill) -> dict` of ROW_KEYS (see `external_row`); empty until wired."""


def policies(predictor: Path | None, horizon: Path | None, seed_mlp: Path | None,
             accelerate: bool, staging: tuple[int, ...] = ()) -> dict[str, list[str]]:  # fmt: skip
    """Row name -> `tensorbend generate` flags beside the shared ones. staging: also each
    tensorbend row that keeps experts with `--staging-slots N`, for each N (`.../staging=N`)."""
    rows = dict(NO_PREDICTION)
    rows[PAGE_CACHE] = ["--policy", "on_demand", "--io", "buffered"]
    peers = {"spec_gate": ["--baseline", "spec_gate"]}
    if seed_mlp:
        peers["seed_mlp"] = ["--predictor", str(seed_mlp)]
    for name, flags in peers.items():
        rows[f"{name}/adm=predicted"] = PREFETCH + flags
        rows[f"{name}/per_layer/adm=predicted"] = PREFETCH + flags + ["--pool", "per_layer"]
    if horizon:  # the forecast as eviction alone: no prefetch, no within-token predictor
        evict = ["--policy", "prefetch", "--horizon", str(horizon), "--token-ahead-layers", "0",
                 *ALL]  # fmt: skip
        rows["ours: horizon(evict only)"] = evict
        rows["ours: horizon(evict only)/per_layer"] = evict + ["--pool", "per_layer"]
        if predictor:  # + within-token prefetches only (no next-forward prefetch), each pool
            d1 = ["--predictor", str(predictor), "--admission", "predicted"]
            rows["ours: horizon(evict only)+d1/adm=predicted"] = evict + d1
            rows["ours: horizon(evict only)+d1/per_layer/adm=predicted"] = evict + [
                "--pool", "per_layer", *d1]  # fmt: skip
    if horizon:  # the training-free cross-token peer, run as ours' forecast is
        evict = ["--policy", "prefetch", "--horizon", "recency", "--token-ahead-layers", "0", *ALL]
        rows["recency(evict only)"] = evict
        rows["recency+d1:spec_gate/adm=predicted"] = PREFETCH + [
            "--horizon", "recency", *peers["spec_gate"]]  # fmt: skip
    if horizon or predictor:
        ours = list(PREFETCH)
        ours += ["--horizon", str(horizon)] if horizon else []
        ours += ["--predictor", str(predictor)] if predictor else []
        label = "+".join(x for x, p in (("horizon", horizon), ("d1", predictor)) if p)
        rows[f"ours: {label}/adm=predicted"] = ours
    for extra in (-2, -3):  # a narrower prefetch (top-2, top-1) than the K routed + 2
        for name in [n for n in rows if "/adm=predicted" in n and "/extra=" not in n]:
            rows[f"{name}/extra={extra}"] = rows[name] + ["--prefetch-extra", str(extra)]
    keeps = [n for n in rows if n != PAGE_CACHE]
    for n_slots in staging:
        for name in keeps:
            rows[f"{name}/staging={n_slots}"] = rows[name] + ["--staging-slots", str(n_slots)]
    if accelerate:
        rows[ACCELERATE] = ["--engine", "accelerate"]
    for name in EXTERNAL:
        rows[name] = []
    return rows


def is_ours(name: str) -> bool:
    return name.startswith("ours")


def predicts_nothing(name: str) -> bool:
    """A cache without prediction (NO_PREDICTION), with its staging variant."""
    return name.split("/staging=")[0] in NO_PREDICTION


def external_row(name: str, ctx: dict, prefill: bool) -> dict:
    """One run of an external row: `EXTERNAL[name](name, ctx, prefill)`, checked for ROW_KEYS.
    ctx: {"checkpoint", "prompts" (the decode prompts' JSONL), "prefill_prompt" (JSONL of the
    one long prompt), "max_new_tokens", "max_memory_bytes", "memory_cap_bytes" (or None)}.
    prefill: the time-to-first-token run (the long prompt, one new token: `prefill_s` is its
    prefill) instead of the decode run. The text (stdout) must be the greedy continuation."""
    got = EXTERNAL[name](name, ctx, prefill)
    missing = [k for k in ROW_KEYS if k not in got]
    assert not missing, f"external row {name!r}: missing keys {missing}"
    return got


def prefill_prompt(path: Path, model_dir: Path, min_tokens: int) -> dict:
    """A JSONL of one prompt of >= min_tokens tokens: held-out prose, the shipped prompts'
    test split from its last prompt backwards (the decode runs take the first), joined by blank
    lines. Returns {"ids", "tokens"}: the prompts it joined and its token count."""
    from tensorbend.capture.hf import load_tokenizer
    from tensorbend.capture.prompts import load_prompts

    tok = load_tokenizer(model_dir)
    taken, text = [], ""
    for p in reversed(load_prompts(None, "test")):
        taken.append(p.id)
        text = f"{text}\n\n{p.text}" if text else p.text
        n = len(tok(text).input_ids)
        if n >= min_tokens:
            break
    else:
        raise SystemExit(f"the test prompts hold {n} tokens: expected >= {min_tokens}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"id": "prefill", "text": text}) + "\n")
    return {"ids": taken, "tokens": n}


def drop_page_cache(root: Path) -> None:
    """Drop the clean cached pages of every file under `root` (the expert stores), so a
    buffered run starts cold: pages an earlier run left in the machine's page cache would
    otherwise serve it outside its memory cgroup."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
