"""native_layer_norm_backward, kept whole in the joint graph (trace_joint.KEPT_WHOLE).

Along one mesh axis, with `axis` = the first normalized dim:
  * batch-parallel: grad_out, input, mean, rstd all split on one dim d < axis, weight and bias whole
    -> d_input split on d, d_weight and d_bias Partial (each rank sums its rows);
  * gradient-Partial: grad_out Partial, everything else whole -> all three gradients Partial. The kernel
    is linear in grad_out once input, mean, rstd and weight are fixed:
        d_input  = rstd * (g*w - mean(g*w) - xhat * mean(g*w*xhat))   (means over the normalized dims)
        d_weight = sum(g * xhat),  d_bias = sum(g)                     (sums over the batch dims)
    so Megatron's tensor-parallel gradient (Partial on tp) may be reduced after the LayerNorm as well as
    before it, as it could when the kernel was decomposed.
DTensor has the batch rows (and no Partial one); this rule replaces it.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.passes.rules.registry import RuleInput, rule

aten = torch.ops.aten


@rule(aten.native_layer_norm_backward.default)
def layer_norm_backward(inp: RuleInput) -> list[list]:
    x = inp.inputs[1]
    normalized = inp.args[2]
    n_state = len(inp.inputs) - 4  # weight and/or bias, when given (tensor inputs only)
    axis = len(x.shape) - len(normalized)
    d_in, d_w, d_b = (list(inp.outputs) + [None] * 3)[:3]
    rows = []
    for d in range(axis):
        outs = [Shard(d), Partial() if d_w is not None else None, Partial() if d_b is not None else None]
        rows.append(outs + [Shard(d)] * 4 + [Replicate()] * n_state)
    outs = [Partial() if o is not None else None for o in (d_in, d_w, d_b)]
    rows.append(outs + [Partial()] + [Replicate()] * (3 + n_state))
    return rows
