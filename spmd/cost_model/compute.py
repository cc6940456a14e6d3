"""Compute cost of one op on local shards: a roofline, max(work, bytes / bandwidth), plus a fixed
per-op overhead. The work is FLOPs at the peak rate, or measured seconds per element for the kernels a
device profile lists; the bandwidth is the cache's or DRAM's by the bytes the op moves; outputs large
enough to be fresh pages pay their page faults (CPU profiles: `DeviceProfile`). Views run no kernel; on an
eager CPU run they still cost a dispatch (`DeviceProfile.view_overhead_s`).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from spmd.core.graph_facts import is_view
from spmd.core.profiles import OPTIMIZER_CACHED_BYTES, OPTIMIZER_LARGE_BYTES
from spmd.core.specs import TensorInfo

aten = torch.ops.aten


# forward: Q K^T and P V; backward: Q K^T again, dV, dP, dQ, dK
_ATTENTION = {
    aten.scaled_dot_product_attention.default: (0, 2, 5),
    aten._scaled_dot_product_flash_attention_for_cpu.default: (0, 2, 4),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (1, 5, 7),
}
# the CUDA kernels (what a joint trace on CUDA tensors holds: flash for fp16/bf16, memory-efficient for
# fp32, cuDNN where enabled); without them they were priced by torch's FLOP counter, causal or not
for _name, _at in (("_scaled_dot_product_flash_attention", (0, 2, 4)),
                   ("_scaled_dot_product_flash_attention_backward", (1, 5, 11)),
                   ("_scaled_dot_product_efficient_attention", (0, 2, 6)),
                   ("_scaled_dot_product_efficient_attention_backward", (1, 5, 11)),
                   ("_scaled_dot_product_cudnn_attention", (0, 2, 6)),
                   ("_scaled_dot_product_cudnn_attention_backward", (1, 5, 14))):
    if hasattr(aten, _name):
        _ATTENTION[getattr(aten, _name).default] = _at
# FlexAttention, priced dense: how much its block mask skips is data (the mask's block counts)
for _name, _at in (("flex_attention", (0, 2, None)), ("flex_attention_backward", (0, 5, None))):
    if hasattr(torch.ops.higher_order, _name):
        _ATTENTION[getattr(torch.ops.higher_order, _name)] = _at


# Elementwise and row-wise kernels whose work per element is many instructions (erf, exp, log, a
# row's mean and variance), not one, for devices that do not measure them (`DeviceProfile.element_seconds`,
# which the cpu profile does): FLOPs per element of the outputs, in matmul-equivalent FLOPs. Measured
# once on an AMD EPYC thread at 100 GFLOP/s matmul (16K-2M elements, rows of 256 and 2048). On GPU
# profiles they stay memory-bound (48 / 750e12 s << 8 bytes / 2.97e12 B/s per element).
_FLOPS_PER_ELEMENT = {
    aten.gelu.default: 22.0,
    aten.gelu_backward.default: 48.0,
    aten.native_layer_norm.default: 27.0,
    aten.native_layer_norm_backward.default: 32.0,
    aten._log_softmax.default: 42.0,
    aten._log_softmax_backward_data.default: 25.0,
    aten._softmax.default: 45.0,
}


def op_name(op) -> str:
    """The ATen op's name without namespace or overload ("gelu"), as `DeviceProfile.element_seconds` keys it."""
    packet = getattr(op, "overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(op, "__name__", str(op))


def _grouped_mm_flops(op, shapes: tuple) -> float | None:
    """A mixture of experts' grouped matmul (torch's `_grouped_mm`, transformers' `grouped_mm_fallback` and its
    backward; torch's FLOP counter has none of them, and they were priced as elementwise): every row of the
    first operand meets one group's matrix. None: not one of them, or a form not modelled."""
    name = str(op) if getattr(op, "namespace", None) == "transformers" else None
    if op is aten._grouped_mm.default or name == "transformers.grouped_mm_fallback.default":
        a, b = shapes[0], shapes[1]
        if len(a) == 2 and len(b) == 3:  # rows by group (S, K) x (E, K, N): a forward
            return 2.0 * a[0] * a[1] * b[2]
        if len(a) == 2 and len(b) == 2:  # (K, S) x (S, N), S cut by group: a weight's gradient (E, K, N)
            return 2.0 * a[0] * a[1] * b[1]
        if len(a) == 3 and len(b) == 3:  # a batch of groups
            return 2.0 * a[0] * a[1] * a[2] * b[2]
        if len(a) == 3 and len(b) == 2:  # (G, M, K) x (K, N), N cut by group: (M, N)
            return 2.0 * a[1] * a[2] * b[1]
        return None
    if name == "transformers.grouped_mm_fallback_backward.default":  # dx and dw, each a forward's work
        x, w = shapes[0], shapes[1]
        return 4.0 * x[0] * x[1] * w[2]
    return None


def op_flops(op, args_with_shapes: tuple, kwargs: dict, out_shapes: list[tuple[int, ...]]) -> float:
    """FLOPs of `op` when its tensor args have the given (local) shapes."""
    grouped = _grouped_mm_flops(op, args_with_shapes)
    if grouped is not None:
        return grouped
    packet = getattr(op, "overloadpacket", None)
    per_element = _FLOPS_PER_ELEMENT.get(op)
    if per_element is not None:
        return per_element * sum(math.prod(s) for s in out_shapes)  # (a layer norm's row stats: +2/row)
    attention = _ATTENTION.get(op)
    if attention is not None:  # (index of q, matmuls of s x s x d, index of is_causal or None)
        qi, matmuls, causal_at = attention
        q, k = args_with_shapes[qi], args_with_shapes[qi + 1]
        causal = causal_at is not None and len(args_with_shapes) > causal_at and args_with_shapes[causal_at] is True
        causal = causal or kwargs.get("is_causal") is True
        # a causal flash kernel skips the blocks above the diagonal: about half the work
        return 2.0 * matmuls * math.prod(q[:-1]) * k[-2] * q[-1] * (0.5 if causal else 1.0)
    if op is aten.matmul.default and len(args_with_shapes[0]) >= 3 and \
            tuple(args_with_shapes[0][:-2]) == tuple(args_with_shapes[1][:-2]):  # (unmerge_bmm's: equal leading dims)
        a, b = args_with_shapes[:2]
        return 2.0 * math.prod(a[:-1]) * a[-1] * b[-1]
    if packet in flop_registry:
        try:
            out = out_shapes[0] if len(out_shapes) == 1 else out_shapes
            return flop_registry[packet](*args_with_shapes, out_val=out, **kwargs)
        except Exception:  # a formula that wants args we do not model: count it as elementwise
            pass
    return sum(math.prod(s) for s in out_shapes)


def compute_cost(op, args_with_shapes: tuple, kwargs: dict, in_infos: list[TensorInfo],
                 out_infos: list[TensorInfo], device, symbolic: bool = False) -> float:
    """Seconds one rank spends running `op` on tensors of these (local) shapes: the larger of its work
    (measured seconds per output element where the device has them, else FLOPs at the peak rate) and its
    bytes at the bandwidth of the memory level they fit in, plus its bytes read and written cold
    (`cold_seconds`), the page faults of fresh large outputs and a fixed cost. `symbolic`: shapes hold
    sympy expressions (cost_model/symbolic.py)."""
    if is_view(op):
        return device.view_overhead_s
    out_shapes = [o.shape for o in out_infos]
    per_element = device.seconds_per_element(op_name(op)) if device.element_seconds else None
    if per_element is not None:
        work = per_element * sum(math.prod(s) for s in out_shapes)
    else:
        rate = device.flops * (device.attention_efficiency if op in _ATTENTION else 1.0)
        work = op_flops(op, args_with_shapes, kwargs, out_shapes) / rate
    moved = sum(i.nbytes for i in in_infos) + sum(o.nbytes for o in out_infos)
    larger = _larger(symbolic)
    return larger(work, streaming_seconds(device, moved, symbolic)) + cold_seconds(device, moved, symbolic) + \
        fault_seconds(device, [o.nbytes for o in out_infos], symbolic) + device.op_overhead_s


# Random ops a rank draws whole where it keeps a piece (passes/rules/random.py: one device's draw, so that
# the ranks and one device agree bit for bit): the piece costs the whole op's seconds as well.
DRAWN_WHOLE = frozenset({aten.native_dropout.default})


def is_drawn_whole(op, placements) -> bool:
    """`op` with these output placements runs the whole op before it keeps its piece."""
    return op in DRAWN_WHOLE and any(ps is not None and any(not p.is_replicate() for p in ps) for ps in placements)


def _pick(symbolic: bool):
    if symbolic:
        import sympy

        return lambda cond, a, b: sympy.Piecewise((a, cond), (b, True))
    return lambda cond, a, b: a if cond else b


def _larger(symbolic: bool):
    if symbolic:
        import sympy

        return sympy.Max
    return max


def streaming_seconds(device, moved, symbolic: bool = False):
    """Seconds to move `moved` bytes (reads + writes of one op) at the bandwidth of the memory level they
    fit in: `memory_bandwidth` up to `cache_bytes`, `dram_bandwidth` beyond."""
    return _pick(symbolic)(moved <= device.cache_bytes, moved / device.memory_bandwidth,
                           moved / (device.dram_bandwidth or device.memory_bandwidth))


def cold_seconds(device, moved, symbolic: bool = False):
    """What an op that fits in the caches pays in a graph for its `moved` bytes not being there: a loop
    (where the device's rates were timed) kept them in cache; in a graph they were written by other ops,
    or long ago (`DeviceProfile.operand_bandwidth`; 0 where it is inf). An op beyond the caches streams
    from DRAM in the loop as well (`streaming_seconds`); it pays no less than the largest op that fits
    (what that op's cold bytes cost beyond the DRAM rate), so an op never gets cheaper as it grows."""
    if math.isinf(device.operand_bandwidth):
        return 0.0
    dram = device.dram_bandwidth or device.memory_bandwidth
    edge = device.cache_bytes * (1 / device.memory_bandwidth + 1 / device.operand_bandwidth - 1 / dram)
    return _pick(symbolic)(moved <= device.cache_bytes, moved / device.operand_bandwidth, max(0.0, edge))


def fault_seconds(device, outputs, symbolic: bool = False):
    """Page faults of the outputs (bytes each) large enough to be fresh mappings from the allocator."""
    pick = _pick(symbolic)
    return sum(pick(o >= device.fresh_page_bytes, o / device.page_fault_bandwidth, 0.0) for o in outputs)


def copy_seconds(device, nbytes, read: bool = True):
    """A copy of `nbytes` into a new tensor (a contiguous clone, a slice made contiguous, a packed buffer;
    `read=False`: a new tensor filled with a constant): its reads and writes at the bandwidth of the level
    they fit in, and the faults of a fresh output. Works on sympy expressions too."""
    symbolic = not isinstance(nbytes, (int, float))
    moved = 2 * nbytes if read else nbytes
    return streaming_seconds(device, moved, symbolic) + fault_seconds(device, [nbytes], symbolic)


def local_call(node: fx.Node, is_tensor, local_infos: list) -> tuple[tuple, dict]:
    """`node`'s (args, kwargs) with each tensor argument (`is_tensor(arg)`, in pytree order, as strategies
    list them) replaced by its local shape from `local_infos`: what FLOP formulas take."""
    it = iter(local_infos)
    # (fx's own walk, in pytree's order: pytree's tree_map leaves a reference cycle per call, 3,100 of them
    # for the collector after planning LLaMA3-8B)
    args, kwargs = fx.node.map_aggregate((tuple(node.args), dict(node.kwargs)),
                                         lambda a: next(it).shape if isinstance(a, fx.Node) and is_tensor(a) else a)
    return tuple(args), dict(kwargs)


def wrapper_counts(graph: fx.Graph, kinds: dict[str, str], joint: bool) -> tuple[int, int, int]:
    """(placeholders the compiled module passes in, parameters, values saved for backward) of a traced
    graph, as `split_joint_graph` will split it: what the per-call costs around the graph scale with
    (`Plan.wrapper_overhead_s`). A forward value is saved when a backward node (tagged `is_backward`, or
    reading a tangent or another backward node) reads it."""
    args = sum(1 for k in kinds.values() if k != "tangent")
    params = sum(1 for k in kinds.values() if k == "parameter")
    if not joint:
        return args, params, 0
    backward: set = set()
    for node in graph.nodes:
        if node.op == "output":
            continue
        if (kinds.get(node.name) == "tangent" or node.meta.get("partitioner_tag") == "is_backward"
                or (node.op == "call_function" and any(a in backward for a in node.all_input_nodes))):
            backward.add(node)
    saved = sum(1 for node in graph.nodes
                if node.op != "output" and node not in backward and any(u in backward for u in node.users))
    return args, params, saved


# Element accesses per parameter element in one step of torch's optimizers, by optimizer state per
# element (in parameter sizes, `PlanOptions.optimizer_state_factor`), linear in between: plain SGD reads
# the parameter and its gradient and writes the parameter (3); with momentum it also reads and writes the
# buffer twice (8); Adam and AdamW make seven passes over the parameter, gradient and two moments (20,
# counting the square root's and the division's temporaries). Timed on a CPU thread (16 tensors of 1M
# elements): 0.19, 0.50 and 1.44 ns per element, 1 : 2.6 : 7.5 against 1 : 2.7 : 6.7 here. Beyond 2
# (master weights in fp32 beside bf16 parameters: 6), Adam's 17 accesses per 2 units of state go on.
_OPTIMIZER_ACCESSES = ((0.0, 3.0), (1.0, 8.0), (2.0, 20.0))
ADAM_ACCESSES = 20.0


def optimizer_accesses(state_factor: float) -> float:
    """Element accesses per parameter element of one optimizer step (`_OPTIMIZER_ACCESSES`)."""
    pts = _OPTIMIZER_ACCESSES
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if state_factor <= x1:
            return y0 + (y1 - y0) * (state_factor - x0) / (x1 - x0)
    return ADAM_ACCESSES + (ADAM_ACCESSES - 3.0) / 2.0 * (state_factor - 2.0)


def optimizer_seconds_per_byte(nbytes: float, device) -> float:
    """Seconds per byte of element accesses the optimizer's step pays on a piece of `nbytes`: at
    `optimizer_cached_bandwidth` up to OPTIMIZER_CACHED_BYTES, at `optimizer_bandwidth` from
    OPTIMIZER_LARGE_BYTES, log-linearly between (a piece never gets cheaper per byte as it grows)."""
    large = 1.0 / (device.optimizer_bandwidth or device.dram_bandwidth or device.memory_bandwidth)
    cached = 1.0 / device.optimizer_cached_bandwidth if device.optimizer_cached_bandwidth else large
    cached = min(cached, large)
    if nbytes <= OPTIMIZER_CACHED_BYTES:
        return cached
    if nbytes >= OPTIMIZER_LARGE_BYTES:
        return large
    w = math.log(nbytes / OPTIMIZER_CACHED_BYTES) / math.log(OPTIMIZER_LARGE_BYTES / OPTIMIZER_CACHED_BYTES)
    return cached + (large - cached) * w


def optimizer_cost(info: TensorInfo, device, state_factor: float) -> float:
    """Seconds the optimizer's step spends on one parameter whose local piece is `info`: its element
    accesses (`optimizer_accesses`) at the device's rate for a piece of that size
    (`optimizer_seconds_per_byte`), plus the per-tensor fixed cost (timed for AdamW, scaled by the
    accesses). A training step runs it after backward, once per trainable parameter; how the parameter
    is laid out sets the elements, so the solver weighs it (a replicated parameter is stepped whole on
    every rank, a sharded one in pieces)."""
    accesses = optimizer_accesses(state_factor)
    nbytes = math.prod(info.shape) * info.dtype.itemsize
    return (accesses * nbytes * optimizer_seconds_per_byte(nbytes, device)
            + device.optimizer_tensor_overhead_s * accesses / ADAM_ACCESSES)
