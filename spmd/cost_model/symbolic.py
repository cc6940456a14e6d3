"""Symbolic costs: a plan's estimated step time as a sympy formula in the batch size, and the batch
sizes at which the best plan changes.

    plan at batch b0 ──trace at b0 and 2*b0──▶ every dim: constant, or proportional to `batch`
        ──the plan's own placements, local shapes in `batch`──▶ compute (roofline, sympy.Max)
        + resharding steps (alpha-beta) + gradient buckets (latency * Max(1, bytes / bucket))
        = plan.cost_formula

`crossover()` solves the pipeline again at other batch sizes (the model is only traced, never run),
and where the best plan changes between two sizes, finds where their formulas cross.

Only the batch is symbolic: the user's inputs are re-sized along one dim each (dim 0 unless told),
and every other dim of every tensor must either stay put or scale with it.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx

from spmd.cost_model.comm import step_cost
from spmd.cost_model.compute import compute_cost
from spmd.errors import SpmdError, SpmdInternalError
from spmd.passes.estimate_costs import local_call
from spmd.specs import shard_factor


@dataclass(frozen=True)
class SymInfo:
    """A tensor's shape with sympy dims (duck-types `TensorInfo` for the cost functions)."""

    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self):
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Replanner:
    """What `spmd.plan` was called with, so the same question can be asked at another batch size."""

    model: torch.nn.Module
    example_inputs: tuple
    mesh: Any
    options: dict = field(default_factory=dict)
    dims: dict[int, int] | None = None  # input index -> its batch dim (default: dim 0 of every tensor)

    @property
    def batch(self) -> int:
        i, d = next(iter(self._dims().items()))
        return int(self.example_inputs[i].shape[d])

    def _dims(self) -> dict[int, int]:
        if self.dims is not None:
            return self.dims
        return {i: 0 for i, t in enumerate(self.example_inputs) if isinstance(t, torch.Tensor) and t.dim() > 0}

    def inputs_at(self, batch: int) -> tuple:
        out = list(self.example_inputs)
        for i, d in self._dims().items():
            shape = list(out[i].shape)
            shape[d] = batch
            out[i] = out[i].new_zeros(shape)
        return tuple(out)

    def trace(self, batch: int):
        from spmd.api import fake_model
        from spmd.passes.trace_joint import trace_joint
        from spmd.passes.trace_module import trace_module

        model, inputs = fake_model(self.model, self.inputs_at(batch))
        if self.options.get("training") or self.options.get("loss_fn") is not None:
            return trace_joint(model, inputs, self.options.get("loss_fn"))
        return trace_module(model, inputs)

    def plan(self, batch: int):
        from spmd.api import plan

        return plan(self.model, self.mesh, self.inputs_at(batch), **self.options)


def _symbolic_shapes(t1, t2, b0: int, batch: sympy.Symbol) -> dict[str, Any]:
    """node name -> SymInfo (or tuple of them), from the same graph traced at b0 and 2*b0."""
    second = t2.tensor_info
    out: dict[str, Any] = {}

    def one(name, i1, i2):
        dims = []
        for d1, d2 in zip(i1.shape, i2.shape):
            if d1 == d2:
                dims.append(d1)
            elif d2 == 2 * d1 and d1 % b0 == 0:
                dims.append(sympy.Integer(d1 // b0) * batch)
            else:
                raise SpmdError(f"cost_formula: node '{name}' has a dim that goes from {d1} to {d2} when the "
                                f"batch goes from {b0} to {2 * b0}; only dims that stay put or scale with the batch "
                                "can be expressed. What to do: pass the inputs' batch dims (dims=...) or a plan "
                                "without batch-dependent reshapes.")
        return SymInfo(tuple(dims), i1.dtype)

    for name, i1 in t1.tensor_info.items():
        i2 = second.get(name)
        if i2 is None or type(i1) is not type(i2):
            raise SpmdInternalError(f"cost_formula: the graph traced at batch {2 * b0} has no node '{name}' like "
                                    f"the one at {b0}")
        if isinstance(i1, tuple):
            out[name] = tuple(None if a is None else one(name, a, b) for a, b in zip(i1, i2))
        elif i1 is not None:
            out[name] = one(name, i1, i2)
    return out


def _local(info: SymInfo, ps, mesh_shape) -> SymInfo:
    return SymInfo(tuple(s / shard_factor(ps, mesh_shape, d) for d, s in enumerate(info.shape)), info.dtype)


def cost_formula(plan, symbol: str = "batch") -> sympy.Expr:
    """The plan's estimated seconds per step as a formula in `symbol` (the batch size)."""
    rp: Replanner | None = getattr(plan, "replanner", None)
    if rp is None:
        raise SpmdError("cost_formula needs a plan made by spmd.plan (it re-traces the model at another "
                        "batch size). What to do: call spmd.plan(model, mesh_spec, example_inputs, ...).")
    batch = sympy.Symbol(symbol, positive=True)
    b0 = rp.batch
    t1, t2 = rp.trace(b0), rp.trace(2 * b0)
    sym = _symbolic_shapes(t1, t2, b0, batch)
    mesh = plan.mesh
    terms = []
    for node in t1.graph.nodes:
        strategy = plan.choices.get(node.name)
        if node.op != "call_function" or strategy is None or node.target is operator.getitem:
            continue
        ins = [_local(sym[a.name], ps, mesh.shape) for a, ps in zip(_in_order(node, sym), strategy.inputs)]
        outs_sym = sym[node.name] if isinstance(sym.get(node.name), tuple) else (sym.get(node.name),)
        outs = [_local(o, ps, mesh.shape) for o, ps in zip(outs_sym, strategy.outputs) if o is not None and ps is not None]
        args, kwargs = local_call(node, lambda a: isinstance(sym.get(a.name), SymInfo), ins)
        terms.append(compute_cost(node.target, args, kwargs, ins, outs, mesh.device, maximum=sympy.Max))

    grads = {f"output_{k}" for k, o in enumerate(t1.output_kinds()) if o.kind == "grad"}
    shares: dict[int, list] = {}
    bucket = plan.stats.get("bucket_bytes") or 4 * 2**20
    for edge in plan.edges:
        info = sym[edge.value[0]]
        info = info[edge.value[1]] if isinstance(info, tuple) else info
        for step in edge.steps:
            local = tuple(sympy.Integer(d) if g == g0 else sympy.Integer(d) * g / g0
                          for d, g, g0 in zip(step.local_in_shape, info.shape, _shape(t1, edge.value)))
            s = dataclasses.replace(step, local_in_shape=local)
            seconds = step_cost(s, mesh)
            if edge.consumer in grads and step.kind == "all_reduce":  # bucketed: the latency is per bucket
                seconds -= mesh.links[step.axis].alpha_beta("all_reduce")[0]
                shares.setdefault(step.axis, []).append(s.in_bytes / bucket)
            terms.append(seconds)
    for axis, parts in shares.items():
        terms.append(mesh.links[axis].alpha_beta("all_reduce")[0] * sympy.Max(1, sympy.Add(*parts)))
    # built with a positive symbol (so Max(2 b, 3 b) is 3 b); handed back plain, so .subs("batch", 8) works
    return sympy.Add(*terms).xreplace({batch: sympy.Symbol(symbol)})


def _shape(traced, value) -> tuple:
    info = traced.tensor_info[value[0]]
    return (info[value[1]] if isinstance(info, tuple) else info).shape


def _in_order(node: fx.Node, sym: dict) -> list[fx.Node]:
    """Tensor inputs in the order strategies list them (pytree order of args, then kwargs)."""
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten((node.args, node.kwargs))
    return [a for a in leaves if isinstance(a, fx.Node) and isinstance(sym.get(a.name), SymInfo)]


def _layout(plan) -> tuple:
    """What a plan decides, independent of the batch size it was solved at."""
    return tuple(sorted((name, str(s)) for name, s in plan.choices.items()))


@dataclass
class Crossover:
    symbol: str
    at: float  # the formulas of `below` and `above` are equal here
    below: Any  # Plan, best just under `at`
    above: Any  # Plan, best just over `at`
    changed: list[tuple[str, str, str]]  # (parameter or input, placements below, placements above)

    def __str__(self) -> str:
        lines = [f"at {self.symbol} ~ {self.at:.4g} the best plan changes"]
        for name, a, b in self.changed[:12]:
            lines.append(f"  {name}: {a} -> {b}")
        if len(self.changed) > 12:
            lines.append(f"  ... and {len(self.changed) - 12} more")
        return "\n".join(lines)


def crossover(plan, symbol: str = "batch", sizes: list[int] | None = None) -> list[Crossover]:
    """Re-solve at other batch sizes (default: the plan's batch times 1/8 ... 64, where whole) and
    report every size where the best plan changes, located where the two plans' formulas cross."""
    from spmd.specs import placements_str

    rp: Replanner | None = getattr(plan, "replanner", None)
    if rp is None:
        raise SpmdError("crossover needs a plan made by spmd.plan. What to do: call spmd.plan(...).")
    b0 = rp.batch
    if sizes is None:
        sizes = sorted({int(b0 * f) for f in (1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8, 16, 32, 64) if b0 * f >= 1 and (b0 * f) % 1 == 0})
    plans = []
    for b in sorted(set(sizes)):
        try:
            plans.append((b, plan if b == b0 else rp.plan(b)))
        except SpmdError:
            continue  # e.g. a pinned placement that this size cannot divide
    found: list[Crossover] = []
    x = sympy.Symbol(symbol)
    for (b1, p1), (b2, p2) in zip(plans, plans[1:]):
        if _layout(p1) == _layout(p2):
            continue
        diff = sympy.lambdify(x, cost_formula(p1, symbol) - cost_formula(p2, symbol), "math")
        lo, hi = float(b1), float(b2)
        if diff(lo) > 0 or diff(hi) < 0:  # no sign change between the two sizes: report the midpoint
            at = (lo + hi) / 2
        else:
            for _ in range(60):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if diff(mid) <= 0 else (lo, mid)
            at = (lo + hi) / 2
        labels = p1.labels
        changed = [(labels[n], placements_str(p1.choices[n].outputs[0]), placements_str(p2.choices[n].outputs[0]))
                   for n in labels if n in p2.choices and p1.choices[n].outputs[0] != p2.choices[n].outputs[0]]
        found.append(Crossover(symbol, at, p1, p2, changed))
    return found
