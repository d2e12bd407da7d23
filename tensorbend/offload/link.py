"""The emulated transfer link: bandwidth + latency caps that reproduce a real system's ratio.

Usage:
    >>> link = parse_link("40MB/s,20us", layer_s=1e-3, expert_bytes=1000)
    >>> round(link.seconds(40_000), 6)              # 1 ms of bandwidth + 20 us latency
    0.00102
    >>> real = parse_link("h100-pcie5-kimi", layer_s=1e-3, expert_bytes=98_304)
    >>> round(real.seconds(98_304) / 1e-3, 2)       # one expert = 2.33 resident MoE layers
    2.33
    >>> parse_link("h100-pcie5-kimi", 1e-3, 98_304, speedup=4).name
    'h100-pcie5-kimi x4'

`ExpertStore.read_into` books every read on one wire (`Link.seconds(nbytes)` each, serialised
over all I/O threads), so a CPU machine reproduces the transfer/compute ratio of a real
system: `h100-pcie5-kimi` keeps the ratio of one Kimi-K2.5-sized expert transfer over PCIe
Gen5 x16 to one H100 MoE layer of batch-1 decode compute (see `real_link`), scaled to this
machine's measured resident compute time per MoE layer. `speedup` makes any link N times faster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tensorbend.errors import StoreError

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


@dataclass(frozen=True)
class Link:
    """An emulated transfer link; `bandwidth_Bps=None` means uncapped (disk speed)."""

    bandwidth_Bps: float | None = None
    latency_s: float = 0.0
    name: str = "none"
    note: str = ""

    def __post_init__(self) -> None:
        if self.bandwidth_Bps is not None and self.bandwidth_Bps <= 0:
            raise StoreError(f"link bandwidth: expected > 0 bytes/s, found {self.bandwidth_Bps}")
        if self.latency_s < 0:
            raise StoreError(f"link latency: expected >= 0 s, found {self.latency_s}")

    def seconds(self, nbytes: int) -> float:
        bw = self.bandwidth_Bps
        return self.latency_s + (nbytes / bw if bw else 0.0)

    def to_dict(self) -> dict:
        mbps = None if self.bandwidth_Bps is None else round(self.bandwidth_Bps / 1e6, 3)
        return {
            "name": self.name,
            "bandwidth_MBps": mbps,
            "latency_us": round(self.latency_s * 1e6, 2),
            "note": self.note,
        }


def real_link(layer_s: float, expert_bytes: int) -> Link:
    """The `h100-pcie5-kimi` link: PCIe Gen5 x16 feeding an H100, Kimi-K2.5-sized experts.

    Real system (per MoE layer, batch-1 decode): one routed expert is 3 x 7168 x 2048 weights
    in INT4 + bf16 scales per 32 (~24.8 MB), over ~52 GB/s effective PCIe Gen5 x16 plus ~10 us
    per transfer: ~0.49 ms. The H100 computes a whole MoE layer (8 experts INT4, the shared
    expert and MLA attention in bf16, ~490 MB of HBM reads at ~2.35 TB/s effective) in ~0.21 ms.
    We keep both ratios (expert transfer / layer compute, latency / layer compute) and scale
    them to this machine's measured resident compute time per MoE layer `layer_s`.
    """
    real_expert_bytes = 3 * 7168 * 2048 * 0.5625
    real_bw, real_lat = 52e9, 10e-6
    real_layer_s = 490e6 / 2.35e12
    ratio = (real_expert_bytes / real_bw) / real_layer_s
    bw = expert_bytes / (ratio * layer_s)
    lat = real_lat / real_layer_s * layer_s
    return Link(
        bw,
        lat,
        "h100-pcie5-kimi",
        f"expert transfer = {ratio:.2f} x resident MoE-layer compute "
        f"({layer_s * 1e3:.3f} ms here), latency = {real_lat / real_layer_s:.3f} x",
    )


def check_link(text: str) -> None:
    """Raise StoreError unless `text` is a link `parse_link` accepts (no calibration needed)."""
    _match_link(text)


def parse_link(text: str, layer_s: float, expert_bytes: int, speedup: float = 1.0) -> Link:
    """`none`, `h100-pcie5-kimi` (scaled to this machine), or `BW[,LAT]` like `40MB/s,20us`.

    `speedup` > 1 makes the link that many times faster (bandwidth x speedup, latency / speedup):
    the same system with a faster interconnect relative to compute."""
    name, m = _match_link(text)
    if name == "none":
        return Link()
    if name == "h100-pcie5-kimi":
        link = real_link(layer_s, expert_bytes)
    else:
        lat = float(m.group(3) or 0) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 0}[m.group(4)]
        link = Link(float(m.group(1)) * _UNITS[m.group(2)], lat, name)
    if speedup == 1.0:
        return link
    assert speedup > 0, speedup
    return Link(
        link.bandwidth_Bps * speedup,
        link.latency_s / speedup,
        f"{link.name} x{speedup:g}",
        f"{link.note}; {speedup:g}x faster".lstrip("; "),
    )


def _match_link(text: str):
    name = text.strip().lower()
    if name in ("none", "", "h100-pcie5-kimi"):
        return name or "none", None
    num = r"(\d+(?:\.\d*)?|\.\d+)"  # 40, 40., 0.5, .5; not ".", "1.2.3" or "1..2"
    m = re.fullmatch(num + r"\s*([kmg]?)b/s(?:\s*,\s*" + num + r"\s*(us|ms|s))?", name)
    if not m or float(m.group(1)) <= 0:
        raise StoreError(
            f"--link {text!r}: expected none, h100-pcie5-kimi, or BANDWIDTH[,LATENCY] with "
            f"decimal numbers like 40MB/s,20us, found {'a zero bandwidth' if m else 'neither'}; "
            "fix the --link value"
        )
    return name, m
