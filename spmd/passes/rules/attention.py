"""scaled_dot_product_attention (DTensor has no rule for the CPU kernels).

q, k, v are [batch, heads, seq, head_dim]; attention mixes seq positions and head_dim, never batches
or heads, so along one mesh axis all three may be sharded together on batch (dim 0) or on heads (dim 1).
A mask follows where it has that dim, else stays replicated (it broadcasts).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from spmd.passes.rules import RuleInput, rule

aten = torch.ops.aten


@rule(aten.scaled_dot_product_attention.default)
def sdpa(inp: RuleInput) -> list[list]:
    q = inp.inputs[0]
    rows = []
    for d in (0, 1):
        row = [Shard(d), Shard(d), Shard(d), Shard(d)]
        for extra in inp.inputs[3:]:  # attn_mask, broadcast against [B, H, Sq, Sk]
            offset = len(q.shape) - len(extra.shape)
            md = d - offset
            row.append(Shard(md) if md >= 0 and extra.shape[md] == q.shape[d] else Replicate())
        rows.append(row)
    return rows
