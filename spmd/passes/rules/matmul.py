"""`aten.matmul` of two tensors with the same leading dims, (*lead, m, k) @ (*lead, k, n) -> (*lead, m, n): the
product passes/unmerge_bmm.py puts where torch's decomposition merged the leading dims into one `bmm`.

Along one mesh axis: any leading dim split in all three (each (leading index) is its own product, so batch and
heads alike); m split in the output and the first operand, the second whole; n likewise with the second; k split
in both operands gives a Partial(sum) output.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.passes.rules.registry import RuleInput, rule

aten = torch.ops.aten


@rule(aten.matmul.default)
def matmul(inp: RuleInput) -> list[list]:
    a, b = (t.shape for t in inp.inputs[:2])
    if len(a) != len(b) or len(a) < 3 or a[:-2] != b[:-2]:
        return []  # (only the form unmerge_bmm makes: whole otherwise)
    rank = len(a)
    rows = [[Shard(d), Shard(d), Shard(d)] for d in range(rank - 2)]
    rows.append([Shard(rank - 2), Shard(rank - 2), Replicate()])
    rows.append([Shard(rank - 1), Replicate(), Shard(rank - 1)])
    rows.append([Partial(), Shard(rank - 1), Shard(rank - 2)])
    return rows
