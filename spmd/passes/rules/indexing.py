"""index_put with accumulate=True: the embedding's backward (a scatter-add of gradient rows).

`out = self; out[indices] += values` is linear in (self, values), so along one mesh axis:
  * indices and values split on the same leading (indexed) dim, self Partial -> out Partial
    (each rank adds its rows; the sum over ranks is the full scatter-add);
  * values split on a trailing dim d, self on the matching dim -> out on that dim (indices whole);
  * self and values Partial, indices whole -> out Partial.
DTensor's own rule has no Partial output, so without this a data-parallel embedding gradient would be
gathered instead of joining the bucketed gradient reductions. Other index_put forms stay replicated.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.passes.rules import RuleInput, rule

aten = torch.ops.aten


@rule(aten.index_put.default)
def index_put(inp: RuleInput) -> list[list]:
    indices = inp.args[1]
    accumulate = inp.args[3] if len(inp.args) > 3 else inp.kwargs.get("accumulate", False)
    tensor_indices = [i for i in indices if i is not None]
    self_info, values = inp.inputs[0], inp.inputs[-1]
    n_idx = len(tensor_indices)
    rows = [[Replicate()] * (3 + n_idx)]  # out, self, indices..., values
    if n_idx != 1 or indices[0] is None:  # only the embedding form: one index tensor on dim 0
        return rows
    idx_ndim = len(tensor_indices[0].shape)
    for k in range(idx_ndim, len(values.shape)):  # trailing dims of values = dims 1.. of self
        d = 1 + k - idx_ndim
        if d < len(self_info.shape):
            rows.append([Shard(d), Shard(d), Replicate(), Shard(k)])
    if accumulate:
        for d in range(idx_ndim):
            rows.append([Partial(), Partial(), Shard(d), Shard(d)])
        rows.append([Partial(), Partial(), Replicate(), Partial()])
    return rows
