"""Factories (full, arange, zeros, ...): no tensor input. Those whose every element is the same (full, zeros,
ones, empty, and `empty_permuted`, a channels_last `empty_like`) are built whole or as any piece of themselves, at
the piece's size (emit_rank_graph's `SHAPE_ARG`); the others (arange, the random draws) whole, Replicate on every rank.

A consumer that wants a whole-built value sharded takes its local slice for free (R -> S is a view), but an
op whose strategy function derives its layouts from its inputs' (DTensor's `slice_scatter`: the backward of a
slice, the gradient written into `zeros`) offered only Replicate: every Llama-family training plan gathered
rotary's activations in backward (two all_gathers per layer, found by a plan-quality probe).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from spmd.passes.rules.registry import RuleInput, rule

aten = torch.ops.aten


@rule(aten.arange.default, aten.arange.start, aten.arange.start_step, aten.scalar_tensor.default,
      aten.randn.default, aten.rand.default)
def factory(inp: RuleInput) -> list[list]:
    return [[Replicate()]]


@rule(aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format,
      aten.empty_permuted.default, aten._efficientzerotensor.default)  # (torch.func's zeros: `hessian`'s backward)
def constant_factory(inp: RuleInput) -> list[list]:
    """Whole, or split on any dim (each piece is the same constant)."""
    return [[Replicate()]] + [[Shard(d)] for d in range(len(inp.outputs[0].shape))]


@rule(aten._sparse_coo_tensor_with_dims_and_tensors.default)
def sparse_coo(inp: RuleInput) -> list[list]:
    """A sparse COO tensor from its indices and values (nn.Embedding(sparse=True)'s gradient): built whole.
    No collective takes a sparse tensor, so it is only ever cut afterwards (collectives.shard_local cuts its
    rows for a sharded weight's piece), never gathered or reduced."""
    return [[Replicate(), Replicate(), Replicate()]]
