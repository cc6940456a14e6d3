"""Property tests of the sharding rules on simulated ranks (one process, no torch.distributed).

For each op a tiny function is traced (`trace_module`), `enumerate_strategies` lists its strategies, and
every strategy of every call node is checked on meshes (2,), (4,) and (2, 2):

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

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Shard
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_map

from spmd.mesh import MeshSpec
from spmd.passes.emit_rank_graph import SHAPE_ARG
from spmd.passes.enumerate_strategies import enumerate_strategies
from spmd.passes.trace_module import GraphInput, TracedGraph, tensor_info_of, trace_module
from spmd.specs import Strategy, TensorInfo, is_even, local_shape

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


_REDUCE = {"sum": lambda ts: ts.sum(0), "avg": lambda ts: ts.mean(0),
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


@st.composite
def mm(draw):
    m, k, n = _dims(draw, 3)
    return Case(("mm", m, k, n), ((m, k), (k, n)), frozenset({aten.mm.default}), torch.mm)


@st.composite
def addmm(draw):
    m, k, n = _dims(draw, 3)
    bias = draw(st.sampled_from(((n,), (m, n), (1, n))))
    return Case(("addmm", m, k, n, bias), (bias, (m, k), (k, n)), frozenset({aten.addmm.default}), torch.addmm)


@st.composite
def linear(draw):  # view -> permute -> addmm -> view after decomposition
    b, s, i, o = _dims(draw, 4)
    return Case(("linear", b, s, i, o), ((b, s, i), (o, i), (o,)),
                frozenset({aten.addmm.default, aten.view.default, aten.permute.default}), F.linear)


@st.composite
def bmm(draw):
    b, m, k, n = _dims(draw, 4)
    return Case(("bmm", b, m, k, n), ((b, m, k), (b, k, n)), frozenset({aten.bmm.default}), torch.bmm)


@st.composite
def add(draw):
    m, n = _dims(draw, 2)
    other = draw(st.sampled_from(((m, n), (n,), (m, 1), (1, n), None)))
    if other is None:  # tensor plus scalar: not linear, so no Partial may pass through
        return Case(("add", m, n, None), ((m, n),), frozenset({aten.add.Tensor}), lambda a: a + 1.5)
    alpha = draw(st.sampled_from((1, 2)))
    return Case(("add", m, n, other, alpha), ((m, n), other), frozenset({aten.add.Tensor}),
                lambda a, b: torch.add(a, b, alpha=alpha))


@st.composite
def mul(draw):
    m, n = _dims(draw, 2)
    other = draw(st.sampled_from(((m, n), (n,), (m, 1), None)))
    if other is None:  # tensor times scalar
        return Case(("mul", m, n, None), ((m, n),), frozenset({aten.mul.Tensor}), lambda a: a * 0.5)
    return Case(("mul", m, n, other), ((m, n), other), frozenset({aten.mul.Tensor}), torch.mul)


@st.composite
def gelu(draw):
    shape = tuple(_dims(draw, draw(st.integers(1, 3))))
    approx = draw(st.sampled_from(("none", "tanh")))
    return Case(("gelu", shape, approx), (shape,), frozenset({aten.gelu.default}),
                lambda x: F.gelu(x, approximate=approx))


@st.composite
def layer_norm(draw):
    b, s, d = _dims(draw, 3)
    norm = draw(st.sampled_from(((d,), (s, d))))
    return Case(("layer_norm", b, s, d, norm), ((b, s, d), norm, norm), frozenset({aten.native_layer_norm.default}),
                lambda x, w, bias: F.layer_norm(x, norm, w, bias))


@st.composite
def softmax(draw):
    shape = tuple(_dims(draw, draw(st.integers(2, 3))))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    return Case(("softmax", shape, dim), (shape,), frozenset({aten._softmax.default}),
                lambda x: torch.softmax(x, dim))


_VIEWS = {
    "flatten01": (3, lambda x: x.flatten(0, 1)),
    "flatten12": (3, lambda x: x.flatten(1, 2)),
    "flatten_all": (3, lambda x: x.reshape(-1)),
    "unflatten_last": (2, lambda x: x.unflatten(-1, (2, x.shape[-1] // 2))),
    "unflatten_first": (2, lambda x: x.unflatten(0, (x.shape[0] // 2, 2))),
    "split_heads": (3, lambda x: x.view(x.shape[0], x.shape[1], 2, x.shape[2] // 2)),
    "unsqueeze": (2, lambda x: x.view(x.shape[0], 1, x.shape[1])),
}


@st.composite
def view(draw):
    kind = draw(st.sampled_from(sorted(_VIEWS)))
    ndim, fn = _VIEWS[kind]
    shape = tuple(_dims(draw, ndim))
    if kind.startswith("unflatten") or kind == "split_heads":  # the split dim must be even
        shape = tuple(s * 2 if s % 2 else s for s in shape)
    return Case(("view", kind, shape), (shape,), frozenset({aten.view.default}), fn)


@st.composite
def permute(draw):
    shape = tuple(_dims(draw, 3))
    perm = tuple(draw(st.permutations(range(3))))
    return Case(("permute", shape, perm), (shape,), frozenset({aten.permute.default}), lambda x: x.permute(perm))


@st.composite
def embedding(draw):
    b, s, vocab, d = _dims(draw, 4)
    return Case(("embedding", b, s, vocab, d), (("index", (b, s), vocab), (vocab, d)),
                frozenset({aten.embedding.default}), F.embedding)


@st.composite
def reduction(draw):
    op = draw(st.sampled_from(("sum", "mean")))
    shape = tuple(_dims(draw, draw(st.integers(2, 3))))
    dims = tuple(sorted(draw(st.sets(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape) - 1))))
    keep = draw(st.booleans())
    target = aten.sum.dim_IntList if op == "sum" else aten.mean.dim
    fn = (lambda x: x.sum(dims, keepdim=keep)) if op == "sum" else (lambda x: x.mean(dims, keepdim=keep))
    return Case(("reduction", op, shape, dims, keep), (shape,), frozenset({target}), fn)


@st.composite
def mean_then_add(draw):  # a P(avg) producer feeding a consumer: non-sum Partial inputs
    m, n = _dims(draw, 2)
    return Case(("mean_then_add", m, n), ((m, n), (m, n)), frozenset({aten.mean.dim, aten.add.Tensor}),
                lambda x, y: x.mean(0) + y.mean(0) * 2)


@st.composite
def sdpa(draw):
    b, h, s, d = _dims(draw, 4)
    s_kv = draw(st.sampled_from((s, 2 * s)))
    causal = draw(st.booleans())
    mask = None if causal else draw(st.sampled_from((None, (s, s_kv), (b, 1, s, s_kv), (b, h, s, s_kv))))
    h_kv = draw(st.sampled_from((h, h // 2))) if h % 2 == 0 and mask is None else h
    q, kv = (b, h, s, d), (b, h_kv, s_kv, d)
    inputs = (q, kv, kv) + ((mask,) if mask else ())

    def fn(q, k, v, *m):
        return F.scaled_dot_product_attention(q, k, v, *m, is_causal=causal, enable_gqa=h_kv != h)
    return Case(("sdpa", q, kv, causal, mask), inputs, frozenset({aten.scaled_dot_product_attention.default}), fn)


@st.composite
def split(draw):
    shape = tuple(_dims(draw, 3))
    dim = draw(st.integers(-3, 2))
    size = shape[dim]
    kind = draw(st.sampled_from(("split", "split_with_sizes", "chunk", "unbind")))
    if kind == "split":  # the last piece may be shorter
        step = draw(st.integers(1, size))
        return Case(("split", shape, dim, step), (shape,), frozenset({aten.split.Tensor}),
                    lambda x: x.split(step, dim), "make_fx")
    if kind == "chunk":
        return Case(("chunk", shape, dim), (shape,), frozenset({aten.split.Tensor}),
                    lambda x: x.chunk(2, dim), "make_fx")
    if kind == "unbind":
        return Case(("unbind", shape, dim), (shape,), frozenset({aten.unbind.int}),
                    lambda x: x.unbind(dim), "make_fx")
    first = draw(st.integers(1, size - 1)) if size > 1 else size
    sizes = [first, size - first] if first < size else [size]
    return Case(("split_with_sizes", shape, dim, tuple(sizes)), (shape,),
                frozenset({aten.split_with_sizes.default}), lambda x: x.split(sizes, dim))


CASES = {f.__name__: f for f in (mm, addmm, linear, bmm, add, mul, gelu, layer_norm, softmax, view, permute,
                                 embedding, reduction, mean_then_add, sdpa, split)}


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
        out = node.target(*r_args, **r_kwargs)
        per_rank[coord] = out if isinstance(out, (tuple, list)) else (out,)

    assert len(s.outputs) == len(outs), what
    for k, (ps, full) in enumerate(zip(s.outputs, outs)):
        if ps is None or not isinstance(full, torch.Tensor):
            continue
        got = combine({c: o[k] for c, o in per_rank.items()}, ps, mesh_shape, f"{what}, output {k}")
        torch.testing.assert_close(got, full, **TOL, msg=lambda m: f"{what}, output {k}:\n{m}")


def _all_even(traced: TracedGraph) -> bool:
    """Every tensor in the graph splits evenly on every mesh here (sizes 1 broadcast and stay whole)."""
    infos = [i for v in traced.tensor_info.values() for i in (v if isinstance(v, tuple) else (v,)) if i]
    return all(n % 4 == 0 for i in infos for n in i.shape if n != 1)


@pytest.mark.parametrize("name", sorted(CASES))
@RUN
@given(data=st.data())
def test_every_strategy_matches_the_unsharded_op(name, data):
    case = data.draw(CASES[name](), label="case")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    traced = traced_of(case)
    gen = torch.Generator().manual_seed(seed)
    values = full_values(traced, make_inputs(case, gen))
    calls = [n for n in traced.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert case.ops <= {n.target for n in calls}, f"graph lacks {case.ops}: {traced.graph}"
    info = traced.tensor_info
    for mesh_shape in MESHES:
        table = strategies_of(case, mesh_shape)
        if _all_even(traced):  # rules may give up on uneven candidates (see the test below), not on even ones
            assert not table.fallbacks, table.fallbacks
        for node in calls:
            ns = table.nodes[node.name]
            outs = info[node.name] if isinstance(info[node.name], tuple) else (info[node.name],)
            ins = tuple(info[v[0]] for v in ns.inputs)
            for s in ns.strategies:
                # uneven strategies are excluded: whatever is left splits every tensor evenly
                pairs = [(ps, o) for ps, o in zip(s.outputs, outs) if ps is not None and o is not None]
                pairs += list(zip(s.inputs, ins))
                assert all(is_even(t.shape, ps, mesh_shape) for ps, t in pairs), \
                    f"{node.name}: uneven strategy {s} kept on mesh {mesh_shape}"
                check_strategy(node, s, traced, values, mesh_shape, gen)


def test_uneven_strategies_are_excluded():
    """mm with 3 rows on a 2-way mesh: no strategy shards the rows, and the dropped ones are counted."""
    case = Case(("mm", 3, 4, 4), ((3, 4), (4, 4)), frozenset({aten.mm.default}), torch.mm)
    table = strategies_of(case, (2,))
    ns = table.nodes["mm"]
    assert ns.excluded > 0
    assert all(s.inputs[0][0] != Shard(0) and s.outputs[0][0] != Shard(0) for s in ns.strategies)
    assert any(s.inputs[1][0] == Shard(1) for s in ns.strategies)  # the even dims still shard


def test_sdpa_rule_shards_batch_and_heads_only():
    """The rule's rows on one axis: all-R, batch-parallel and head-parallel (q, k, v, out together)."""
    case = Case(("sdpa", (4, 4, 8, 8), (4, 4, 8, 8), True, None), ((4, 4, 8, 8),) * 3,
                frozenset({aten.scaled_dot_product_attention.default}),
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    ns = strategies_of(case, (2,)).nodes["scaled_dot_product_attention"]
    assert ns.source == "spmd"
    assert {str(s) for s in ns.strategies} == {"([R], [R], [R]) -> [R]", "([S(0)], [S(0)], [S(0)]) -> [S(0)]",
                                               "([S(1)], [S(1)], [S(1)]) -> [S(1)]"}


def _check_all(case: Case, mesh_shape) -> None:
    traced = traced_of(case)
    gen = torch.Generator().manual_seed(0)
    values = full_values(traced, make_inputs(case, gen))
    table = strategies_of(case, mesh_shape)
    for node in traced.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            for s in table.nodes[node.name].strategies:
                check_strategy(node, s, traced, values, mesh_shape, gen)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_sdpa_on_3d_inputs_does_not_shard_the_sequence(mesh_shape):
    """q, k, v of shape (N, L, E): dim 1 is the sequence, which attention mixes (only dim 0 may be cut)."""
    case = Case(("sdpa3d", 4, 8, 4), ((4, 8, 4),) * 3, frozenset({aten.scaled_dot_product_attention.default}),
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
    _check_all(case, mesh_shape)


def test_view_keeps_its_even_strategies_when_one_candidate_is_uneven():
    # linear on (2, 4, 8) -> view (8, 8) -> addmm -> view (2, 4, 8); addmm may output S(0) on its 8 rows,
    # which the last view cannot unflatten into 2 rows on 4 ranks: that one candidate must go, not all.
    case = Case(("linear", 2, 4, 8, 8), ((2, 4, 8), (8, 8), (8,)), frozenset({aten.view.default}), F.linear)
    table = strategies_of(case, (4,))
    assert not table.fallbacks, table.fallbacks
