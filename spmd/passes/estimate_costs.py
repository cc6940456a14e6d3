"""estimate_costs: price every strategy of every node and every resharding edge.

Before: a `StrategyTable`. After: a `CostTable` with the compute seconds of each (node, strategy) on
local shards (a node of a chain `fuse_decomposed_ops` puts back together, in a strategy that keeps
the reduced dim whole: its share of the one fused kernel, which is what the rank graph runs; in
training, a parameter's placeholder: the optimizer's step on its piece, `compute.optimizer_cost`), an
edge-cost function (seconds to turn one placement of a value into another) whose
steps come from the one redistribute planner, so the solver prices exactly what will run, and the
per-rank memory terms (parameters, gradients, optimizer state, saved activations).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from spmd.core.graph_facts import hashable_args
from spmd.core.redistribute import pick
from spmd.core.specs import Placements, Strategy, TensorInfo, Value, local_shape
from spmd.cost_model.compute import compute_cost, is_drawn_whole, local_call, optimizer_cost
from spmd.cost_model.layout_graph import cheapest_paths, layout_graph
from spmd.cost_model.memory import MemoryTerm, memory_terms, optimizer_step_factor, stepped_parameters
from spmd.passes.enumerate_strategies import StrategyTable
from spmd.passes.fuse_decomposed_ops import fusible_chains
from spmd.passes.trace_module import TracedGraph


@dataclass(frozen=True)
class CostTable:
    mesh: object
    value_info: dict[Value, TensorInfo]
    node_costs: dict[str, tuple[float, ...]]  # aligned with each node's strategies
    memory: tuple[MemoryTerm, ...] = ()  # per-rank bytes as terms over values
    bucket_bytes: float | None = None  # gradient all_reduces are bucketed at this size (training)
    # node of a chain priced fused -> (the chain's number, the dim it reduces): a resharding between two
    # of its nodes that both keep that dim whole would cut the chain the price assumes whole (the solver
    # forbids it; the layouts may change before the chain or after it)
    chains: dict[str, tuple[int, int]] = field(default_factory=dict)

    def paths_from(self, value: Value, src: Placements, gradient: bool = False) -> dict:
        """Every layout `value` can reach from `src`: layout -> (seconds, steps). `gradient`: the value
        is a parameter gradient on its way out, whose all_reduces the runtime buckets."""
        return cheapest_paths(tuple(src), self.value_info[value], self.mesh, self.bucket_bytes if gradient else None)

    def pair_table(self, value: Value, made, wanted, gradient: bool = False):
        """(seconds, holds a collective) of the paths `paths_from` gives from each of `made` to each of
        `wanted` (arrays), or None where a layout has a non-sum Partial (then ask `paths_from`)."""
        return layout_graph(self.value_info[value], self.mesh, self.bucket_bytes if gradient else None
                            ).pair_table(made, wanted)

    def redistribute(self, value: Value, src: Placements, dst: Placements, gradient: bool = False):
        if src == dst:
            return ()
        return pick(self.paths_from(value, src, gradient), src, dst, self.value_info[value], self.mesh)

    def edge_cost(self, value: Value, src: Placements, dst: Placements, gradient: bool = False) -> float:
        if src == dst:
            return 0.0
        return self.paths_from(value, src, gradient)[dst][0]


def _local(info: TensorInfo, ps: Placements, mesh_shape) -> TensorInfo:
    return TensorInfo(local_shape(info.shape, ps, mesh_shape), info.dtype)


def value_infos(traced: TracedGraph) -> dict[Value, TensorInfo]:
    out: dict[Value, TensorInfo] = {}
    for name, info in traced.tensor_info.items():
        if isinstance(info, TensorInfo):
            out[(name, 0)] = info
        else:
            for k, i in enumerate(info):
                if i is not None:
                    out[(name, k)] = i
    return out


def keeps_whole(ps: Placements, dim: int, rank: int) -> bool:
    """Whether a layout keeps `dim` whole on every rank and holds no partial value."""
    return not any(p.is_partial() or p.is_shard() and p.dim % rank == dim for p in ps)


@dataclass(frozen=True)
class _Fused:
    """One fusible chain (`fuse_decomposed_ops.fusible_chains`) as its nodes price it: the fused op, the
    global infos of its tensor inputs and output, the dim it reduces, its extra args, and its nodes with
    the global infos of their tensor inputs and output (all of the output's rank)."""

    op: object
    ins: tuple[TensorInfo, ...]
    out: TensorInfo
    dim: int
    extra: tuple
    nodes: tuple  # (fx node, infos of its tensor args in pytree order, output info), in graph order
    _seconds: dict = field(default_factory=dict, compare=False, repr=False)  # layout -> node -> share

    def seconds(self, name: str, s: Strategy, mesh) -> float | None:
        """Node `name`'s share of its chain in strategy `s`, where `s` keeps the reduced dim whole and
        holds no partial value (the rank graph then runs the chain as one kernel), and None where `s`
        cuts the chain (collectives between its pieces). The shares are the pieces' own seconds scaled
        to sum to the fused kernel's, so that no piece pays more than it would apart (a piece laid out
        apart would otherwise shed its share and leave the kernel unpaid). A profile that prices the
        pieces lower than the kernel (exp and log at one FLOP an element) keeps the pieces' prices: the
        kernel does less work than they do."""
        rank = len(self.out.shape)
        layout = None
        for ps in (*s.outputs, *s.inputs):
            if ps is None:
                continue
            if not keeps_whole(ps, self.dim, rank):
                return None
            layout = layout or ps
        if layout is None:
            return None
        layout = tuple(layout)
        if layout not in self._seconds:  # (one mesh per cost table)
            def local(info: TensorInfo) -> TensorInfo:
                return _local(info, layout, mesh.shape)

            ins, out = [local(i) for i in self.ins], local(self.out)
            kernel = compute_cost(self.op, (*(i.shape for i in ins), *self.extra), {}, ins, [out], mesh.device)
            pieces = {}
            for node, in_infos, out_info in self.nodes:
                node_ins = [local(i) for i in in_infos]
                args, kwargs = local_call(node, lambda a: True, node_ins)
                pieces[node.name] = compute_cost(node.target, args, kwargs, node_ins, [local(out_info)], mesh.device)
            total = sum(pieces.values())
            scale = min(1.0, kernel / total) if total > 0 else 1.0
            self._seconds[layout] = {n: c * scale for n, c in pieces.items()}
        return self._seconds[layout][name]


def _tensor_args(node) -> list:
    """The nodes `node` reads, in pytree order and repeated as often as they are passed (`local_call`'s order)."""
    found: list = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a) or a)
    return found


def _fused_chains(traced: TracedGraph) -> dict[str, _Fused]:
    """Node -> its fusible chain, for the chains whose tensors all have the output's rank (a reduction
    keeping its dim), so that any node's placements say how the whole chain is laid out."""
    out: dict[str, _Fused] = {}
    info = traced.tensor_info
    for chain, op, args in fusible_chains(traced.graph):
        tensors = [a for a in args if hasattr(a, "op")]
        result = info.get(chain[-1].name)
        if not isinstance(result, TensorInfo):
            continue
        rank = len(result.shape)
        reads = {n: _tensor_args(n) for n in chain}
        every = [info.get(a.name) for n in chain for a in (n, *reads[n])]
        if any(not isinstance(i, TensorInfo) or len(i.shape) != rank for i in every):
            continue
        dim = next(a for a in args[len(tensors):] if isinstance(a, int)) % rank
        nodes = tuple((n, tuple(info[a.name] for a in reads[n]), info[n.name]) for n in chain)
        fused = _Fused(op, tuple(info[a.name] for a in tensors), result, dim, tuple(args[len(tensors):]), nodes)
        out.update(dict.fromkeys((n.name for n in chain), fused))
    return out


def estimate_costs(traced: TracedGraph, table: StrategyTable, mesh, optimizer_state_factor: float = 2.0,
                   bucket_bytes: float | None = None, blocks=None) -> CostTable:
    """`blocks`: a `RepeatedBlocks`; a node sharing its representative's strategies (same variant) shares
    its cost row."""
    rep_of = blocks.representative if blocks is not None else {}
    rows_by_variant: dict[tuple[str, int], tuple[float, ...]] = {}
    nodes = {n.name: n for n in traced.graph.nodes}
    info = value_infos(traced)

    def is_tensor(a) -> bool:
        return isinstance(traced.tensor_info.get(a.name), TensorInfo)

    def tensor_or_name(a):
        found = traced.tensor_info.get(a.name)
        return found if isinstance(found, TensorInfo) else a.name

    # the strategy lists are held by `table` throughout, so their ids stand for them
    rows_by_question: dict[tuple, tuple[float, ...]] = {}
    fused = _fused_chains(traced)

    node_costs: dict[str, tuple[float, ...]] = {}
    stepped = stepped_parameters(traced)
    for name, ns in table.nodes.items():
        node = nodes.get(name)
        if name in stepped:  # the optimizer's step on this rank's piece, after backward
            node_costs[name] = tuple(optimizer_cost(_local(info[(name, 0)], s.outputs[0], mesh.shape), mesh.device,
                                                    optimizer_state_factor) for s in ns.strategies)
            continue
        if node is None or node.op != "call_function" or ns.source == "follow":
            node_costs[name] = (0.0,) * len(ns.strategies)
            continue
        key = (rep_of.get(name, name), ns.variant)
        if key in rows_by_variant:
            node_costs[name] = rows_by_variant[key]
            continue
        try:  # the same op on the same shapes with the same strategy list (twins of another layer)
            question = (node.target, hashable_args((node.args, node.kwargs), tensor_or_name), id(ns.strategies),
                        ns.outputs, fused.get(name))
        except TypeError:
            question = None
        if question in rows_by_question:
            node_costs[name] = rows_by_variant[key] = rows_by_question[question]
            continue
        in_infos = [info[v] for v in ns.inputs]
        row, whole_seconds = [], None
        for s in ns.strategies:
            share = fused[name].seconds(name, s, mesh) if name in fused else None
            if share is not None:
                row.append(share)
                continue
            ins = [_local(i, ps, mesh.shape) for i, ps in zip(in_infos, s.inputs)]
            outs = [_local(o, ps, mesh.shape) for o, ps in zip(ns.outputs, s.outputs) if o is not None and ps is not None]
            args, kwargs = local_call(node, is_tensor, ins)
            seconds = compute_cost(node.target, args, kwargs, ins, outs, mesh.device)
            if is_drawn_whole(node.target, s.outputs):  # the whole draw (the same for every cut), then the piece
                if whole_seconds is None:
                    whole = [o for o, ps in zip(ns.outputs, s.outputs) if o is not None and ps is not None]
                    whole_seconds = compute_cost(node.target, *local_call(node, is_tensor, in_infos), in_infos,
                                                 whole, mesh.device)
                seconds += whole_seconds
            row.append(seconds)
        node_costs[name] = rows_by_variant[key] = tuple(row)
        if question is not None:
            rows_by_question[question] = node_costs[name]
    numbers = {id(f): k for k, f in enumerate(dict.fromkeys(fused.values()))}
    step = optimizer_step_factor(optimizer_state_factor, mesh.device)
    return CostTable(mesh, info, node_costs, tuple(memory_terms(traced, optimizer_state_factor, step)),
                     bucket_bytes if traced.joint else None, {n: (numbers[id(f)], f.dim) for n, f in fused.items()})
