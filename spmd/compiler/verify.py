"""The passes' stated postconditions, checked between passes when asked (PlanOptions.verify, SPMD_VERIFY=1;
the tests turn it on). A broken one is an `SpmdInternalError` carrying the graph: a bug in spmd, not in
the model. Each check reads the pipeline's values after its pass and says what should hold, in the
words of the pass's docstring.
"""
from __future__ import annotations

import operator

import torch.fx as fx
from torch.utils._pytree import tree_flatten

from spmd.core import collectives as C
from spmd.core.collectives import STEP_FUNCTIONS
from spmd.core.errors import SpmdInternalError
from spmd.core.specs import TensorInfo
from spmd.passes.trace_module import flat_outputs


def _fail(pass_name: str, problems: list[str], graph: fx.Graph | None) -> None:
    if problems:
        shown = "\n".join(f"  - {p}" for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise SpmdInternalError(f"{pass_name}: its postcondition does not hold:\n{shown}{more}",
                                str(graph) if graph is not None else "")


def check_traced(pass_name: str, v: dict) -> None:
    """trace: one placeholder per graph input, each named in `inputs`; a TensorInfo for every tensor
    value; as many output kinds as flat outputs. merge_tied_parameters: also no tied name with a
    placeholder of its own."""
    traced = v["traced"]
    problems = []
    placeholders = [n.name for n in traced.graph.nodes if n.op == "placeholder"]
    named = [gi.placeholder for gi in traced.inputs]
    if placeholders != named:
        problems.append(f"placeholders {placeholders[:8]}... are not the inputs {named[:8]}...")
    for n in traced.graph.nodes:
        if n.op in ("placeholder", "call_function") and hasattr(n.meta.get("val"), "shape") and \
                n.name not in traced.tensor_info:
            problems.append(f"{n.name} has a tensor value but no TensorInfo")
    if len(traced.output_kinds()) != len(flat_outputs(traced.graph.output_node())):
        problems.append("output kinds and flat outputs differ in number")
    names = [gi.name for gi in traced.inputs if gi.kind in ("parameter", "buffer")]
    if pass_name == "merge_tied_parameters" and set(names) & set(traced.aliases):
        problems.append(f"tied names still have placeholders of their own: {sorted(set(names) & set(traced.aliases))}")
    _fail(pass_name, problems, traced.graph)


def check_blocks(pass_name: str, v: dict) -> None:
    """find_repeated_blocks: a node maps to a representative of the same op with the same value shapes."""
    blocks, traced = v["blocks"], v["traced"]
    nodes = {n.name: n for n in traced.graph.nodes}
    problems = [f"{a} -> {b}" for a, b in blocks.representative.items() if a in nodes and b in nodes and
                (nodes[a].op != nodes[b].op or traced.tensor_info.get(a) != traced.tensor_info.get(b) or
                 (nodes[a].op == "call_function" and nodes[a].target != nodes[b].target))]
    _fail(pass_name, problems, traced.graph)


def check_strategies(pass_name: str, v: dict) -> None:
    """enumerate_strategies / merge_followers: every node and output sink has at least one strategy, each
    with one placement list per input and per output; inputs name values that exist; pins hold."""
    table, traced = v["strategies"], v["traced"]
    problems = []
    for name, ns in table.nodes.items():
        if not ns.strategies:
            problems.append(f"{name} has no strategy")
        for s in ns.strategies:
            if len(s.inputs) != len(ns.inputs) or (ns.source != "output" and len(s.outputs) != len(ns.outputs)):
                problems.append(f"{name}: strategy {s} does not match {len(ns.inputs)} inputs / {len(ns.outputs)} outputs")
                break
        for src, _ in ns.inputs:
            if src not in table.nodes:
                problems.append(f"{name} reads {src}, which has no entry")
    for n in traced.graph.nodes:
        if n.op in ("placeholder", "call_function") and n.name not in table.nodes:
            problems.append(f"{n.name} has no entry")
    _fail(pass_name, problems, traced.graph)


def check_costs(pass_name: str, v: dict) -> None:
    """estimate_costs: one finite, non-negative compute cost per strategy of every node."""
    table, costs = v["strategies"], v["costs"]
    problems = []
    for name, ns in table.nodes.items():
        row = costs.node_costs.get(name)
        if row is None or len(row) != len(ns.strategies):
            problems.append(f"{name}: {0 if row is None else len(row)} costs for {len(ns.strategies)} strategies")
        elif any(not (0.0 <= c < float("inf")) for c in row):
            problems.append(f"{name}: costs {row}")
    _fail(pass_name, problems, v["traced"].graph)


def check_plan(pass_name: str, v: dict) -> None:
    """solve_placements: every node picks one of its strategies; an edge exactly where a producer's
    placements differ from what the consumer reads, whose steps end in the consumer's; ties hold."""
    table, plan = v["strategies"], v["plan"]
    if table is None:  # this rank took rank 0's plan, checked there, or a plan given (given_plan.py checked it)
        return
    problems = []
    for name, ns in table.nodes.items():
        s = plan.choices.get(name)
        if s not in ns.strategies:
            problems.append(f"{name} chose {s}, not one of its strategies")
    if problems:
        _fail(pass_name, problems, v["traced"].graph)
    edges = {(e.consumer, e.slot): e for e in plan.edges}
    for name, ns in table.nodes.items():
        for j, value in enumerate(ns.inputs):
            src, dst = plan.output_placements(value), plan.choices[name].inputs[j]
            e = edges.get((name, j))
            if (src != dst) != (e is not None):
                problems.append(f"{name} input {j}: {src} -> {dst} but edge {e}")
            elif e is not None and (e.src != src or e.dst != dst):
                problems.append(f"{name} input {j}: edge {e.src} -> {e.dst}, placements {src} -> {dst}")
        if ns.tie is not None and ns.key(plan.choices[name]) != table.nodes[ns.tie].key(plan.choices[ns.tie]):
            problems.append(f"{name} is tied to {ns.tie} but their placements differ")
    _fail(pass_name, problems, v["traced"].graph)


def check_global_graph(pass_name: str, v: dict) -> None:
    """insert_collectives: every traced node is there under its name, with its planned placements, and
    every input it reads arrives in the placements its strategy needs."""
    gm, plan, traced = v["global_gm"], v["plan"], v["traced"]
    nodes = {n.name: n for n in gm.graph.nodes}
    problems = []
    for n in traced.graph.nodes:
        if n.op in ("placeholder", "call_function") and n.name not in nodes:
            problems.append(f"{n.name} is missing")
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.name not in plan.choices or "spmd_step" in n.meta:
            continue
        if n.target is operator.getitem:
            continue
        wanted = plan.choices[n.name].inputs
        leaves, _ = tree_flatten((n.args, n.kwargs))
        got = [a.meta.get("spmd_placements", (None,))[0] for a in leaves
               if isinstance(a, fx.Node) and isinstance(traced.tensor_info.get(_source(a).name), TensorInfo)]
        if got != list(wanted):
            problems.append(f"{n.name} reads {got}, needs {list(wanted)}")
    _fail(pass_name, problems, gm.graph)


def _source(node: fx.Node) -> fx.Node:
    while "spmd_step" in node.meta:
        node = node.args[0]
    return node


def check_rank_graph(pass_name: str, v: dict) -> None:
    """emit_rank_graph: every step is bound to this rank (a group name or a coordinate; no mesh axis)."""
    gm = v["rank_gm"]
    problems = [f"{n.name} still names a mesh axis" for n in gm.graph.nodes
                if n.op == "call_function" and n.target in STEP_FUNCTIONS.values() and "mesh_axis" in n.kwargs]
    _fail(pass_name, problems, gm.graph)


def check_in_place(pass_name: str, v: dict) -> None:
    """reduce_in_place: a rank graph whose in-place all_reduces read a value that nothing else reads and
    that is no placeholder (the caller's tensors are never written)."""
    check_rank_graph(pass_name, v)
    gm = v["rank_gm"]
    problems = [f"{n.name} reduces {n.args[0]} in place, which is read by {len(n.args[0].users)} nodes or is a "
                "placeholder" for n in gm.graph.nodes
                if n.op == "call_function" and n.target is STEP_FUNCTIONS["all_reduce"] and n.kwargs.get("inplace")
                and (len(n.args[0].users) != 1 or n.args[0].op == "placeholder")]
    _fail(pass_name, problems, gm.graph)


def check_overlap(pass_name: str, v: dict) -> None:
    """overlap_collectives: each rank graph has at most one collective in flight per process group (a
    launch or a synchronous collective on a group waits for the one before), and every launch is waited for."""
    starts = {C.all_reduce_start: C.all_reduce_wait, C.bucket_start: C.bucket_wait}
    if v.get("split") is not None:
        check_split(pass_name, v)
    graphs = [v["split"].forward, v["split"].backward] if v.get("split") is not None else [v["rank_gm"]]
    for gm in graphs:
        problems, in_flight = [], {}  # group -> the launch not waited for yet
        for n in gm.graph.nodes:
            group = n.kwargs.get("group") if n.op == "call_function" else None
            if n.target in starts.values():
                in_flight.pop(group, None)
            elif group is not None and getattr(n.target, "__module__", "") == C.__name__:
                if group in in_flight:
                    problems.append(f"{n.name} uses group {group} while {in_flight[group].name} is in flight")
                if n.target in starts:
                    in_flight[group] = n
        problems += [f"{n.name} is never waited for" for n in in_flight.values()]
        _fail(pass_name, problems, gm.graph)


def check_split(pass_name: str, v: dict) -> None:
    """split_joint_graph / bucket_gradients: forward returns the outputs, the buffers' new values and the
    saved values; backward
    takes the saved values and one tangent per output and returns one gradient per trainable parameter."""
    split, traced = v["split"], v["traced"]
    problems = []
    fwd_out = flat_outputs(split.forward.graph.output_node())
    if len(fwd_out) != split.n_outputs + len(split.updates) + len(split.saved):
        problems.append(f"forward returns {len(fwd_out)} values, not {split.n_outputs} outputs + "
                        f"{len(split.updates)} buffer updates + {len(split.saved)} saved")
    bwd_in = [n for n in split.backward.graph.nodes if n.op == "placeholder"]
    tangents = sum(1 for gi in traced.inputs if gi.kind == "tangent")
    if len(bwd_in) != len(split.saved) + tangents:
        problems.append(f"backward takes {len(bwd_in)} values, not {len(split.saved)} saved + {tangents} tangents")
    if len(flat_outputs(split.backward.graph.output_node())) != len(split.grads):
        problems.append("backward returns another number of gradients than it names")
    _fail(pass_name, problems, split.backward.graph)


CHECKS = {
    "trace": check_traced, "index_by_arange": check_traced, "gather_rows": check_traced, "unmerge_bmm": check_traced,
    "kernel_layouts": check_traced, "as_strided_views": check_traced, "merge_tied_parameters": check_traced,
    "find_repeated_blocks": check_blocks,
    "enumerate_strategies": check_strategies, "merge_followers": check_strategies, "estimate_costs": check_costs,
    "solve_placements": check_plan, "insert_collectives": check_global_graph, "emit_rank_graph": check_rank_graph,
    "fuse_decomposed_ops": check_rank_graph, "reduce_in_place": check_in_place,
    "split_joint_graph": check_split, "bucket_gradients": check_split, "overlap_collectives": check_overlap,
}
