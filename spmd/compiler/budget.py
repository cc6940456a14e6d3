"""The solve step: the ILP, with the schedule's temporaries checked inside the search, under the budget.

    solve_placements ──▶ Plan whose linear memory terms (parameters, gradients, optimizer state, saved
        activations, inputs) fit `memory_budget` (the budget row, relaxed with a price per byte) and
        whose schedule's temporaries (`peak_live_bytes`: the worst point's bytes beyond the saved
        activations) fit what is left: every candidate the search meets is checked whole
    none fits whole? ──▶ the leanest plan the search met whose linear terms fit, with a warning

What is guaranteed: a plan that fits whole is found when one of the search's plans fits (the best plan
at each price it tries, up to the leanest in the linear terms, and branch and bound's with the room the
leanest plan's temporaries leave). A fitting plan off that path, lean in the linear terms but with
large temporaries, can be missed: ViT-60B at 80 GB comes back at 90.0 GB while a pinned 2-D plan fits at
73.1 GB (bench/results_plan.md). Temporaries as rows of the program would close that.
The result is the plan with `memory["temporaries"]`, the stats every pass reported, and what the
per-call costs around the graph scale with (`wrapper_counts`).
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

from spmd.compiler.axis_search import solve_by_axes
from spmd.core.plan import Plan
from spmd.cost_model.compute import wrapper_counts
from spmd.cost_model.memory import peak_live_bytes
from spmd.passes.solve_placements import solve_placements
from spmd.passes.trace_module import TracedGraph, flat_outputs


def temporaries(traced: TracedGraph, plan: Plan) -> tuple[float, str | None]:
    """Bytes the schedule holds at its worst point beyond the saved activations (see memory.py), and where."""
    flat, kinds = flat_outputs(traced.graph.output_node()), traced.output_kinds()
    grads = {a.name for a, k in zip(flat, kinds) if k.kind == "grad" and isinstance(a, torch.fx.Node)}
    peak, at = peak_live_bytes(traced.graph, plan.choices, traced.tensor_info, plan.mesh.shape, grads, plan.edges)
    held = plan.memory.get("activations", 0.0) + plan.recomputed_bytes  # the schedule walked saves every layer
    return max(0.0, peak - held), at


def solve_within_budget(traced: TracedGraph, strategies, costs, memory_budget: float | None, blocks=None,
                        stats: dict | None = None, bucket_bytes: float | None = None,
                        on_progress=None, recompute=None, by_axes: bool = False) -> Plan:
    """`stats`: what earlier passes reported, kept in `plan.stats`.
    `by_axes`: solve a few mesh axes at a time (compiler/axis_search.py), not the whole program at once."""
    labels, regions = traced.labels(), traced.regions()

    def solve(table, table_costs) -> Plan:
        return solve_placements(table, table_costs, labels, memory_budget, blocks=blocks,
                                extra_bytes=lambda p: temporaries(traced, p)[0], on_progress=on_progress,
                                regions=regions, recompute=recompute)

    plan = solve_by_axes(solve, strategies, costs, len(costs.mesh.shape)) if by_axes else solve(strategies, costs)
    extra, at = temporaries(traced, plan)
    if memory_budget is not None and plan.predicted_peak_bytes + extra > memory_budget * (1 + 1e-9):
        warnings.warn(f"memory_budget {memory_budget / 2**20:.1f} MiB: the plan's parameters, gradients, "
                      f"optimizer state and saved activations fit, but with the schedule's temporaries "
                      f"({extra / 2**20:.1f} MiB at '{at}') the predicted peak is "
                      f"{(plan.predicted_peak_bytes + extra) / 2**20:.1f} MiB, and no plan the search met fits "
                      "whole (this is the leanest it found). "
                      "What to do: raise the budget, use a bigger mesh, or a smaller batch.", stacklevel=4)
    kinds = {gi.placeholder: gi.kind for gi in traced.inputs}
    return dataclasses.replace(
        plan, memory={**plan.memory, "temporaries": extra},
        stats={**plan.stats, **(stats or {}), "peak_live_at": at, "bucket_bytes": bucket_bytes},
        wrapper_counts=wrapper_counts(traced.graph, kinds, traced.joint), joint=traced.joint)
