"""The embedding's backward: embedding_dense_backward (kept whole in the joint graph, see
trace_joint.KEPT_WHOLE) and index_put with accumulate=True (what it decomposes to: a scatter-add of
gradient rows).

`out = self; out[indices] += values` is linear in (self, values), so along one mesh axis:
  * indices and values split on the same leading (indexed) dim, self Partial -> out Partial
    (each rank adds its rows; the sum over ranks is the full scatter-add);
  * values split on a trailing dim d, self on the matching dim -> out on that dim (indices whole);
  * self and values Partial, indices whole -> out Partial.
A bool mask over self's first k dims takes only the rows that split self past them (the mask whole), and,
accumulating, the Partial one.
DTensor's own rule has no Partial output, so without this a data-parallel embedding gradient would be
gathered instead of joining the bucketed gradient reductions. Integer indices on adjacent dims after whole
slices (`out[:, :, i, j] += g`, the backward of nearest and bilinear upsampling and of `unfold`) split self on
any other dim, values on the matching dim of the index result (`_past_slices`): a batch-split CNN gathered its
activations there. Other index_put forms stay replicated.

An EmbeddingBag's table split by columns (its hidden dim) looks up and reduces each column apart, in every mode (sum,
mean, max: a max and its row are per column), so along one mesh axis its output, and its max indices (max mode), split
on that dim, the indices, offsets and per-sample weights whole; its backward takes the gradient so split, or Partial
(linear in it), to the table's gradient so; the per-sample weights' gradient (a dot product over the hidden dim) is
Partial from split gradient and table. Splitting the bags needs their offsets made local, and the rows a masked
lookup: not done (a probe found every EmbeddingBag run whole on every rank; recommender tables split by columns now).

embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq) is the same
scatter-add (rows at padding_idx dropped), so along one mesh axis:
  * grad and indices split on the same index dim -> weight gradient Partial (DTensor's rule has this),
    except with scale_grad_by_freq: each row is divided by how often its index occurs, and a rank only
    sees its own indices' counts;
  * grad split on its last (hidden) dim, indices whole -> weight gradient split on dim 1;
  * grad Partial, indices whole -> Partial (the counts, if any, are the global ones);
  * grad and indices whole -> weight gradient split on dim 0 (vocab-parallel: each rank computes the rows
    it holds, see vocab_parallel.py), except with scale_grad_by_freq.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.core.specs import TensorInfo
from spmd.passes.rules.registry import RuleInput, rule

aten = torch.ops.aten


@rule(aten.index_put.default)
def index_put(inp: RuleInput) -> list[list]:
    indices = inp.args[1]
    accumulate = inp.args[3] if len(inp.args) > 3 else inp.kwargs.get("accumulate", False)
    tensor_indices = [i for i in indices if i is not None]
    self_info, values = inp.inputs[0], inp.inputs[-1]
    n_idx = len(tensor_indices)
    rows = [[Replicate()] * (3 + n_idx)]  # out, self, indices..., values
    if n_idx and indices[0] is None:
        return rows + _past_slices(indices, self_info, values, accumulate)
    if n_idx != 1:  # only the embedding form: one index tensor on dim 0
        return rows
    idx_ndim = len(tensor_indices[0].shape)
    if tensor_indices[0].dtype in (torch.bool, torch.uint8):
        # a mask over self's first idx_ndim dims: the index result is (its True positions, *self.shape[idx_ndim:]),
        # so only self's dims past the mask split (the mask whole), and values' rows are positions, not a dim of
        # the mask (a probe found both forms of the integer index's rows failing on a mask: an IndexError)
        offset = 1 + len(self_info.shape) - idx_ndim - len(values.shape)
        for d in range(idx_ndim, len(self_info.shape)):
            k = 1 + d - idx_ndim - offset
            on = Shard(k) if k >= 0 and values.shape[k] == self_info.shape[d] else Replicate()
            rows.append([Shard(d), Shard(d), Replicate(), on])
        if accumulate:
            rows.append([Partial(), Partial(), Replicate(), Partial()])
        return rows
    # values broadcast (right-aligned) against the index result, of shape (*index.shape, *self.shape[1:])
    offset = idx_ndim + len(self_info.shape) - 1 - len(values.shape)

    def values_on(pos: int, size: int):
        """values' placement where the index result is split on dim `pos` (of size `size`): the matching
        dim of values, or whole where values broadcasts there (missing, or size 1)."""
        k = pos - offset
        return Shard(k) if k >= 0 and values.shape[k] == size else Replicate()

    for d in range(1, len(self_info.shape)):  # dims 1.. of self = trailing dims of the index result
        rows.append([Shard(d), Shard(d), Replicate(), values_on(idx_ndim + d - 1, self_info.shape[d])])
    if accumulate:
        for d in range(idx_ndim):
            rows.append([Partial(), Partial(), Shard(d), values_on(d, tensor_indices[0].shape[d])])
        rows.append([Partial(), Partial(), Replicate(), Partial()])
    return rows


def _past_slices(indices, self_info, values, accumulate) -> list[list]:
    """`out = self; out[:, ..., i, j] (+)= values`: integer index tensors on adjacent dims [k, k + m) after k whole
    slices (None), as the backward of `x[:, :, rows, cols]` (nearest upsampling, reflection padding) puts its
    gradient. The index result is (*self.shape[:k], *broadcast index shape, *self.shape[k + m:]), so self splits on
    any dim the indices do not cover, values on the matching dim of the result (whole where it broadcasts there),
    the indices whole; accumulating, Partial self and values give a Partial result."""
    at = [p for p, i in enumerate(indices) if i is not None]
    k, m = at[0], len(at)
    if at != list(range(k, k + m)) or any(indices[p].dtype in (torch.bool, torch.uint8) for p in at):
        return []  # (indices apart put their dims first; a mask counts its True positions)
    b = max(len(indices[p].shape) for p in at)
    offset = k + b + len(self_info.shape) - k - m - len(values.shape)

    def values_on(pos: int, size: int):
        j = pos - offset
        return Shard(j) if j >= 0 and values.shape[j] == size else Replicate()

    rows = []
    for d in range(len(self_info.shape)):
        if k <= d < k + m:
            continue
        pos = d if d < k else d - m + b
        rows.append([Shard(d), Shard(d), *[Replicate()] * m, values_on(pos, self_info.shape[d])])
    if accumulate:
        rows.append([Partial(), Partial(), *[Replicate()] * m, Partial()])
    return rows


@rule(aten.embedding_dense_backward.default)
def embedding_dense_backward(inp: RuleInput) -> list[list]:
    grad, indices = inp.inputs
    by_freq = inp.args[4] if len(inp.args) > 4 else inp.kwargs.get("scale_grad_by_freq", False)
    rows = [[Shard(1), Shard(len(grad.shape) - 1), Replicate()]]
    if not by_freq:
        rows += [[Partial(), Shard(d), Shard(d)] for d in range(len(indices.shape))]
        rows.append([Shard(0), Replicate(), Replicate()])  # vocab-parallel: each rank its rows (vocab_parallel.py)
    rows.append([Partial(), Partial(), Replicate()])
    return rows


def _by_tensor_arg(inp: RuleInput, placement_of) -> list:
    """One placement per tensor input, in the order the op takes them: `placement_of(position, info)`, position an
    index into args or a keyword's name."""
    at = [(i, a) for i, a in enumerate(inp.args) if isinstance(a, TensorInfo)]
    at += [(k, v) for k, v in inp.kwargs.items() if isinstance(v, TensorInfo)]
    return [placement_of(position, info) for position, info in at]


@rule(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(inp: RuleInput) -> list[list]:
    """(output, offset2bag, bag_size, max_indices) from (weight, indices, offsets, per_sample_weights)."""
    hidden = inp.inputs[0].shape[1]
    outs = [None if o is None else Shard(1) if len(o.shape) == 2 and o.shape[1] == hidden else Replicate()
            for o in inp.outputs]
    return [[*outs, *_by_tensor_arg(inp, lambda at, _: Shard(1) if at == 0 else Replicate())]]


def _bag_backward(inp: RuleInput, max_indices: int) -> list[list]:
    """The table's gradient from (grad, ..., maximum_indices at `max_indices`, ..., per_sample_weights)."""
    def split(at, info):
        return Shard(1) if at == 0 or (at == max_indices and len(info.shape) == 2) else Replicate()

    return [[Shard(1), *_by_tensor_arg(inp, split)],
            [Partial(), *_by_tensor_arg(inp, lambda at, _: Partial() if at == 0 else Replicate())]]


@rule(aten._embedding_bag_backward.default)
def embedding_bag_backward(inp: RuleInput) -> list[list]:
    sparse = inp.args[9] if len(inp.args) > 9 else inp.kwargs.get("sparse", False)
    if sparse:  # (a sparse gradient: whole)
        return [[Replicate()] * (1 + len(inp.inputs))]
    return _bag_backward(inp, 5)


@rule(aten._embedding_bag_dense_backward.default)
def embedding_bag_dense_backward(inp: RuleInput) -> list[list]:
    return _bag_backward(inp, 4)


@rule(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(inp: RuleInput) -> list[list]:
    """The per-sample weights' gradient, sum over the hidden dim of grad * the looked-up rows: (grad, weight, ...)."""
    return [[Partial(), *_by_tensor_arg(inp, lambda at, _: Shard(1) if at in (0, 1) else Replicate())],
            [Partial(), *_by_tensor_arg(inp, lambda at, _: Partial() if at == 0 else Replicate())]]
