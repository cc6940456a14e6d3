"""estimate_costs: price every strategy of every node and every resharding edge.

Before: a `StrategyTable`. After: a `CostTable` with the compute seconds of each (node, strategy) on
local shards, an edge-cost function (seconds to turn one placement of a value into another) whose
steps come from the one redistribute planner, so the solver prices exactly what will run, and the
per-rank memory terms (parameters, gradients, optimizer state, saved activations).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx
from torch.utils._pytree import tree_map

from spmd.cost_model.compute import compute_cost
from spmd.cost_model.memory import MemoryTerm, memory_terms
from spmd.passes.enumerate_strategies import StrategyTable, Value
from spmd.passes.trace_module import TracedGraph
from spmd.redistribute import plan_redistribute, shortest_redistributions
from spmd.specs import Placements, TensorInfo, local_shape


@dataclass
class CostTable:
    mesh: object
    value_info: dict[Value, TensorInfo]
    node_costs: dict[str, list[float]] = field(default_factory=dict)
    memory: list[MemoryTerm] = field(default_factory=list)  # per-rank bytes as terms over values
    bucket_bytes: float | None = None  # gradient all_reduces are bucketed at this size (training)
    _paths: dict = field(default_factory=dict)

    def paths_from(self, value: Value, src: Placements, gradient: bool = False) -> dict:
        """Every layout `value` can reach from `src`: layout -> (seconds, steps). `gradient`: the value
        is a parameter gradient on its way out, whose all_reduces the runtime buckets."""
        bucket = self.bucket_bytes if gradient else None
        key = (self.value_info[value], src, bucket)
        found = self._paths.get(key)
        if found is None:
            found = self._paths[key] = shortest_redistributions(src, self.value_info[value], self.mesh, bucket)
        return found

    def redistribute(self, value: Value, src: Placements, dst: Placements, gradient: bool = False):
        if src == dst:
            return ()
        return plan_redistribute(src, dst, self.value_info[value], self.mesh,
                                 self.bucket_bytes if gradient else None)

    def edge_cost(self, value: Value, src: Placements, dst: Placements, gradient: bool = False) -> float:
        if src == dst:
            return 0.0
        return self.paths_from(value, src, gradient)[dst][0]


def local_call(node: fx.Node, is_tensor, local_infos: list) -> tuple[tuple, dict]:
    """`node`'s (args, kwargs) with each tensor argument (`is_tensor(arg)`, in pytree order, as strategies
    list them) replaced by its local shape from `local_infos`: what FLOP formulas take."""
    it = iter(local_infos)
    return tree_map(lambda a: next(it).shape if isinstance(a, fx.Node) and is_tensor(a) else a,
                    (tuple(node.args), dict(node.kwargs)))


def _local(info: TensorInfo, ps: Placements, mesh_shape) -> TensorInfo:
    return TensorInfo(local_shape(info.shape, ps, mesh_shape), info.dtype)


def estimate_costs(traced: TracedGraph, table: StrategyTable, mesh, optimizer_state_factor: float = 2.0,
                   bucket_bytes: float | None = None, blocks=None) -> CostTable:
    """`blocks`: a `RepeatedBlocks`; a node sharing its representative's strategies shares its costs."""
    rep_of = blocks.representative if blocks is not None else {}
    rows_by_variant: dict[tuple[str, int], list[float]] = {}
    nodes = {n.name: n for n in traced.graph.nodes}
    value_info: dict[Value, TensorInfo] = {}
    for name, info in traced.tensor_info.items():
        if isinstance(info, TensorInfo):
            value_info[(name, 0)] = info
        else:
            for k, i in enumerate(info):
                if i is not None:
                    value_info[(name, k)] = i
    costs = CostTable(mesh, value_info, memory=memory_terms(traced, optimizer_state_factor),
                      bucket_bytes=bucket_bytes if traced.joint else None)
    for name, ns in table.nodes.items():
        node = nodes.get(name)
        if node is None or node.op != "call_function" or ns.source == "follow":
            costs.node_costs[name] = [0.0] * len(ns.strategies)
            continue
        key = (rep_of.get(name, name), id(ns.strategies))  # copies share their strategies list
        if key in rows_by_variant:
            costs.node_costs[name] = rows_by_variant[key]
            continue
        in_infos = [value_info[v] for v in ns.inputs]
        row = []
        for s in ns.strategies:
            ins = [_local(i, ps, mesh.shape) for i, ps in zip(in_infos, s.inputs)]
            outs = [_local(o, ps, mesh.shape) for o, ps in zip(ns.outputs, s.outputs) if o is not None and ps is not None]
            args, kwargs = local_call(node, lambda a: isinstance(traced.tensor_info.get(a.name), TensorInfo), ins)
            row.append(compute_cost(node.target, args, kwargs, ins, outs, mesh.device))
        costs.node_costs[name] = row
        rows_by_variant[key] = row
    return costs
