"""insert_collectives: make every resharding in the plan an explicit node.

Before: the traced graph and a solved `Plan`. After: a new GraphModule (global shapes still in its
args) where each consumer reads its input in the placements its strategy needs: every plan edge became
a chain of step nodes calling `spmd.core.collectives`, with `mesh_axis` naming the axis. Chains are
shared between consumers that need the same (value, placements). Every node carries
`meta["spmd_placements"]` (per output) for the emitter and the dumps.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from spmd.core.collectives import STEP_FUNCTIONS
from spmd.core.errors import SpmdInternalError
from spmd.core.plan import Plan
from spmd.core.redistribute import after_step
from spmd.core.specs import TensorInfo, placements_str
from spmd.passes.trace_module import TracedGraph, flat_outputs, graph_module


def unplanned_reshardings(traced: TracedGraph, plan: Plan) -> list[str]:
    """Where `plan`'s edges disagree with its choices: a value read in other placements than it is made with and no
    edge between, or an edge whose ends are not the choices' (a plan file edited and signed again: insert_collectives
    follows the edges, the pieces the choices). Slots numbered as insert_collectives numbers them."""
    edges = {(e.consumer, e.slot): e for e in plan.edges}
    found = []

    def check(consumer: str, slot: int, producer: str) -> None:
        if consumer in plan.choices and producer in plan.choices:
            said = _disagreement(plan, edges.get((consumer, slot)), consumer, slot, producer)
            if said:
                found.append(said)

    for node in traced.graph.nodes:
        if node.op == "output":
            for k, a in enumerate(flat_outputs(node)):
                if isinstance(a, fx.Node) and isinstance(traced.tensor_info.get(a.name), TensorInfo):
                    check(f"output_{k}", 0, a.name)
        elif node.op == "call_function" and node.target is not operator.getitem:
            slot = iter(range(1 << 30))
            fx.node.map_aggregate((tuple(node.args), dict(node.kwargs)), lambda a: check(
                node.name, next(slot), a.name) if isinstance(a, fx.Node) and
                isinstance(traced.tensor_info.get(a.name), TensorInfo) else None)
    return found


def _disagreement(plan: Plan, edge, consumer: str, slot: int, producer: str) -> str | None:
    """How the `edge` into `consumer`'s `slot` (or None) disagrees with the plan's choices and the graph, which has
    `producer` feed that slot; None where it agrees."""
    made, needed = plan.choices[producer].outputs[0], plan.choices[consumer].inputs[slot]
    if edge is None:
        return None if made == needed else (f"{consumer} reads {producer} as {placements_str(needed)}, made as "
                                            f"{placements_str(made)}, and no edge reshards it")
    if (edge.value, edge.src, edge.dst) == ((producer, 0), made, needed):
        return None
    return (f"the edge into {consumer} (slot {slot}) takes {edge.value[0]} from {placements_str(edge.src)} to "
            f"{placements_str(edge.dst)}, the graph and choices {producer} from {placements_str(made)} to "
            f"{placements_str(needed)}")


def insert_collectives(traced: TracedGraph, plan: Plan) -> fx.GraphModule:
    src_graph = traced.graph
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    edge_by_slot = {(e.consumer, e.slot): e for e in plan.edges}
    labels = traced.labels()
    shared: dict[tuple, fx.Node] = {}

    def resharded(consumer: str, slot: int, node: fx.Node, tag: str | None) -> fx.Node:
        """`node` as consumer input `slot` needs it. The steps run where the consumer runs (`tag`:
        forward or backward), so a saved activation is resharded when backward uses it."""
        edge = edge_by_slot.get((consumer, slot))
        said = _disagreement(plan, edge, consumer, slot, node.name)
        if said:  # (a given plan is checked so before: take_given_plan)
            raise SpmdInternalError(f"insert_collectives: {said}", str(src_graph))
        if edge is None:
            return node
        key = (edge.value, edge.dst, tag)  # backward re-gathers rather than keep a forward copy alive
        if key in shared:
            return shared[key]
        cur = node
        placements = list(edge.src)
        for step in edge.steps:
            fn = STEP_FUNCTIONS[step.kind]
            cur = graph.create_node("call_function", fn, (cur,), {**step.call_kwargs(), "mesh_axis": step.axis},
                                    name=f"{step.kind}_{edge.value[0]}")
            placements[step.axis] = after_step(step)
            cur.meta["spmd_placements"] = (tuple(placements),)
            cur.meta["spmd_step"] = step
            cur.meta["spmd_for"] = (labels.get(edge.value[0], edge.value[0]), consumer)  # for its error message
            cur.meta["val"] = node.meta.get("val")
            cur.meta["stack_trace"] = node.meta.get("stack_trace")
            if tag is not None:
                cur.meta["partitioner_tag"] = tag
        if tuple(placements) != tuple(edge.dst):
            raise SpmdInternalError(f"steps for {edge.value} end in {placements}, not {edge.dst}",
                                    str(traced.gm.code))
        shared[key] = cur
        return cur

    # Outputs are resharded right where they are produced, not at the end of the graph: a gradient's
    # reduction can then start while backward still works on earlier layers.
    out_node = src_graph.output_node()
    region = traced.regions()
    output_uses: dict[str, list[tuple[int, str | None]]] = {}
    for k, a in enumerate(flat_outputs(out_node)):
        if isinstance(a, fx.Node) and isinstance(traced.tensor_info.get(a.name), TensorInfo):
            output_uses.setdefault(a.name, []).append((k, region.get(f"output_{k}")))

    def reshard_outputs(node: fx.Node) -> None:
        for k, tag in output_uses.get(node.name, ()):
            resharded(f"output_{k}", 0, env[node.name], tag)

    for node in src_graph.nodes:
        if node.op == "placeholder":
            new = graph.placeholder(node.name)
            new.meta = dict(node.meta)
            new.meta["spmd_placements"] = plan.choices[node.name].outputs
            env[node.name] = new
            continue  # (a placeholder returned as an output is resharded at the output: placeholders come first)
        if node.op == "get_attr":  # a higher-order op's subgraph
            env[node.name] = graph.get_attr(node.target)
            env[node.name].meta = dict(node.meta)
            continue
        if node.op == "output":  # chains made by reshard_outputs are reused here
            new_outs = []
            for k, a in enumerate(flat_outputs(node)):
                if isinstance(a, fx.Node) and isinstance(traced.tensor_info.get(a.name), TensorInfo):
                    new_outs.append(resharded(f"output_{k}", 0, env[a.name], region.get(f"output_{k}")))
                else:
                    new_outs.append(env[a.name] if isinstance(a, fx.Node) else a)
            graph.output(tuple(new_outs))
            continue
        slot = iter(range(1 << 30))

        def remap(a):
            if not isinstance(a, fx.Node):
                return a
            if node.target is not operator.getitem and isinstance(traced.tensor_info.get(a.name), TensorInfo):
                return resharded(node.name, next(slot), env[a.name], region.get(node.name))
            if node.target is operator.getitem:
                next(slot)
                src, idx = node.args
                if plan.choices[node.name].inputs[0] != plan.choices[src.name].outputs[idx]:
                    raise SpmdInternalError(
                        f"insert_collectives: {node.name} takes element {idx} of {src.name} as "
                        f"{plan.choices[node.name].inputs[0]}, which is made as {plan.choices[src.name].outputs[idx]}",
                        str(src_graph))
            return env[a.name]

        args = fx.node.map_aggregate(tuple(node.args), remap)
        kwargs = fx.node.map_aggregate(dict(node.kwargs), remap)
        new = graph.create_node("call_function", node.target, args, kwargs, name=node.name)
        if new.name != node.name:
            raise SpmdInternalError(f"node name {node.name} taken in the new graph", str(graph))
        new.meta = dict(node.meta)
        new.meta["spmd_placements"] = plan.choices[node.name].outputs
        new.meta["spmd_strategy"] = plan.choices[node.name]
        env[node.name] = new
        reshard_outputs(node)
    gm = graph_module(traced.gm, graph)
    return gm

