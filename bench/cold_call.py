"""Why prediction costs more in the runtime than in a loop: one call's time after other work.

Usage:
    python -m bench.cold_call --predictor OURS_D1.safetensors \\
        [--horizon HORIZON.safetensors] [--model zoo:default] [--calls 300] [--json OUT]

One decode call of `prefetch.Prefetcher.observe` (one token at one MoE layer's router, the
runtime's hot path: the within-token predictor's call at layer 0 for layer 1, and, with
`--horizon`, the horizon's at the last layer, each Prefetcher holding one predictor; a
token's earlier calls run untimed first), timed right after each of these (interleaved,
medians over `--calls`):
- `back_to_back`: the same call (as in a tight loop: bench.predictor_cost's isolated
  numbers are close to this);
- `spin_2ms`: 2 ms of a Python busy loop (no memory traffic to speak of);
- `sleep_2ms`: 2 ms asleep (the thread off the CPU, as while it waits for an expert load);
- `decode_forward`: one batch-1 decode forward of the resident model (its layers' compute, as
  between two of the runtime's calls, which come one MoE layer apart).
Ratios over `back_to_back` say how much of a runtime call's cost is the
CPU's state after other work rather than the call's own work. Needs a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.record import command, emit
from tensorbend.capture.hf import cache_kwarg, cache_of, load_model
from tensorbend.models import describe_model
from tensorbend.offload.runner import build_predictor
from tensorbend.predictors.prefetch import Prefetcher

CONDITIONS = ("back_to_back", "spin_2ms", "sleep_2ms", "decode_forward")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="zoo:default")
    ap.add_argument("--predictor", required=True, help="within-token checkpoint (d1)")
    ap.add_argument("--horizon", default=None, help="cross-token checkpoint")
    ap.add_argument("--calls", type=int, default=300, help="timed calls per condition")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, _ = load_model(args.model)
    spec = describe_model(model)
    load = lambda path: build_predictor(model, Path(path), None, "d1", None) if path else None  # noqa: E731
    g = torch.Generator().manual_seed(0)
    ids_1K = torch.randperm(spec.num_experts, generator=g)[: spec.top_k].view(1, -1)
    hidden_1D = torch.randn(1, spec.hidden_size, generator=g)
    L = spec.num_moe_layers
    predictor = load(args.predictor)
    calls = {"within-token (layer 0 -> 1)": _token_call(spec, predictor, None, 0, hidden_1D,
                                                        ids_1K)}  # fmt: skip
    if args.horizon:
        calls[f"horizon (layer {L - 1})"] = _token_call(spec, None, load(args.horizon), L - 1,
                                                        hidden_1D, ids_1K)  # fmt: skip
    before = _conditions(model)
    times = {(c, k): [] for c in calls for k in CONDITIONS}
    for i in range(args.calls + 10):  # interleaved; the first 10 rounds warm up
        for c, (prep, call) in calls.items():
            for k in CONDITIONS:
                prep()
                (call if k == "back_to_back" else before[k])()  # (back to back: the same call)
                t0 = time.perf_counter()
                call()
                dt = time.perf_counter() - t0
                if i >= 10:
                    times[(c, k)].append(dt)
    rows = []
    for c in calls:
        base = statistics.median(times[(c, "back_to_back")])
        for k in CONDITIONS:
            med = statistics.median(times[(c, k)])
            rows.append({"call": c, "after": k, "us": med * 1e6, "vs_back_to_back": med / base})
    return emit({
        "bench": "cold_call", "command": command("cold_call", argv), "model": args.model,
        "predictor": args.predictor, "horizon": args.horizon, "calls": args.calls,
        "results": rows,
    }, args.json)  # fmt: skip


def _token_call(spec, predictor, horizon, layer: int, hidden_1D, ids_1K) -> tuple:
    """(prep, call): `call` is one decode token's observe at `layer`'s router; `prep` (not
    timed) ends the previous token and makes this one's earlier routers' calls."""
    pf = Prefetcher(spec, predictor, horizon)
    pf.begin_request()

    def prep():
        pf.on_token_end()
        for m in range(layer):
            pf.observe(m, hidden_TD=hidden_1D, routed_ids_TK=ids_1K)

    return prep, lambda: pf.observe(layer, hidden_TD=hidden_1D, routed_ids_TK=ids_1K)


def _conditions(model) -> dict:
    """What runs before a timed call, by `CONDITIONS` name (but back_to_back: the call)."""
    kw = cache_kwarg(model)
    prompt, nxt = torch.zeros(1, 16, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    state = {"cache": None, "n": 0}  # the decode forwards' KV cache

    def forward():
        with torch.inference_mode():  # a decode step; every 64 a new prompt (its prefill)
            if state["n"] % 64 == 0:
                state["cache"] = cache_of(model(input_ids=prompt, use_cache=True))
            state["n"] += 1
            state["cache"] = cache_of(model(input_ids=nxt, use_cache=True, **{kw: state["cache"]}))

    def spin():
        t = time.perf_counter()
        while time.perf_counter() - t < 0.002:
            pass

    return {"spin_2ms": spin, "sleep_2ms": lambda: time.sleep(0.002), "decode_forward": forward}


if __name__ == "__main__":
    raise SystemExit(main())
