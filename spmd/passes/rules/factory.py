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
