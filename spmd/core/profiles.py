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
    view_overhead_s: float = 0.0  # a view launches nothing, but an eager CPU run still dispatches it
    # Around the graph, once per call, the same for every plan (so in `Plan.predicted_step_s`, not in the
    # ILP objective): the compiled module's Python wrapper per call and per tensor argument, and in a
    # training step the autograd Function and engine, fixed and per tensor they handle (each trainable
    # parameter's gradient and each activation saved for backward).
    call_overhead_s: float = 0.0
    arg_overhead_s: float = 0.0
    backward_overhead_s: float = 0.0
    autograd_tensor_overhead_s: float = 0.0
    # the fraction of `flops` that the fused attention kernels reach (they are priced by their matmul FLOPs)
    attention_efficiency: float = 1.0

    def __post_init__(self):
        if self.flops <= 0 or self.memory_bandwidth <= 0:
            raise ValueError(f"DeviceProfile {self.name}: flops and bandwidth must be > 0")
        if not 0 < self.attention_efficiency <= 1:
            raise ValueError(f"DeviceProfile {self.name}: attention_efficiency must be in (0, 1]")
        for f in _OVERHEADS:
            if getattr(self, f) < 0:
                raise ValueError(f"DeviceProfile {self.name}: {f} must be >= 0")

    def scaled(self, share: float) -> "DeviceProfile":
        """This device when a rank gets only `share` of it (more ranks than cores): every rate times
        `share`, every fixed cost divided by it."""
        if share >= 1.0:
            return self
        return DeviceProfile(f"{self.name}x{share:g}", self.flops * share, self.memory_bandwidth * share,
                             self.op_overhead_s / share, self.memory_bytes, self.source,
                             attention_efficiency=self.attention_efficiency,
                             **{f: getattr(self, f) / share for f in _OVERHEADS if f != "op_overhead_s"})


# fixed costs of a DeviceProfile (seconds; scaled together, saved in profile files)
_OVERHEADS = ("op_overhead_s", "view_overhead_s", "call_overhead_s", "arg_overhead_s", "backward_overhead_s",
              "autograd_tensor_overhead_s")


LINKS: dict[str, LinkProfile] = {
    p.name: p
    for p in (
        LinkProfile("nvlink", 5e-6, 150e9, "H100 SXM NVLink4: 450 GB/s/direction; NCCL all_reduce busbw ~360 GB/s on 8 GPUs; "
                    "derated to 150 GB/s for mid-size messages (nccl-tests, NVIDIA DGX H100 guide)"),
        LinkProfile("infiniband", 15e-6, 25e9, "NDR InfiniBand 400 Gb/s = 50 GB/s per NIC; ~25 GB/s busbw achieved across nodes "
                    "(nccl-tests on DGX H100 SuperPOD)"),
        # gloo on CPU, 2026-11-22 on this 2-core AMD EPYC VM: `python -m spmd.tools.calibrate` (the
        # runtime's functional collectives on dim 0, 4 KiB..8 MiB, each call after 2 ms of compute as
        # inside a step, mean of 15 less the slowest 10%), the median of three quiet runs per size, fitted.
        # Back to back (--gap-ms 0) an all_reduce costs ~0.3-0.45 ms; after compute 1-2.5 ms (bimodal).
        LinkProfile("gloo", 1.2e-3, 1.2e9,
                    "measured here: spmd.tools.calibrate, 2 processes with a core each, each call after 2 ms "
                    "of compute, median of 3 quiet runs fitted (all_reduce 1.2 ms at 4 KiB, 8.8 ms at 8 MiB; "
                    "fit error <= 24%, all_to_all 57%); bimodal, 0.3-2.5 ms at any size (bench/results_predict.md)",
                    (("all_gather", 0.95e-3, 1.1e9), ("reduce_scatter", 1.3e-3, 0.6e9),
                     ("all_to_all", 0.5e-3, 0.95e9))),
        LinkProfile("gloo-oversubscribed", 4.1e-3, 1.0e9,
                    "measured here: the same with 4 processes on 2 cores, mesh (dp=2, tp=2), both axes, median of "
                    "2 runs fitted (all_reduce 3-7 ms even at 4 KiB; fit error <= 22%)",
                    (("all_gather", 4.0e-3, 0.5e9), ("reduce_scatter", 4.1e-3, 0.47e9),
                     ("all_to_all", 3.2e-3, 0.76e9))),
    )
}

DEVICES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile("h100", 989e12, 3.35e12, 5e-6, 80e9, "H100 SXM datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3"),
        DeviceProfile("h200", 989e12, 4.8e12, 5e-6, 141e9, "H200 SXM datasheet: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e"),
        DeviceProfile("a100", 312e12, 2.0e12, 5e-6, 80e9, "A100 SXM 80GB datasheet: 312 TFLOP/s bf16, 2.0 TB/s"),
        # Per-call costs: measured(compiled step) - measured(its generated graphs called directly), 7 models
        # (4-96 parameters, 6-145 saved values), one process, fitted by least squares on relative errors:
        # forward 7-55 us, training 80-900 us (residuals +-30%; large activations pay more, gpt-medium's
        # training step 1.6 ms against ~0.3 predicted).
        DeviceProfile("cpu", 100e9, 70e9, 6e-6, 24e9,
                      "measured here, one thread per rank: fp32 matmul 99-103 GFLOP/s at n>=256, streaming add "
                      "68-71 GB/s with 2 ranks at once (spmd.tools.calibrate; one rank alone 56-86 GB/s on "
                      "64K-2M elements), ~6 us per small ATen op, ~3 us per view, per call 6.5 us + 0.5 us per "
                      "argument, per training step 40 us + 2.3 us per parameter and saved value; flash attention "
                      "30-46 GFLOP/s "
                      "(bench/results_predict.md)", 3e-6,
                      call_overhead_s=6.5e-6, arg_overhead_s=0.5e-6, backward_overhead_s=40e-6,
                      autograd_tensor_overhead_s=2.3e-6,
                      # the _for_cpu flash kernels, causal, one thread: 30-46 GFLOP/s forward and backward at
                      # seq 64-512 and head dim 64 (15-22 at head dim 16, 60 at seq 1024), mm 100-109
                      attention_efficiency=0.4),
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


# ---------------------------------------------------------------------------------------------------
# Profile files: what `spmd.tools.calibrate` measured, for the planner to load
# (`MeshSpec.from_profile`). JSON, with the measured points kept for reference.

PROFILE_SCHEMA = "spmd-profile"
PROFILE_VERSION = 1


@dataclass(frozen=True, slots=True)
class Profile:
    """A calibrated profile: one link per mesh axis name, the device, and what they were fitted from."""

    links: dict[str, LinkProfile]
    device: DeviceProfile
    points: dict  # free-form measured points (JSON-able), for reference only
    meta: dict  # backend, world size, mesh, date, command: for reference only

    def __post_init__(self):
        if not self.links:
            raise ValueError("Profile: no links")


def _link_to_json(link: LinkProfile) -> dict:
    return {"name": link.name, "latency_s": link.latency_s, "bandwidth": link.bandwidth, "source": link.source,
            "per_collective": {k: {"latency_s": lat, "bandwidth": bw} for k, lat, bw in link.per_collective}}


def _link_from_json(d: dict) -> LinkProfile:
    per = tuple((k, float(v["latency_s"]), float(v["bandwidth"])) for k, v in d.get("per_collective", {}).items())
    return LinkProfile(d["name"], float(d["latency_s"]), float(d["bandwidth"]), d.get("source", ""), per)


def save_profile(path: str, links: dict[str, LinkProfile], device: DeviceProfile, points: dict | None = None,
                 meta: dict | None = None) -> None:
    """Write `links` (mesh axis name -> link) and `device` as a versioned JSON profile."""
    import json

    doc = {"schema": PROFILE_SCHEMA, "version": PROFILE_VERSION, "meta": dict(meta or {}),
           "links": {axis: _link_to_json(link) for axis, link in links.items()},
           "device": {"name": device.name, "flops": device.flops, "memory_bandwidth": device.memory_bandwidth,
                      "memory_bytes": device.memory_bytes, "source": device.source,
                      "attention_efficiency": device.attention_efficiency,
                      **{f: getattr(device, f) for f in _OVERHEADS}},
           "points": points or {}}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def load_profile(path: str) -> Profile:
    """Read a profile written by `save_profile` (raises ValueError on another schema or version)."""
    import json

    with open(path) as f:
        doc = json.load(f)
    if doc.get("schema") != PROFILE_SCHEMA or doc.get("version") != PROFILE_VERSION:
        raise ValueError(f"{path}: not a {PROFILE_SCHEMA} v{PROFILE_VERSION} file "
                         f"(schema {doc.get('schema')!r}, version {doc.get('version')!r}); re-run calibration")
    d = doc["device"]
    # files from before a fixed cost was measured leave it at 0 (not priced), op_overhead_s excepted
    device = DeviceProfile(d["name"], float(d["flops"]), float(d["memory_bandwidth"]), float(d["op_overhead_s"]),
                           float(d["memory_bytes"]), d.get("source", ""),
                           attention_efficiency=float(d.get("attention_efficiency", 1.0)),
                           **{f: float(d[f]) for f in _OVERHEADS if f in d and f != "op_overhead_s"})
    links = {axis: _link_from_json(link) for axis, link in doc["links"].items()}
    return Profile(links, device, doc.get("points", {}), doc.get("meta", {}))
