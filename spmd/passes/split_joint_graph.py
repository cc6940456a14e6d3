"""split_joint_graph: this rank's joint graph -> its forward graph and its backward graph.

Before: a rank graph from a joint trace, nodes tagged `partitioner_tag` is_forward / is_backward (steps
inserted for an edge carry their consumer's tag). After: `forward(state..., inputs...) -> (outputs...,
buffer updates..., saved...)` and `backward(saved..., tangents...) -> (one gradient per joint grad output)`. Saved values
keep the placements the plan gave them: backward reshards them at use, never silently up front.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from spmd.core.errors import SpmdInternalError
from spmd.core.graph_facts import backward_nodes, view_base
from spmd.passes.trace_module import TracedGraph, flat_outputs

aten = torch.ops.aten


@dataclass(frozen=True)
class SplitGraphs:
    forward: fx.GraphModule
    backward: fx.GraphModule
    n_outputs: int  # forward returns n_outputs user outputs, then the saved values
    saved: tuple[str, ...]
    grads: tuple[str, ...]  # FQN of the parameter each backward output is the gradient of (`input_grad_key`)
    updates: tuple[str, ...] = ()  # FQN of the buffer each forward output after the user's is the new value of
    # per gradient of `grads`, a bit mask of the tangents it depends on (bit k: the k-th tangent), read on the
    # single-device graph (the rank graph's gradient buckets join gradients that depend on different outputs)
    grad_tangents: tuple[int, ...] = ()


def input_grad_key(name: str) -> str:
    """How `SplitGraphs.grads` names the gradient of the input `name` (apart from a parameter so named)."""
    return f"input {name}"


def split_joint_graph(rank_gm: fx.GraphModule, traced: TracedGraph) -> SplitGraphs:
    graph = rank_gm.graph
    kinds = traced.output_kinds()
    backward = backward_nodes(graph, (i.placeholder for i in traced.inputs if i.kind == "tangent"))
    forward = [n for n in graph.nodes if n.op != "output" and n not in backward]
    for node in forward:
        if any(a in backward for a in node.all_input_nodes):
            raise SpmdInternalError(f"split_joint_graph: forward node {node.name} reads a backward value",
                                    rank_gm.code)
    outs = flat_outputs(graph.output_node())
    user_outs = [a for a, k in zip(outs, kinds) if k.kind == "output"]
    updates = [(a, k.name) for a, k in zip(outs, kinds) if k.kind == "buffer_update"]
    grad_outs = [(a, k.name if k.kind == "grad" else input_grad_key(k.name)) for a, k in zip(outs, kinds)
                 if k.kind in ("grad", "input_grad") and a is not None]
    saved = [n for n in forward if any(u in backward for u in n.users)]
    saved += [a for a, _ in grad_outs if a not in backward and a not in saved]  # grads known in forward

    fwd = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in forward:
        env[node] = fwd.node_copy(node, lambda n: env[n])
    # a saved value that is an updated buffer (or a view of one) is saved as a copy: the runtime writes the buffer's
    # new value into its memory after the forward, and backward would read that (found by a probe: Transformer-XL's
    # memory, read by a layer backward recomputes and then updated with `copy_`, gave gradients 0.04 off)
    updated = {k.name for k in kinds if k.kind == "buffer_update"}
    live = {i.placeholder for i in traced.inputs if i.kind == "buffer" and i.name in updated}
    kept = [fwd.call_function(aten.clone.default, (env[n],)) if view_base(n).op == "placeholder"
            and view_base(n).name in live else env[n] for n in saved]
    fwd.output(tuple(env[a] if isinstance(a, fx.Node) else a for a in user_outs)
               + tuple(env[a] for a, _ in updates) + tuple(kept))

    bwd = fx.Graph()
    env = {}
    for node in saved:
        env[node] = bwd.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in graph.nodes:
        if node in backward:
            env[node] = bwd.node_copy(node, lambda n: env[n])
    bwd.output(tuple(env[a] for a, _ in grad_outs))
    masks = _tangents_reaching(traced)
    return SplitGraphs(fx.GraphModule(rank_gm, fwd), fx.GraphModule(rank_gm, bwd), len(user_outs),
                       tuple(n.name for n in saved), tuple(name for _, name in grad_outs),
                       tuple(name for _, name in updates), tuple(masks.get(name, -1) for _, name in grad_outs))


def _tangents_reaching(traced: TracedGraph) -> dict[str, int]:
    """Gradient name (as `SplitGraphs.grads`) -> a bit mask of the tangents its value depends on in the traced
    graph (bit k: the k-th tangent placeholder). A gradient none of whose tangents came (outputs no loss used)
    is None on one device, not zeros: an optimizer then leaves its parameter alone."""
    tangents = [gi.placeholder for gi in traced.inputs if gi.kind == "tangent"]
    bit = {name: 1 << k for k, name in enumerate(tangents)}
    reach: dict[fx.Node, int] = {}
    for node in traced.graph.nodes:
        mask = bit.get(node.name, 0) if node.op == "placeholder" else 0
        for a in node.all_input_nodes:
            mask |= reach.get(a, 0)
        reach[node] = mask
    out = {}
    for a, k in zip(flat_outputs(traced.graph.output_node()), traced.output_kinds()):
        if k.kind in ("grad", "input_grad") and isinstance(a, fx.Node):
            out[k.name if k.kind == "grad" else input_grad_key(k.name)] = reach[a]
    return out
