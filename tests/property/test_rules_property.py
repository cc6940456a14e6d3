"""Property tests of the sharding rules on simulated ranks (one process, no torch.distributed).

For each op a tiny function is traced (`trace_module`), `enumerate_strategies` lists its strategies, and
every strategy of every call node is checked on meshes (2,), (4,) and (2, 2) against the unsharded op
(tests/property/rule_check.py).
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Shard

from spmd.core.specs import is_even
from spmd.passes.trace_module import TracedGraph
from tests.property.rule_check import (MESHES, RUN, Case, _dims, aten, check_strategy, full_values, make_inputs,
                                       strategies_of, traced_of)


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
def copy(draw):
    """`aten.copy(x, src)`, a slice assignment's functional form: src broadcast into x's shape, x's values gone."""
    m, n = _dims(draw, 2)
    src = draw(st.sampled_from(((m, n), (n,), (m, 1), (1, n))))
    return Case(("copy", m, n, src), ((m, n), src), frozenset({aten.copy.default}), aten.copy.default)


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
def gather(draw):
    """The loss's pick of each target's log-probability: x split on the gathered dim is vocabulary
    parallelism (masked local gathers, Partial out; rules/vocab_parallel.py)."""
    n, classes = _dims(draw, 2)
    return Case(("gather", n, classes), ((n, classes), ("index", (n, 1), classes)),
                frozenset({aten.gather.default}), lambda x, t: torch.gather(x, 1, t))


@st.composite
def reduction(draw):
    op = draw(st.sampled_from(("sum", "mean")))
    shape = tuple(_dims(draw, draw(st.integers(2, 3))))
    # (no dims: every dim, as torch.export traces `x.sum()`; DTensor's rule read it as none and kept x whole)
    dims = tuple(sorted(draw(st.sets(st.integers(0, len(shape) - 1), min_size=0, max_size=len(shape) - 1))))
    keep = draw(st.booleans())
    target = aten.sum.dim_IntList if op == "sum" else aten.mean.dim
    fn = lambda x: target(x, list(dims), keep)  # noqa: E731
    return Case(("reduction", op, shape, dims, keep), (shape,), frozenset({target}), fn)


@st.composite
def mean_then_add(draw):  # a P(avg) producer feeding a consumer: non-sum Partial inputs
    m, n = _dims(draw, 2)
    return Case(("mean_then_add", m, n), ((m, n), (m, n)), frozenset({aten.mean.dim, aten.add.Tensor}),
                lambda x, y: x.mean(0) + y.mean(0) * 2)


@st.composite
def prod_then_mul(draw):  # a P(product) producer feeding a consumer (found by a probe: never checked before)
    m, n = _dims(draw, 2)
    return Case(("prod_then_mul", m, n), ((m, n), (n,)), frozenset({aten.prod.dim_int, aten.mul.Tensor}),
                lambda x, y: x.prod(0) * y.exp())


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


@st.composite
def solve_triangular(draw):
    """A batch of triangular systems; A may broadcast over the batch (no batch dim, or size 1)."""
    batch, n, k = _dims(draw, 3)
    left, upper = draw(st.booleans()), draw(st.booleans())
    a = draw(st.sampled_from(((batch, n, n), (n, n), (1, n, n))))
    b = (batch, n, k) if left else (batch, k, n)

    def fn(a, b):  # unit diagonal, small off-diagonal entries: well conditioned at any size
        return torch.linalg.solve_triangular(a * 0.1, b, upper=upper, left=left, unitriangular=True)
    return Case(("solve_triangular", a, b, left, upper), (a, b), frozenset({aten.linalg_solve_triangular.default}), fn)


_SCANS = {"cumsum": (aten.cumsum.default, torch.cumsum), "cumprod": (aten.cumprod.default, torch.cumprod),
          "logcumsumexp": (aten.logcumsumexp.default, torch.logcumsumexp)}


@st.composite
def scan(draw):
    """Running sums, products and log-sum-exps, over a dim given as positive or negative (a value split along
    the scanned dim must be gathered first; DTensor's rule took dim=-1 for no dim of the split)."""
    shape = tuple(_dims(draw, draw(st.integers(1, 3))))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    name = draw(st.sampled_from(sorted(_SCANS)))
    target, fn = _SCANS[name]
    return Case(("scan", name, shape, dim), (shape,), frozenset({target}), lambda x: fn(x, dim))


@st.composite
def index_put(draw):
    """`x.index_put((i,), v, accumulate)` (`x[i] += v`, index_add's lowering, the embedding's gradient), with
    `v` full or broadcast: a row (`x[i] += row`) or fewer dims (spmd's rule once split `v` on the dims of the
    full form: 4.36 off on 4 ranks, found by a rule sweep)."""
    rows, width, n = _dims(draw, 3)
    index = draw(st.sampled_from(((n,), (n, 4))))
    full = (*index, width)
    values = draw(st.sampled_from((full, full[1:], (width,), (1, width), full[:-1] + (1,))))
    # (a put without accumulating keeps one of the values a repeated index gets: any, unless they are one row)
    accumulate = draw(st.booleans()) if values in ((width,), (1, width)) else True
    return Case(("index_put", rows, width, index, values, accumulate), ((rows, width), ("index", index, rows), values),
                frozenset({aten.index_put.default}), lambda x, i, v: x.index_put((i,), v, accumulate=accumulate))


@st.composite
def masked_put(draw):
    """`x.index_put((mask,), v, accumulate)` (`x[mask] = v`, `x[mask] += v`) with a bool mask over x's first one or
    two dims, `v` a scalar or a row of x's trailing dims (found by a probe: the integer index's rows split self
    past the mask's dims and the mask's own, an IndexError on every rank)."""
    rows, width, _ = _dims(draw, 3)
    shape = draw(st.sampled_from(((rows, width), (rows, width, 4))))
    covered = draw(st.integers(1, len(shape) - 1)) if len(shape) > 2 else draw(st.integers(1, 2))
    tail = shape[covered:]
    values = draw(st.sampled_from(((), tail[-1:] if tail else (), (1,))))
    accumulate = draw(st.booleans())
    return Case(("masked_put", shape, covered, values, accumulate), (shape, ("mask", shape[:covered]), values),
                frozenset({aten.index_put.default}), lambda x, m, v: x.index_put((m,), v, accumulate=accumulate))


CASES = {f.__name__: f for f in (mm, addmm, linear, bmm, add, mul, copy, gelu, layer_norm, softmax, view, permute,
                                 embedding, gather, reduction, mean_then_add, prod_then_mul, sdpa, split, solve_triangular, scan,
                                 index_put, masked_put)}


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


@pytest.mark.parametrize("name", sorted(_SCANS))
def test_a_scan_over_the_last_dim_named_negative_never_keeps_it_split(name):
    """`x.cumsum(-1)` on a value split along its last dim: each rank would scan only its own part."""
    target, fn = _SCANS[name]
    for dim in (-1, 1):
        case = Case(("scan", name, (4, 8), dim), ((4, 8),), frozenset({target}), lambda x, dim=dim: fn(x, dim))
        ns = strategies_of(case, (2,)).nodes[name]
        assert ns.strategies and all(s.inputs[0][0] != Shard(1) and s.outputs[0][0] != Shard(1)
                                     for s in ns.strategies), (dim, ns.strategies)
        assert any(s.inputs[0][0] == Shard(0) for s in ns.strategies)  # (the other dim still splits)
