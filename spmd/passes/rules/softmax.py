"""Softmax and log-softmax backward. The joint graph keeps the softmax one whole (trace_joint.KEPT_WHOLE)
and decomposes log-softmax (trace_joint.DECOMPOSED); graphs traced otherwise may hold either.

    _softmax_backward_data(g, y, dim)     = y * (g - sum(g * y, dim))
    _log_softmax_backward_data(g, y, dim) = g - exp(y) * sum(g, dim)

Along one mesh axis: g, y and the result split together on any dim but `dim` (DTensor's rule), or g
Partial and y whole -> Partial (both are linear in g once y is fixed).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.passes.rules.registry import RuleInput, rule

aten = torch.ops.aten


@rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward(inp: RuleInput) -> list[list]:
    ndim = len(inp.inputs[0].shape)
    dim = inp.args[2] % max(ndim, 1)
    rows = [[Shard(d)] * 3 for d in range(ndim) if d != dim]
    rows.append([Partial(), Partial(), Replicate()])
    return rows
