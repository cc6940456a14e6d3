"""Convolutions split on channels, beside DTensor's batch split (its only one).

Along one mesh axis, for `convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)`
(not transposed; x [N, C_in, ...], w [C_out, C_in / groups, ...]):

  batch          out S(0) <- x S(0), w R, b R                   (DTensor's)
  column         out S(1) <- x R, w S(0), b S(0)                one group (groups == 1): each rank its
                                                                output channels, as a column-parallel Linear
  row            out P    <- x S(1), w S(1), b P                one group: each rank sums its input
                                                                channels, as a row-parallel Linear
  depthwise      out S(1) <- x S(1), w S(0), b S(0)             groups == C_in (a depthwise conv, any
                                                                channel multiplier): each rank its channels'
                                                                groups, run with its own number of groups

and `convolution_backward(g, x, w, bias_sizes, ..., groups, output_mask)` -> (dx, dw, db) alike:

  batch          dx S(0), dw P, db P    <- g S(0), x S(0), w R
  column         dx P, dw S(0), db S(0) <- g S(1), x R, w S(0)
  row            dx S(1), dw S(1), db R <- g R, x S(1), w S(1)
  depthwise      dx S(1), dw S(0), db S(0) <- g S(1), x S(1), w S(0)

A depthwise conv between the two Linears of an MLP (ConvNeXt, Segformer's Mix-FFN, MobileNet, Mamba's causal
conv1d) then keeps Megatron's channel split through it; without the row, its activation went from channels to
the batch and the pinned Linears' weights were gathered. The depthwise row holds where pieces split x's
channels evenly: with one input channel per group, every piece is whole groups. A rank runs its groups
(`groups` and `bias_sizes` its own); the other rows run the op as traced. Transposed convolutions keep
DTensor's rows.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.core.specs import local_shape
from spmd.passes.rules.registry import RuleInput, local_rewrite, rule

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _kind(x_channels: int, transposed: bool, groups: int) -> str | None:
    """Which channel rows a conv takes: "dense" (one group), "depthwise" (one input channel per group), or None
    (transposed, or groups of several channels: DTensor's rows alone). The depthwise row's pieces are whole groups
    because the expander keeps only even splits of the input's channels (`expand_single_dim`'s callers drop the
    uneven: 6 channels on 4 ranks keep no channel row)."""
    if transposed:
        return None
    if groups == 1:
        return "dense"
    return "depthwise" if groups == x_channels else None


@rule(aten.convolution.default)
def convolution(inp: RuleInput) -> list[list]:
    x, w = inp.inputs[:2]
    biased = len(inp.inputs) == 3
    transposed, groups = inp.args[6], inp.args[8]
    bias = lambda p: [p] if biased else []  # noqa: E731
    rows = [[Shard(0), Shard(0), R, *bias(R)]]
    kind = _kind(x.shape[1], transposed, groups)
    if kind == "dense":
        rows.append([Shard(1), R, Shard(0), *bias(Shard(0))])
        rows.append([P, Shard(1), Shard(1), *bias(P)])
    elif kind == "depthwise":
        rows.append([Shard(1), Shard(1), Shard(0), *bias(Shard(0))])
    return rows


@rule(aten.convolution_backward.default)
def convolution_backward(inp: RuleInput) -> list[list]:
    x = inp.inputs[1]
    transposed, groups = inp.args[7], inp.args[9]
    outs = lambda *ps: [p if o is not None else None for p, o in zip(ps, inp.outputs)]  # noqa: E731
    rows = [outs(Shard(0), P, P) + [Shard(0), Shard(0), R]]
    kind = _kind(x.shape[1], transposed, groups)
    if kind == "dense":
        rows.append(outs(P, Shard(0), Shard(0)) + [Shard(1), R, Shard(0)])
        rows.append(outs(Shard(1), Shard(1), R) + [R, Shard(1), Shard(1)])
    elif kind == "depthwise":
        rows.append(outs(Shard(1), Shard(0), Shard(0)) + [Shard(1), Shard(1), Shard(0)])
    return rows


def _local_groups(x_shape, x_placements, mesh_shape, groups: int) -> int:
    """The groups in this rank's piece of the input's channels: whole groups of a depthwise conv; one group's
    part of a row-parallel one (still one group)."""
    if groups == 1:
        return 1
    return groups * local_shape(tuple(x_shape), x_placements, mesh_shape)[1] // x_shape[1]


@local_rewrite(aten.convolution.default)
def _convolution(args, strategy, shapes, mesh_shape, coord):
    groups = _local_groups(shapes[0], strategy.inputs[0], mesh_shape, args[8])
    if groups == args[8]:
        return None
    return aten.convolution.default, (*args[:8], groups, *args[9:]), None


@local_rewrite(aten.convolution_backward.default)
def _convolution_backward(args, strategy, shapes, mesh_shape, coord):
    groups = _local_groups(shapes[1], strategy.inputs[1], mesh_shape, args[9])
    bias_sizes = args[3]
    if bias_sizes is not None:  # (the bias's length: its piece of the output channels)
        bias_sizes = [local_shape(tuple(shapes[0]), strategy.inputs[0], mesh_shape)[1]]
    if groups == args[9] and bias_sizes == args[3]:
        return None
    return aten.convolution_backward.default, (*args[:3], bias_sizes, *args[4:9], groups, *args[10:]), None
