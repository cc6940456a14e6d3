"""Device and link profiles: the numbers the cost model believes about the hardware.

Data, with the source of each number. A link is the alpha-beta model of one mesh axis:
`time(collective) = latency * steps + bytes_on_the_wire / bandwidth`, where `bandwidth` is the bus
bandwidth one rank sustains (NCCL's "busbw" convention), so the ring factors live in `comm.py`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LinkProfile:
    name: str
    latency_s: float  # per collective (alpha)
    bandwidth: float  # bytes/s per rank (beta = 1/bandwidth)
    source: str = ""
    # (kind, latency_s, bandwidth) where a backend's collective departs from the default: gloo's
    # reduce_scatter, for one, is much slower than its all_reduce.
    per_collective: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self):
        if self.latency_s < 0 or self.bandwidth <= 0:
            raise ValueError(f"LinkProfile {self.name}: latency must be >= 0 and bandwidth > 0")
        for kind, lat, bw in self.per_collective:
            if lat < 0 or bw <= 0:
                raise ValueError(f"LinkProfile {self.name}: bad numbers for {kind}")

    def alpha_beta(self, kind: str) -> tuple[float, float]:
        """(latency, bandwidth) of collective `kind` on this link."""
        for k, lat, bw in self.per_collective:
            if k == kind:
                return lat, bw
        return self.latency_s, self.bandwidth


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    name: str
    flops: float  # peak FLOP/s at the training dtype (fp32 on CPU, bf16 dense on GPUs)
    memory_bandwidth: float  # bytes/s
    op_overhead_s: float  # fixed cost per launched op (kernel launch / dispatcher)
    memory_bytes: float
    source: str = ""

    def __post_init__(self):
        if self.flops <= 0 or self.memory_bandwidth <= 0 or self.op_overhead_s < 0:
            raise ValueError(f"DeviceProfile {self.name}: flops and bandwidth must be > 0")

    def scaled(self, share: float) -> "DeviceProfile":
        """This device when a rank gets only `share` of it (more ranks than cores)."""
        if share >= 1.0:
            return self
        return DeviceProfile(f"{self.name}x{share:g}", self.flops * share, self.memory_bandwidth * share,
                             self.op_overhead_s / share, self.memory_bytes, self.source)


LINKS: dict[str, LinkProfile] = {
    p.name: p
    for p in (
        LinkProfile("nvlink", 5e-6, 150e9, "H100 SXM NVLink4: 450 GB/s/direction; NCCL all_reduce busbw ~360 GB/s on 8 GPUs; "
                    "derated to 150 GB/s for mid-size messages (nccl-tests, NVIDIA DGX H100 guide)"),
        LinkProfile("infiniband", 15e-6, 25e9, "NDR InfiniBand 400 Gb/s = 50 GB/s per NIC; ~25 GB/s busbw achieved across nodes "
                    "(nccl-tests on DGX H100 SuperPOD)"),
        LinkProfile("gloo", 3.3e-4, 1.5e9,
                    "measured here: gloo functional collectives, 2 processes with a core each, medians of 25 "
                    "at 4 KiB..8 MiB (all_reduce 0.34 ms at 4 KiB, 5.9 ms at 8 MiB); bimodal, see NOTES",
                    (("all_gather", 2.0e-4, 1.0e9), ("reduce_scatter", 5.0e-4, 0.75e9),
                     ("all_to_all", 2.0e-4, 2.0e9))),
        LinkProfile("gloo-oversubscribed", 5.0e-3, 1.1e9,
                    "measured here: the same with 4 processes on 2 cores (all_reduce 5-7 ms even at 4 KiB)",
                    (("all_gather", 3.3e-3, 0.8e9), ("reduce_scatter", 7.0e-3, 0.66e9),
                     ("all_to_all", 5.5e-4, 1.3e9))),
    )
}

DEVICES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile("h100", 989e12, 3.35e12, 5e-6, 80e9, "H100 SXM datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3"),
        DeviceProfile("h200", 989e12, 4.8e12, 5e-6, 141e9, "H200 SXM datasheet: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e"),
        DeviceProfile("a100", 312e12, 2.0e12, 5e-6, 80e9, "A100 SXM 80GB datasheet: 312 TFLOP/s bf16, 2.0 TB/s"),
        DeviceProfile("cpu", 100e9, 5e9, 6e-6, 24e9, "measured here, one thread: fp32 matmul 100-110 GFLOP/s at n>=256, "
                      "4-8 GB/s streaming, ~6 us per small ATen op"),
    )
}


def link_profile_for(name: str) -> LinkProfile:
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"unknown link profile {name!r}; known: {sorted(LINKS)}") from None


def device_profile_for(name: str) -> DeviceProfile:
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device profile {name!r}; known: {sorted(DEVICES)}") from None
