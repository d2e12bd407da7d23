"""Hardware profiles for the simulator: fast memory, compute, and the link experts arrive over.

Usage:
    >>> hw = get_hardware("h100-pcie5")
    >>> round(hw.link_bandwidth.value / 1e9, 1), hw.link_bandwidth.source[:25]
    (52.8, 'NVIDIA/nvbandwidth issue ')
    >>> sorted(HARDWARE) == sorted(HARDWARE_NAMES)
    True

Every number carries its source: a datasheet or product page, a published measurement, a
derivation from such numbers (said so), or an explicit assumption (said so, and overridable
through a calibration file; see costs.py). The simulator turns these into seconds:
  - compute of a layer = bytes it reads / (memory bandwidth x `mem_efficiency`), or FLOPs /
    `peak_flops` when that is larger (prefill, big batches);
  - an expert transfer = `link_latency` + bytes / `link_bandwidth`, on one link with one queue
    (transfers are serialised on the wire; `io_slots` may be in flight, overlapping latency).
Fast-memory capacity bounds the expert cache (what is left after the resident weights).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, get_args

from tensorbend.errors import TensorbendError

HardwareName = Literal[
    "h100-pcie5", "rtx4090-pcie4", "dgx-spark", "apple-m-ssd", "nvme-gen4", "nvme-gen5"
]
HARDWARE_NAMES = get_args(HardwareName)

_H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM5), https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_ASSUME_EFF = (
    "assumption: batch-1 decode kernels stream weights at ~70% of peak memory bandwidth "
    "(override with a calibration file)"
)
_ASSUME_LAT_PCIE = (
    "assumption: ~10 us per copy (launch + DMA setup), the figure docs/guide/offload.md uses"
)
_ASSUME_LAT_NVME = "assumption: ~60 us per read (NVMe random-read latency order; a multi-MB expert read is bandwidth-bound)"


@dataclass(frozen=True)
class Number:
    """A value with its unit and where it comes from."""

    value: float
    unit: str
    source: str


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    mem_bandwidth: Number  # fast memory (HBM / GDDR / unified LPDDR), B/s
    mem_capacity: Number  # bytes of fast memory
    peak_flops: Number  # dense bf16 tensor FLOP/s (prefill, large batches)
    link_bandwidth: Number  # effective B/s of the path experts are loaded over
    link_latency: Number  # s per transfer
    mem_efficiency: Number  # fraction of mem_bandwidth that weight-streaming kernels reach
    io_slots: int = 2  # transfers in flight on the one link (the runtime's I/O threads)

    def to_json(self) -> dict:
        return asdict(self)


def get_hardware(name: str) -> Hardware:
    if name not in HARDWARE:
        raise TensorbendError(f"--hardware {name!r}: expected one of {', '.join(HARDWARE_NAMES)}")
    return HARDWARE[name]


def _h100(name: str, description: str, link_bw: Number, link_lat: Number) -> Hardware:
    return Hardware(
        name=name,
        description=description,
        mem_bandwidth=Number(3.35e12, "B/s", f"{_H100}: GPU memory bandwidth 3.35 TB/s"),
        mem_capacity=Number(80e9, "B", f"{_H100}: GPU memory 80 GB"),
        peak_flops=Number(
            989e12, "FLOP/s", f"{_H100}: BF16 tensor 1,979 TFLOPS with sparsity, half dense"
        ),
        link_bandwidth=link_bw,
        link_latency=link_lat,
        mem_efficiency=Number(0.7, "fraction", _ASSUME_EFF),
    )


_NVME_GEN4 = Number(
    7.45e9,
    "B/s",
    "Samsung 990 PRO data sheet: sequential read up to 7,450 MB/s (PCIe 4.0 x4), "
    "https://semiconductor.samsung.com/consumer-storage/internal-ssd/990-pro/",
)
_NVME_GEN5 = Number(
    14.8e9,
    "B/s",
    "Samsung 9100 PRO data sheet: sequential read up to 14,800 MB/s (PCIe 5.0 x4), "
    "https://semiconductor.samsung.com/consumer-storage/internal-ssd/9100-pro/",
)
_NVME_LAT = Number(60e-6, "s", _ASSUME_LAT_NVME)

HARDWARE: dict[str, Hardware] = {
    "h100-pcie5": _h100(
        "h100-pcie5",
        "H100 SXM5 80 GB; experts in host DRAM, loaded over PCIe Gen5 x16",
        Number(
            52.8e9,
            "B/s",
            "NVIDIA/nvbandwidth issue #24 (https://github.com/NVIDIA/nvbandwidth/issues/24): "
            "52.8 GB/s measured copy-engine bandwidth over PCIe Gen5 x16 on H100 (64 GB/s raw, PCI-SIG)",
        ),
        Number(10e-6, "s", _ASSUME_LAT_PCIE),
    ),
    "rtx4090-pcie4": Hardware(
        name="rtx4090-pcie4",
        description="GeForce RTX 4090 24 GB; experts in host DRAM, loaded over PCIe Gen4 x16",
        mem_bandwidth=Number(
            1008e9,
            "B/s",
            "NVIDIA Ada GPU architecture whitepaper, RTX 4090: 1,008 GB/s GDDR6X, "
            "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf",
        ),
        mem_capacity=Number(24e9, "B", "same whitepaper: 24 GB GDDR6X"),
        peak_flops=Number(
            165.2e12, "FLOP/s", "same whitepaper: peak BF16 tensor 165.2 TFLOPS (dense)"
        ),
        link_bandwidth=Number(
            25e9,
            "B/s",
            "ZaidQureshi/bam issue #54 (https://github.com/ZaidQureshi/bam/issues/54): 25 GB/s "
            "measured peak over PCIe Gen4 x16 (32 GB/s raw)",
        ),
        link_latency=Number(10e-6, "s", _ASSUME_LAT_PCIE),
        mem_efficiency=Number(0.7, "fraction", _ASSUME_EFF),
    ),
    "dgx-spark": Hardware(
        name="dgx-spark",
        description="DGX Spark (GB10, 128 GB unified LPDDR5x); experts on its NVMe Gen5 SSD",
        mem_bandwidth=Number(
            273e9,
            "B/s",
            "NVIDIA DGX Spark product page / hardware guide: 128 GB LPDDR5x, 273 GB/s, "
            "https://www.nvidia.com/en-us/products/workstations/dgx-spark/",
        ),
        mem_capacity=Number(128e9, "B", "same page: 128 GB unified system memory"),
        peak_flops=Number(
            125e12,
            "FLOP/s",
            "derived: 1 PFLOP FP4 with sparsity (same page) -> 500 dense FP4 -> 250 FP8 -> 125 BF16 "
            "(Blackwell halves per precision step)",
        ),
        link_bandwidth=_NVME_GEN5,
        link_latency=_NVME_LAT,
        mem_efficiency=Number(0.7, "fraction", _ASSUME_EFF),
    ),
    "apple-m-ssd": Hardware(
        name="apple-m-ssd",
        description="Apple M4 Max (40-core GPU, 128 GB unified memory); experts on the internal SSD",
        mem_bandwidth=Number(
            546e9,
            "B/s",
            "Apple MacBook Pro (M4 Max) tech specs: 546 GB/s memory bandwidth, "
            "https://www.apple.com/macbook-pro/specs/",
        ),
        mem_capacity=Number(128e9, "B", "same page: up to 128 GB unified memory"),
        peak_flops=Number(
            18.4e12,
            "FLOP/s",
            "derived: 40 GPU cores x 128 FP32 ALUs x 2 FLOP x ~1.8 GHz (Apple publishes no TFLOPS)",
        ),
        link_bandwidth=Number(
            7.3e9,
            "B/s",
            "The Verge, M5 Max MacBook Pro review (2026): 13.6 GB/s read, 86% faster than the "
            "M4 Max's SSD -> ~7.3 GB/s",
        ),
        link_latency=_NVME_LAT,
        mem_efficiency=Number(0.7, "fraction", _ASSUME_EFF),
    ),
    "nvme-gen4": _h100(
        "nvme-gen4",
        "H100 SXM5 80 GB; experts on one NVMe Gen4 x4 SSD (GPUDirect Storage path)",
        _NVME_GEN4,
        _NVME_LAT,
    ),
    "nvme-gen5": _h100(
        "nvme-gen5",
        "H100 SXM5 80 GB; experts on one NVMe Gen5 x4 SSD (GPUDirect Storage path)",
        _NVME_GEN5,
        _NVME_LAT,
    ),
}
