"""What each simulated action costs in seconds: a hardware x geometry profile, or a calibration.

Usage:
    >>> from tensorbend.timing.hardware import get_hardware
    >>> from tensorbend.simulate.geometry import get_geometry
    >>> c = Costs.from_profiles(get_hardware("h100-pcie5"), get_geometry("kimi-k2.5"), unit_scale=1.0)
    >>> round(c.transfer_s() * 1e3, 3), round((c.attn_s(1) + 8 * c.expert_s(1)) * 1e3, 3)
    (0.479, 0.211)

From profiles, compute streams weights: a step reading B bytes for T tokens takes
max(B / (mem_bandwidth x mem_efficiency), 2 x params x T / peak_flops). Per MoE layer the
simulator charges `attn_s(T)` before the router (attention, shared experts, router weights) and
`expert_s(T_e)` per routed expert used by T_e tokens; `forward_s(T)` once per forward (dense
layers, LM head). A transfer is `link_latency + unit_bytes / link_bandwidth`.

A calibration (JSON, `Calibration`; python -m bench.simulate_validate measures one on this machine)
replaces all of these with measured values: x(T) = x_decode + x_per_token * (T - 1).
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from tensorbend.errors import TensorbendError
from tensorbend.simulate.geometry import BYTES_PER_WEIGHT, Geometry
from tensorbend.timing.hardware import Hardware


@dataclass(frozen=True)
class Calibration:
    """Measured costs of one machine and model (seconds, bytes); written as JSON."""

    expert_bytes: int
    link_bandwidth_Bps: float
    link_latency_s: float
    attn_s: float  # per MoE layer before the router, one decode token
    expert_s: float  # per routed expert computed, one decode token
    forward_s: float  # per forward outside the MoE layers, one decode token
    attn_s_per_token: float = 0.0  # extra per additional token of a forward (prefill)
    expert_s_per_token: float = 0.0
    forward_s_per_token: float = 0.0
    predict_s: float = 0.0  # one within-token predictor call (a target layer's prediction)
    forecast_s: float = 0.0  # one cross-token forecast (the horizon's, once per forward)
    miss_s: float = 0.0  # compute-thread time per demand miss (queueing the load, waking up)
    io_slots: int = 2
    source: str = ""

    def save(self, path: Path) -> Path:
        from tensorbend.atomic import atomic_write_text

        return atomic_write_text(path, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> Calibration:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TensorbendError(f"calibration {path}: unreadable JSON ({e})") from e
        how = "python -m bench.simulate_validate writes one"
        if not isinstance(d, dict):
            raise TensorbendError(
                f"calibration {path}: expected a JSON object of numbers (the fields of "
                f"tensorbend.simulate.costs.Calibration), found a {type(d).__name__}; {how}"
            )
        names = {f.name for f in fields(cls)}
        required = [f.name for f in fields(cls) if f.default is MISSING]
        missing = [n for n in required if n not in d]
        if missing:
            raise TensorbendError(
                f"calibration {path}: missing {missing}; expected the keys of "
                f"tensorbend.simulate.costs.Calibration ({how})"
            )
        for k in sorted(names & set(d) - {"source"}):
            v, positive = d[k], k in ("expert_bytes", "link_bandwidth_Bps", "io_slots")
            number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not number or v < 0 or (positive and v <= 0):
                raise TensorbendError(
                    f"calibration {path}: {k} = {v!r}; expected a finite number "
                    f"{'> 0' if positive else '>= 0'} (seconds, bytes or counts); fix the file "
                    f"or measure it again ({how})"
                )
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class Costs:
    unit_bytes: int  # bytes of one simulated expert (a geometry expert x unit_scale)
    link_bandwidth: float
    link_latency: float
    io_slots: int
    predict_s: float
    miss_s: float
    _attn: tuple[float, float]  # (bytes or seconds, FLOPs or seconds per extra token)
    _expert: tuple[float, float]
    _forward: tuple[float, float]
    _bw: float | None  # effective memory bandwidth; None: calibrated seconds
    _flops: float | None
    forecast_s: float = 0.0

    @classmethod
    def from_profiles(
        cls, hw: Hardware, geo: Geometry, unit_scale: float, dtype: str = "native"
    ) -> Costs:
        unit_bytes = int(geo.expert_bytes(dtype) * unit_scale)
        other = BYTES_PER_WEIGHT[geo.other_dtype]
        return cls(
            unit_bytes=unit_bytes,
            link_bandwidth=hw.link_bandwidth.value,
            link_latency=hw.link_latency.value,
            io_slots=hw.io_slots,
            predict_s=0.0,
            miss_s=0.0,
            _attn=(geo.layer_static_bytes(), 2.0 * geo.layer_static_params()),
            _expert=(unit_bytes, 2.0 * geo.expert_params() * unit_scale),
            _forward=(geo.forward_static_bytes(), 2.0 * geo.forward_static_bytes() / other),
            _bw=hw.mem_bandwidth.value * hw.mem_efficiency.value,
            _flops=hw.peak_flops.value,
        )

    @classmethod
    def from_calibration(cls, cal: Calibration, unit_scale: float = 1.0) -> Costs:
        return cls(
            unit_bytes=int(cal.expert_bytes * unit_scale),
            link_bandwidth=cal.link_bandwidth_Bps,
            link_latency=cal.link_latency_s,
            io_slots=cal.io_slots,
            predict_s=cal.predict_s,
            forecast_s=cal.forecast_s,
            miss_s=cal.miss_s,
            _attn=(cal.attn_s, cal.attn_s_per_token),
            _expert=(cal.expert_s * unit_scale, cal.expert_s_per_token * unit_scale),
            _forward=(cal.forward_s, cal.forward_s_per_token),
            _bw=None,
            _flops=None,
        )

    @property
    def calibrated(self) -> bool:
        return self._bw is None

    def transfer_s(self) -> float:
        return self.link_latency + self.wire_s()

    def wire_s(self) -> float:
        return self.unit_bytes / self.link_bandwidth

    def attn_s(self, T: int) -> float:
        return self._time(self._attn, T)

    def expert_s(self, T: int) -> float:
        return self._time(self._expert, T)

    def forward_s(self, T: int) -> float:
        return self._time(self._forward, T)

    def to_json(self) -> dict:
        return {
            "unit_bytes": self.unit_bytes,
            "transfer_s": self.transfer_s(),
            "decode_layer_s": self.attn_s(1),
            "decode_expert_s": self.expert_s(1),
            "decode_forward_s": self.forward_s(1),
            "link_bandwidth_Bps": self.link_bandwidth,
            "link_latency_s": self.link_latency,
            "io_slots": self.io_slots,
            "predict_s": self.predict_s,
            "forecast_s": self.forecast_s,
            "miss_s": self.miss_s,
            "calibrated": self.calibrated,
        }

    def _time(self, c: tuple[float, float], T: int) -> float:
        if self._bw is None:
            return c[0] + c[1] * (T - 1)
        return max(c[0] / self._bw, c[1] * T / self._flops)
