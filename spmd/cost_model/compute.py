"""Compute cost of one op on local shards: a roofline, max(FLOPs / peak, bytes / memory bandwidth),
plus a fixed per-op overhead. Views cost nothing (no kernel runs).
"""
from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import flop_registry

from spmd.specs import TensorInfo

aten = torch.ops.aten


def is_view(op) -> bool:
    schema = getattr(op, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


def op_flops(op, args_with_shapes: tuple, kwargs: dict, out_shapes: list[tuple[int, ...]]) -> float:
    """FLOPs of `op` when its tensor args have the given (local) shapes."""
    packet = getattr(op, "overloadpacket", None)
    if op is aten.scaled_dot_product_attention.default:
        q, k = args_with_shapes[0], args_with_shapes[1]
        return 4.0 * math.prod(q[:-1]) * k[-2] * q[-1]
    if packet in flop_registry:
        try:
            out = out_shapes[0] if len(out_shapes) == 1 else out_shapes
            return float(flop_registry[packet](*args_with_shapes, out_val=out, **kwargs))
        except Exception:  # a formula that wants args we do not model: count it as elementwise
            pass
    return float(sum(math.prod(s) for s in out_shapes))


def compute_cost(op, args_with_shapes: tuple, kwargs: dict, in_infos: list[TensorInfo],
                 out_infos: list[TensorInfo], device) -> float:
    """Seconds one rank spends running `op` on tensors of these (local) shapes."""
    if is_view(op):
        return 0.0
    flops = op_flops(op, args_with_shapes, kwargs, [o.shape for o in out_infos])
    moved = sum(i.nbytes for i in in_infos) + sum(o.nbytes for o in out_infos)
    return max(flops / device.flops, moved / device.memory_bandwidth) + device.op_overhead_s
