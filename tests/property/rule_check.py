"""Checking a sharding rule against the unsharded op on simulated ranks: the machinery the rule
property tests share (tests/property/test_rules_*.py).

    full inputs --split as the strategy's input placements--> per-rank locals
    per-rank locals --the ATen op, shape args made local--> per-rank outputs
    per-rank outputs --combined as the output placements--> must equal the op on the full inputs

Split and combine follow docs/placements.md: Shard(d) chunks dim d (axes sharding one dim nest left to
right), Replicate copies (and on output every rank must agree), Partial(op) hands each rank a random part
whose `op`-reduction over the axis is the value.
"""
from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Shard
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_map

from spmd.core.mesh import MeshSpec
from spmd.core.specs import Strategy, TensorInfo, local_shape
from spmd.passes.emit_rank_graph import SHAPE_ARG
from spmd.passes.rules import LOCAL_REWRITES
from spmd.passes.enumerate_strategies import enumerate_strategies
from spmd.passes.trace_module import GraphInput, TracedGraph, tensor_info_of, trace_module

aten = torch.ops.aten
MESHES = ((2,), (4,), (2, 2))
TOL = dict(rtol=1e-9, atol=1e-9)
RUN = settings(max_examples=5, deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------------------------------------------
# Simulated ranks: a layout is {mesh coordinate: local tensor}.

def _partial_parts(t: torch.Tensor, n: int, op: str, gen: torch.Generator) -> list[torch.Tensor]:
    """n rank-specific random tensors whose `op`-reduction is `t`."""
    if not t.is_floating_point():
        raise AssertionError(f"a Partial layout of an integer tensor ({t.dtype}) makes no sense")
    noise = torch.randn((n, *t.shape), generator=gen, dtype=t.dtype)
    if op == "sum":
        return [*noise[:-1], t - noise[:-1].sum(0)]
    if op == "avg":
        return list(t + noise - noise.mean(0))
    if op == "product":  # (factors near 1, the last one making up the rest)
        factors = (0.2 * noise[:-1]).exp()
        return [*factors, t / factors.prod(0)]
    # max / min: every part is on the losing side of t, and one random rank per element holds t itself.
    winner = torch.randint(0, n, t.shape, generator=gen)
    sign = -1.0 if op == "max" else 1.0
    return [torch.where(winner == i, t, t + sign * noise[i].abs()) for i in range(n)]


def distribute(full: torch.Tensor, placements, mesh_shape, gen) -> dict[tuple, torch.Tensor]:
    """Per-rank locals of `full` laid out as `placements`, splitting outer axes first."""
    layout = {(): full}
    for axis, p in enumerate(placements):
        n, nxt = mesh_shape[axis], {}
        for coord, t in layout.items():
            if isinstance(p, Shard):
                parts = t.chunk(n, p.dim)
            elif isinstance(p, Partial):
                parts = _partial_parts(t, n, p.reduce_op, gen)
            else:
                parts = [t] * n
            for i in range(n):
                nxt[coord + (i,)] = parts[i].contiguous()
        layout = nxt
    return layout


_REDUCE = {"sum": lambda ts: ts.sum(0), "avg": lambda ts: ts.mean(0), "product": lambda ts: ts.prod(0),
           "max": lambda ts: ts.amax(0), "min": lambda ts: ts.amin(0)}


def combine(layout: dict[tuple, torch.Tensor], placements, mesh_shape, what: str) -> torch.Tensor:
    """The global tensor the per-rank `layout` stands for, folding the innermost axis first."""
    for axis in reversed(range(len(mesh_shape))):
        p, groups = placements[axis], {}
        for coord, t in sorted(layout.items()):
            groups.setdefault(coord[:axis], []).append(t)
        layout = {}
        for key, ts in groups.items():
            if isinstance(p, Shard):
                layout[key] = torch.cat(ts, p.dim)
            elif isinstance(p, Partial):
                layout[key] = _REDUCE[p.reduce_op](torch.stack(ts))
            else:
                for i, t in enumerate(ts[1:], 1):
                    torch.testing.assert_close(t, ts[0], **TOL,
                                               msg=lambda m: f"{what}: Replicate on axis {axis} but ranks "
                                                             f"{key + (0,)} and {key + (i,)} differ\n{m}")
                layout[key] = ts[0]
    return layout[()]


# ---------------------------------------------------------------------------------------------------
# Cases: a function of some tensors, the shapes it is traced at, and the ATen ops its graph must hold.

@dataclass(frozen=True)
class Case:
    key: tuple  # (name, *params): identifies the traced graph
    inputs: tuple  # per argument: a float64 shape, or ("index", shape, high) for int64 indices
    ops: frozenset
    fn: Callable = field(compare=False, hash=False)
    tracer: str = "export"  # make_fx keeps ops that export decomposes (split.Tensor, unbind)


def make_inputs(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    out = []
    for spec in case.inputs:
        if spec and spec[0] == "index":
            out.append(torch.randint(0, spec[2], spec[1], generator=gen))
        elif spec and spec[0] == "mask":
            out.append(torch.rand(spec[1], generator=gen) < 0.5)
        else:
            out.append(torch.randn(spec, generator=gen, dtype=torch.float64))
    return tuple(out)


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _make_fx_traced(fn, inputs) -> TracedGraph:
    gm = make_fx(fn)(*inputs)
    for node in reversed(gm.graph.nodes):  # unused tensor constants (torch.tensor(...) in a dead branch)
        if not node.users and (node.op == "get_attr" or node.target is aten.lift_fresh_copy.default):
            gm.graph.erase_node(node)
    info = {n.name: i for n in gm.graph.nodes if (i := tensor_info_of(n)) is not None}
    phs = tuple(GraphInput(n.name, "input", n.name) for n in gm.graph.nodes if n.op == "placeholder")
    return TracedGraph(gm=gm, inputs=phs, state={}, out_spec=None, tensor_info=info)


_TRACED: dict[tuple, TracedGraph] = {}


def traced_of(case: Case) -> TracedGraph:
    if case.key not in _TRACED:
        example = make_inputs(case, torch.Generator().manual_seed(0))
        _TRACED[case.key] = (trace_module(_Call(case.fn), example) if case.tracer == "export"
                             else _make_fx_traced(case.fn, example))
    return _TRACED[case.key]


@functools.lru_cache(maxsize=None)
def strategies_of(case: Case, mesh_shape: tuple[int, ...]):
    names = ("x",) if len(mesh_shape) == 1 else ("dp", "tp")
    return enumerate_strategies(traced_of(case), MeshSpec(mesh_shape, names))


def _dims(draw, n: int) -> list[int]:
    """Mostly sizes every mesh divides (so sharded strategies survive), sometimes uneven ones."""
    pool = (4, 8) if draw(st.sampled_from(("even", "even", "mixed"))) == "even" else (2, 3, 4, 6)
    return [draw(st.sampled_from(pool)) for _ in range(n)]



# ---------------------------------------------------------------------------------------------------
# The oracle.

class _Recorder(fx.Interpreter):
    """Runs the graph on full inputs and keeps every node's value."""

    def run_node(self, n):
        self.values[n] = out = super().run_node(n)
        return out


def full_values(traced: TracedGraph, inputs) -> dict:
    rec = _Recorder(traced.gm)
    rec.values = {}
    rec.run(*inputs)
    return rec.values


@dataclass(frozen=True)
class _Arg:
    index: int  # the index-th tensor input of the node


def check_strategy(node: fx.Node, s: Strategy, traced: TracedGraph, values: dict, mesh_shape, gen) -> None:
    info = traced.tensor_info
    what = f"{node.name} ({node.target}) strategy {s} on mesh {mesh_shape}"
    tensor_args = []

    def mark(a):
        if isinstance(a, fx.Node):
            if isinstance(info.get(a.name), TensorInfo):
                tensor_args.append(values[a])
                return _Arg(len(tensor_args) - 1)
            return values[a]
        return a

    args, kwargs = tree_map(mark, (tuple(node.args), dict(node.kwargs)))
    assert len(tensor_args) == len(s.inputs), what
    locals_ = [distribute(t, ps, mesh_shape, gen) for t, ps in zip(tensor_args, s.inputs)]
    outs = values[node] if isinstance(values[node], (tuple, list)) else (values[node],)
    if node.target in SHAPE_ARG:  # as emit_rank_graph does: the shape argument becomes the local one
        i = SHAPE_ARG[node.target]
        local = local_shape(tuple(outs[0].shape), s.outputs[0], mesh_shape)
        old = list(args[i])
        args = list(args)
        args[i] = [(-1 if o == -1 else n) for o, n in zip(old, local)] if len(old) == len(local) else list(local)
        args = tuple(args)

    per_rank = {}
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        r_args, r_kwargs = tree_map(lambda a: locals_[a.index][coord] if isinstance(a, _Arg) else a,
                                    (args, kwargs), is_leaf=lambda a: isinstance(a, _Arg))
        target = node.target
        if target in LOCAL_REWRITES:  # as emit_rank_graph does: the masked local form for this rank's rows
            shapes = tuple(tuple(info[a.name].shape) if isinstance(a, fx.Node) and
                           isinstance(info.get(a.name), TensorInfo) else None for a in node.args)
            local = LOCAL_REWRITES[target](r_args, s, shapes, mesh_shape, coord)
            if local is not None:
                target, r_args, r_kwargs = local[0], local[1], r_kwargs if local[2] is None else local[2]
        out = target(*r_args, **r_kwargs)
        per_rank[coord] = out if isinstance(out, (tuple, list)) else (out,)

    assert len(s.outputs) == len(outs), what
    for k, (ps, full) in enumerate(zip(s.outputs, outs)):
        if ps is None or not isinstance(full, torch.Tensor):
            continue
        got = combine({c: o[k] for c, o in per_rank.items()}, ps, mesh_shape, f"{what}, output {k}")
        torch.testing.assert_close(got, full, **TOL, msg=lambda m: f"{what}, output {k}:\n{m}")


def check_case(case: Case, seed: int, only: frozenset | None = None) -> None:
    """Every strategy of every op in `case`'s graph (of the ops in `only`, if given), on every mesh of
    MESHES, on random inputs from `seed`, against the unsharded op. The graph must hold `case.ops`."""
    traced = traced_of(case)
    gen = torch.Generator().manual_seed(seed)
    values = full_values(traced, make_inputs(case, gen))
    calls = [n for n in traced.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert case.ops <= {n.target for n in calls}, traced.graph
    for mesh_shape in MESHES:
        table = strategies_of(case, mesh_shape)
        for node in calls:
            if only is None or node.target in only:
                for s in table.nodes[node.name].strategies:
                    check_strategy(node, s, traced, values, mesh_shape, gen)
