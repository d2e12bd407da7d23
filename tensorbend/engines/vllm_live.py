"""A trained predictor running inside vLLM's forward: `tensorbend live --engine vllm`.

Usage (in .venv-vllm):
    .venv-vllm/bin/tensorbend live --model zoo:qwen3moe-tiny --predictor ours_d1.safetensors \\
        --split test --max-prompts 8 --max-new-tokens 32

Prompts generate greedily in vLLM (engines/vllm_engine.py: the model in this process, hooks on every
MoE layer's router and decoder layer). At each source point the hooks hand vLLM's own tensors to
a `prefetch.Prefetcher` holding the predictor, exactly as an engine integration would; when the
target layer's router then runs, its executed ids score the prediction made for it:
- decode (one token per forward): recall@K = |predicted top-K & routed K| / K per (token,
  target layer), the definition `tensorbend eval` uses on a trace's decode rows;
- prefill (all prompt tokens in one forward): the Prefetcher names one list per forward (the
  union of the tokens' top-K, most voted first), so its score is the share of the forward's
  distinct routed experts in that list (`prefill_union_recall`), not eval's per-token recall.
Cost: wall seconds inside the hooks (the Prefetcher's calls, predictor scoring included)
beside the wall seconds of vLLM's generate, per decode token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tensorbend.capture.hf import DecodeConfig, encode_prompt
from tensorbend.capture.prompts import load_prompts
from tensorbend.errors import TensorbendError
from tensorbend.predictors.prefetch import Prefetcher
from tensorbend.routers import model_fingerprint


@dataclass(frozen=True)
class LiveConfig:
    model: str
    """Local HF checkpoint directory or zoo:NAME."""
    predictor: Path
    """A trained within-token predictor (`tensorbend train`) for this model."""
    engine: Literal["vllm"] = "vllm"
    """The engine the predictor runs in (vllm only)."""
    prompts: Path | None = None
    """Prompts JSONL (default: the shipped calibration prompts)."""
    split: Literal["train", "val", "test", "all"] = "test"
    """Which prompts of the file to run (test: never seen by `train`)."""
    max_prompts: int | None = 8
    """Stop after this many prompts (in file order)."""
    max_new_tokens: int = 32
    """Greedy decode steps per prompt (fewer at EOS)."""
    max_prompt_tokens: int = 256
    """Prompts are truncated to this many tokens."""
    model_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """Compute dtype of the model in vLLM."""

    def __post_init__(self) -> None:
        if self.engine != "vllm":
            raise TensorbendError(f"--engine {self.engine!r}: live runs in vllm only")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise TensorbendError(f"--max-prompts {self.max_prompts}: expected >= 1")


def live(cfg: LiveConfig) -> dict:
    """Run the prompts in vLLM with the predictor live; returns the report (JSON-able)."""
    from tensorbend.engines.vllm_engine import VllmEngine
    from tensorbend.predictors.checkpoint import load_predictor

    prompts = load_prompts(cfg.prompts, cfg.split)[: cfg.max_prompts]
    dc = DecodeConfig("greedy", cfg.max_new_tokens, cfg.max_prompt_tokens)
    engine = VllmEngine(cfg.model, cfg.model_dtype, dc, verb="live")
    spec = engine.spec
    pred = load_predictor(cfg.predictor, spec, model_fingerprint(engine.model, spec))
    if pred.lookahead is None:
        raise TensorbendError(f"{cfg.predictor}: expected a within-token predictor (ours, mlp)")
    meter = LiveMeter(Prefetcher(spec, predictor=pred), spec.top_k, spec.num_moe_layers)
    from vllm import SamplingParams

    # max_new_tokens decode forwards, as collect (the last generated token is never fed)
    params = SamplingParams(max_tokens=cfg.max_new_tokens + 1, temperature=0.0)
    on_input = meter.on_layer_input if meter.pf.wants_layer_input else None
    t0 = time.perf_counter()
    with engine.hooks(None, spec, on_route=meter.on_route, on_layer_input=on_input):
        for p in prompts:
            meter.begin_request()
            ids = encode_prompt(engine.tokenizer, p, dc).ids_1S[0].tolist()
            engine.llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return meter.report(cfg, pred, len(prompts), wall)


class LiveMeter:
    """Hook callbacks: feed the Prefetcher, score its predictions against the routed ids
    (hits and total per phase and target layer). The serving plugin's meter extends it
    (engines/vllm_counters.py): there a forward's phase comes from vLLM's batch."""

    def __init__(self, pf: Prefetcher, top_k: int, num_layers: int):
        self.pf, self.K, self.L = pf, top_k, num_layers
        self.hits = {"decode": [0] * num_layers, "prefill": [0] * num_layers}
        self.total = {"decode": [0] * num_layers, "prefill": [0] * num_layers}
        self.forwards = {"decode": 0, "prefill": 0}
        self.hook_s = 0.0
        self._pending: dict[int, set[int]] = {}
        self._first = True
        self.on_predictions = None  # called with each call's predictions (an offload's prefetch)

    def begin_request(self) -> None:
        self.pf.begin_request()
        self._first = True

    def on_layer_input(self, m: int, hidden_TD) -> None:
        t = time.perf_counter()
        self._keep(self.pf.observe(m, hidden_TD=hidden_TD))
        self.hook_s += time.perf_counter() - t

    def on_route(self, call) -> None:
        t = time.perf_counter()
        m, ids_TK = call.m, call.ids_TK.long()
        phase = self.phase()
        if m in self._pending:  # score the prediction made for this layer
            self._score(phase, m, ids_TK, self._pending.pop(m))
        self._keep(self.pf.observe(m, hidden_TD=call.gate_input, routed_ids_TK=ids_TK))
        if m == self.L - 1:
            self.pf.on_token_end()
            self.forwards[phase] += 1
            self._first = False
            self._pending.clear()
            self.pf.token_topk.clear()
        self.hook_s += time.perf_counter() - t

    def phase(self) -> str:
        """The current forward's phase: one request at a time, its first forward prefills."""
        return "prefill" if self._first else "decode"

    def _score(self, phase: str, m: int, ids_TK, pending: set[int]) -> None:
        """Decode: per token, |predicted top-K & routed K| / K; prefill: the share of the
        forward's distinct routed experts in its one list (prefill_union_recall)."""
        if phase == "prefill":
            routed = set(ids_TK.reshape(-1).tolist())
            self.hits[phase][m] += len(pending & routed)
            self.total[phase][m] += len(routed)
            return
        guess = self.pf.token_topk.get(m)
        rows = [guess] if isinstance(guess, list) else guess.tolist()
        for g, r in zip(rows, ids_TK.tolist(), strict=True):
            self.hits[phase][m] += len(set(g) & set(r))
        self.total[phase][m] += self.K * ids_TK.shape[0]

    def _keep(self, preds) -> None:
        for p in preds:
            if p.hint:
                self._pending.setdefault(p.layer, set()).add(p.expert)
        if preds and self.on_predictions is not None:
            self.on_predictions(preds)

    def report(self, cfg: LiveConfig, pred, n_prompts: int, wall_s: float) -> dict:
        def rate(ph):
            hits, total = sum(self.hits[ph]), sum(self.total[ph])
            return round(hits / total, 4) if total else None

        n_dec = max(self.forwards["decode"], 1)
        return {
            "model": cfg.model,
            "predictor": str(cfg.predictor),
            "lookahead": pred.lookahead.name,
            "prompts": n_prompts,
            "forwards": dict(self.forwards),
            f"decode_recall@{self.K}": rate("decode"),
            "prefill_union_recall": rate("prefill"),
            "hook_s": round(self.hook_s, 3),
            "score_s": round(self.pf.score_s, 3),
            "generate_s": round(wall_s, 3),
            "hook_share": round(self.hook_s / wall_s, 4),
            "hook_us_per_decode_token": round(1e6 * self.hook_s / n_dec, 1),
        }
