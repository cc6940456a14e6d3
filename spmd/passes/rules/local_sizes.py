"""Ops whose non-tensor arguments name sizes of the global tensors, and what a rank runs on its pieces.

The rules (DTensor's, through the adapter) say which placements these ops take; their arguments are the
trace's, written for the whole tensors. A rank runs them on its pieces, so the sizes become its own
(DTensor adjusts the same ones: `_adjust_squeeze_to_global_singletons`, `_adjust_group_norm_scalars`):

  squeeze(x[, dims])                 only the dims of size 1 in the whole tensor: a dim split down to one
                                     row per rank (a batch of 2 on dp=2) is size 1 in each piece, and
                                     squeezing it there dropped a dim the whole tensor keeps (a mean over
                                     the next dim then averaged features instead of the batch, silently)
  native_group_norm(x, w, b, N, C, HxW, group, eps)
  native_group_norm_backward(g, x, mean, rstd, w, N, C, HxW, group, mask)
                                     N, C, HxW (and the groups, where channels are split) of this rank's
                                     piece of x: the global N failed every data-parallel GroupNorm model
  new_empty_strided(x, size, stride) this rank's piece of the output, contiguous

The view and factory ops with one shape argument are rewritten by emit_rank_graph itself (`SHAPE_ARG`).
"""
from __future__ import annotations

import math

import torch

from spmd.core.specs import contiguous_strides, local_shape
from spmd.passes.rules.registry import local_rewrite

aten = torch.ops.aten


@local_rewrite(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(args, strategy, shapes, mesh_shape, coord):
    shape = shapes[0]
    if not shape:  # (a 0-d tensor: nothing to squeeze)
        return None
    if len(args) < 2:
        dims = range(len(shape))
    else:
        dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
    ones = sorted({d % len(shape) for d in dims if shape[d % len(shape)] == 1})
    return aten.squeeze.dims, (args[0], ones), None


def _group_norm_sizes(shape, placements, mesh_shape, C, group):
    local = local_shape(tuple(shape), placements, mesh_shape)
    groups = group * local[1] // C if C else group
    return local[0], local[1], math.prod(local[2:]), groups


@local_rewrite(aten.native_group_norm.default)
def _group_norm(args, strategy, shapes, mesh_shape, coord):
    N, C, HxW, groups = _group_norm_sizes(shapes[0], strategy.inputs[0], mesh_shape, args[4], args[6])
    return aten.native_group_norm.default, (*args[:3], N, C, HxW, groups, *args[7:]), None


@local_rewrite(aten.native_group_norm_backward.default)
def _group_norm_backward(args, strategy, shapes, mesh_shape, coord):
    N, C, HxW, groups = _group_norm_sizes(shapes[1], strategy.inputs[1], mesh_shape, args[6], args[8])
    return aten.native_group_norm_backward.default, (*args[:5], N, C, HxW, groups, *args[9:]), None


@local_rewrite(aten.new_empty_strided.default)
def _new_empty_strided(args, strategy, shapes, mesh_shape, coord):
    size = local_shape(tuple(args[1]), strategy.outputs[0], mesh_shape)
    return aten.new_empty_strided.default, (args[0], list(size), list(contiguous_strides(size)), *args[3:]), None
