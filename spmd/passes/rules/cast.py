"""Casts (`aten._to_copy`): DTensor's rule, except that a Partial(sum) does not pass a cast that rounds.

A cast is pointwise: split on any dim in, the same dim out. Along one mesh axis, a Partial passes a cast
when the reduction commutes with it:
  * max / min: always (rounding is monotone, so max_r cast(x_r) = cast(max_r x_r)), except to bool;
  * sum / avg: through a cast that is exact on every value of its source, a widening one (bf16 or fp16
    -> fp32 -> fp64), or one between integer dtypes (wrap-around commutes with the sum). Then the
    reduction runs in the wider dtype and rounds no more than the single-device program does.
    Not through a narrowing float cast (fp32 -> bf16, fp64 -> fp32, bf16 <-> fp16): there every rank's
    part would be rounded before the sum and the sum taken in the narrow dtype, an error up to
    eps * sum_r |x_r| (and growing with the axis size on a ring) where the user's program rounds once,
    eps/2 * |sum_r x_r|. Nor from a float to an integer or bool (DTensor refuses those too).

DTensor lets Partial(sum) through any float-to-float cast, and the solver would even prefer reducing
after the downcast, the bf16 all_reduce moving half the bytes: a reduction in a lower precision than the
model's. Here the value is reduced before such a cast, in the dtype the user's program sums in
(tests/e2e/test_low_precision.py).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.passes.rules.registry import RuleInput, rule

aten = torch.ops.aten

_MONOTONE = ("max", "min")
# the reductions a Partial carries (DTensor's Partial.ALL_REDUCE_OPS, which torch 2.11 lacks): named here,
# since partial_passes reasons about each
REDUCE_OPS = ("sum", "avg", "min", "max", "product")


def partial_passes(reduce_op: str, src: torch.dtype, dst: torch.dtype) -> bool:
    """Does a Partial(`reduce_op`) value of dtype `src` stay Partial(`reduce_op`) when cast to `dst`?"""
    if src == dst:
        return True
    if dst == torch.bool:
        return False
    if reduce_op in _MONOTONE:
        return True
    if src.is_floating_point or src.is_complex:
        # exact only when dst holds every value of src: the promotion of the two is dst itself
        return (dst.is_floating_point or dst.is_complex) and torch.promote_types(src, dst) == dst
    return True  # from integers (or bool): as DTensor


@rule(aten._to_copy.default)
def to_copy(inp: RuleInput) -> list[list]:
    if not inp.inputs:  # (a Python number made a tensor, `h.norm() + 1` under vmap: whole; a probe met an IndexError)
        return [[Replicate()]]
    src, out = inp.inputs[0], inp.outputs[0]
    rows = [[Shard(d), Shard(d)] for d in range(len(out.shape))]
    rows += [[Partial(op), Partial(op)] for op in REDUCE_OPS if partial_passes(op, src.dtype, out.dtype)]
    return rows
