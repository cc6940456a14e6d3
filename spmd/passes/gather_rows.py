"""gather_rows: a lookup of one position per row, `source[arange(B), idx]`, -> `gather` along the rows; its backward's
`index_put` -> `scatter_add` (or `scatter`).

Before: a traced graph in which an `aten.index.Tensor` (or the `aten.index_put.default` its backward writes the
gradient with) may take k leading `arange`s of its source's first k dims, each along its own dim of the indices'
broadcast shape (which starts with source's first k dims), then one integer index: each row takes one position
along dim k, or several (the broadcast shape's dims past k; reflection padding's backward reads every row's
gradient at its padded positions so, its row aranges clamped). transformers'
sequence classification and reward models pick each row's last token so (`logits[arange(batch), last_non_pad]`).
The indices are values, so every rule for the lookup wanted its source whole: a batch-split plan of such a model
gathered the logits in forward and their gradient in backward.

After: each such lookup is `gather(source, k, idx expanded over the other dims)` viewed as the lookup's result,
and each such put `scatter_add` (accumulating) or `scatter` (one position per row) of its values; a negative index counts from the end, as
the lookup's does. Both split on the rows as the index does. The aranges and their views that fed nothing else are
gone; the rest of the graph, its nodes' names and metadata, is as traced. An arange is taken as index_by_arange
proves one (`arange_dim`).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from spmd.passes.index_by_arange import arange_dim, erase_unused
from spmd.passes.trace_module import TracedGraph, call_like, copy_graph, with_graph

aten = torch.ops.aten


def row_lookups(graph: fx.Graph) -> list[tuple[fx.Node, int]]:
    """The `aten.index.Tensor` and `aten.index_put.default` nodes that look up or write one position per row
    (`source[arange(B), idx]`), each with the dim its index picks along."""
    along: dict[fx.Node, int | None] = {}
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in (aten.index.Tensor, aten.index_put.default):
            dim = _row_dim(node, along)
            if dim is not None:
                found.append((node, dim))
    return found


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
    """`source[a_0, ..., a_k-1, idx]` as a `gather` along dim k, or its `index_put` as a `scatter_add` / `scatter`
    (see the module docstring). The indices' broadcast shape is source's first k dims, then the positions each row
    takes (E, none or more dims): those are flattened into dim k of the gather's index, and the result viewed back."""
    source, indices = node.args[0], node.args[1]
    shape = tuple(source.meta["val"].shape)
    rows, rest = list(shape[:k]), list(shape[k + 1:])
    broadcast = list(torch.broadcast_shapes(*(i.meta["val"].shape for i in indices)))
    positions = math.prod(broadcast[k:])
    idx = indices[k]

    def call(op, *args, **kwargs):
        return call_like(graph, node, op, args, kwargs)

    def as_rows(value, trailing):
        """`value` (broadcast to [*broadcast, *trailing]) as [*rows, positions, *trailing]."""
        value = call(aten.expand.default, value, broadcast + trailing)
        if len(broadcast) > k + 1:  # (several dims of positions: one, from a copy of the expanded value)
            value = call(aten.clone.default, value, memory_format=torch.contiguous_format)
        return call(aten.view.default, value, rows + [positions] + trailing)

    with graph.inserting_before(node):
        index = idx if idx.meta["val"].dtype == torch.int64 else call(aten._to_copy.default, idx, dtype=torch.int64)
        wrapped = call(aten.add.Tensor, index, shape[k])  # (a negative index counts from the end)
        index = call(aten.where.self, call(aten.lt.Scalar, index, 0), wrapped, index)
        index = as_rows(index, [])
        index = call(aten.view.default, index, rows + [positions] + [1] * len(rest))
        index = call(aten.expand.default, index, rows + [positions] + rest)
        if node.target is aten.index.Tensor:
            picked = call(aten.gather.default, source, k, index)
            result = call(aten.view.default, picked, broadcast + rest)
        else:
            values, accumulate = node.args[2], (node.args[3] if len(node.args) > 3 else
                                                node.kwargs.get("accumulate", False))
            op = aten.scatter_add.default if accumulate else aten.scatter.src
            result = call(op, source, k, index, as_rows(values, rest))
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    for feeder in dict.fromkeys(indices[:k]):  # the aranges and views that fed only this lookup
        erase_unused(graph, feeder)


def _row_dim(node: fx.Node, along: dict) -> int | None:
    """k, for `source[a_0, ..., a_k-1, idx]` (or its index_put) where each `a_j` is `arange(source.shape[j])`
    along dim j of the indices' broadcast shape, that shape starts with `source.shape[:k]`, and `idx` is an integer
    tensor (a put that does not accumulate: one position per row, where a repeated one keeps any of its values);
    else None."""
    source, indices = node.args[0], node.args[1]
    if not isinstance(source, fx.Node) or not isinstance(indices, (list, tuple)) or len(indices) < 2 or \
            any(not isinstance(i, fx.Node) for i in indices):
        return None
    val, vals = source.meta.get("val"), [i.meta.get("val") for i in indices]
    k = len(indices) - 1
    if not isinstance(val, torch.Tensor) or val.dim() <= k or not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    shape = tuple(val.shape)
    try:
        broadcast = tuple(torch.broadcast_shapes(*(v.shape for v in vals)))
    except RuntimeError:
        return None
    if broadcast[:k] != shape[:k]:
        return None
    for j, (index, arange) in enumerate(zip(indices[:k], vals)):
        p = arange_dim(index, along)
        if p is None or p + len(broadcast) - arange.dim() != j or arange.shape[p] != shape[j]:
            return None
    idx = vals[k]
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype in (torch.bool, torch.uint8):
        return None
    if node.target is aten.index_put.default:
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        values = node.args[2].meta.get("val") if isinstance(node.args[2], fx.Node) else None
        result = broadcast + shape[k + 1:]
        if not isinstance(values, torch.Tensor) or values.dim() > len(result) or \
                any(n not in (1, result[len(result) - values.dim() + d]) for d, n in enumerate(values.shape)) or \
                (not accumulate and len(broadcast) > k):
            return None
    return k
