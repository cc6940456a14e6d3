"""merge_tied_parameters: one placeholder and one gradient per parameter shared under several names.

Before: a `TracedGraph` whose `aliases` map each extra name of a shared parameter or buffer to its
canonical FQN (GPT-2's `lm_head.weight` is `transformer.wte.weight`). The tracer gives each name a
placeholder: torch.export feeds every one of them, AOTAutograd feeds one and leaves the others unused,
and in a joint graph each name has a gradient output of its own, holding only its uses' share.
After: one placeholder per shared tensor, named by its canonical FQN, read by every use; in a joint
graph one gradient output for it, the sum over all its uses (what autograd gives the one tensor on a
single device). `aliases` is kept: state dicts list the tensor under every name.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from spmd.passes.trace_module import TracedGraph, flat_outputs, with_graph

aten = torch.ops.aten


def merge_tied_parameters(traced: TracedGraph) -> TracedGraph:
    by_name = {gi.name: gi for gi in traced.inputs if gi.kind in ("parameter", "buffer")}
    merged = {alias: canonical for alias, canonical in traced.aliases.items()
              if alias in by_name and canonical in by_name}
    if not merged:
        return traced
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.graph_copy(traced.graph, env)
    node_of = {n.name: n for n in graph.nodes}
    for alias, canonical in merged.items():
        dead, kept = node_of[by_name[alias].placeholder], node_of[by_name[canonical].placeholder]
        dead.replace_all_uses_with(kept)
        graph.erase_node(dead)
        env.update({old: kept for old, new in env.items() if new is dead})

    flat = [env[a] if isinstance(a, fx.Node) else a for a in flat_outputs(traced.graph.output_node())]
    kinds = list(traced.output_kinds())
    if traced.joint:
        slot = {k.name: i for i, k in enumerate(kinds) if k.kind == "grad"}
        for canonical in dict.fromkeys(merged.values()):
            names = [canonical] + [a for a, c in merged.items() if c == canonical]
            grads = [flat[slot[n]] for n in names if n in slot and flat[slot[n]] is not None]
            total = grads[0] if grads else None
            for g in grads[1:]:  # autograd's answer for one tensor used in several places (appended: the
                add = graph.call_function(aten.add.Tensor, (total, g))  # output comes last, below)
                add.meta = {"val": g.meta.get("val"), "partitioner_tag": "is_backward",
                            "stack_trace": g.meta.get("stack_trace"), "fwd_nn_module_stack": g.meta.get("fwd_nn_module_stack")}
                total = add
            if canonical in slot:
                flat[slot[canonical]] = total
            elif grads:
                raise AssertionError(f"merge_tied_parameters: {canonical} has no gradient output")
        keep = [i for i, k in enumerate(kinds) if not (k.kind == "grad" and k.name in merged)]
        flat, kinds = [flat[i] for i in keep], [kinds[i] for i in keep]
    graph.output(tuple(flat) if isinstance(traced.graph.output_node().args[0], (tuple, list)) else flat[0])
    inputs = tuple(gi for gi in traced.inputs if gi.name not in merged or gi.kind not in ("parameter", "buffer"))
    return with_graph(traced, graph, inputs=inputs, outputs=tuple(kinds) if traced.outputs else ())

