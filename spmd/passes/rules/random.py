"""Random ops (dropout and friends): every rank draws exactly the single-device numbers.

On CPU there are no per-shard RNG offsets (DTensor's Philox offset tracking is CUDA-only), and a rank
drawing only its piece would consume the generator differently from one device: equal seeds would give
every shard the same mask (correlated, and not one device's). So a random op is drawn whole, on every
rank, from the same generator state (the same seed on every rank, as for building the model): ranks and
the single-device model consume the generator identically and agree bit for bit.

    most random ops        Replicate only; consumers slice the result for free
    native_dropout(x)      also out, mask S(d) <- x S(d), any d: the rank draws the whole mask (one
                           device's kernel on an empty tensor of the global shape), keeps its piece of
                           it and multiplies its piece of x (`local_ops.dropout_piece`). The draw costs
                           what the replicated op does (estimate_costs prices it whole), but the
                           mask saved for backward, the output and the product are the piece: what
                           sequence parallelism needs for the dropout on the residual branch.
"""
from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import Replicate, Shard

from spmd.core import local_ops
from spmd.core.specs import piece_span
from spmd.passes.rules.registry import RuleInput, local_rewrite, rule

aten = torch.ops.aten

_RANDOM = [aten.rand_like.default, aten.randn_like.default,
           aten.bernoulli.default, aten.bernoulli.p, aten.randint_like.default, aten.randint_like.low_dtype, aten.normal_functional.default
           if hasattr(aten, "normal_functional") else None, aten.uniform.default if hasattr(aten, "uniform") else None]


@rule(*[op for op in _RANDOM if op is not None])
def replicated_random(inp: RuleInput) -> list[list]:
    return [[Replicate()] * (len(inp.outputs) + len(inp.inputs))]


def _in_traced_layout(name: str, args, strategy, shapes, mesh_shape, coord):
    """A replicated draw like its input (`rand_like(h)`) on a rank whose input is laid out otherwise than one
    device's (a transposed activation, after a collective): drawn on the input in the traced layout, as the kernel
    fills memory in order (found by a review, as for dropout below)."""
    stride = getattr(shapes[0], "stride", None) if shapes else None
    if stride is None:
        return None
    return local_ops.drawn_in_layout, (name, tuple(stride), *args), None


for _op in _RANDOM:
    if _op is not None:
        local_rewrite(_op)(functools.partial(_in_traced_layout, f"{_op.overloadpacket.__name__}.{_op._overloadname}"))


@rule(aten.native_dropout.default)
def dropout(inp: RuleInput) -> list[list]:
    """(out, mask, x): replicated, or all three cut alike on any dim."""
    rows = [[Replicate()] * 3]
    rows += [[Shard(d)] * 3 for d in range(len(inp.inputs[0].shape))]
    return rows


@local_rewrite(aten.native_dropout.default)
def _dropout(args, strategy, shapes, mesh_shape, coord):
    shape = shapes[0]
    spans = [(dim, piece_span(strategy.inputs[0], dim, size, mesh_shape, coord)) for dim, size in enumerate(shape)]
    pieces = [(dim, *span) for dim, span in spans if span is not None]
    # (the mask drawn in the layout one device's input had: the kernel fills memory in order, so a transposed
    # input's mask, drawn contiguous, was another mask; found by a probe in nn.TransformerEncoderLayer. A rank's
    # whole input may be laid out otherwise than one device's, after a collective)
    stride = getattr(shape, "stride", None)
    if not pieces and stride is None:
        return None
    train = args[2] if len(args) > 2 else None
    return local_ops.dropout_piece, (args[0], args[1], train, tuple(shape), tuple(pieces), stride), {}
