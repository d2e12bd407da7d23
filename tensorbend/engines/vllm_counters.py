"""Serving counters inside vLLM: live recall per layer and phase, predicted vs actual tokens
per expert and per expert-parallel rank. Written by the vLLM plugin (engines/vllm_plugin.py).

Usage:
    >>> ranks_of_experts(8, 2)                    # vLLM's default linear expert placement
    [0, 0, 0, 0, 1, 1, 1, 1]
    >>> ranks_of_experts(5, 2)                    # the first E % ep ranks hold one more
    [0, 0, 0, 1, 1]

    counters = read_counters("runs/counters")     # one dict per process, rank order
    summary(counters[0])                          # recall per phase, totals, worst rank error

`ServeMeter` extends live's `LiveMeter` (the same Prefetcher on the same hooks, the same
scoring), so a served request is scored as `tensorbend live` scores it. In a batch, a forward
is a decode forward when every request in it adds one token (vLLM's max_query_len == 1),
else a prefill forward; a prefill forward starts the Prefetcher's request history afresh
(exact one request at a time; in a mixed batch the history is the batch's last token's).

Per forward and MoE layer m, with a prediction for m (`Prefetcher.token_topk`: each token's
predicted top-K): predicted tokens per expert = bincount of those guesses, actual = bincount of
the ids vLLM's router executed; per EP rank, the sums over the experts it holds. The absolute
error per rank is what pre-sized all-to-all buffers must absorb: its max over forwards is kept.
Keys of the JSON file: docs/guide/vllm.md.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import torch

from tensorbend.atomic import atomic_write_text
from tensorbend.engines.vllm_live import LiveMeter
from tensorbend.errors import TensorbendError
from tensorbend.memory import peak_rss_bytes
from tensorbend.models import RoutingSpec
from tensorbend.predictors.prefetch import Prefetcher

FORMAT = "tensorbend.vllm_counters/1"


def ranks_of_experts(num_experts: int, ep: int) -> list[int]:
    """The EP rank holding each expert under vLLM's "linear" placement (its default:
    `determine_expert_map`): contiguous blocks, the first E % ep ranks one expert more."""
    base, extra = divmod(num_experts, ep)
    return [r for r in range(ep) for _ in range(base + (r < extra))]


def read_counters(path: str | Path) -> list[dict]:
    """The counters a plugin wrote: a counters JSON file, or a directory of them (one per
    process, `counters-rank{R}.json`), in rank order."""
    path = Path(path)
    files = sorted(path.glob("counters-rank*.json")) if path.is_dir() else [path]
    if not files or not files[0].is_file():
        raise TensorbendError(f"{path}: no counters here (expected counters-rank*.json)")
    out = [json.loads(f.read_text()) for f in files]
    for f, c in zip(files, out, strict=True):
        if c.get("format") != FORMAT:
            raise TensorbendError(f"{f}: expected format {FORMAT!r}, found {c.get('format')!r}")
    return sorted(out, key=lambda c: c["process"]["rank"])


def summary(c: dict) -> dict:
    """One process's counters in a few numbers: recall per phase over all layers, tokens
    routed, and per EP rank the worst absolute error of predicted tokens over layers."""
    rec = {ph: _rate(sum(c["hits"][ph]), sum(c["total"][ph])) for ph in c["hits"]}
    tr = c["tokens_per_rank"]
    return {
        "forwards": c["forwards"],
        "recall": rec,
        "tokens_routed": int(np.sum(c["tokens_per_expert"]["actual"])),
        "max_abs_error_per_rank": np.max(tr["max_abs_error"], axis=0).tolist(),
        "max_actual_per_rank": np.max(tr["max_actual"], axis=0).tolist(),
    }


class ServeMeter(LiveMeter):
    """LiveMeter plus token counts per expert and per EP rank; thread-safe `snapshot()`."""

    def __init__(self, spec: RoutingSpec, pf: Prefetcher, ep: int, header: dict):
        super().__init__(pf, spec.top_k, spec.num_moe_layers)
        L, E = spec.num_moe_layers, spec.num_experts
        if E < ep:
            raise TensorbendError(f"TENSORBEND_EP={ep}: more ranks than the {E} experts")
        self.E, self.ep, self.header = E, ep, header
        self.rank_of = torch.tensor(ranks_of_experts(E, ep))
        self.tokens = {"decode": 0, "prefill": 0}
        self.act_LE = np.zeros((L, E), np.int64)
        self.pred_LE = np.zeros((L, E), np.int64)
        z = np.zeros((L, ep), np.int64)
        self.rank = {
            k: z.copy()
            for k in (
                "actual",
                "predicted",
                "actual_when_predicted",
                "max_actual",
                "max_abs_error",
                "sum_abs_error",
            )
        }
        self.lock = threading.Lock()
        self.dirty = False
        self._phase = "prefill"
        self.offload = None  # engines/vllm_offload.VllmOffload, when the experts are offloaded

    def phase(self) -> str:
        return self._phase

    def on_route(self, call) -> None:
        with self.lock:
            ids_TK = call.ids_TK.long()
            if call.m == 0:  # a new forward
                self._phase = _batch_phase(ids_TK.shape[0])
                if self._phase == "prefill":
                    self.begin_request()
                self.tokens[self._phase] += ids_TK.shape[0]
            self._count(call.m, ids_TK)
            super().on_route(call)
            self.dirty = True

    def on_layer_input(self, m: int, hidden_TD) -> None:
        with self.lock:
            super().on_layer_input(m, hidden_TD)

    def _count(self, m: int, ids_TK: torch.Tensor) -> None:
        """Before LiveMeter scores layer m: actual counts, and the prediction's if it made one."""
        act_E = torch.bincount(ids_TK.reshape(-1), minlength=self.E)
        act_R = torch.zeros(self.ep, dtype=torch.long).index_add_(0, self.rank_of, act_E)
        self.act_LE[m] += act_E.numpy()
        r = self.rank
        r["actual"][m] += act_R.numpy()
        np.maximum(r["max_actual"][m], act_R.numpy(), out=r["max_actual"][m])
        guess = self.pf.token_topk.get(m) if m in self._pending else None
        if guess is None:
            return
        g = torch.as_tensor(guess, dtype=torch.long).reshape(-1)
        pred_E = torch.bincount(g[g >= 0], minlength=self.E)
        pred_R = torch.zeros(self.ep, dtype=torch.long).index_add_(0, self.rank_of, pred_E)
        err_R = (pred_R - act_R).abs().numpy()
        self.pred_LE[m] += pred_E.numpy()
        r["predicted"][m] += pred_R.numpy()
        r["actual_when_predicted"][m] += act_R.numpy()
        r["sum_abs_error"][m] += err_R
        np.maximum(r["max_abs_error"][m], err_R, out=r["max_abs_error"][m])

    def snapshot(self) -> dict:
        """The counters as the JSON file holds them (keys: docs/guide/vllm.md)."""
        with self.lock:
            self.dirty = False
            recall = {
                ph: [_rate(h, t) for h, t in zip(self.hits[ph], self.total[ph], strict=True)]
                for ph in self.hits
            }
            return {
                "format": FORMAT,
                **self.header,
                "top_k": self.K,
                "num_moe_layers": self.L,
                "num_experts": self.E,
                "ep_degree": self.ep,
                "expert_placement": "linear",
                "rank_of_expert": self.rank_of.tolist(),
                "updated": time.time(),
                "forwards": dict(self.forwards),
                "tokens": dict(self.tokens),
                "recall": recall,
                "hits": {ph: list(v) for ph, v in self.hits.items()},
                "total": {ph: list(v) for ph, v in self.total.items()},
                "tokens_per_expert": {
                    "actual": self.act_LE.tolist(),
                    "predicted": self.pred_LE.tolist(),
                },
                "tokens_per_rank": {k: v.tolist() for k, v in self.rank.items()},
                "hook_s": round(self.hook_s, 3),
                "offload": None if self.offload is None else self.offload.counters(),
                "peak_rss_bytes": peak_rss_bytes(),
            }

    def write(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(self.snapshot()))


def _rate(hits: int, total: int) -> float | None:
    return round(hits / total, 4) if total else None


def _batch_phase(num_tokens: int) -> str:
    """decode when every request of vLLM's current batch adds one token (its attention
    metadata's max_query_len), else prefill; one token means decode where none is set."""
    try:
        from vllm.forward_context import get_forward_context

        md = get_forward_context().attn_metadata
    except (ImportError, AssertionError, AttributeError):
        md = None
    if isinstance(md, list):
        md = md[0] if md else None
    if isinstance(md, dict):
        md = next(iter(md.values()), None)
    q = getattr(md, "max_query_len", None)
    if q is None:
        return "decode" if num_tokens == 1 else "prefill"
    return "decode" if q == 1 else "prefill"
