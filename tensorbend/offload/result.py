"""The result of one offloaded run (`tensorbend measure --json`), and its comparison with the resident run.

Usage:
    result = session.run_policy(PolicyConfig(policy="lru"))
    result.output_matches_resident, result.max_logit_abs_diff       # True, 0.0
    json.dumps(result.to_json())

"Matches" means bit-identical by default: the same argmax token after every forward of every
prompt (and the same tokens fed) and `max_logit_abs_diff == 0` over every forward's
last-position logits (compared in fp32). A tolerance (`logit_tolerance` > 0) is only for devices whose kernels are not
deterministic; it is reported next to the flag. The resident row has no comparison (null).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tensorbend.cache.slots import CacheStats
from tensorbend.offload.generation import Generation


@dataclass(frozen=True)
class RunResult:
    """One policy run. `to_json()` keys (decode's numbers per decode token unless prefixed):

    model, policy, predictor (kind or null), cache_frac (slots / all routed experts),
    decode_tok_s, prefill_tok_s, stall_s_per_token (compute thread waiting for experts),
    bytes_read_per_token, demand_hit_rate (a needed expert READY when its layer asked; one still
    loading counts as a miss), wasted_prefetch_bytes (prefetched, never used; whole run),
    output_matches_resident (null for the resident row), max_logit_abs_diff, logit_tolerance,
    predictor_checkpoint, lookahead, pool, admission, foresight (oracle: forwards of routing it
    knows, null = all), link {name, bandwidth_MBps, latency_us, note}, io, decode, device,
    prefetch_extra, prefetch_backlog (null = unbounded), cache_slots, expert_bytes,
    tokens {prefill, decode}, prompts, prefill {stall_s_per_token, bytes_read_per_token,
    demand_hit_rate}, counters {CacheStats fields, whole run}, horizon (the cross-token
    predictor's checkpoint driving eviction and next-forward prefetches, or null),
    token_ahead_layers (with a horizon: next-forward MoE layers prefetched, else null),
    batch (sequences decoded together in lockstep; per-token numbers count every sequence's),
    predict_s_per_token (seconds inside the prediction hooks per decode token, measured in
    the runtime: Prefetcher, predictor, queueing and hints; null for the resident row),
    decode_predict_s_per_token (the same, counting only the calls of decode forwards: the
    share of a decode step), predict_queue_s_per_token (the part of predict_s_per_token spent
    handing forecasts, hints and prefetches to the cache and the loader),
    decode_predict_exposed_s_per_token (of decode_predict_s_per_token, the seconds followed
    by no wait for an expert load in their MoE layer: the rest overlapped I/O, which on CPU
    does not make it free, `offload.hooks.PredictionHooks.settle`);
    decode_predict_score_s_per_token and decode_predict_queue_s_per_token (of
    decode_predict_s_per_token, the seconds scoring: kernels, model calls, `Prefetcher.score_s`;
    and the seconds handing forecasts, hints and prefetches over; the rest is Python glue);
    predict_calls (prediction hook calls in the whole run, both phases; null for resident);
    expert_compute (per token count T of an experts call: [T, calls, experts computed,
    (token, expert) pairs, seconds in the expert math]; null for resident); host_load {run,
    reference: {wall_s, own_cores, other_cores (average CPU cores other processes used over
    that pass; null where not measurable), cpus}} and host_busy (either pass had other_cores >
    host_load.BUSY_CORES: its tok/s are not reliable, and the link is scaled to the reference's
    layer time).
    io_cpu_s_per_token (CPU seconds of the I/O threads per decode token, `time.thread_time`
    around each load: victim search, the read's own CPU, on an emulated link also the
    wake-up from its timed wait, and bookkeeping; null for the resident row); oracle_beyond
    (oracle: its rule past its foresight, else null); time_model (the regime and
    what each cost is charged as, `offload.time_model.declare`). `cache.report.run_label`
    names a row.
    """

    model: str
    policy: str
    predictor: str | None
    cache_frac: float
    decode_tok_s: float | None
    prefill_tok_s: float | None
    stall_s_per_token: float
    bytes_read_per_token: float
    demand_hit_rate: float
    wasted_prefetch_bytes: int
    output_matches_resident: bool | None
    max_logit_abs_diff: float | None
    logit_tolerance: float
    predictor_checkpoint: str | None
    lookahead: str | None
    pool: str
    admission: str
    foresight: int | None
    link: dict
    io: str
    decode: str
    device: str
    prefetch_extra: int
    prefetch_backlog: float | None
    cache_slots: int
    expert_bytes: int
    tokens: dict
    prompts: int
    prefill: dict
    counters: dict
    horizon: str | None = None
    token_ahead_layers: int | None = None
    batch: int = 1
    predict_s_per_token: float | None = None
    decode_predict_s_per_token: float | None = None
    predict_queue_s_per_token: float | None = None
    decode_predict_exposed_s_per_token: float | None = None
    decode_predict_score_s_per_token: float | None = None
    decode_predict_queue_s_per_token: float | None = None
    oracle_beyond: str | None = None
    predict_calls: int | None = None
    expert_compute: list | None = None
    host_load: dict | None = None
    host_busy: bool = False
    time_model: dict | None = None
    io_cpu_s_per_token: float | None = None

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        if out["prefetch_backlog"] is not None and math.isinf(out["prefetch_backlog"]):
            out["prefetch_backlog"] = None
        return out


def compare(gen: Generation, ref: Generation, tolerance: float = 0.0) -> tuple[bool, float | None]:
    """(matches, max |logit difference|); the difference is None when the tokens differ."""
    same_tokens = len(gen.logits) == len(ref.logits) and all(
        a.argmax_ids == b.argmax_ids and a.fed_ids == b.fed_ids
        for a, b in zip(gen.decoded, ref.decoded, strict=True)
    )
    if not same_tokens:
        return False, None
    diff = max(
        (float((a - b).abs().max()) for a, b in zip(gen.logits, ref.logits, strict=True)),
        default=0.0,
    )
    return diff <= tolerance, diff


def phase_numbers(stats: CacheStats, tokens: int) -> dict:
    n = max(1, tokens)
    return {
        "stall_s_per_token": stats.stall_s / n,
        "bytes_read_per_token": stats.bytes_read / n,
        "demand_hit_rate": stats.demand_hit_rate,
        "io_cpu_s_per_token": stats.io_cpu_s / n,
    }
