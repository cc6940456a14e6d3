"""gather_rows: a lookup of one position per row, `source[arange(B), idx]`, -> `gather` along the rows; its backward's
`index_put` -> `scatter_add` (or `scatter`).

Before: a traced graph in which an `aten.index.Tensor` (or the `aten.index_put.default` its backward writes the
gradient with) may take k leading `arange`s of its source's first k dims, each along its own dim of the indices'
broadcast shape (which is source's first k dims), then one integer index that broadcasts to it. transformers'
sequence classification and reward models pick each row's last token so (`logits[arange(batch), last_non_pad]`).
The indices are values, so every rule for the lookup wanted its source whole: a batch-split plan of such a model
gathered the logits in forward and their gradient in backward.

After: each such lookup is `gather(source, k, idx expanded over the other dims).squeeze(k)`, and each such put
`scatter_add` (accumulating) or `scatter` of its values unsqueezed at k; a negative index counts from the end, as
the lookup's does. Both split on the rows as the index does. The aranges and their views that fed nothing else are
gone; the rest of the graph, its nodes' names and metadata, is as traced. An arange is taken as index_by_arange
proves one (`arange_dim`).
"""
from __future__ import annotations

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
    """`source[a_0, ..., a_k-1, idx]` as `gather(source, k, idx expanded).squeeze(k)`, or its `index_put` as
    `scatter_add` / `scatter` of the values unsqueezed at k (see the module docstring)."""
    source, indices = node.args[0], node.args[1]
    shape = tuple(source.meta["val"].shape)
    rows, rest = shape[:k], shape[k + 1:]
    idx = indices[k]
    with graph.inserting_before(node):
        index = idx
        if index.meta["val"].dim() < k:
            index = call_like(graph, node, aten.view.default, (index, [1] * (k - index.meta["val"].dim()) +
                                                                list(index.meta["val"].shape)))
        if index.meta["val"].dtype != torch.int64:
            index = call_like(graph, node, aten._to_copy.default, (index,), {"dtype": torch.int64})
        negative = call_like(graph, node, aten.lt.Scalar, (index, 0))
        wrapped = call_like(graph, node, aten.add.Tensor, (index, shape[k]))
        index = call_like(graph, node, aten.where.self, (negative, wrapped, index))
        index = call_like(graph, node, aten.expand.default, (index, list(rows)))
        index = call_like(graph, node, aten.view.default, (index, [*rows, 1] + [1] * len(rest)))
        index = call_like(graph, node, aten.expand.default, (index, [*rows, 1, *rest]))
        if node.target is aten.index.Tensor:
            picked = call_like(graph, node, aten.gather.default, (source, k, index))
            result = call_like(graph, node, aten.squeeze.dim, (picked, k))
        else:
            values, accumulate = node.args[2], (node.args[3] if len(node.args) > 3 else
                                                node.kwargs.get("accumulate", False))
            values = call_like(graph, node, aten.expand.default, (values, [*rows, *rest]))
            values = call_like(graph, node, aten.unsqueeze.default, (values, k))
            op = aten.scatter_add.default if accumulate else aten.scatter.src
            result = call_like(graph, node, op, (source, k, index, values))
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    for feeder in dict.fromkeys(indices[:k]):  # the aranges and views that fed only this lookup
        erase_unused(graph, feeder)


def _row_dim(node: fx.Node, along: dict) -> int | None:
    """k, for `source[a_0, ..., a_k-1, idx]` (or its index_put) where each `a_j` is `arange(source.shape[j])`
    along dim j of the indices' broadcast shape, that shape is `source.shape[:k]`, and `idx` is an integer tensor
    that broadcasts to it; else None."""
    source, indices = node.args[0], node.args[1]
    if not isinstance(source, fx.Node) or not isinstance(indices, (list, tuple)) or len(indices) < 2 or \
            any(not isinstance(i, fx.Node) for i in indices):
        return None
    val = source.meta.get("val")
    k = len(indices) - 1
    if not isinstance(val, torch.Tensor) or val.dim() <= k:
        return None
    shape = tuple(val.shape)
    for j, index in enumerate(indices[:k]):
        p, arange = arange_dim(index, along), index.meta.get("val")
        if p is None or p + k - arange.dim() != j or arange.shape[p] != shape[j]:
            return None
    idx = indices[k].meta.get("val")
    if not isinstance(idx, torch.Tensor) or idx.dtype.is_floating_point or idx.dtype.is_complex or \
            idx.dtype in (torch.bool, torch.uint8) or idx.dim() > k or \
            any(n not in (1, shape[k - idx.dim() + d]) for d, n in enumerate(idx.shape)):
        return None
    if node.target is aten.index_put.default:
        values = node.args[2].meta.get("val") if isinstance(node.args[2], fx.Node) else None
        result = shape[:k] + shape[k + 1:]
        if not isinstance(values, torch.Tensor) or values.dim() > len(result) or \
                any(n not in (1, result[len(result) - values.dim() + d]) for d, n in enumerate(values.shape)):
            return None
    return k
