"""The time model of a run: its regime, and what each cost on the critical path is charged as.

Usage:
    >>> from tensorbend.timing.hardware import get_hardware
    >>> cost = PredictorCost(bytes_per_call=2.345e6, flops_per_call=4e6, kernels_per_call=4)
    >>> round(cost.call_s(get_hardware("h100-pcie5")) * 1e6, 3)  # 4 x 5 us + 2.345 MB / 2.345 TB/s
    21.0
    >>> charged(glue_s=4e-4, target_score_s=2e-5, slowdown=10.0)   # s x (2e-5 + 4e-4)
    0.0042

Regimes (`regime()`; every end-to-end JSON carries one `time_model` dict, tables print `label()`):
  real disk      `run --link none --io direct`: real compute, real reads; every second measured.
  host           `--link none` over the page cache, or a BW[,LAT] link: host seconds throughout.
  emulated link  `--link h100-pcie5-kimi`: experts computed at this host's speed, the link
                 scaled so that one expert transfer takes the target's transfer / layer ratio
                 times the host's measured layer time (cache.transfers.real_link). The compute
                 slowdown s = host layer time (the resident reference's) / target layer time
                 says how many host seconds stand for one target second; `slowdown_in_run` is
                 the same from the run's own decode seconds less stall and prediction (host
                 drift between repeats; it also holds the offload runtime's overhead). Prediction runs at host speed on the compute
                 thread; on the target it would cost modelled scoring + glue per decode token, in
                 host units s x that. Both are reported: `decode_tok_s` as run, and
                 `decode_tok_s_charged` = 1 / (1 / decode_tok_s - measured + charged).
  simulated      `tensorbend simulate`: event time on a hardware profile; each prediction call
                 charged `PredictorCost.call_s` on the target (simulate/runs.py), not zero.

The target's predictor cost (a model, stated; no GPU measured it): one call (one target layer's
prediction at batch 1; the horizon: one per forward) launches `kernels_per_call` kernels of
`LAUNCH_S` each and reads its weights once: kernels x LAUNCH_S + max(bytes / (memory bandwidth
x efficiency), FLOPs / peak FLOP/s), with the profile's numbers (timing/hardware.py). Bytes
and FLOPs come from the predictor's tensors (`PredictorCost.of`: every tensor it holds, spread
over its target layers; FLOPs = 2 per weight). The CPU-side part (queueing, hints, Python glue:
`decode_predict_s_per_token - decode_predict_score_s_per_token`) runs on the target's host CPU
as well: charged as measured here (assumption: a host CPU as fast as this one), so the target
pays modelled scoring + measured glue, and the emulation charges s x that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAUNCH_S = 5e-6  # assumption: one CUDA kernel launch on the critical path (~5 us, batch 1)
KERNELS_PER_CALL = 4  # assumption: gather/concat, matmul, activation + matmul, top-k
REGIMES = ("real disk", "host", "emulated link", "simulated")


@dataclass(frozen=True)
class PredictorCost:
    """One prediction call's work on a target: weight bytes read, FLOPs, kernel launches."""

    bytes_per_call: float
    flops_per_call: float
    kernels_per_call: int = KERNELS_PER_CALL

    @classmethod
    def of(cls, predictor, calls_per_forward: int) -> PredictorCost:
        """Every tensor `predictor` holds (attributes, lists, dicts, modules), spread over
        `calls_per_forward` calls: weights read once per call, 2 FLOPs per weight."""
        nbytes, nel = _tensor_sizes(predictor, set())
        n = max(1, calls_per_forward)
        return cls(nbytes / n, 2.0 * nel / n)

    def call_s(self, hw) -> float:
        """Seconds of one call on hardware profile `hw` (simulate.hardware.Hardware)."""
        bw = hw.mem_bandwidth.value * hw.mem_efficiency.value
        work = max(self.bytes_per_call / bw, self.flops_per_call / hw.peak_flops.value)
        return self.kernels_per_call * LAUNCH_S + work

    def to_json(self) -> dict:
        return {
            "bytes_per_call": round(self.bytes_per_call),
            "flops_per_call": round(self.flops_per_call),
            "kernels_per_call": self.kernels_per_call,
            "launch_s": LAUNCH_S,
        }


def charged(glue_s: float, target_score_s: float, slowdown: float) -> float:
    """Host seconds per token the emulation should have spent predicting: s x (the target's
    modelled scoring + the glue as measured); minus what it spent, it is what a token adds."""
    assert glue_s >= 0 and target_score_s >= 0 and slowdown > 0
    return round(slowdown * (target_score_s + glue_s), 12)


def regime(link_name: str, io: str, target: str | None) -> str:
    if target is not None:
        return "emulated link"
    if link_name == "none":
        return "real disk" if io == "direct" else "host"
    return "host"


def declare(
    run: dict, link, host_layer_s: float, costs: list[tuple[PredictorCost, int]], layers: int = 0
) -> dict:
    """The `time_model` dict of one run's JSON (`run`: RunResult.to_json() without it; `link`: a
    cache.transfers.Link; costs: (cost, calls per decode forward) of each predictor used;
    layers: MoE layers, for the host layer time this run itself computed at, `slowdown_in_run`:
    a decode forward's seconds less stall and prediction, per layer, over the target's)."""
    target = getattr(link, "target", None)
    out = {
        "regime": regime(link.name.split(" ")[0], run["io"], target),
        "target": target,
        "host_layer_ms": round(host_layer_s * 1e3, 6),
    }
    if target is None:
        out["prediction"] = "host seconds, as measured"
        return out
    from tensorbend.timing.hardware import get_hardware

    s = host_layer_s / link.target_layer_s
    hw = get_hardware(target)
    batch = max(1, run.get("batch") or 1)
    score_target = sum(c.call_s(hw) * n for c, n in costs) / batch
    measured = run.get("decode_predict_s_per_token") or 0.0
    glue = max(0.0, measured - (run.get("decode_predict_score_s_per_token") or 0.0))
    pay = charged(glue, score_target, s)
    tok_s = run.get("decode_tok_s")
    in_run = None
    if tok_s and layers:
        stall = run.get("stall_s_per_token") or 0.0
        in_run = batch * (1.0 / tok_s - stall - measured) / layers / link.target_layer_s
    out.update(
        target_layer_ms=round(link.target_layer_s * 1e3, 6),
        slowdown=round(s, 4),
        slowdown_in_run=None if in_run is None else round(in_run, 4),
        compute="experts at host speed (s host seconds = one target second)",
        transfers="link scaled: " + link.note,
        prediction=f"as run at host speed; charged: s x (modelled scoring on {target} + "
        "glue as measured)",
        predictor_costs=[dict(c.to_json(), calls_per_forward=n) for c, n in costs],
        target_predict_score_s_per_token=score_target,
        predict_measured_s_per_token=measured,
        predict_charged_s_per_token=pay,
        decode_tok_s_charged=None if not tok_s else 1.0 / (1.0 / tok_s - measured + pay),
    )
    return out


def label(tm: dict | None, before: str = "2026-12-05") -> str:
    """One line naming a row's regime and time model, for tables ('time model not recorded'
    for JSON written before `time_model` existed)."""
    if not tm:
        return f"time model not recorded (run before {before})"
    if tm["regime"] == "emulated link":
        return (
            f"emulated link (target {tm['target']}, s={tm['slowdown']:.1f}, prediction "
            "charged as run and at s x the target's modelled cost)"
        )
    if tm["regime"] == "simulated":
        return f"simulated ({tm['target']}, prediction charged {tm['prediction']})"
    return f"{tm['regime']} ({tm['prediction']})"


def regime_line(rows: list[dict]) -> str:
    """'regime: ...' for a table of run rows (the first offloaded row's time model; with an
    emulated link, the range of s the runs measured)."""
    tms = [r.get("time_model") for r in rows if r.get("policy") != "resident"]
    tms = [t for t in tms if t]
    line = "regime: " + label(tms[0] if tms else None)
    ss = [x for t in tms for x in t.get("slowdown_in_run_repeats") or [t.get("slowdown_in_run")]]
    ss = [x for x in ss if x]
    if ss:
        line += (
            f"; s in the runs themselves (decode time less stall and prediction, per layer; "
            f"runtime overhead and other processes included) {min(ss):.1f}-{max(ss):.1f}"
        )
    return line


def charged_tok_s(row: dict) -> float | None:
    """A row's decode tok/s with prediction charged as the target pays it (None: not an
    emulated link, or not recorded)."""
    return (row.get("time_model") or {}).get("decode_tok_s_charged")


def _tensor_sizes(obj, seen: set) -> tuple[int, int]:
    if id(obj) in seen:
        return 0, 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size(), obj.numel()
    if isinstance(obj, torch.nn.Module):
        items = list(obj.parameters()) + list(obj.buffers())
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    else:
        return 0, 0
    sizes = [_tensor_sizes(x, seen) for x in items]
    return sum(b for b, _ in sizes), sum(n for _, n in sizes)
