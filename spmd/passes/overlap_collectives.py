"""overlap_collectives: launch each all_reduce as soon as its input is ready, and wait for it only where
its result is first needed, so that the rank computes what does not depend on it meanwhile.

Before: a rank graph (inference, or training's forward or backward graph) whose all_reduce steps are
synchronous, each where the trace's order put it: in a tensor-parallel backward, after the weight
gradients' matmuls that came first in the trace but do not feed it, and right before its reader.

After: each all_reduce is an `all_reduce_start` and an `all_reduce_wait`. Between two launches on the
graph (all_reduce starts and gradient bucket starts), the nodes the second launch does not need move
after it, in their order: the launch comes right after what its input needs. Collective steps and ops
that draw random numbers or have effects stay before it, with what they need, in their order, and no
node moves past a write (an in-place op, a copy into a buffer), which may change what it reads. Each wait then moves down to just before the first reader
of its result, or the next collective on its group, or the output (gloo pairs up two collectives in
flight on one group wrongly; the bucket waits of bucket_gradients follow the same rule). The values
computed are the same; only the order changes, and nodes move only within the stretch between two
launches, so what is alive at once grows by at most that stretch's values.

Measured on 2 gloo ranks (2 cores): a 2 MB all_reduce beside a 10 ms matmul takes 11.3 ms for both
instead of 14.2 run one after the other.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from spmd.core import collectives as C
from spmd.passes.bucket_gradients import sink_wait

LAUNCHES = (C.all_reduce, C.bucket_start)


def _step(node: fx.Node) -> bool:
    """A step of core/collectives.py (a collective, or a local slice or zeros of one)."""
    return getattr(node.target, "__module__", "") == C.__name__


def _ancestors(roots: list[fx.Node], within: set[fx.Node]) -> set[fx.Node]:
    """`roots` and every node of `within` they read, directly or through others of `within`."""
    found, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found.add(node)
        stack.extend(a for a in node.all_input_nodes if a in within and a not in found)
    return found


def _stays(node: fx.Node) -> bool:
    """Whether `node` keeps its place before the next launch: a collective step (one on the launch's
    group must end first, and steps on one group keep their order), or an op that draws random numbers
    or has effects (their order is kept)."""
    op = node.target
    return _step(node) or node.is_impure() or (hasattr(op, "tags") and torch.Tag.nondeterministic_seeded in op.tags)


def _launch_order(graph: fx.Graph) -> list[fx.Node]:
    """The graph's nodes with each launch moved up to right after what it needs in its stretch."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    order, stretch = [], []
    for node in nodes:
        if node.op == "call_function" and node.target in LAUNCHES:
            within = set(stretch)
            roots = [a for a in node.all_input_nodes if a in within] + [n for n in stretch if _stays(n)]
            # nothing moves past a write (an in-place op, a copy into a buffer): it may read what is written
            writes = [i for i, n in enumerate(stretch) if n.is_impure() and not _step(n)]
            if writes:
                roots += stretch[:writes[-1] + 1]
            needed = _ancestors(roots, within)
            order += [n for n in stretch if n in needed] + [node] + [n for n in stretch if n not in needed]
            stretch = []
        else:
            stretch.append(node)
    return order + stretch


def overlap_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """A new graph module (the given one is left as it is; returned where it has no all_reduce)."""
    if not any(n.target is C.all_reduce for n in gm.graph.nodes):
        return gm
    graph = fx.Graph()
    out = graph.output(graph.graph_copy(gm.graph, {}))
    for node in _launch_order(graph):
        out.prepend(node)
    waits = []
    for node in [n for n in graph.nodes if n.target is C.all_reduce]:
        kw = node.kwargs
        with graph.inserting_after(node):
            start = graph.create_node("call_function", C.all_reduce_start, node.args, dict(kw),
                                      name=f"{node.name}_start")
        with graph.inserting_after(start):
            wait = graph.create_node("call_function", C.all_reduce_wait, (start,),
                                     {"reduce_op": kw["reduce_op"], "world": kw["world"], "group": kw["group"],
                                      **({"where": kw["where"]} if "where" in kw else {})},
                                     name=f"{node.name}_wait")
        start.meta, wait.meta = dict(node.meta), dict(node.meta)
        node.replace_all_uses_with(wait)
        graph.erase_node(node)
        waits.append(wait)
    for wait in waits:
        sink_wait(wait, wait.kwargs["group"])
    graph.lint()
    return fx.GraphModule(gm, graph)
