"""unmerge_bmm: a `bmm` over leading dims merged into one -> a `matmul` over those dims themselves.

Before: a traced graph in which `torch.matmul` of two tensors of 4 or more dims (an eager attention's
`q @ k.transpose(-1, -2)` and `probs @ v` over [batch, heads, seq, dim]) is, as torch decomposes it, a `view`
of each operand merging its leading dims into one, a `bmm`, and a `view` splitting the result's first dim back;
and backward's `bmm`s read those merged views, transposed (`permute(m, [0, 2, 1])`). A merged dim can keep a split
of its outermost dim only (the batch): split on heads, each rank's rows of [batch * heads] are not one block of
it, so a head-parallel (Megatron) plan gathered q, k and v, or sent them from heads to batch, before every such
product (a plan-quality probe: 8 extra all_gathers on a BERT layer with attention dropout, which takes the
eager path; the same on T5 and any model that calls `torch.matmul` on 4-D tensors).

After: each such `bmm` whose two operands are merged views of tensors with the same leading dims (each maybe
transposed in its last two dims) and whose every reader splits the merged dim back into them is one
`aten.matmul` of the unmerged tensors (transposed with a `permute` of their last two dims), read in place of
those splits; `rules/matmul.py` splits it on any leading dim. The merged views and transposes nothing else
reads are gone. The values are the same (each batch of the `bmm` is one (leading index) of the `matmul`).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx

from spmd.passes.trace_module import TracedGraph, call_like, copy_graph, with_graph

aten = torch.ops.aten

_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})


@dataclasses.dataclass(frozen=True)
class _Operand:
    source: fx.Node  # the tensor of unmerged leading dims
    lead: tuple[int, ...]  # its leading dims (merged into the bmm's batch)
    transposed: bool  # the bmm reads it with its last two dims swapped
    via: tuple[fx.Node, ...]  # the merged view (and the transpose) between it and the bmm


def unmergeable(graph: fx.Graph) -> list[tuple[fx.Node, _Operand, _Operand]]:
    """The `bmm` nodes this pass rewrites, each with its two operands (the pipeline runs it where there are some)."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten.bmm.default:
            continue
        a, b = (_operand(arg) for arg in node.args[:2])
        if a is None or b is None or a.lead != b.lead:
            continue
        if node.users and all(_splits(user, a.lead) for user in node.users):
            found.append((node, a, b))
    return found


def unmerge_bmm(traced: TracedGraph) -> TracedGraph:
    """See the module docstring. A graph with nothing to rewrite is returned as it is; otherwise a new
    TracedGraph over a copy of the graph."""
    found = unmergeable(traced.graph)
    if not found:
        return traced
    graph, env = copy_graph(traced.graph)
    became: dict[fx.Node, fx.Node] = {}  # a split erased -> the matmul read in its place (a chain of products)
    for bmm, *operands in found:
        node = env[bmm]
        with graph.inserting_before(node):
            unmerged = []
            for operand in operands:
                value = became.get(env[operand.source], env[operand.source])
                if operand.transposed:
                    rank = len(operand.lead) + 2
                    order = [*range(rank - 2), rank - 1, rank - 2]
                    value = call_like(graph, env[operand.via[-1]], aten.permute.default, (value, order))
                unmerged.append(value)
            product = call_like(graph, node, aten.matmul.default, tuple(unmerged))
        split = next(iter(node.users)).meta["val"]
        assert (product.meta["val"].shape, product.meta["val"].dtype) == (split.shape, split.dtype), (node, split)
        for split in list(node.users):
            split.replace_all_uses_with(product)
            graph.erase_node(split)
            became[split] = product
        graph.erase_node(node)
        for operand in operands:  # the transposes and merged views nothing else reads (another product may)
            for via in reversed(operand.via):
                if env[via] not in became and not env[via].users and env[via].graph is graph:
                    graph.erase_node(env[via])
                    became[env[via]] = None
    return with_graph(traced, graph)


def _operand(node) -> _Operand | None:
    """`node` as a bmm operand that is a merged view of a tensor of 4 or more dims, maybe transposed."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    transposed = node.target is aten.permute.default and list(node.args[1]) == [0, 2, 1]
    merged = node.args[0] if transposed else node
    if not isinstance(merged, fx.Node) or merged.op != "call_function" or merged.target not in _VIEWS:
        return None
    source = merged.args[0]
    if not isinstance(source, fx.Node) or not isinstance(source.meta.get("val"), torch.Tensor):
        return None
    whole, view = tuple(source.meta["val"].shape), tuple(merged.meta["val"].shape)
    if len(whole) < 4 or len(view) != 3 or view != (math.prod(whole[:-2]), *whole[-2:]):
        return None
    return _Operand(source, whole[:-2], transposed, (merged, node) if transposed else (merged,))


def _splits(node: fx.Node, lead: tuple[int, ...]) -> bool:
    """`node` views a bmm's result [prod(lead), m, n] as [*lead, m, n]."""
    if node.op != "call_function" or node.target not in _VIEWS:
        return False
    val, source = node.meta.get("val"), node.args[0].meta.get("val")
    return isinstance(val, torch.Tensor) and tuple(val.shape) == (*lead, *source.shape[-2:])
