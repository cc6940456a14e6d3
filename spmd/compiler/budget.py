"""The solve step: the ILP, with the schedule's temporaries checked inside the search, under the budget.

    solve_placements ──▶ Plan whose linear memory terms (parameters, gradients, optimizer state, saved
        activations, inputs) fit `memory_budget` (the budget row, relaxed with a price per byte) and
        whose schedule's temporaries (`Schedule.temporaries`: the worst point's bytes beyond the saved
        activations) fit what is left: every candidate the search meets is checked whole
    none fits whole? ──▶ cuts: each plan that was over by its temporaries gives rows, the bytes alive
        at each hill of its schedule over the budget as a function of the choices (`solve_placements._cut`,
        every plan's values and copies there), which every fitting plan satisfies; branch and bound under
        the budget row and the cuts finds a plan, which either fits whole or adds its own cuts, until one
        fits or the program is infeasible
    still none? ──▶ the leanest plan the search met whose linear terms fit, with a warning that says
        whether no plan fits (proven: the cuts left nothing) or the search ran out of time; where not even
        the linear terms of any plan met fit, an SpmdError: "no plan fits" only when that is proven, else
        that the search ran out of time, with the floor

What is guaranteed: when some plan fits whole, the search ends with a plan that fits, unless its time
runs out first (each branch and bound round has `Budget.seconds`, the whole solve `time_limit`; the
first fitting plan the cuts let through gets the rest of `time_limit` to close the gap). The
cuts only matter where the price search's plans are all over: ViT-120B at batch 1024 on (8, 8) at 80 GB
came back 145.8 GB over; with one cut it fits at 79.3 GB (bench/results_plan.md).
The result is the plan with `memory["temporaries"]`, the stats every pass reported, and what the
per-call costs around the graph scale with (`wrapper_counts`).
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

from spmd.compiler.axis_search import solve_by_axes
from spmd.core.graph_facts import format_bytes
from spmd.core.plan import Plan
from spmd.cost_model.compute import wrapper_counts
from spmd.cost_model.memory import AT_THE_STEP, Schedule
from spmd.passes.solve_placements import rebuilt_regions, solve_placements
from spmd.passes.trace_module import TracedGraph, flat_outputs


def schedule_of(traced: TracedGraph, bucket_bytes: float | None = None) -> Schedule:
    """The graph's schedule, with every parameter's gradient leaving as backward makes it, held from then
    on in its parameter's layout, and its all_reduces packed into buckets of `bucket_bytes` (memory.py)."""
    flat, kinds = flat_outputs(traced.graph.output_node()), traced.output_kinds()
    placeholder = {gi.name: gi.placeholder for gi in traced.inputs if gi.kind == "parameter" and gi.name not in traced.frozen}
    grads = {a.name: placeholder.get(k.name) for a, k in zip(flat, kinds)
             if k.kind == "grad" and isinstance(a, torch.fx.Node)}
    return Schedule(traced.graph, traced.tensor_info, set(grads), {g: p for g, p in grads.items() if p is not None},
                    bucket_bytes)


def solve_within_budget(traced: TracedGraph, strategies, costs, memory_budget: float | None, blocks=None,
                        stats: dict | None = None, bucket_bytes: float | None = None,
                        on_progress=None, recompute=None, by_axes: bool = False, time_limit: float = 60.0) -> Plan:
    """`stats`: what earlier passes reported, kept in `plan.stats`.
    `by_axes`: solve a few mesh axes at a time (compiler/axis_search.py), not the whole program at once.
    `time_limit`: seconds each solve may take (`PlanOptions.solver_time_limit`)."""
    labels, regions = traced.labels(), traced.regions()
    schedule = schedule_of(traced, bucket_bytes)

    def solve(table, table_costs) -> Plan:
        return solve_placements(table, table_costs, labels, memory_budget, time_limit=time_limit, blocks=blocks,
                                schedule=schedule, on_progress=on_progress, regions=regions, recompute=recompute)

    plan = solve_by_axes(solve, strategies, costs, len(costs.mesh.shape)) if by_axes else solve(strategies, costs)
    # (with the gradient buckets' flat copies, which the search's cuts cannot weigh: a memory probe found a small
    # GPT's step peaking at its dp bucket's packing, 1.21x the prediction without them)
    rebuilt = rebuilt_regions(plan, recompute)
    extra, point = schedule.temporaries(plan, rebuilt, packing=True)
    unpacked = schedule.temporaries(plan, rebuilt)[0]
    # the row's kinds (held when backward starts) with what the walk holds beyond the saved activations
    held = sum(b for k, b in plan.memory.items() if k not in AT_THE_STEP)
    peak, searched = held + extra, held + unpacked  # (`searched`: the peak as the search weighed it)
    at = None if point is None else point.at
    # "temporaries": the rest of what the walk holds beyond the saved activations, less the gradients made
    # by the worst point (`memory` keeps every kind at its most, so its sum is at least the peak)
    made = 0.0 if point is None else schedule.gradient_bytes(point, plan.choices, plan.mesh.shape)
    temporaries = max(0.0, extra - made)  # (0 where the worst point holds fewer activations than were saved)
    more = f"with the gradients and temporaries the schedule holds ({format_bytes(extra)} more at '{at}')"
    # the optimizer's step, after backward: every gradient and the step's temporaries (`optimizer_step_factor`)
    # beside what is held all the time (a memory probe: AdamW's foreach step 1.25x the peak predicted without them)
    step = sum(b for k, b in plan.memory.items() if k != "activations")
    if plan.memory.get("optimizer step"):
        searched = max(searched, step)
        if step > peak:
            peak, at, made = step, "the optimizer's step", plan.memory.get("gradients", 0.0)
            more = (f"at the optimizer's step, with every gradient and the step's own temporaries "
                    f"({format_bytes(plan.memory['optimizer step'])}: AdamW's foreach square roots)")
    packing = peak - searched  # (what the buckets' copies add to the peak)
    if memory_budget is not None and searched <= memory_budget * (1 + 1e-9) < peak:
        warnings.warn(f"memory_budget {format_bytes(memory_budget)}: the plan fits but for a gradient bucket's flat "
                      f"copy, alive beside its gradients at its launch ('{at}'), which the search does not weigh: "
                      f"the predicted peak is {format_bytes(peak)}, {format_bytes(packing)} of it the copy. What to "
                      f"do: smaller gradient buckets (bucket_bytes={format_bytes(bucket_bytes or 0)} now) make the "
                      "copy smaller, at a latency per launch.", stacklevel=4)
    elif memory_budget is not None and peak > memory_budget * (1 + 1e-9):
        warnings.warn(f"memory_budget {format_bytes(memory_budget)}: the plan's parameters, optimizer state and "
                      f"saved activations fit, but {more} the predicted peak is {format_bytes(peak)}, and "
                      + ("no plan fits whole (proven; this is the leanest plan found). "
                         if "(proven)" in str(plan.stats.get("status")) else
                         "no plan the search met fits whole (this is the leanest it found). ") +
                      "What to do: raise the budget, use a bigger mesh, or a smaller batch.", stacklevel=4)
    kinds = {gi.placeholder: gi.kind for gi in traced.inputs}
    return dataclasses.replace(
        plan, memory={**plan.memory, "temporaries": temporaries}, peak_bytes=peak,
        stats={**plan.stats, **(stats or {}), "peak_live_at": at, "gradients_at_peak": made,
               "bucket_bytes": bucket_bytes, "bucket_packing": packing},
        wrapper_counts=wrapper_counts(traced.graph, kinds, traced.joint), joint=traced.joint)
