"""gather_rows: a lookup of one position per row, `source[arange(B), idx]`, -> `gather` along the rows; its backward's
`index_put` -> `scatter_add` (or `scatter`).

Before: a traced graph in which an `aten.index.Tensor` (or the `aten.index_put.default` its backward writes the
gradient with) may take k leading `arange`s of its source's first k dims, each along its own dim of the indices'
broadcast shape (which starts with source's first k dims), then integer indices of the next dims: each row takes one
position, or several (the broadcast shape's dims past k; reflection padding's backward reads every row's gradient at
its padded positions so, over one or two dims, its row aranges clamped). transformers' sequence classification and
reward models pick each row's last token so (`logits[arange(batch), last_non_pad]`). The indices are values, so
every rule for the lookup wanted its source whole: a batch-split plan of such a model gathered the logits in forward
and their gradient in backward.

After: each such lookup is `gather(source, k, idx expanded over the other dims)` viewed as the lookup's result
(several indexed dims merged into one, and their indices into one linear index), and each such put `scatter_add`
(accumulating) or `scatter` (one position per row) of its values; a negative index counts from the end, as the
lookup's does, and one outside its dim raises, as the lookup does (gather's bounds error; merged dims, each index
checked against its own). Both split on the rows as the index does. The aranges and their views that fed nothing
else are gone; the rest of the graph, its nodes' names and metadata, is as traced. An arange is taken as
index_by_arange proves one (`arange_dim`).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from spmd.passes.index_by_arange import arange_dim, erase_unused, lookups
from spmd.passes.trace_module import TracedGraph, call_like, copy_graph, with_graph

aten = torch.ops.aten


def row_lookups(graph: fx.Graph) -> list[tuple[fx.Node, int]]:
    """The `aten.index.Tensor` and `aten.index_put.default` nodes that look up or write one position per row
    (`source[arange(B), idx]`), each with the dim its index picks along."""
    return lookups(graph, (aten.index.Tensor, aten.index_put.default), _row_dim)


def gather_rows(traced: TracedGraph) -> TracedGraph:
    """See the module docstring. A graph with nothing to rewrite is returned as it is; otherwise a new
    TracedGraph over a copy of the graph."""
    rows = row_lookups(traced.graph)
    if not rows:
        return traced
    graph, env = copy_graph(traced.graph)
    for node, dim in rows:
        _as_gather_or_scatter(graph, env[node], dim)
    return with_graph(traced, graph)


def _as_gather_or_scatter(graph: fx.Graph, node: fx.Node, k: int) -> None:
    """`source[a_0, ..., a_k-1, i_0, ..., i_m-1]` as a `gather` along dim k, or its `index_put` as a `scatter_add` /
    `scatter` (see the module docstring). Source's m indexed dims are merged into one (a contiguous copy first where
    they are not laid out so) and the indices into one linear index; the positions each row takes (the broadcast
    shape past its first k dims) are flattened into dim k of the gather's index, and the result viewed back."""
    source, indices = node.args[0], node.args[1]
    val = source.meta["val"]
    shape, m = tuple(val.shape), len(indices) - k
    rows, picked_dims, rest = list(shape[:k]), list(shape[k:k + m]), list(shape[k + m:])
    broadcast = list(torch.broadcast_shapes(*(i.meta["val"].shape for i in indices)))
    positions, length = math.prod(broadcast[k:]), math.prod(picked_dims)

    def call(op, *args, **kwargs):
        return call_like(graph, node, op, args, kwargs)

    def as_rows(value, trailing):
        """`value` (broadcast to [*broadcast, *trailing]) as [*rows, positions, *trailing]."""
        value = call(aten.expand.default, value, broadcast + trailing)
        if len(broadcast) > k + 1:  # (several dims of positions: one, from a copy of the expanded value)
            value = call(aten.clone.default, value, memory_format=torch.contiguous_format)
        return call(aten.view.default, value, rows + [positions] + trailing)

    with graph.inserting_before(node):
        linear = outside = None
        for j, idx in enumerate(indices[k:]):  # (row-major over the indexed dims; a negative index from the end)
            index = idx if idx.meta["val"].dtype == torch.int64 else call(aten._to_copy.default, idx, dtype=torch.int64)
            if not _non_negative(idx):
                wrapped = call(aten.add.Tensor, index, picked_dims[j])
                index = call(aten.where.self, call(aten.lt.Scalar, index, 0), wrapped, index)
            if m > 1:  # (past its own dim, an index would land in the merged dim's next row: a neighbour, silently)
                past = call(aten.ge.Scalar, index, picked_dims[j])
                if not _non_negative(idx):
                    past = call(aten.logical_or.default, past, call(aten.lt.Scalar, index, 0))
                outside = past if outside is None else call(aten.logical_or.default, outside, past)
            step = math.prod(picked_dims[j + 1:])
            index = index if step == 1 else call(aten.mul.Tensor, index, step)
            linear = index if linear is None else call(aten.add.Tensor, linear, index)
        if outside is not None:  # (the merged dim's length is out of its range: gather raises, as the lookup did)
            linear = call(aten.masked_fill.Scalar, linear, outside, length)
        index = as_rows(linear, [])
        index = call(aten.view.default, index, rows + [positions] + [1] * len(rest))
        index = call(aten.expand.default, index, rows + [positions] + rest)
        merged = source
        if m > 1:
            if not _mergeable(val, k, m):
                merged = call(aten.clone.default, merged, memory_format=torch.contiguous_format)
            merged = call(aten.view.default, merged, rows + [length] + rest)
        if node.target is aten.index.Tensor:
            picked = call(aten.gather.default, merged, k, index)
            result = call(aten.view.default, picked, broadcast + rest)
        else:
            op = aten.scatter_add.default if _accumulates(node) else aten.scatter.src
            result = call(op, merged, k, index, as_rows(node.args[2], rest))
            if m > 1:
                result = call(aten.view.default, result, list(shape))
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    for feeder in dict.fromkeys(indices[:k]):  # the aranges and views that fed only this lookup
        erase_unused(graph, feeder)


def _accumulates(node: fx.Node) -> bool:
    """Whether an `index_put` adds its values (`accumulate=True`) rather than writing them."""
    return bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False))


def _non_negative(node: fx.Node) -> bool:
    """Whether the graph shows `node`'s values are never negative (an argmax, sequence classification's last token;
    a clamp from 0 or more, reflection padding's), so that no wrap of negative indices is needed (three kernels
    fewer, each a launch: on a GPU profile they cost about what the gather they spare did)."""
    if node.op != "call_function":
        return False
    if node.target in (aten.argmax.default, aten.argmin.default):
        return True
    if node.target is aten.clamp.default:
        low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
        return isinstance(low, (int, float)) and low >= 0
    if node.target is aten._to_copy.default and isinstance(node.args[0], fx.Node):
        return _non_negative(node.args[0])
    return False


def _mergeable(val: torch.Tensor, k: int, m: int) -> bool:
    """Whether dims k .. k+m-1 of `val` view as one (each laid out right after the next, sizes of one aside)."""
    dims = [d for d in range(k, k + m) if val.shape[d] != 1]
    return all(val.stride(a) == val.stride(b) * val.shape[b] for a, b in zip(dims, dims[1:]))


def _row_dim(node: fx.Node, along: dict) -> int | None:
    """k, for `source[a_0, ..., a_k-1, i_0, ..., i_m-1]` (or its index_put), k, m >= 1, where each `a_j` is
    `arange(source.shape[j])` along dim j of the indices' broadcast shape, that shape starts with `source.shape[:k]`,
    and the `i` are integer tensors (a put that does not accumulate: one position per row, where a repeated one
    keeps any of its values); else None."""
    source, indices = node.args[0], node.args[1]
    if not isinstance(source, fx.Node) or not isinstance(indices, (list, tuple)) or len(indices) < 2 or \
            any(not isinstance(i, fx.Node) for i in indices):
        return None
    val, vals = source.meta.get("val"), [i.meta.get("val") for i in indices]
    if not isinstance(val, torch.Tensor) or val.dim() < len(indices) or \
            not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    shape = tuple(val.shape)
    try:
        broadcast = tuple(torch.broadcast_shapes(*(v.shape for v in vals)))
    except RuntimeError:
        return None
    k = 0
    while k < len(indices) - 1:  # (the leading aranges, each along its own dim)
        p = arange_dim(indices[k], along)
        if p is None or p + len(broadcast) - vals[k].dim() != k or vals[k].shape[p] != shape[k]:
            break
        k += 1
    if k == 0 or broadcast[:k] != shape[:k]:
        return None
    if any(v.dtype.is_floating_point or v.dtype.is_complex or v.dtype in (torch.bool, torch.uint8) for v in vals[k:]):
        return None
    if node.target is aten.index_put.default:
        values = node.args[2].meta.get("val") if isinstance(node.args[2], fx.Node) else None
        result = broadcast + shape[len(indices):]
        if not isinstance(values, torch.Tensor) or values.dim() > len(result) or \
                any(n not in (1, result[len(result) - values.dim() + d]) for d, n in enumerate(values.shape)) or \
                (not _accumulates(node) and len(broadcast) > k):
            return None
    return k
