"""A plan solved before, taken instead of solving (`PlanOptions.plan`): checked against what this compilation
traced, since a plan names nodes and a plan for another graph would run other collectives, or none, around
the same names.

    take_given_plan(plan, traced, mesh, options) -> plan    or one SpmdError listing every difference

What is checked: the mesh's shape and axis names; training or not; the digest of the traced ops (each op,
the numbers it takes, the values it reads and its output shape, in order: `agreement.graph_digest`), which
the plan keeps from its own trace, with each input's, parameter's and buffer's shape and dtype, named where
they differ; a choice for every value the graph makes and none for a node it lacks; the
names of the inputs, parameters and buffers, and each placeholder's shape and dtype; stamped layer stacks
where the plan stamped them; the pins given with the plan, each met; a memory budget, an optimizer state
factor and a gradient bucket size given with it, the plan's (`spmd.api` takes the plan's where they are
left at their defaults).
The profiles the plan was priced with may differ from this mesh's: they are what its costs and memory say.
"""
from __future__ import annotations

import torch.fx as fx

from spmd.compiler.agreement import graph_digest, placeholder_shapes
from spmd.compiler.options import PlanOptions
from spmd.core.errors import SpmdError
from spmd.core.graph_facts import format_bytes
from spmd.core.plan import Plan
from spmd.core.specs import placements_str
from spmd.passes.check_pins import check_pins
from spmd.passes.insert_collectives import unplanned_reshardings

_WAY_OUT = ("What to do: plan again from this model with these inputs and options (`spmd.plan(...)`, then "
            "`plan.save(path)`), or compile without plan= to solve here.")


def take_given_plan(plan: Plan, traced, mesh, options: PlanOptions, stamp_note: str = "") -> Plan:
    """`stamp_note`: how this trace stamped its layer stacks (pipeline's `_trace`), which a plan solved over
    stamped layers must have done too (its node names are the stamped graph's)."""
    problems = _differences(plan, traced, mesh, options, stamp_note)
    if problems:
        raise SpmdError("the plan given (plan=) is not a plan of what this compile traced:\n" +
                        "\n".join(f"  - {p}" for p in problems) + f"\n{_WAY_OUT}")
    return plan


def _differences(plan: Plan, traced, mesh, options: PlanOptions, stamp_note: str) -> list[str]:
    mine = (tuple(mesh.shape), tuple(mesh.axis_names))
    theirs = (tuple(plan.mesh.shape), tuple(plan.mesh.axis_names))
    if mine != theirs:  # (nothing else can be compared: the pieces' shapes follow from the mesh)
        return [f"it was solved for a mesh of shape {theirs[0]} with axes {theirs[1]}, this one is {mine[0]} with "
                f"axes {mine[1]}"]
    if plan.joint != traced.joint:  # (then every op after the forward's differs: nothing more to say)
        said = {True: "training (forward and backward)", False: "inference (forward only)"}
        return [f"it is a plan for {said[plan.joint]}, this compile is for {said[traced.joint]}"]
    stamped = plan.stats.get("stamped_layers", "")
    if was_stamped(stamped) and not was_stamped(stamp_note):  # (the ops alike, the node names apart)
        return [f"it was solved over layer stacks traced a few layers deep and stamped ({stamped}); this compile "
                f"traced every layer ({stamp_note or 'stamp_layers=False'}). Plan with stamp_layers=False to run it "
                "here"]
    problems = []
    digest = plan.stats.get("wired_graph")
    if digest is None:
        problems.append("it keeps no digest of its ops and what each reads (a plan file written before spmd kept "
                        "one), so nothing shows it is this graph's")
    elif digest != graph_digest(traced, wiring=True):
        problems += _shapes_differ(plan, traced) or [
            "its ops are not this graph's, or read other values (another model, configuration or "
            "forward, other input shapes or dtypes, another loss function, a device whose kernels "
            "trace otherwise, or an spmd version that rewrites the traced graph otherwise)"]
    problems += _names_differ(plan, traced)
    if not problems:  # (the same ops: the nodes and their names are too, but for what the plan left out)
        problems += _unchosen(plan, traced)
    if not problems:  # (every pinned value has its choice)
        problems += _pins_unmet(plan, traced, mesh, options)
    if not problems:  # (a file edited and signed again: a probe's compile ran the old edges beside new choices)
        disagree = unplanned_reshardings(traced, plan)
        problems += [f"its edges (the reshardings) disagree with its choices: {'; '.join(disagree[:3])}" +
                     (f"; and {len(disagree) - 3} more" if len(disagree) > 3 else "")] if disagree else []
    if options.memory_budget is not None and options.memory_budget != plan.memory_budget:
        planned = "no budget" if plan.memory_budget is None else f"a budget of {plan.memory_budget:.0f} bytes"
        problems.append(f"memory_budget={options.memory_budget:.0f} was given, and the plan was solved under "
                        f"{planned} (leave memory_budget out to take the plan as solved)")
    if options.recompute is not None:
        problems.append(f"recompute={options.recompute!r} was given: the plan says which layers recompute (its "
                        f"recompute: {list(plan.recompute) or 'none'}; selectively: "
                        f"{list(plan.recompute_selective) or 'none'}); give recompute= when planning")
    for name, what in (("optimizer_state_factor", "its memory counts that much optimizer state and prices its "
                                                  "step so"),
                       ("bucket_bytes", "it priced its gradient all_reduces packed so, and explains them so")):
        planned, given = plan.stats.get(name), getattr(options, name)
        if planned is not None and planned != given:
            said = format_bytes if name == "bucket_bytes" else (lambda v: f"{v:g}")
            problems.append(f"{name}={said(given)} was given, and the plan was priced for {said(planned)} ({what}; "
                            "leave it out to take the plan's)")
    return problems


def was_stamped(note: str) -> bool:
    """A trace's stamping note says it stamped layers (not "none: ...", why it traced every layer)."""
    return bool(note) and not note.startswith("none")


def _names_differ(plan: Plan, traced) -> list[str]:
    """The plan's labels (placeholder -> parameter or buffer FQN, input name) against this trace's, backward's
    seeds (the outputs' gradients, which a training plan has and an inference plan lacks) left out."""
    seeds = {gi.name for gi in traced.inputs if gi.kind == "tangent"}
    mine = {ph: name for ph, name in traced.labels().items() if name not in seeds}
    theirs = {ph: name for ph, name in plan.labels.items() if name not in seeds and not ph.startswith("tangents")}
    if mine == theirs:
        return []
    only_plan = sorted(set(theirs.values()) - set(mine.values()))
    only_here = sorted(set(mine.values()) - set(theirs.values()))
    if not only_plan and not only_here:
        return ["its inputs, parameters and buffers are the same but held by other placeholders (another trace)"]
    inputs = {gi.name for gi in traced.inputs if gi.kind == "input"}
    if only_plan and set(only_plan) <= set(plan.stats.get("loss_targets", ())) and set(only_here) <= inputs:
        # (the targets are named by the loss function's arguments: a probe found another loss_fn told of inputs)
        return [f"its loss function took the targets as {_few(only_plan)}, this compile's takes them as "
                f"{_few(only_here)}: another loss_fn (a plan is solved for its loss function)"]
    return _either(only_plan and f"the plan's {_few(only_plan)} are not among this compile's inputs, parameters "
                                 "and buffers",
                   only_here and f"this compile's {_few(only_here)} are not in the plan")


def _shapes_differ(plan: Plan, traced) -> list[str]:
    """The inputs, parameters and buffers of both whose shape or dtype differ (a plan file kept them from its trace;
    found by a probe: a wider model, another batch or dtype were refused with the digest's words alone)."""
    planned = plan.stats.get("placeholders") or {}
    mine = placeholder_shapes(traced)
    apart = [f"{name} is {was} in the plan, {mine[name]} here" for name, was in planned.items()
             if name in mine and mine[name] != was]
    return [f"other shapes or dtypes: {_few(apart)}"] if apart else []


def _unchosen(plan: Plan, traced) -> list[str]:
    graph: fx.Graph = traced.graph
    made = [n.name for n in graph.nodes if n.op in ("placeholder", "call_function")]
    missing = [n for n in made if n not in plan.choices]
    known = set(made) | {f"output_{k}" for k in range(len(traced.output_kinds()))}
    extra = [n for n in plan.choices if n not in known]
    return _either(missing and f"it chooses no placements for {_few(missing)}",
                   extra and f"it chooses placements for {_few(extra)}, which this graph does not have")


def _pins_unmet(plan: Plan, traced, mesh, options: PlanOptions) -> list[str]:
    pins = check_pins(options.pins, traced, mesh)
    by_name = {gi.name: gi.placeholder for gi in traced.inputs}
    unmet = []
    for book, table, what in (("in_placements", pins.inputs, "input"), ("param_placements", pins.params, "")):
        for name, pin in table.items():
            chosen = plan.choices[by_name[name]].outputs[0]
            if tuple(chosen) != tuple(pin):
                unmet.append(f"{book} pins {what + ' ' if what else ''}{name!r} to {placements_str(pin)}; the plan "
                             f"lays it out {placements_str(chosen)}")
    for k, pin in pins.outputs.items():
        chosen = plan.choices[f"output_{k}"].inputs[0]
        if tuple(chosen) != tuple(pin):
            unmet.append(f"out_placements pins output {k} to {placements_str(pin)}; the plan returns it "
                         f"{placements_str(chosen)}")
    return unmet


def _either(*said) -> list[str]:
    """One problem of the parts said (an empty part: nothing to say), or none."""
    said = [s for s in said if s]
    return ["; ".join(said)] if said else []


def _few(names: list[str], shown: int = 4) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
