"""What `spmd.plan` returns and `compiled.plan` holds: the frozen `Plan` plus what reports need.

    PlanReport  = Plan (placements, edges, costs, memory: every field and method)
                + sources  (the traced graph, the solver's tables: explain, visualize)
                + request  (the model, inputs and options: cost_formula, crossover; spmd.plan only)
                + details  (computed on first use; read from the file for a loaded plan)

`.explain()`, `.visualize()`, `.save()`, `.diff()`, `.to_parallelize_plan()`, `.cost_formula`,
`.crossover()` live here, so nothing below the report layer imports a presenter.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx

from spmd.compiler.dump import plan_table
from spmd.compiler.pipeline import planning_tables, stamping_unchecked
from spmd.core.errors import SpmdError
from spmd.core.plan import Plan
from spmd.passes.insert_collectives import insert_collectives
from spmd.report import diff, explain, parallelize, plan_io, render, whatif
from spmd.report.details import PlanDetails, compute_details
from spmd.report.whatif import Request


@dataclass(frozen=True)
class PlanSources:
    """What planning saw (no parameter values: a compiled rank keeps only its shards)."""

    graph: fx.Graph  # the traced ATen graph (node names are the plan's)
    emitted: fx.GraphModule | Callable[[], fx.GraphModule] | None  # insert_collectives' output, or how to make it
    strategies: Any  # StrategyTable (None: made by `make_tables` on first use)
    costs: Any  # CostTable (likewise)
    kinds: dict[str, str]  # placeholder -> parameter | buffer | constant | input | tangent
    joint: bool = False
    blocks: Any = None  # RepeatedBlocks: repeated layers are reported once, with their count
    # (strategies, costs) where this process did not make them (a rank that took rank 0's plan)
    make_tables: Callable[[], tuple] | None = None
    module_types: dict[str, str] = field(default_factory=dict)  # module path -> class name, all modules
    aliases: dict[str, str] = field(default_factory=dict)  # a tied tensor's other name -> its canonical FQN

    @functools.cached_property
    def tables(self) -> tuple:
        """(strategies, costs) the plan was solved from."""
        if self.strategies is None and self.make_tables is not None:
            return self.make_tables()
        return self.strategies, self.costs

    @functools.cached_property
    def global_gm(self) -> fx.GraphModule | None:
        """The sharded graph with explicit steps (made on first use when planning skipped it)."""
        return self.emitted() if callable(self.emitted) and not isinstance(self.emitted, fx.GraphModule) \
            else self.emitted


@dataclass(frozen=True)
class PlanReport(Plan):
    sources: PlanSources | None = field(default=None, repr=False, compare=False)
    request: Request | None = field(default=None, repr=False, compare=False)
    saved_details: PlanDetails | None = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def details(self) -> PlanDetails | None:
        """Per node and per parameter: the choice, its cost and the best alternative (report/details.py)."""
        if self.saved_details is not None:
            return self.saved_details
        return compute_details(self, self.sources) if self.sources is not None else None

    def explain(self, detail: bool = True) -> str:
        """Per-module layout in Megatron terms, collective totals, and (detail) every costed node with its
        cost split and the best alternative (see `spmd.report.explain`)."""
        return explain.explain(self, self.details, detail)

    def summary(self) -> str:
        """One screen: time and memory per rank, module layouts, inputs, collective totals."""
        return explain.explain(self, self.details, detail=False)

    def table(self) -> str:
        """Every placeholder's and op's placements, one line each."""
        return plan_table(self)

    def visualize(self, path, collapse: bool | None = None, views: bool = False, title: str | None = None):
        """Draw the sharded graph to `path` (.svg, .png, .pdf, .dot or .html; see `spmd.report.render`)."""
        return render.visualize(self, self.sources, path, collapse=collapse, views=views, title=title)

    def save(self, path) -> None:
        """Write the plan as versioned JSON (`spmd.load_plan` reads it back)."""
        plan_io.save_plan(self, self.details, path)

    def diff(self, other: Plan):
        """What changed from this plan to `other` (see `spmd.diff_plans`)."""
        return diff.diff_plans(self, other)

    def to_parallelize_plan(self, axis: str | None = None) -> dict:
        """The tensor-parallel part as a DTensor `parallelize_module` plan (see `spmd.report.parallelize`). A plan
        whose layers `spmd.plan` stamped without checking them is checked first: the export gives each layer the
        placements of the layer it was stamped from (a layer the parent tells to take a softmax over its hidden
        size was exported column-parallel, 0.0239 off; found by a probe)."""
        stamped = self.stats.get("stamped_layers", "")
        if self.request is not None and stamped and not stamped.startswith("none"):
            differs = stamping_unchecked(self.request.model, self.request.example_inputs, self.request.options)
            if differs:
                raise SpmdError(f"to_parallelize_plan: this plan stamped its layers ({stamped}), and the model at full "
                                f"depth is not its traced layers repeated: {differs}. What to do: plan again with "
                                "stamp_layers=False, then export.")
        return parallelize.to_parallelize_plan(self, self.details, axis)

    @functools.cached_property
    def cost_formula(self):
        """Estimated seconds per step as a sympy formula in the batch size (`batch`), for this plan's
        placements (report/whatif.py); `.subs("batch", b)` prices the same plan at batch b, also where that plan
        cannot run (a batch its layouts do not divide: batch 1 of a batch split on dp), which `crossover` skips."""
        return whatif.cost_formula(self, self.request)

    def crossover(self, symbol: str = "batch", sizes=None) -> list:
        """Batch sizes at which the best plan changes (re-solving at other sizes; no processes)."""
        return whatif.crossover(self, self.request, symbol, sizes)

    def __str__(self) -> str:
        if self.details is None:
            return plan_table(self)
        return (self.summary() + "\n(plan.explain() adds every op's cost and best alternative; plan.table() lists "
                "every value's placements)\n")


def report_of(c, request: Request | None = None) -> PlanReport:
    """The report of a `Compilation`: its plan, and the graph and tables it was solved from. `request`:
    what to ask again at other batch sizes (spmd.plan's; never a compiled model's: it would keep the
    whole model alive)."""
    kinds = {gi.placeholder: gi.kind for gi in c.traced.inputs}
    traced, plan = c.traced, c.plan
    emitted = c.global_gm if c.global_gm is not None else (lambda: insert_collectives(traced, plan))
    make_tables = None
    if c.strategies is None:  # this rank took rank 0's plan: the tables are made again if explained
        mesh, options, blocks = c.mesh, c.options, c.blocks
        make_tables = functools.partial(planning_tables, traced, mesh, options, blocks)
    sources = PlanSources(traced.graph, emitted, c.strategies, c.costs, kinds, traced.joint, c.blocks, make_tables,
                          traced.module_types, traced.aliases)
    return as_report(plan, sources=sources, request=request)


def as_report(plan: Plan, **extra) -> PlanReport:
    """`plan` as a `PlanReport` with `extra` (sources, request, saved_details)."""
    return PlanReport(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(Plan)}, **extra)


def load_plan(path) -> PlanReport:
    """Read a plan written by `plan.save(path)`: it explains, prints and diffs; it does not run or draw."""
    plan, details = plan_io.load_plan(path)
    return as_report(plan, saved_details=details)
