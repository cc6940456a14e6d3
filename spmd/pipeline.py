"""The compiler pipeline: one tuple, read top to bottom.

    nn.Module ──trace_module | trace_joint──▶ ATen FX graph ──find_repeated_blocks──▶ identical layers
       ──enumerate_strategies──▶ candidates per node ──merge_followers (large graphs)──▶ fewer choices
       ──estimate_costs──▶ compute + resharding costs ──solve_placements──▶ Plan
       ──insert_collectives──▶ global graph with explicit steps ──emit_rank_graph──▶ this rank's graph
       ──split_joint_graph, bucket_gradients (training)──▶ forward and backward graphs

Per-compilation state lives in a `Compilation` object, never in module globals, so two compilations in
one process never interfere. After every pass the annotated graph can be dumped (SPMD_DUMP=dir).
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from spmd.cost_model.memory import peak_live_bytes
from spmd.dump import Dumper, format_graph
from spmd.errors import SpmdError
from spmd.passes.bucket_gradients import bucket_gradients
from spmd.passes.emit_rank_graph import emit_rank_graph
from spmd.passes.enumerate_strategies import Pins, enumerate_strategies
from spmd.passes.find_layer_stacks import TRACED, find_layer_stacks, truncated
from spmd.passes.find_repeated_blocks import AUTO_MIN_REPEATS, find_repeated_blocks
from spmd.passes.merge_followers import AUTO_MIN_NODES, merge_followers
from spmd.passes.merge_tied_parameters import merge_tied_parameters
from spmd.passes.estimate_costs import estimate_costs
from spmd.passes.insert_collectives import insert_collectives
from spmd.passes.solve_placements import solve_placements
from spmd.passes.split_joint_graph import split_joint_graph
from spmd.passes.stamp_layers import CannotStamp, stamp_layers
from spmd.passes.trace_joint import trace_joint
from spmd.passes.trace_module import flat_outputs, trace_module
from spmd.specs import placements_str


@dataclass
class Compilation:
    """Everything one compilation knows; each pass reads some fields and fills one."""

    model: torch.nn.Module
    example_inputs: tuple
    mesh: Any  # MeshSpec
    pins: Pins = field(default_factory=Pins)
    rank: int | None = None  # None: plan only, emit nothing
    group_names: tuple[str, ...] = ()
    device: torch.device | None = None  # where this rank runs (None: wherever the model's tensors are)
    training: bool = False  # trace the joint forward+backward graph
    loss_fn: Any = None
    memory_budget: float | None = None  # bytes per rank
    optimizer_state_factor: float = 2.0  # optimizer state per parameter (Adam: 2)
    bucket_bytes: float = 4 * 2**20  # gradient all_reduces are packed into buckets of this size
    defer_waits: bool = True  # wait for a gradient bucket at its first use, not right after its launch
    traced: Any = None
    strategies: Any = None
    costs: Any = None
    plan: Any = None
    global_gm: Any = None
    rank_gm: Any = None
    split: Any = None  # SplitGraphs (training)
    device_mesh: Any = None  # the runtime torch DeviceMesh (compile only; planning never needs it)
    agree: Callable | None = None  # every rank adopts rank 0's solution (compile on a live mesh)
    tie_blocks: bool | None = None  # identical layers get identical placements (solve one layer, not all);
    # None: only where a layer repeats at least AUTO_MIN_REPEATS times
    blocks: Any = None  # RepeatedBlocks
    merge_followers: bool | None = None  # cheap ops follow their input (approximate; None: large graphs only)
    stamp_layers: bool | None = None  # trace TRACED layers of each stack of identical layers and copy the
    # middle one up to full depth (None: when planning only, see find_layer_stacks.py)
    stacks: tuple = ()  # LayerStacks traced truncated
    plan_only: bool = False  # stop at the plan (spmd.plan): the sharded graph is made when first drawn
    timings: dict = field(default_factory=dict)  # pass name -> seconds
    stats: dict = field(default_factory=dict)  # what passes report (e.g. nodes merged), copied into plan.stats


def _specs(node) -> str:
    ps = node.meta.get("spmd_placements")
    if not ps:
        return ""
    return ", ".join(placements_str(p) for p in ps if p is not None)


def _dump_strategies(c: Compilation) -> str:
    def note(n):
        ns = c.strategies.nodes.get(n.name)
        if ns is None:
            return ""
        uneven = f", {ns.excluded} excluded as uneven" if ns.excluded else ""
        return f"{len(ns.strategies)} strategies ({ns.source}{uneven})"
    return format_graph(c.traced.graph, note)


def _dump_costs(c: Compilation) -> str:
    def note(n):
        row = c.costs.node_costs.get(n.name)
        return f"compute {min(row) * 1e6:.1f}..{max(row) * 1e6:.1f} us" if row else ""
    return format_graph(c.traced.graph, note)


def _dump_plan(c: Compilation) -> str:
    def note(n):
        s = c.plan.choices.get(n.name)
        if s is None:
            return ""
        outs = ", ".join(placements_str(p) for p in s.outputs if p is not None)
        return f"{outs}  {c.plan.node_costs.get(n.name, 0.0) * 1e6:.1f} us"
    return format_graph(c.traced.graph, note) + "\n" + str(c.plan) + "\n"


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Compilation], None]
    dump: Callable[[Compilation], str]
    when: Callable[[Compilation], bool] = lambda c: True


def _temporaries(c: Compilation, plan) -> tuple[float, str | None]:
    """Bytes the schedule holds at its worst point beyond the saved activations (see memory.py)."""
    flat, kinds = flat_outputs(c.traced.graph.output_node()), c.traced.output_kinds()
    grads = {a.name for a, k in zip(flat, kinds) if k.kind == "grad" and isinstance(a, torch.fx.Node)}
    peak, at = peak_live_bytes(c.traced.graph, plan.choices, c.traced.tensor_info, c.mesh.shape, grads, plan.edges)
    return max(0.0, peak - plan.memory.get("activations", 0.0)), at


def _solve(c: Compilation) -> None:
    """The ILP, then the schedule's temporaries on top of its memory terms. Under a budget, when the
    temporaries do not fit beside the plan, solve once more leaving room for them; if no plan leaves
    that much room, keep the first (its terms fit the budget) and say so."""
    def solve(budget):
        return solve_placements(c.strategies, c.costs, c.traced.labels(), budget, agree=c.agree, blocks=c.blocks)

    plan = solve(c.memory_budget)
    extra, at = _temporaries(c, plan)
    if c.memory_budget is not None and plan.predicted_peak_bytes + extra > c.memory_budget:
        try:
            roomier = solve(c.memory_budget - extra)
        except SpmdError:
            warnings.warn(f"memory_budget {c.memory_budget / 2**20:.1f} MiB: the plan's parameters, gradients, "
                          f"optimizer state and saved activations fit, but with the schedule's temporaries "
                          f"({extra / 2**20:.1f} MiB at '{at}') the predicted peak is "
                          f"{(plan.predicted_peak_bytes + extra) / 2**20:.1f} MiB and no plan leaves room for them. "
                          "What to do: raise the budget, use a bigger mesh, or a smaller batch.", stacklevel=3)
        else:
            plan = roomier
            extra, at = _temporaries(c, plan)
            plan.memory_budget = c.memory_budget
    plan.memory["temporaries"] = extra
    plan.stats.update(c.stats, peak_live_at=at, bucket_bytes=c.bucket_bytes)
    c.plan = plan


def _merge_followers(c: Compilation) -> bool:
    if c.merge_followers is None:
        return sum(1 for n in c.traced.graph.nodes if n.op == "call_function") > AUTO_MIN_NODES
    return c.merge_followers


def _forward_only(c: Compilation) -> bool:
    return not c.training


def _stamping(c: Compilation) -> bool:
    return c.stamp_layers if c.stamp_layers is not None else c.rank is None


def _trace(c: Compilation) -> None:
    """The traced graph, of the model with its layer stacks truncated when there are any; a truncated
    model that does not trace (a forward that indexes layers by a configured depth) is traced whole."""
    def trace(model):  # tied weights: one placeholder, one (summed) gradient per shared tensor
        if c.training:
            return merge_tied_parameters(trace_joint(model, c.example_inputs, c.loss_fn))
        return merge_tied_parameters(trace_module(model, c.example_inputs))

    if c.stacks:
        try:
            with truncated(c.model, c.stacks):
                c.traced = trace(c.model)
        except SpmdError as e:
            c.stats["stamped_layers"] = f"none: the model with {TRACED} layers per stack did not trace ({e})"
            c.stacks = ()
    if not c.stacks:
        c.traced = trace(c.model)
    if c.traced.custom_functions:
        c.stats["custom_functions"] = list(c.traced.custom_functions)


def _stamp(c: Compilation) -> None:
    try:
        c.traced = stamp_layers(c.traced, c.stacks, c.model)
        c.stats["stamped_layers"] = "; ".join(f"{s.fqn}: {TRACED} traced, {s.depth - TRACED} stamped" for s in c.stacks)
    except CannotStamp as e:
        c.stats["stamped_layers"] = f"none: {e}; traced every layer"
        c.stacks = ()
        _trace(c)


def _has_rank(c: Compilation) -> bool:
    return c.rank is not None


def _training_rank(c: Compilation) -> bool:
    return c.training and c.rank is not None


# Why each pass sits where it does:
PIPELINE: tuple[Pass, ...] = (
    # Deep models: stacks of identical layers are traced a few layers deep and stamped to full depth.
    Pass("find_layer_stacks", lambda c: setattr(c, "stacks", find_layer_stacks(c.model)),
         lambda c: "\n".join(map(str, c.stacks)), _stamping),
    # ATen graph first: every later pass reasons about core ATen ops with static shapes. Training traces
    # the joint forward+backward graph; after that, both take the same road.
    Pass("trace_module", _trace,
         lambda c: format_graph(c.traced.graph, lambda n: str(c.traced.tensor_info.get(n.name, ""))), _forward_only),
    Pass("trace_joint", _trace,
         lambda c: format_graph(c.traced.graph, lambda n: f"{c.traced.tensor_info.get(n.name, '')} "
                                f"{n.meta.get('partitioner_tag', '')}"), lambda c: c.training),
    Pass("stamp_layers", _stamp, lambda c: c.stats.get("stamped_layers", ""), lambda c: bool(c.stacks)),
    # Identical layers, found once, let the next three passes do one layer's work for all of them.
    Pass("find_repeated_blocks", lambda c: setattr(c, "blocks", find_repeated_blocks(
        c.traced, AUTO_MIN_REPEATS if c.tie_blocks is None else 2)),
         lambda c: c.blocks.summary() + "\n" + format_graph(c.traced.graph, lambda n: c.blocks.rep(n.name) or ""),
         lambda c: c.tie_blocks is not False),
    # Candidates need shapes (evenness) and the mesh; pins cut them down before any cost is paid.
    Pass("enumerate_strategies", lambda c: setattr(c, "strategies", enumerate_strategies(c.traced, c.mesh, c.pins,
                                                                                         c.blocks)),
         _dump_strategies),
    # Large graphs only (an approximation): single-input ops follow their input instead of choosing.
    Pass("merge_followers", lambda c: c.stats.__setitem__("merged_followers", merge_followers(c.traced, c.strategies)),
         _dump_strategies, _merge_followers),
    # Costs for every candidate and edge, from the same redistribute planner codegen uses.
    Pass("estimate_costs", lambda c: setattr(c, "costs", estimate_costs(c.traced, c.strategies, c.mesh,
                                                                           c.optimizer_state_factor, c.bucket_bytes,
                                                                           c.blocks)),
         _dump_costs),
    # One global choice (ILP). Optimal plans can tie and the solver breaks ties by timing, so on a live
    # mesh every rank adopts rank 0's solution (one small broadcast).
    Pass("solve_placements", lambda c: _solve(c), _dump_plan),
    # Structural passes from here: explicit steps, then this rank's local graph.
    Pass("insert_collectives", lambda c: setattr(c, "global_gm", insert_collectives(c.traced, c.plan)),
         lambda c: format_graph(c.global_gm.graph, _specs), lambda c: not c.plan_only),
    Pass("emit_rank_graph", lambda c: setattr(c, "rank_gm", emit_rank_graph(c.global_gm, c.mesh, c.rank,
                                                                            c.group_names, c.device)),
         lambda c: c.rank_gm.code, _has_rank),
    # Last: autograd runs forward and backward separately, so the joint rank graph is cut in two.
    Pass("split_joint_graph", lambda c: setattr(c, "split", split_joint_graph(c.rank_gm, c.traced)),
         lambda c: c.split.forward.code + "\n" + c.split.backward.code, _training_rank),
    # Communication passes on the per-rank backward graph: the cost model already priced bucketing.
    Pass("bucket_gradients", lambda c: bucket_gradients(c.split.backward, c.mesh.shape, c.bucket_bytes, c.defer_waits),
         lambda c: c.split.backward.code, _training_rank),
)


def run_pipeline(c: Compilation, dump_dir: str | None = None) -> Compilation:
    dump = Dumper(dump_dir or os.environ.get("SPMD_DUMP"))
    for p in PIPELINE:
        if not p.when(c):
            continue
        t0 = time.perf_counter()
        p.run(c)
        c.timings[p.name] = time.perf_counter() - t0
        if dump.directory:
            dump(p.name, p.dump(c))
    return c
