"""Ops with several tensor outputs cut from one input: split, split_with_sizes, unbind, chunk.

Along one mesh axis the input may be sharded on any dim except the one being cut (or Partial): every
output then carries the input's placement.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Shard

from spmd.passes.rules.registry import RuleInput, rule

aten = torch.ops.aten


def _cut_dim(inp: RuleInput) -> int:
    ndim = len(inp.inputs[0].shape)
    dim = inp.args[2] if len(inp.args) > 2 else inp.kwargs.get("dim", 0)
    if inp.op is aten.unbind.int:
        dim = inp.args[1] if len(inp.args) > 1 else inp.kwargs.get("dim", 0)
    return dim % ndim


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default)
def split_like(inp: RuleInput) -> list[list]:
    n_out = len(inp.outputs)
    cut = _cut_dim(inp)
    rows = []
    for d in range(len(inp.inputs[0].shape)):
        if d == cut:
            continue
        out_dim = d if (inp.op is not aten.unbind.int or d < cut) else d - 1
        rows.append([Shard(out_dim)] * n_out + [Shard(d)])
    rows.append([Partial()] * n_out + [Partial()])
    return rows
