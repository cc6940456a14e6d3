"""What if the batch were different: a plan's cost as a formula in the batch size, and the batch sizes at
which the best plan changes.

    cost_formula(plan, request)   trace the model at the planned batch b0 and at 2*b0 (fake tensors, no
                                  memory) -> which dims scale -> cost_model/symbolic.py prices the plan's
                                  own placements with sympy dims
    crossover(plan, request)      solve again at b0/8 ... 64*b0 (only traced, never run); where the best
                                  plan changes between two sizes, bisect where their formulas cross

Only the batch is symbolic: the user's inputs are re-sized along one dim each (dim 0 unless told).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from spmd.compiler.meta import fake_model
from spmd.compiler.options import PlanOptions
from spmd.compiler.pipeline import rewritten, run_pipeline
from spmd.core.errors import SpmdError
from spmd.core.specs import placements_str
from spmd.cost_model import symbolic
from spmd.passes.trace_joint import trace_joint
from spmd.passes.trace_module import trace_module


@dataclass(frozen=True)
class Request:
    """What was planned, to ask again at another batch size. `dims`: input index -> its batch dim
    (default: dim 0 of every tensor input)."""

    model: torch.nn.Module
    example_inputs: tuple
    mesh: Any  # MeshSpec
    options: PlanOptions
    dims: dict[int, int] | None = field(default=None)

    def batch_dims(self) -> dict[int, int]:
        if self.dims is not None:
            return self.dims
        return {i: 0 for i, t in enumerate(self.example_inputs) if isinstance(t, torch.Tensor) and t.dim() > 0}

    @property
    def batch(self) -> int:
        i, d = next(iter(self.batch_dims().items()))
        return int(self.example_inputs[i].shape[d])

    def inputs_at(self, batch: int) -> tuple:
        out = list(self.example_inputs)
        for i, d in self.batch_dims().items():
            shape = list(out[i].shape)
            shape[d] = batch
            out[i] = out[i].new_zeros(shape)
        return tuple(out)

    def trace(self, batch: int):
        model, inputs = fake_model(self.model, self.inputs_at(batch))
        if self.options.joint:
            return rewritten(trace_joint(model, inputs, self.options.loss_fn))
        return rewritten(trace_module(model, inputs))

    def plan(self, batch: int):
        model, inputs = fake_model(self.model, self.inputs_at(batch))
        return run_pipeline(model, inputs, self.mesh, self.options).plan


def _need(request: Request | None, what: str) -> Request:
    if request is None:
        raise SpmdError(f"{what} needs a plan made by spmd.plan (it re-traces the model at other batch sizes). "
                        "What to do: call spmd.plan(model, mesh_spec, example_inputs, ...).")
    return request


def cost_formula(plan, request: Request | None, symbol: str = "batch", batch: int | None = None) -> sympy.Expr:
    """The plan's estimated seconds per step as a sympy formula in `symbol` (the batch size). `batch`: the
    batch the plan was solved at (default: the request's)."""
    request = _need(request, "cost_formula")
    b0 = batch or request.batch
    return symbolic.cost_formula(plan, request.trace(b0), request.trace(2 * b0), b0, symbol)


def _layout(plan) -> tuple:
    """What a plan decides, independent of the batch size it was solved at."""
    return tuple(sorted((name, str(s)) for name, s in plan.choices.items()))


@dataclass
class Crossover:
    symbol: str
    at: float | None  # the formulas of `below` and `above` are equal here; None: they do not cross in `between`
    below: Any  # Plan, best just under `at`
    above: Any  # Plan, best just over `at`
    changed: list[tuple[str, str, str]]  # (parameter or input, placements below, placements above)
    below_formula: Any = None  # their costs in the batch size (sympy)
    above_formula: Any = None
    between: tuple[int, int] = (0, 0)  # the two sizes solved: `below` best at the first, `above` at the second
    unpriced: str = ""  # why no formula covers `between` (cost_formula's error), where none does

    def __repr__(self) -> str:
        # (the dataclass's own repr printed both whole Plans: about 70 kB for one crossover in a list)
        where = f"~ {self.at:.4g}" if self.at is not None else f"between {self.between[0]} and {self.between[1]}"
        return (f"Crossover({self.symbol} {where}: {len(self.changed)} placement(s) change; "
                "str() lists them, .below and .above are the plans)")

    def __str__(self) -> str:
        if self.at is None and self.unpriced:
            lo, hi = self.between
            lines = [f"between {self.symbol} {lo} and {hi} the best plan changes; where, no formula says: "
                     f"{self.unpriced}"]
        elif self.at is None:
            lo, hi = self.between
            lines = [f"between {self.symbol} {lo} and {hi} the best plan changes; their formulas do not cross "
                     "there (each plan's formula also counts sizes its layout cannot split evenly, where it "
                     "cannot run; or one solve stopped within its optimality gap)"]
        else:
            lines = [f"at {self.symbol} ~ {self.at:.4g} the best plan changes"]
        for name, a, b in self.changed[:12]:
            lines.append(f"  {name}: {a} -> {b}")
        if len(self.changed) > 12:
            lines.append(f"  ... and {len(self.changed) - 12} more")
        return "\n".join(lines)


def crossover(plan, request: Request | None, symbol: str = "batch", sizes: list[int] | None = None) -> list[Crossover]:
    """Re-solve at other batch sizes (default: the plan's batch times 1/8 ... 64, where whole) and
    report every size where the best plan changes, located where the two plans' formulas cross (`at`;
    None where they do not cross between the two sizes solved, `between`)."""
    request = _need(request, "crossover")
    b0 = request.batch
    if sizes is None:
        sizes = sorted({int(b0 * f) for f in (1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8, 16, 32, 64) if b0 * f >= 1 and (b0 * f) % 1 == 0})
    plans = []
    for b in sorted(set(sizes)):
        try:
            plans.append((b, plan if b == b0 else request.plan(b)))
        except SpmdError:
            continue  # e.g. a pinned placement that this size cannot divide
    found: list[Crossover] = []
    x = sympy.Symbol(symbol)
    for (b1, p1), (b2, p2) in zip(plans, plans[1:]):
        if _layout(p1) == _layout(p2):
            continue
        f1 = f2 = None
        unpriced = ""
        try:
            f1 = cost_formula(p1, request, symbol, b1)
            f2 = cost_formula(p2, request, symbol, b2)
        except SpmdError as e:  # (a size whose graph has other ops than at twice it: transformers' masks at batch 1
            unpriced = str(e).splitlines()[0]  # expand from 1; a probe's Llama stopped the whole crossover there)
        formula = sympy.lambdify(x, f1 - f2, "math") if f2 is not None else None
        lo, hi = float(b1), float(b2)
        if formula is None or formula(lo) > 0 or formula(hi) < 0:  # no sign change: no crossing to report
            at = None
        else:
            for _ in range(60):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if formula(mid) <= 0 else (lo, mid)
            at = (lo + hi) / 2
        labels = p1.labels
        changed = [(labels[n], placements_str(p1.choices[n].outputs[0]), placements_str(p2.choices[n].outputs[0]))
                   for n in labels if n in p2.choices and p1.choices[n].outputs[0] != p2.choices[n].outputs[0]]
        found.append(Crossover(symbol, at, p1, p2, changed, f1, f2, (b1, b2), unpriced))
    return found
