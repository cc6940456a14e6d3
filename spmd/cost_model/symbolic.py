"""Symbolic costs: a plan's estimated step time as a sympy formula in the batch size.

    the graph traced at b0 and 2*b0 ──▶ every dim: constant, or proportional to `batch`
        ──the plan's own placements, local shapes in `batch`──▶ compute (roofline, sympy.Max)
        + resharding steps (alpha-beta) + gradient buckets (comm.bucketed_latency, as the solver prices them)
        + the optimizer's step on each parameter (a constant: parameters do not scale with the batch)
        = plan.cost_formula

Only the batch is symbolic: every dim of every tensor must either stay put or scale with it. The
tracing at two sizes, and `crossover()` (re-solving at other sizes), are in report/whatif.py.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx

from spmd.core.errors import SpmdError, SpmdInternalError
from spmd.core.specs import shard_factor
from spmd.cost_model.comm import bucket_share, bucketed_latency, step_cost
from spmd.cost_model.compute import compute_cost, is_drawn_whole, local_call


@dataclass(frozen=True)
class SymInfo:
    """A tensor's shape with sympy dims (duck-types `TensorInfo` for the cost functions)."""

    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self):
        return math.prod(self.shape) * self.dtype.itemsize


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


def _as_planned(term: sympy.Expr, planned: float | None, batch: sympy.Symbol, b0: int) -> sympy.Expr:
    """`term`, a node's seconds in `batch`, scaled to the plan's price of the node at `b0` where that is lower: a
    node of a chain the rank graph runs as one kernel (log_softmax's max, exp, sum, log) pays its share of the
    kernel (`estimate_costs`), not its own price (found by a docs check: a cross-entropy plan's formula was 64 us
    above its objective at the planned batch)."""
    if planned is None:
        return term
    at_b0 = float(term.subs(batch, b0)) if isinstance(term, sympy.Expr) else float(term)
    return term * (planned / at_b0) if at_b0 > 0 and planned < at_b0 * (1 - 1e-9) else term


def cost_formula(plan, small, large, b0: int, symbol: str = "batch") -> sympy.Expr:
    """The plan's estimated seconds per step as a formula in `symbol` (the batch size): `small` and `large`
    are the same graph traced at batch `b0` and `2 * b0` (what tells which dims scale)."""
    batch = sympy.Symbol(symbol, positive=True)
    sym = _symbolic_shapes(small, large, b0, batch)
    mesh = plan.mesh
    terms = []
    for node in small.graph.nodes:
        strategy = plan.choices.get(node.name)
        if node.op == "placeholder" and plan.node_costs.get(node.name):  # the optimizer's step on a parameter
            terms.append(sympy.Float(plan.node_costs[node.name]))
            continue
        if node.op != "call_function" or strategy is None or node.target is operator.getitem:
            continue
        ins = [_local(sym[a.name], ps, mesh.shape) for a, ps in zip(_in_order(node, sym), strategy.inputs)]
        outs_sym = sym[node.name] if isinstance(sym.get(node.name), tuple) else (sym.get(node.name),)
        outs = [_local(o, ps, mesh.shape) for o, ps in zip(outs_sym, strategy.outputs) if o is not None and ps is not None]
        def is_tensor(a) -> bool:
            return isinstance(sym.get(a.name), SymInfo)

        args, kwargs = local_call(node, is_tensor, ins)
        term = compute_cost(node.target, args, kwargs, ins, outs, mesh.device, symbolic=True)
        if is_drawn_whole(node.target, strategy.outputs):  # the whole draw, then the piece
            whole_ins = [sym[a.name] for a in _in_order(node, sym)]
            whole = [o for o, ps in zip(outs_sym, strategy.outputs) if o is not None and ps is not None]
            term = term + compute_cost(node.target, *local_call(node, is_tensor, whole_ins), whole_ins, whole,
                                       mesh.device, symbolic=True)
        terms.append(_as_planned(term, plan.node_costs.get(node.name), batch, b0))

    grads = {f"output_{k}" for k, o in enumerate(small.output_kinds()) if o.kind == "grad"}
    shares: dict[int, list] = {}
    bucket = plan.stats.get("bucket_bytes")
    for edge in plan.edges:
        if edge.shared:  # an earlier consumer's resharding serves it (priced there, launched once)
            continue
        info = sym[edge.value[0]]
        info = info[edge.value[1]] if isinstance(info, tuple) else info
        bucketed = bucket and edge.consumer in grads
        for step in edge.steps:
            local = tuple(sympy.Integer(d) if g == g0 else sympy.Integer(d) * g / g0
                          for d, g, g0 in zip(step.local_in_shape, info.shape, _shape(small, edge.value)))
            s = dataclasses.replace(step, local_in_shape=local)
            if bucketed and step.kind == "all_reduce":  # its latency share moves to the axis's bucket floor
                share = bucket_share(s.in_bytes, bucket)
                terms.append(step_cost(s, mesh, bucket) - mesh.links[step.axis].alpha_beta("all_reduce")[0] * share)
                shares.setdefault(step.axis, []).append(share)
            else:
                terms.append(step_cost(s, mesh))
    for axis, parts in shares.items():
        terms.append(bucketed_latency(mesh.links[axis].alpha_beta("all_reduce")[0], parts))
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
