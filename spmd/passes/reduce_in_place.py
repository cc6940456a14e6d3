"""reduce_in_place: all_reduce a Partial value in its own buffer wherever nothing else can see it.

Before: this rank's graph, every `all_reduce` step out of place. The functional all_reduce clones its
input so that other readers of the Partial value keep seeing it unreduced: a copy of the value per
collective, into a freshly allocated buffer (on a CPU, page faults for a large one).

After: the same graph, with `inplace=True` on each all_reduce whose input nothing else reads and nothing
else aliases. Such an input is the one reference to its buffer: it is made by an op that returns a new
tensor (an ATen op whose schema returns no alias of its inputs, or a collective step), possibly seen
through views that each have this one reader; never a placeholder (a parameter, an input, a value saved
for backward). Run on the joint graph before the cut, a value backward reads has a reader there, so it
stays out of place, and a backward step never reduces a forward value in place (what forward saved).
At run time the step still reduces out of place under torch.compile and where autograd records it
(`collectives._in_place`). The values computed are the same; a row-parallel matmul's partial sums are reduced
where they were written, as hand-written Megatron's `dist.all_reduce(x)` does.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from spmd.core import collectives as C
from spmd.core.graph_facts import backward_nodes

# collective steps whose result is a buffer of their own (an in-place all_reduce's is its input's,
# which had no other reader)
FRESH_STEPS = frozenset({C.all_reduce, C.all_gather, C.reduce_scatter, C.all_to_all, C.shard_local})
# ops whose schema declares a fresh result but that return a view of their input
UNDECLARED_VIEWS = frozenset({torch.ops.aten._unsafe_view.default})


def _returns_alias(op, index: int | None) -> bool:
    """Whether ATen op `op` may return (its `index`th result, or any) as a view of, or as, an input."""
    if op in UNDECLARED_VIEWS:
        return True
    returns = op._schema.returns
    picked = returns if index is None else returns[index:index + 1]
    return not picked or any(r.alias_info is not None for r in picked)


def _owned(node: fx.Node) -> bool:
    """Whether `node`'s value is a buffer that no other value of the graph shares: made fresh, or a view
    of such a buffer that no one else reads."""
    while True:
        if node.op != "call_function":
            return False  # placeholders are the caller's tensors
        target = node.target
        if target in FRESH_STEPS:
            return True
        if target is operator.getitem:  # one result of a multi-result op, picked out once
            base, index = node.args
            return (isinstance(base, fx.Node) and isinstance(base.target, torch._ops.OpOverload)
                    and isinstance(index, int) and len(base.target._schema.returns) > 1
                    and not _returns_alias(base.target, index)
                    and sum(1 for u in base.users if u.target is operator.getitem and u.args[1] == index) == 1)
        if not isinstance(target, torch._ops.OpOverload):
            return False
        if not _returns_alias(target, None):
            return True
        # a view (or an in-place op): its base must be read by it alone, and owned in turn
        bases = node.all_input_nodes
        if len(bases) != 1 or len(bases[0].users) != 1:
            return False
        node = bases[0]


def _reducible(node: fx.Node, backward: set[fx.Node]) -> bool:
    if node.op != "call_function" or node.target is not C.all_reduce or node.kwargs.get("inplace"):
        return False
    x = node.args[0]
    # a backward step reading a forward value reads what forward saved: a tensor autograd hands back,
    # which a second backward (retain_graph) would read again
    return (isinstance(x, fx.Node) and len(x.users) == 1 and not (node in backward and x not in backward)
            and _owned(x))


def reduce_in_place(gm: fx.GraphModule, tangents: frozenset[str] = frozenset()) -> fx.GraphModule:
    """A new graph module with the safe all_reduces in place (the given one is left as it is, and
    returned where none is: a copy and its code cost 0.1 s on GPT-2-small's 12-layer graph).
    `tangents`: the names of a joint graph's tangent placeholders (what tells backward nodes apart)."""
    backward = backward_nodes(gm.graph, tangents)
    names = {n.name for n in gm.graph.nodes if _reducible(n, backward)}
    if not names:
        return gm
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if node.name in names:
            node.kwargs = {**node.kwargs, "inplace": True}
    return fx.GraphModule(gm, graph)
