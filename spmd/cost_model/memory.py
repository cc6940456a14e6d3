"""Per-rank memory of a plan: parameters, gradients, optimizer state, saved activations, inputs.

Each term is a value of the graph whose bytes on one rank depend on the placements the plan gives it:
`nbytes / (product of the mesh axes sharding it) * factor`. In training everything here is alive at
once when backward starts (parameters, their gradients and optimizer state, every activation saved for
backward); these terms are linear in the solver's choices, so they form the `memory_budget` row.

On top of them, `peak_live_bytes` walks the schedule with the chosen placements: the most bytes of
intermediate values alive at any one point. What that peak holds beyond the saved activations is
reported as "temporaries" (in inference, where nothing is saved, it is the whole activation peak).
"""
from __future__ import annotations

from dataclasses import dataclass

from spmd.core.graph_facts import is_view, view_base
from spmd.core.specs import Placements, TensorInfo, Value, pieces


@dataclass(frozen=True)
class MemoryTerm:
    value: Value
    kind: str  # parameters | gradients | optimizer | buffers | inputs | activations
    info: TensorInfo
    factor: float = 1.0

    def bytes(self, placements: Placements, mesh_shape: tuple[int, ...]) -> float:
        return self.info.nbytes / pieces(placements, mesh_shape) * self.factor


def memory_terms(traced, optimizer_state_factor: float = 2.0) -> list[MemoryTerm]:
    """What one rank holds, as terms over graph values. `optimizer_state_factor`: optimizer state per
    parameter element, in parameter sizes (Adam/AdamW 2, SGD with momentum 1, plain SGD 0)."""
    terms: list[MemoryTerm] = []
    for gi in traced.inputs:
        info = traced.tensor_info[gi.placeholder]
        value = (gi.placeholder, 0)
        if gi.kind == "parameter":
            terms.append(MemoryTerm(value, "parameters", info))
            if traced.joint and gi.name not in traced.frozen:
                terms.append(MemoryTerm(value, "gradients", info))
                if optimizer_state_factor:
                    terms.append(MemoryTerm(value, "optimizer", info, optimizer_state_factor))
        elif gi.kind in ("buffer", "constant"):
            terms.append(MemoryTerm(value, "buffers", info))
        elif gi.kind == "input":
            terms.append(MemoryTerm(value, "inputs", info))
    if traced.joint:
        seen: set[str] = set()
        for node in traced.graph.nodes:
            if node.op != "call_function" or node.meta.get("partitioner_tag") == "is_backward":
                continue
            if not any(u.meta.get("partitioner_tag") == "is_backward" for u in node.users):
                continue
            base = view_base(node)  # a saved view keeps its base alive, not a copy
            info = traced.tensor_info.get(base.name)
            if base.op != "call_function" or base.name in seen or not isinstance(info, TensorInfo):
                continue
            seen.add(base.name)
            terms.append(MemoryTerm((base.name, 0), "activations", info))
    return terms


def peak_live_bytes(graph, choices: dict, tensor_info: dict, mesh_shape: tuple[int, ...],
                    exclude: set[str] = frozenset(), edges=()) -> tuple[float, str | None]:
    """The most bytes of intermediate values one rank holds at any point of the graph's schedule
    (node order), under the chosen placements, and the node where that happens.

    A value is alive from the node that makes it to its last reader; a view allocates nothing but
    keeps its base alive as long as it lives. Placeholders (parameters, inputs, tangents) and the
    values in `exclude` (parameter gradients, counted as "gradients") are left out. `edges` (the plan's
    reshardings) add the resharded copies their consumers read: a weight gathered for a matmul, an
    all_reduced partial sum. As insert_collectives makes them, one copy per (value, layout, phase)
    serves every consumer in that phase, alive from the first to the last."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_name = {n.name: n for n in graph.nodes}
    copies: dict[tuple, list] = {}  # (value, layout, phase) -> [first reader, last reader, bytes]
    for e in edges:
        reader = by_name.get(e.consumer)
        info = tensor_info.get(e.value[0])
        info = info[e.value[1]] if isinstance(info, tuple) else info
        if reader is None or not isinstance(info, TensorInfo):
            continue  # an output sink: a gradient in its parameter's layout, counted as "gradients"
        key = (e.value, e.dst, reader.meta.get("partitioner_tag"))
        i, j = order[reader], _last_through_views(reader, order)
        if key in copies:
            copies[key][0], copies[key][1] = min(copies[key][0], i), max(copies[key][1], j)
        else:
            copies[key] = [i, j, info.nbytes / pieces(e.dst, mesh_shape)]
    copy_alloc: dict[int, float] = {}
    copy_free: dict[int, float] = {}
    for first, last, size in copies.values():
        copy_alloc[first] = copy_alloc.get(first, 0.0) + size
        copy_free[last] = copy_free.get(last, 0.0) + size
    base: dict = {}
    for n in graph.nodes:
        if n.op == "call_function" and is_view(n.target) and n.args and hasattr(n.args[0], "op"):
            base[n] = base.get(n.args[0], n.args[0])
    # a parameter's gradient (or what it is a view of) leaves through its output as soon as backward is
    # done with it: the rank graph reduces it there, and the reduced piece is counted as "gradients"
    transient = {base.get(n, n) for n in graph.nodes if n.name in exclude}
    last: dict = {}
    for n in graph.nodes:
        for a in n.all_input_nodes:
            root = base.get(a, a)
            if n.op != "output" or root not in transient:
                last[root] = max(last.get(root, order[root]), order[n])
    frees: dict[int, list] = {}
    for root, i in last.items():
        frees.setdefault(i, []).append(root)
    for root in transient - last.keys():
        frees.setdefault(order[root], []).append(root)
    live, peak, at = 0.0, 0.0, None
    sizes: dict = {}
    for i, n in enumerate(graph.nodes):
        live += copy_alloc.get(i, 0.0)  # the node's resharded inputs, alive while it runs
        if live > peak:
            peak, at = live, n.name
        if n.op == "call_function" and n not in base and n.name in choices:
            infos = tensor_info.get(n.name)
            infos = infos if isinstance(infos, tuple) else (infos,)
            total = 0.0
            for info, ps in zip(infos, choices[n.name].outputs):
                if isinstance(info, TensorInfo) and ps is not None:
                    total += info.nbytes / pieces(ps, mesh_shape)
            sizes[n] = total
            live += total
            if live > peak:
                peak, at = live, n.name
        for root in frees.get(i, ()):
            live -= sizes.pop(root, 0.0)
        live -= copy_free.get(i, 0.0)
    return peak, at


def _last_through_views(node, order: dict) -> int:
    """Where a value read by `node` dies: after `node`, or, when `node` is a view of it, after the last
    reader of that view (and of views of it)."""
    last = order[node]
    if node.op == "call_function" and is_view(node.target):
        for user in node.users:
            last = max(last, _last_through_views(user, order))
    return last
