"""index_by_arange: a gather whose indices are `arange`s over whole dims -> the same values as views and a copy.

Before: a traced graph in which an `aten.index.Tensor` may take, for each of the leading dims it indexes, an
`arange(0, size)` of that dim laid along one dim of the index's broadcast shape. transformers builds every
attention mask so (`padding_mask[batch_arange[:, None, None, None], kv_arange[None, None, None, :]]`): the
lookup gives the padding mask back, `unsqueeze`d. No sharding rule can see that from the op: the indices are
values, so the gather wants its source whole, and a batch-split plan of every such model gathered the mask
over the data-parallel axis at each call (an all_gather in inference, an all_to_all in training), where a
hand-written data-parallel model runs no collective at all.

After: each such index is `unsqueeze`s of its source (a 1 where the broadcast shape has no arange) and a
contiguous `clone` (an index makes a new tensor), the same values, dtype, shape and strides; the aranges and
their views that fed nothing else are gone. The rest of the graph, its nodes' names and metadata, is as traced.
Only what the graph proves is taken: an arange from 0 by 1, moved only through views that add or drop dims of size
1, adding 0, a clamp to a range that holds it, or a cast to an integer dtype that holds it; indices in the order of
the dims they index (a transposing lookup stays a gather), with no `None` (slice) among them; a contiguous source (a
lookup lays its result out as its source, channels_last too, which the copy would not). A lookup of one position per
row is gather_rows's.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from spmd.passes.trace_module import TracedGraph, call_like, copy_graph, with_graph

aten = torch.ops.aten

_ARANGES = frozenset({aten.arange.default, aten.arange.start, aten.arange.start_step})
# ops whose output holds its first input's values, in order, where the shapes differ at most in dims of size 1
_SAME_VALUES = frozenset({aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                          aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.clone.default,
                          aten.alias.default, aten.lift_fresh_copy.default, aten._to_copy.default})
_PLUS_ZERO = frozenset({aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar})


def identity_indexes(graph: fx.Graph) -> list[tuple[fx.Node, tuple[int, ...]]]:
    """The `aten.index.Tensor` nodes this pass rewrites, each with the broadcast dims its indices lie along (the
    pipeline runs the pass where there are some)."""
    return lookups(graph, (aten.index.Tensor,), _identity_dims)


def lookups(graph: fx.Graph, targets: tuple, probe) -> list[tuple[fx.Node, object]]:
    """Each node of `graph` calling one of `targets` for which `probe(node, along)` finds something (not None),
    with what it found; `along` keeps the aranges proven so far (`arange_dim`) for the whole graph."""
    along: dict[fx.Node, int | None] = {}
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in targets:
            what = probe(node, along)
            if what is not None:
                found.append((node, what))
    return found


def index_by_arange(traced: TracedGraph) -> TracedGraph:
    """See the module docstring. A graph with nothing to rewrite is returned as it is; otherwise a new
    TracedGraph over a copy of the graph."""
    found = identity_indexes(traced.graph)
    if not found:
        return traced
    graph, env = copy_graph(traced.graph)
    for index, dims in found:
        node = env[index]
        source, indices = node.args[0], node.args[1]
        rank = len(node.meta["val"].shape) - (len(source.meta["val"].shape) - len(indices))
        value = source
        with graph.inserting_before(node):
            for dim in (d for d in range(rank) if d not in dims):  # (ascending: each lands where it is meant to)
                value = call_like(graph, node, aten.unsqueeze.default, (value, dim))
            copy = call_like(graph, node, aten.clone.default, (value,), {"memory_format": torch.contiguous_format})
        node.replace_all_uses_with(copy)
        graph.erase_node(node)
        for feeder in dict.fromkeys(indices):  # the aranges and views that fed only this lookup
            erase_unused(graph, feeder)
    return with_graph(traced, graph)


def erase_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erase `node` and, in turn, the inputs it alone read, while they are aranges or the ops that carry them."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.users or n.op != "call_function" or not (n.target in _ARANGES or n.target in _SAME_VALUES or
                                                       n.target in _PLUS_ZERO):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        stack.extend(inputs)


def _identity_dims(node: fx.Node, along: dict) -> tuple[int, ...] | None:
    """For `source[i_0, ..., i_k-1]` where each `i_d` is `arange(source.shape[d])` along dim `p_d` of the
    indices' broadcast shape, with p_0 < ... < p_k-1, and the broadcast shape 1 elsewhere: (p_0, ..., p_k-1)."""
    source, indices = node.args[0], node.args[1]
    if not isinstance(source, fx.Node) or not indices or any(not isinstance(i, fx.Node) for i in indices):
        return None
    shape, out = source.meta.get("val"), node.meta.get("val")
    if not isinstance(shape, torch.Tensor) or not isinstance(out, torch.Tensor) or len(indices) > shape.dim():
        return None
    if not (shape.is_contiguous() and out.is_contiguous()):  # (a lookup follows its source's layout, channels_last
        return None  # too, which the contiguous copy would not: a dropout after it drew another mask; a review)
    rank = out.dim() - (shape.dim() - len(indices))  # the indices' broadcast rank
    dims = []
    for d, index in enumerate(indices):
        p = arange_dim(index, along)
        val = index.meta.get("val")
        if p is None or val.shape[p] != shape.shape[d]:
            return None
        dims.append(p + rank - val.dim())  # (indices broadcast from the right)
    broadcast = tuple(out.shape[:rank])
    if any(later <= earlier for earlier, later in zip(dims, dims[1:])) or \
            broadcast != tuple(shape.shape[dims.index(p)] if p in dims else 1 for p in range(rank)):
        return None
    return tuple(dims)


def arange_dim(node: fx.Node, along: dict) -> int | None:
    """The dim along which `node`'s value is `arange(0, n)` (its only dim of more than one element; n >= 2),
    or None where the graph does not show it."""
    if node in along:
        return along[node]
    along[node] = None  # (a cycle cannot happen in a graph; this only keeps a failed look from repeating)
    val = node.meta.get("val")
    if node.op != "call_function" or not isinstance(val, torch.Tensor) or val.dtype.is_floating_point or \
            val.dtype.is_complex or val.dtype == torch.bool:
        return None
    wide = [d for d, s in enumerate(val.shape) if s != 1]
    if len(wide) != 1 or val.shape[wide[0]] < 2 or val.shape[wide[0]] - 1 > torch.iinfo(val.dtype).max:
        return None
    args, kwargs = node.args, node.kwargs
    if node.target in _ARANGES:
        ends = list(args) + [kwargs[k] for k in ("start", "end", "step") if k in kwargs]
        start, step = (0, 1) if node.target is aten.arange.default else (ends[0], ends[2] if len(ends) > 2 else 1)
        proven = start == 0 and step == 1
    elif node.target in _PLUS_ZERO:
        proven = isinstance(args[0], fx.Node) and len(args) > 1 and not isinstance(args[1], fx.Node) and \
            args[1] == 0 and kwargs.get("alpha", 1) == 1 and arange_dim(args[0], along) is not None
    elif node.target is aten.clamp.default:  # (reflection padding's backward clamps its row aranges to their range)
        low = args[1] if len(args) > 1 else kwargs.get("min")
        high = args[2] if len(args) > 2 else kwargs.get("max")
        n = val.shape[wide[0]]
        proven = isinstance(args[0], fx.Node) and arange_dim(args[0], along) is not None and \
            not isinstance(low, fx.Node) and not isinstance(high, fx.Node) and \
            (low is None or low <= 0) and (high is None or high >= n - 1)
    elif node.target in _SAME_VALUES:
        source = args[0] if args and isinstance(args[0], fx.Node) else None
        proven = source is not None and arange_dim(source, along) is not None and \
            source.meta["val"].numel() == val.numel() and \
            (node.target is not aten._to_copy.default or set(kwargs) <= {"dtype", "device", "layout"})
    else:
        proven = False
    along[node] = wide[0] if proven else None
    return along[node]
