"""The tensor-parallel part of a plan as DTensor's `parallelize_module` plan (`plan.to_parallelize_plan()`)."""
from __future__ import annotations

import warnings
from collections import Counter

from spmd.core.plan import Plan
from spmd.report.details import ParamUse, PlanDetails
from spmd.report.tp_regions import COLWISE, style_of


class ParallelizePlan(dict):
    """{module FQN: ColwiseParallel() | RowwiseParallel()} for `parallelize_module` on one mesh axis;
    `notes` says what of the spmd plan this does not express."""

    def __init__(self, styles: dict, axis: str | None, notes: list[str]):
        super().__init__(styles)
        self.axis, self.notes = axis, notes


def to_parallelize_plan(plan: Plan, details: PlanDetails | None, axis: str | None = None) -> ParallelizePlan:
    """The tensor-parallel layouts on `axis` (default: the axis with the most of them) as DTensor styles:
    Linear column-parallel -> ColwiseParallel, row-parallel -> RowwiseParallel; Embedding sharded on the
    vocabulary -> RowwiseParallel, on the hidden dim -> ColwiseParallel. Between the styles the model's
    own code runs eagerly on the local tensors they hand out; where that would not compute what the plan
    does (the plan gathers an activation there, a model output is sharded, the code's sizes are the
    whole model's), the styles around that region gather and split (`output_layouts=Replicate()`,
    `input_layouts=Replicate()`: see `spmd.report.tp_regions`), so the exported plan is right, if slower
    there. Anything else (FSDP, data parallel, other sharded parameters, biases laid out differently
    from the style's, regions run whole where the plan keeps them sharded) goes to `notes`, and a
    warning lists them."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if details is None:
        raise ValueError("to_parallelize_plan needs the plan's details (a plan from spmd.plan/compile, or a "
                         "plan file saved with them)")
    names = plan.mesh.axis_names
    tp_roles = ("column-parallel", "row-parallel", "vocab-parallel", "hidden-sharded")
    if axis is None:
        votes = Counter(names[i] for p in details.params for i, r in enumerate(p.roles) if r in tp_roles)
        axis = votes.most_common(1)[0][0] if votes else None
    notes: list[str] = []
    styles: dict = {}
    if axis is None:
        notes.append("no tensor-parallel layouts in this plan: nothing to export")
    else:
        i = plan.mesh.axis(axis)
        regions = (details.style_regions or {}).get(axis)
        if details.style_regions is None:
            notes.append("this plan file predates the check of the code between the styles: the styles assume "
                         "it runs on their local tensors as the plan does (plan and save it again to check)")
        by_module: dict[str, dict[str, ParamUse]] = {}
        for p in details.params:
            by_module.setdefault(p.module, {})[p.fqn.rsplit(".", 1)[-1]] = p
        for module, uses in by_module.items():
            weight = uses.get("weight")
            role = weight.roles[i] if weight else None
            kind = weight.module_type if weight else ""
            if regions is not None and module in regions.unstyled:
                continue  # (its parameter is read elsewhere too: a note says so)
            name = style_of(kind, role) if role is not None and weight.called else None
            style = None if name is None else ColwiseParallel if name == COLWISE else RowwiseParallel
            if style is not None:
                layouts = {}
                if regions is not None and module in regions.gather_outputs:
                    layouts["output_layouts"] = Replicate()
                if (regions is not None and module in regions.split_inputs) or (style is RowwiseParallel and
                                                                                 kind == "Embedding"):
                    layouts["input_layouts"] = Replicate()  # (an embedding reads whole indices)
                styles[module] = style(**layouts)
                bias = uses.get("bias")
                want = "column-parallel" if style is ColwiseParallel else "replicated"
                if bias is not None and bias.roles[i] != want:
                    notes.append(f"{bias.fqn}: {bias.roles[i]} on {axis}, {style.__name__} makes it {want}")
            for use in uses.values():
                if use.roles[i] not in ("replicated",) and style is None:
                    why = "DTensor's styles take nn.Linear and nn.Embedding only (Conv1D holds its weight " \
                        "transposed)" if use.module_type == "Conv1D" else "no parallel style for it" if use.called \
                        else "no parallel style: the forward never calls the module by this name (its weight is " \
                        "read directly, or the module runs under another name it is tied to)"
                    notes.append(f"{use.fqn} ({use.module_type or 'no module type'}): {use.roles[i]} on {axis}, {why}")
        for p in details.params:
            for j, r in enumerate(p.roles):
                if j != i and r != "replicated":
                    notes.append(f"{p.fqn}: {r} on {names[j]} (another axis: use fully_shard / data parallel there)")
        notes.extend(regions.notes if regions is not None else ())
        targets = set(plan.stats.get("loss_targets", ()))  # (the loss runs outside the model's styles)
        for name, ps in details.inputs.items():
            each = [p.strip() for p in ps.strip("[]").split(",")]
            if name not in targets and "S(" in each[i]:
                notes.append(f"input {name!r} is sharded on {axis} ({ps}); the styles assume it replicated there")
            # (the batch split on another axis: data parallel there, which the styles do not say; a probe found it
            # left out of the notes)
            batch = [names[j] for j, p in enumerate(each) if j != i and p == "S(0)"]
            other = [f"{names[j]} (its dim {p[2:-1]})" for j, p in enumerate(each)
                     if j != i and p.startswith("S(") and p != "S(0)"]
            if batch and name not in details.inputs_gathered:
                notes.append(f"input {name!r} is split on {', '.join(batch)} ({ps}): data parallel there, which the "
                             "styles do not express (give each rank its part of the batch, and average the "
                             "gradients over that axis: replicate / fully_shard over it)")
            if other:
                notes.append(f"input {name!r} is split on {', '.join(other)} ({ps}), which the styles do not express")
    if notes:
        warnings.warn("to_parallelize_plan: not expressed as parallel styles:\n  " + "\n  ".join(notes), stacklevel=3)
    return ParallelizePlan(styles, axis, notes)
