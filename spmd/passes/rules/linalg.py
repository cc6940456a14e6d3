"""Triangular solves: aten.linalg_solve_triangular(A, B, upper, left, unitriangular).

    left:  A X = B, A (*, n, n), B (*, n, k) -> X (*, n, k)
    right: X A = B, A (*, n, n), B (*, k, n) -> X (*, k, n)

Along one mesh axis: X is linear in B, so B Partial with A whole gives X Partial, and B's k columns (left)
or rows (right) split with A whole. Batch dims broadcast: a batch dim splits in X, and in each of A and B
that has it at full size; one that broadcasts (size 1, or absent) stays whole. DTensor's rule lets a
batched A stay whole while B splits by batch, which pairs every piece of B with the wrong matrices.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.passes.rules.registry import RuleInput, rule

aten = torch.ops.aten


@rule(aten.linalg_solve_triangular.default)
def solve_triangular(inp: RuleInput) -> list[list]:
    a, b = (t.shape for t in inp.inputs[:2])
    x = inp.outputs[0].shape
    left = inp.kwargs.get("left", inp.args[3] if len(inp.args) > 3 else True)
    rows = [[Partial(), Replicate(), Partial()]]
    free = -1 if left else -2  # B's columns (left) or rows (right): each solved on its own
    rows.append([Shard(len(x) + free), Replicate(), Shard(len(b) + free)])
    for d in range(len(x) - 2):
        if x[d] == 1:
            continue
        row = [Shard(d)]
        for shape in (a, b):
            k = d - (len(x) - len(shape))
            row.append(Shard(k) if k >= 0 and shape[k] == x[d] else Replicate())
        rows.append(row)
    return rows
