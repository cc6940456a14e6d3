"""Device and link profiles: the numbers the cost model believes about the hardware.

Data, with the source of each number. A link is the alpha-beta model of one mesh axis:
`time(collective) = latency * steps + bytes_on_the_wire / bandwidth`, where `bandwidth` is the bus
bandwidth one rank sustains (NCCL's "busbw" convention), so the ring factors live in `comm.py`.
"""
from __future__ import annotations

import dataclasses
import math
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
    # (kind, wire bytes, bandwidth): a collective of `kind` moves the wire bytes beyond that size at this
    # bandwidth instead (gloo past ~8 MiB per rank: its buffers leave the caches and its outputs are fresh
    # pages; measured 0.17 GB/s for all_gather there, against 0.9-1.1 below).
    large_messages: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self):
        if self.latency_s < 0 or self.bandwidth <= 0:
            raise ValueError(f"LinkProfile {self.name}: latency must be >= 0 and bandwidth > 0")
        for kind, lat, bw in self.per_collective:
            if lat < 0 or bw <= 0:
                raise ValueError(f"LinkProfile {self.name}: bad numbers for {kind}")
        for kind, size, bw in self.large_messages:
            if size < 0 or bw <= 0:
                raise ValueError(f"LinkProfile {self.name}: bad large-message numbers for {kind}")

    def large_message(self, kind: str) -> tuple[float, float] | None:
        """(wire bytes, bandwidth beyond them) of collective `kind`, or None: one bandwidth at any size."""
        for k, size, bw in self.large_messages:
            if k == kind:
                return size, bw
        return None

    def transfer_seconds(self, kind: str, wire) -> float:
        """Seconds collective `kind` spends moving `wire` bytes (a number or a sympy expression), latency
        aside: at its bandwidth, and past the large-message size at that bandwidth."""
        bandwidth = self.alpha_beta(kind)[1]
        large = self.large_message(kind)
        if large is None:
            return wire / bandwidth
        size, slow = large
        if isinstance(wire, (int, float)):
            beyond = max(0.0, wire - size)
        else:
            import sympy

            beyond = sympy.Max(0, wire - size)
        return wire / bandwidth + beyond * (1.0 / slow - 1.0 / bandwidth)

    def alpha_beta(self, kind: str) -> tuple[float, float]:
        """(latency, bandwidth) of collective `kind` on this link."""
        for k, lat, bw in self.per_collective:
            if k == kind:
                return lat, bw
        return self.latency_s, self.bandwidth


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    name: str
    flops: float  # FLOP/s a matmul reaches at the training dtype (fp32 on CPU, bf16 on GPUs), not the peak
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
    # The memory hierarchy as one op sees it (a CPU; GPU profiles keep the defaults: one bandwidth, no
    # faults). An op moving more than `cache_bytes` (inputs + outputs) streams at `dram_bandwidth`
    # instead of `memory_bandwidth`. An output of at least `fresh_page_bytes` is a fresh mapping from the
    # allocator (glibc mmaps every block of 32 MiB or more and unmaps it on free), and the kernel faults
    # its pages in as they are first written, at `page_fault_bandwidth` bytes/s, on top of the op.
    cache_bytes: float = math.inf
    dram_bandwidth: float | None = None  # None: memory_bandwidth
    fresh_page_bytes: float = math.inf
    page_fault_bandwidth: float = math.inf
    # Where a graph's kernels find their tensors colder than the loop that timed the rates above did (a
    # CPU: an op that fits in `cache_bytes` was timed with its tensors in cache, but in a graph they come
    # from other ops or from long ago, and the cores do not overlap that traffic with the work), the bytes
    # such an op moves at this bandwidth come on top of its work (`compute.cold_seconds`); inf: the
    # roofline alone (the larger of work and bytes, as on GPUs). Fitted by `measure.in_graph`.
    operand_bandwidth: float = math.inf
    # (ATen op name, seconds per output element): kernels whose work per element is many instructions
    # (exp, tanh, erf in gelu, a row's statistics, a random draw in dropout), measured on this device;
    # an op named here costs max(that x elements, its bytes / bandwidth) instead of its FLOPs / flops.
    element_seconds: tuple[tuple[str, float], ...] = ()
    # Ranks stepping together wait at every collective for the slowest of them. On a host whose cores run
    # at uneven speeds (a shared VM: here one core is often 5-30% slower than the other, and which one
    # changes), a step's compute takes this much longer than one rank's alone: the sum over segments of
    # the slowest rank's time / the mean rank's (`calibrate` measures it; 1: even cores, GPUs).
    # `in_lockstep` applies it for a mesh of several ranks.
    lockstep_slowdown: float = 1.0
    # The optimizer's step after backward (cost_model/compute.py `optimizer_cost`): its element-wise passes
    # over each parameter's local piece, its gradient and its state, at `optimizer_bandwidth` bytes/s of
    # element accesses for a piece of OPTIMIZER_LARGE_BYTES or more (its passes stream it from DRAM; None:
    # `dram_bandwidth`, else `memory_bandwidth`) and `optimizer_cached_bandwidth` for one of
    # OPTIMIZER_CACHED_BYTES or less (its later passes find it in cache; None: the same), between them
    # log-linearly; `optimizer_tensor_overhead_s` per parameter (AdamW's; its ops are launched once per
    # tensor); and `optimizer_call_overhead_s` once per step, whatever the parameters (`step()` itself: its
    # groups, its checks; a constant of the training step, in `Plan.wrapper_overhead_s`). The host profile
    # times torch's AdamW.
    optimizer_bandwidth: float | None = None
    optimizer_cached_bandwidth: float | None = None
    optimizer_tensor_overhead_s: float = 0.0
    optimizer_call_overhead_s: float = 0.0
    # torch's optimizers take their multi-tensor ("foreach") form by default here (on CUDA; on CPU they step
    # tensor by tensor): AdamW's then makes the square root of every second moment at once, one more copy of
    # the optimizer's state per parameter, alive beside the gradients and the state at the step
    # (cost_model/memory.py `optimizer_step_factor`; a memory probe: 1.25x the predicted peak without it)
    foreach_optimizer: bool = False

    def __post_init__(self):
        if self.flops <= 0 or self.memory_bandwidth <= 0:
            raise ValueError(f"DeviceProfile {self.name}: flops and bandwidth must be > 0")
        if not 0 < self.attention_efficiency <= 1:
            raise ValueError(f"DeviceProfile {self.name}: attention_efficiency must be in (0, 1]")
        for f in _OVERHEADS:
            if getattr(self, f) < 0:
                raise ValueError(f"DeviceProfile {self.name}: {f} must be >= 0")
        if self.cache_bytes <= 0 or self.fresh_page_bytes <= 0 or self.page_fault_bandwidth <= 0 or \
                self.operand_bandwidth <= 0 or \
                (self.dram_bandwidth is not None and self.dram_bandwidth <= 0):
            raise ValueError(f"DeviceProfile {self.name}: cache_bytes, fresh_page_bytes and the bandwidths must be > 0")
        if not self.lockstep_slowdown >= 1.0:
            raise ValueError(f"DeviceProfile {self.name}: lockstep_slowdown must be >= 1")
        for f in ("optimizer_bandwidth", "optimizer_cached_bandwidth"):
            v = getattr(self, f)
            if v is not None and not 0 < v < math.inf:
                raise ValueError(f"DeviceProfile {self.name}: {f} must be > 0 and finite (None: from the memory's)")
        for op, s in self.element_seconds:
            if s < 0:
                raise ValueError(f"DeviceProfile {self.name}: element_seconds of {op} must be >= 0")

    def seconds_per_element(self, op_name: str) -> float | None:
        for name, s in self.element_seconds:
            if name == op_name:
                return s
        return None

    def scaled(self, share: float) -> "DeviceProfile":
        """This device when a rank gets only `share` of it (more ranks than cores): every rate times
        `share`, every fixed cost divided by it."""
        if share >= 1.0:
            return self
        return DeviceProfile(f"{self.name}x{share:g}", self.flops * share, self.memory_bandwidth * share,
                             self.op_overhead_s / share, self.memory_bytes, self.source,
                             attention_efficiency=self.attention_efficiency, cache_bytes=self.cache_bytes,
                             dram_bandwidth=None if self.dram_bandwidth is None else self.dram_bandwidth * share,
                             fresh_page_bytes=self.fresh_page_bytes,
                             page_fault_bandwidth=self.page_fault_bandwidth * share,
                             operand_bandwidth=self.operand_bandwidth * share,
                             element_seconds=tuple((op, s / share) for op, s in self.element_seconds),
                             lockstep_slowdown=self.lockstep_slowdown,
                             optimizer_bandwidth=None if self.optimizer_bandwidth is None
                             else self.optimizer_bandwidth * share,
                             optimizer_cached_bandwidth=None if self.optimizer_cached_bandwidth is None
                             else self.optimizer_cached_bandwidth * share, foreach_optimizer=self.foreach_optimizer,
                             **{f: getattr(self, f) / share for f in _OVERHEADS if f != "op_overhead_s"})

    def in_lockstep(self, ranks: int) -> "DeviceProfile":
        """This device as `ranks` ranks stepping together see it: every rate divided by
        `lockstep_slowdown`, every fixed cost multiplied (one rank alone: this device). The result
        carries slowdown 1, so applying it twice changes nothing."""
        if ranks < 2 or self.lockstep_slowdown == 1.0:
            return self
        slowed = self.scaled(1.0 / self.lockstep_slowdown)
        return dataclasses.replace(slowed, name=f"{self.name} in lockstep x{self.lockstep_slowdown:g}",
                                   lockstep_slowdown=1.0)


# the optimizer's piece sizes at which `optimizer_cached_bandwidth` and `optimizer_bandwidth` hold
OPTIMIZER_CACHED_BYTES = 1 << 20
OPTIMIZER_LARGE_BYTES = 16 << 20

# fixed costs of a DeviceProfile (seconds; scaled together, saved in profile files)
_OVERHEADS = ("op_overhead_s", "view_overhead_s", "call_overhead_s", "arg_overhead_s", "backward_overhead_s",
              "autograd_tensor_overhead_s", "optimizer_tensor_overhead_s", "optimizer_call_overhead_s")


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
                     ("all_to_all", 0.5e-3, 0.95e9)),
                    # past 8 MiB per rank (2026-11-26, calibrate --large-max-bytes 64 MiB; all_gather 347 ms at
                    # 64 MiB, all_reduce 133, reduce_scatter 156, all_to_all 167: within 6% of this model)
                    (("all_reduce", 8 * 2**20, 0.49e9), ("all_gather", 8 * 2**20, 0.18e9),
                     ("reduce_scatter", 4 * 2**20, 0.21e9), ("all_to_all", 4 * 2**20, 0.18e9))),
        LinkProfile("gloo-oversubscribed", 4.1e-3, 1.0e9,
                    "measured here: the same with 4 processes on 2 cores, mesh (dp=2, tp=2), both axes, median of "
                    "2 runs fitted (all_reduce 3-7 ms even at 4 KiB; fit error <= 22%)",
                    (("all_gather", 4.0e-3, 0.5e9), ("reduce_scatter", 4.1e-3, 0.47e9),
                     ("all_to_all", 3.2e-3, 0.76e9)),
                    # past 8 MiB per rank (2026-11-26, both axes; all_gather 482-548 ms at 64 MiB)
                    (("all_reduce", 8 * 2**20, 0.29e9), ("all_gather", 8 * 2**20, 0.115e9),
                     ("reduce_scatter", 4 * 2**20, 0.118e9), ("all_to_all", 4 * 2**20, 0.12e9))),
    )
}

DEVICES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        # GPUs: what one reaches at a transformer's shapes, not the datasheet's peak. Measured on an H200
        # (2026-11-27, bench/bench_gpu.py --measure, bf16, torch 2.11, GPT d 2048 and d 4096 with 8,192
        # tokens; bench/results_gpu.md): matmuls 788 and 708 TFLOP/s (0.80 and 0.72 of the 989 peak),
        # streaming adds 4.45 and 4.07 TB/s (0.93 and 0.85 of 4.8), a small kernel launched from Python
        # back to back 10 and 7.5 us, causal fused attention (cuDNN) 0.41 and 0.62 of the matmul rate at
        # sequence 1,024 and 2,048. Priced with these, the two steps came within 7% and 4% of their
        # measurement (with the datasheet's numbers, 27% and 30% under it). The H100 has the same compute
        # die (its 8192^3 bf16 product ran at 798 TFLOP/s, the H200's at 788) and its HBM3 streamed about
        # 3.0 TB/s here (device/KINDS.md): the same fractions of its datasheet. The A100 takes them
        # unmeasured.
        DeviceProfile("h100", 750e12, 2.97e12, 8e-6, 80e9, "H100 SXM: 989 TFLOP/s bf16 dense and 3.35 TB/s HBM3 on "
                      "the datasheet; 0.76 and 0.885 of them, as measured on an H200 at transformer shapes",
                      attention_efficiency=0.5, foreach_optimizer=True),
        DeviceProfile("h200", 750e12, 4.25e12, 8e-6, 141e9, "H200 SXM, measured (bench_gpu.py --measure, bf16): "
                      "708-788 TFLOP/s matmuls, 4.07-4.45 TB/s streaming; datasheet 989 TFLOP/s, 4.8 TB/s",
                      attention_efficiency=0.5, foreach_optimizer=True),
        DeviceProfile("a100", 237e12, 1.77e12, 8e-6, 80e9, "A100 SXM 80GB: 312 TFLOP/s bf16 and 2.0 TB/s on the "
                      "datasheet, at the fractions measured on an H200 (0.76, 0.885)", attention_efficiency=0.5,
                      foreach_optimizer=True),
        # Per-call costs: measured(compiled step) - measured(its generated graphs called directly), 7 models
        # (4-96 parameters, 6-145 saved values), one process, fitted by least squares on relative errors:
        # forward 7-55 us, training 80-900 us (residuals +-30%; large activations pay more, gpt-medium's
        # training step 1.6 ms against ~0.3 predicted).
        # The rates and the memory hierarchy: `spmd.tools.calibrate --nproc 2` on this 2-core AMD EPYC VM
        # (2026-11-26; an earlier host of the same name measured 100 GFLOP/s on squares), both ranks at once,
        # the median of 3 runs (element costs: 2 runs).
        # Per small ATen op, as a generated graph pays it (Python line, dispatcher, kernel start-up): the
        # small joint graph of `calibrate`, one process on a quiet machine, 11.7 / 19.6 / 23.4 us per
        # non-view node in 3 runs; 27.7 us with 2 ranks at once (bench/profile_gloo_2.json). An earlier
        # host measured 6.
        DeviceProfile("cpu", 58e9, 60e9, 20e-6, 24e9,
                      "measured here, one thread per rank, 2 ranks at once (spmd.tools.calibrate, 2026-11-26): fp32 "
                      "matmul 58 GFLOP/s fitted on a transformer layer's shapes at 512 tokens, d 128..768 (46-66; "
                      "squares 66-81, an odd n such as GPT-2's 50257 vocabulary 25% slower), add 60 GB/s up to 8.25 "
                      "MiB moved (half of L2 + L3 / 2), 11.7 GB/s from DRAM, outputs of 32 MiB or more (glibc "
                      "mmaps them) faulted in at 1.27 GB/s; per element of exp, tanh, dropout, norms... timed at "
                      "1 MiB; ~20 us per small ATen op (12-28), ~3 us per view, per call 6.5 us + 0.5 us per argument, per "
                      "training step 40 us + 2.3 us per parameter and saved value; flash attention 17-30 GFLOP/s; "
                      "ranks stepping together run at the slowest's pace, 1.08x one rank's "
                      "(bench/results_predict.md, bench/results_first_step.md)", 3e-6,
                      call_overhead_s=6.5e-6, arg_overhead_s=0.5e-6, backward_overhead_s=40e-6,
                      autograd_tensor_overhead_s=2.3e-6,
                      # the _for_cpu flash kernels, causal, one thread, head dim 64: here 23-30 GFLOP/s forward,
                      # 17-22 backward at seq 128-512 (0.3-0.5 of the matmul rate; the earlier host: 30-46
                      # against mm 100-109)
                      attention_efficiency=0.4,
                      cache_bytes=8.25 * 2**20, dram_bandwidth=11.7e9, fresh_page_bytes=32 * 2**20,
                      page_fault_bandwidth=1.27e9,
                      # torch's AdamW, 2 ranks stepping at once on a later host of the same kind (2026-11-30,
                      # `measure.measure_optimizer`): 1.6 ns per element on 1 MB tensors, 2.8 on 16 MB ones
                      # (20 accesses of 4 bytes: 50 and 28 GB/s), 17 us per tensor; per step() ~2.5 tensors'
                      # worth (a slower host of the kind, 2026-12-02: 54-73 us per step, 24-27 per tensor)
                      optimizer_bandwidth=28e9, optimizer_cached_bandwidth=50e9, optimizer_tensor_overhead_s=17e-6,
                      optimizer_call_overhead_s=40e-6,
                      # 2 ranks, the same 40 ms of a transformer layer's ops each, a barrier before each of 40
                      # segments: the slowest's sum / the mean's 1.05-1.11 in 4 runs (2026-11-26); inside
                      # GPT-2-small's training step the ranks waited 13-15% of their compute at collectives
                      lockstep_slowdown=1.08,
                      element_seconds=(
                          ("_log_softmax", 1.51e-9), ("_log_softmax_backward_data", 1.37e-9), ("_softmax", 1.42e-9),
                          ("_softmax_backward_data", 0.42e-9), ("bernoulli", 12.6e-9), ("cos", 2.75e-9),
                          ("erf", 2.18e-9), ("exp", 1.50e-9), ("gelu", 1.66e-9), ("gelu_backward", 2.60e-9),
                          ("log", 1.84e-9), ("native_dropout", 6.95e-9), ("native_layer_norm", 0.63e-9),
                          ("native_layer_norm_backward", 0.83e-9), ("pow", 0.19e-9), ("rsqrt", 0.43e-9),
                          ("sigmoid", 1.19e-9), ("sigmoid_backward", 0.26e-9), ("silu", 1.38e-9),
                          ("silu_backward", 1.59e-9), ("sin", 3.36e-9), ("sqrt", 1.15e-9), ("tanh", 3.51e-9),
                          ("tanh_backward", 0.28e-9), ("where", 5.50e-9))),
    )
}


def link_profile_for(name: str) -> LinkProfile:
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"unknown link profile {name!r}; known: {sorted(LINKS)}") from None


def gpu_profile_name(device_name: str) -> str:
    """The built-in profile for a CUDA device's name ("NVIDIA H200" -> "h200"); h100 for any other (or
    none: compiling for CUDA on a machine without one)."""
    upper = device_name.upper()
    return next((n for n in ("h200", "h100", "a100") if n.upper() in upper), "h100")


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


def link_to_json(link: LinkProfile) -> dict:
    return {"name": link.name, "latency_s": link.latency_s, "bandwidth": link.bandwidth, "source": link.source,
            "per_collective": {k: {"latency_s": lat, "bandwidth": bw} for k, lat, bw in link.per_collective},
            "large_messages": {k: {"wire_bytes": float(size), "bandwidth": float(bw)} for k, size, bw in link.large_messages}}


def link_from_json(d: dict) -> LinkProfile:
    """The inverse of `link_to_json` (also reads plan files of before, whose per_collective is a list)."""
    per = d.get("per_collective") or {}
    per = tuple((k, float(v["latency_s"]), float(v["bandwidth"])) for k, v in per.items()) if isinstance(per, dict) \
        else tuple((k, float(lat), float(bw)) for k, lat, bw in per)
    large = tuple((k, float(v["wire_bytes"]), float(v["bandwidth"])) for k, v in (d.get("large_messages") or {}).items())
    return LinkProfile(d["name"], float(d["latency_s"]), float(d["bandwidth"]), d.get("source", ""), per, large)


_HIERARCHY = ("cache_bytes", "fresh_page_bytes", "page_fault_bandwidth", "operand_bandwidth")  # inf (none) saved as null


def device_to_json(device: DeviceProfile) -> dict:
    """Every field of `device`, JSON-able (strict JSON: no infinities)."""
    d = {"name": device.name, "flops": device.flops, "memory_bandwidth": device.memory_bandwidth,
         "memory_bytes": device.memory_bytes, "source": device.source,
         "attention_efficiency": device.attention_efficiency, **{f: getattr(device, f) for f in _OVERHEADS},
         "dram_bandwidth": device.dram_bandwidth, "element_seconds": {op: s for op, s in device.element_seconds},
         "lockstep_slowdown": device.lockstep_slowdown, "optimizer_bandwidth": device.optimizer_bandwidth,
         "optimizer_cached_bandwidth": device.optimizer_cached_bandwidth,
         "foreach_optimizer": device.foreach_optimizer}
    d.update({f: None if math.isinf(getattr(device, f)) else getattr(device, f) for f in _HIERARCHY})
    return d


def device_from_json(d: dict) -> DeviceProfile:
    """The inverse of `device_to_json`. Files from before a number was measured leave it at its default
    (a fixed cost at 0, not priced; no memory hierarchy), op_overhead_s excepted."""
    hierarchy = {f: math.inf if d.get(f) is None else float(d[f]) for f in _HIERARCHY}
    return DeviceProfile(d["name"], float(d["flops"]), float(d["memory_bandwidth"]), float(d["op_overhead_s"]),
                         float(d["memory_bytes"]), d.get("source", ""),
                         attention_efficiency=float(d.get("attention_efficiency", 1.0)),
                         dram_bandwidth=None if d.get("dram_bandwidth") is None else float(d["dram_bandwidth"]),
                         element_seconds=tuple((op, float(s)) for op, s in (d.get("element_seconds") or {}).items()),
                         lockstep_slowdown=float(d.get("lockstep_slowdown", 1.0)), **hierarchy,
                         foreach_optimizer=bool(d.get("foreach_optimizer", False)),
                         **{f: None if d.get(f) is None else float(d[f])
                            for f in ("optimizer_bandwidth", "optimizer_cached_bandwidth")},
                         **{f: float(d[f]) for f in _OVERHEADS if f in d and f != "op_overhead_s"})


def save_profile(path: str, links: dict[str, LinkProfile], device: DeviceProfile, points: dict | None = None,
                 meta: dict | None = None) -> None:
    """Write `links` (mesh axis name -> link) and `device` as a versioned JSON profile."""
    import json

    doc = {"schema": PROFILE_SCHEMA, "version": PROFILE_VERSION, "meta": dict(meta or {}),
           "links": {axis: link_to_json(link) for axis, link in links.items()},
           "device": device_to_json(device),
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
    device = device_from_json(doc["device"])
    links = {axis: link_from_json(link) for axis, link in doc["links"].items()}
    return Profile(links, device, doc.get("points", {}), doc.get("meta", {}))
