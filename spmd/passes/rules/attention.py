"""Scaled dot-product attention, forward and backward (DTensor has no rule for the CPU kernels).

q, k, v are [batch, heads, seq, head_dim] (or [batch, seq, dim]; logsumexp drops the last dim); attention
mixes seq positions and head_dim, never batches or heads, so along one mesh axis every tensor may be
sharded together on batch (dim 0) or on heads (dim 1 of 4-D inputs). A mask follows where it has that dim, else stays replicated (it
broadcasts).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from spmd.core.graph_facts import dropout_p
from spmd.passes.rules.registry import RuleInput, rule

aten = torch.ops.aten

_CPU_FLASH = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_OPS = [aten.scaled_dot_product_attention.default]
_OPS += [op.default for op in (_CPU_FLASH, _CPU_FLASH_BWD) if op is not None]
_CPU_FLASH_BWD_OP = _CPU_FLASH_BWD.default if _CPU_FLASH_BWD is not None else None


def _mask_placement(mask, q, d: int):
    offset = len(q.shape) - len(mask.shape)
    md = d - offset
    return Shard(md) if md >= 0 and mask.shape[md] == q.shape[d] else Replicate()


@rule(*_OPS)
def sdpa(inp: RuleInput) -> list[list]:
    """Batch- or head-parallel: every 3-D/4-D tensor (q, k, v, out, grads, logsumexp) on the same dim. With
    dropout (an inference graph keeps the op whole: a model left in train mode, MC dropout), whole on every
    rank: the kernel draws its mask inside, so a rank holding a piece drew the first rows' mask for its own
    rows (found by a probe: both halves of the batch got the same mask, 1.51 off)."""
    if dropout_p(inp.op, inp.args, inp.kwargs) not in (0, None) and inp.op is not _CPU_FLASH_BWD_OP:
        return [[Replicate() for _ in (*inp.outputs, *inp.inputs)]]
    q = inp.inputs[1] if inp.op is _CPU_FLASH_BWD_OP else inp.inputs[0]
    mask = inp.kwargs.get("attn_mask")
    if inp.op is aten.scaled_dot_product_attention.default and len(inp.args) > 3:
        mask = inp.args[3]
    rows = []
    for d in range(len(q.shape) - 2):  # batch dims (and heads): never seq or head_dim
        row = [Shard(d) for _ in inp.outputs]
        for t in inp.inputs:
            if mask is not None and t is mask:
                row.append(_mask_placement(t, q, d))
            else:
                row.append(Shard(d))
        rows.append(row)
    return rows
