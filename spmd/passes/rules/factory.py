"""Factories (full, arange, zeros, ...): no tensor input, so always built Replicate on every rank.

A consumer that wants the value sharded takes its local slice for free (R -> S is a view).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate

from spmd.passes.rules.registry import RuleInput, rule

aten = torch.ops.aten


@rule(aten.full.default, aten.arange.default, aten.arange.start, aten.arange.start_step,
      aten.scalar_tensor.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format,
      aten.randn.default, aten.rand.default)
def factory(inp: RuleInput) -> list[list]:
    return [[Replicate()]]


@rule(aten._sparse_coo_tensor_with_dims_and_tensors.default)
def sparse_coo(inp: RuleInput) -> list[list]:
    """A sparse COO tensor from its indices and values (nn.Embedding(sparse=True)'s gradient): built whole.
    No collective takes a sparse tensor, so it is only ever cut afterwards (collectives.shard_local cuts its
    rows for a sharded weight's piece), never gathered or reduced."""
    return [[Replicate(), Replicate(), Replicate()]]
