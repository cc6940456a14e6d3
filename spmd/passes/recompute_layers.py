"""recompute_layers: backward runs the forward of the layers the plan recomputes again, instead of
reading their activations saved.

Before: this rank's joint graph (nodes tagged is_forward / is_backward) and the layers `plan.recompute`
and `plan.recompute_selective` name, each with its region (`find_recomputable_layers`: forward nodes
whose values backward reads, rebuilt from the layer's input, its weights and its kept values; selective:
its matmuls and attention kept too). After: per layer, a copy of the region
(and of the reshardings that feed only it: a weight gathered, a sequence all_gathered) tagged
is_backward, placed just before the first backward node that reads the region; every backward reader
reads the copy. The forward nodes are unchanged: `split_joint_graph` then saves only what the copies
read from outside the region, so the region's values die in forward.

    forward   x ─▶ norm ─▶ mm ─▶ gelu ─▶ mm ─▶ out             (norm, mm, gelu no longer saved)
    backward          norm' ─▶ mm' ─▶ gelu' ─▶ ...  (from x)   ─▶ d(gelu) reads gelu', not gelu
Collectives inside a region run again on every rank alike, so ranks stay in step.
"""
from __future__ import annotations

import torch.fx as fx

from spmd.core.errors import SpmdInternalError
from spmd.core.graph_facts import backward_nodes


def recompute_layers(rank_gm: fx.GraphModule, recomputable, keys: tuple[str, ...],
                     selective: tuple[str, ...] = ()) -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.graph_copy(rank_gm.graph, {}))
    layers = {layer.key: layer for stack in recomputable.stacks for layer in stack}
    nodes = {n.name: n for n in graph.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    backward = backward_nodes(graph)
    chosen = [(k, layers.get(k)) for k in keys] + [(k, getattr(layers.get(k), "selective", None)) for k in selective]
    for key, layer in chosen:
        if layer is None:
            raise SpmdInternalError(f"recompute_layers: the plan recomputes {key}, which has no such region",
                                    graph.python_code("self").src)
        members = {nodes[name] for name in layer.nodes}
        for node in reversed(graph.nodes):  # a resharding that only the region reads runs again with it
            if ("spmd_step" in node.meta and node not in backward and node.users
                    and all(u in members for u in node.users)):
                members.add(node)
        region = sorted(members, key=order.__getitem__)
        readers = [u for n in region for u in n.users if u in backward]
        if not readers:
            continue
        copies: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(min(readers, key=order.__getitem__)):
            for n in region:
                copy = graph.node_copy(n, lambda a: copies.get(a, a))
                copy.meta["partitioner_tag"] = "is_backward"
                copy.meta["spmd_recomputes"] = n.name
                copies[n] = copy
        for n in region:
            for user in list(n.users):
                if user in backward:
                    user.replace_input_with(n, copies[n])
        backward.update(copies.values())
        order = {n: i for i, n in enumerate(graph.nodes)}
    graph.lint()
    return fx.GraphModule(rank_gm, graph)
