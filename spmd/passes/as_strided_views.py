"""as_strided_views: an `as_strided` that reads a tensor in its own order, and an `as_strided_scatter` that
writes the whole of one, -> views.

Before: a traced graph (after `kernel_layouts`: every value's strides are the device kernels'). torch's
decompositions leave storage-level ops where a model did nothing of the kind: `AdaptiveAvgPool1d` over a
transposed tensor (Swin's pooler, audio encoders) traces `as_strided(mean, size, stride)` in forward and, in
backward, a zeros buffer viewed by `as_strided`, written by `copy` and put back by `as_strided_scatter`, read
again by `as_strided`. These ops have no sharding rule (they read memory, not a tensor's values), so each ran
replicated: its input gathered on every rank, and the model's head after it run whole.

After: each such op whose input (for a scatter: the tensor written into) is contiguous over a storage of its own,
with no offset, and which reads (writes) it all in that order (the contiguous strides of its size, up to dims of
size 1, as many elements) is a `view` of it (of the source written, copied first where it owns no storage).
The values are the same: such an op reads (writes) the tensor's elements in their flat order. Any other
`as_strided` stays, and runs replicated as before.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from spmd.core.local_ops import owns_its_storage
from spmd.passes.trace_module import TracedGraph, call_like, copy_graph, with_graph

aten = torch.ops.aten


def _contiguous_strides(size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _in_order(base, size, stride, offset) -> bool:
    """Whether `as_strided(base, size, stride, offset)` covers all of `base`, in its flat order."""
    if not isinstance(base, torch.Tensor) or base.numel() == 0 or not owns_its_storage(base):
        return False
    size, stride = tuple(size), tuple(stride)
    return (offset in (None, 0) and len(size) == len(stride) and math.prod(size) == base.numel()
            and all(n == 1 or s == c for n, s, c in zip(size, stride, _contiguous_strides(size))))


def _val(arg):
    return arg.meta.get("val") if isinstance(arg, fx.Node) else None


def _offset(node: fx.Node):
    at = 4 if node.target is aten.as_strided_scatter.default else 3  # (self, [src,] size, stride, storage_offset)
    return node.args[at] if len(node.args) > at else node.kwargs.get("storage_offset")


def viewable(graph: fx.Graph) -> list[fx.Node]:
    """The `as_strided` and `as_strided_scatter` nodes this pass rewrites (the pipeline runs it where there are
    some)."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.as_strided.default:
            base, size, stride = node.args[:3]
            if _in_order(_val(base), size, stride, _offset(node)):
                found.append(node)
        elif node.target is aten.as_strided_scatter.default:
            base, src, size, stride = node.args[:4]
            if _in_order(_val(base), size, stride, _offset(node)) and isinstance(_val(src), torch.Tensor) \
                    and _val(src).dtype == _val(base).dtype and tuple(_val(src).shape) == tuple(size):
                found.append(node)
    return found


def as_strided_views(traced: TracedGraph) -> TracedGraph:
    """See the module docstring. A graph with nothing to rewrite is returned as it is; otherwise a new
    TracedGraph over a copy of the graph."""
    found = viewable(traced.graph)
    if not found:
        return traced
    graph, env = copy_graph(traced.graph)
    for old in found:
        node = env[old]
        with graph.inserting_before(node):
            if node.target is aten.as_strided.default:
                view = call_like(graph, node, aten.view.default, (node.args[0], list(node.args[1])))
            else:
                src = node.args[1]  # (a copy unless it owns its storage: a view of `h[1:]` would be read through
                if not owns_its_storage(src.meta["val"]):  # by a later as_strided; a review)
                    src = call_like(graph, node, aten.clone.default, (src,),
                                    {"memory_format": torch.contiguous_format})
                view = call_like(graph, node, aten.view.default, (src, list(node.args[0].meta["val"].shape)))
        node.replace_all_uses_with(view)
        graph.erase_node(node)
    return with_graph(traced, graph)
