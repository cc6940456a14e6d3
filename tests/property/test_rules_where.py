"""`where` with Partial branches (spmd/passes/rules/pointwise.py), on simulated ranks.

`where(c, x, y)` with c whole is linear in (x, y) together, so Partial(sum) branches give a Partial(sum)
result; masked_fill's constant branch (a Replicate scalar 0) becomes Partial locally, with no
communication. Checked like every rule (tests/property/rule_check.py): each strategy on random inputs
split as it claims, per-rank results combined as it claims, against the unsharded op. Then a whole plan:
a contraction-sharded matmul's Partial output passes a masked_fill unreduced.
"""
from __future__ import annotations

import operator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.core.profiles import LinkProfile
from spmd.core import collectives as C
from spmd.runtime.distribute import local_shard
from spmd.runtime.simulate import simulate
from tests.support import compile_graph, spec
from tests.property.rule_check import (MESHES, RUN, Case, _dims, check_strategy, full_values, make_inputs,
                                       strategies_of, traced_of)

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def float64():
    """masked_fill's scalar is built in the default dtype: float64 keeps the oracle's 1e-9 tolerance."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


_FORMS = {
    # name: (number of float inputs, fn); the first input's sign is the mask
    "masked_fill_zero": lambda m, x: x.masked_fill(m > 0, 0.0),
    "masked_fill_value": lambda m, x: x.masked_fill(m > 0, 1.5),  # a non-zero constant: still exact
    "where_two_tensors": lambda m, x, y: torch.where(m > 0, x, y),
}


@st.composite
def where_case(draw):
    form = draw(st.sampled_from(sorted(_FORMS)))
    m, n = _dims(draw, 2)
    x = (m, n)
    mask = draw(st.sampled_from(((m, n), (n,), (m, 1))))  # broadcasting masks too
    shapes = (mask, x) + (((m, n) if draw(st.booleans()) else (n,),) if form == "where_two_tensors" else ())
    return Case(("where", form, mask, shapes), shapes, frozenset({aten.where.self}), _FORMS[form])


@RUN
@given(data=st.data())
def test_every_where_strategy_matches_the_unsharded_op(data):
    case = data.draw(where_case(), label="case")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    traced = traced_of(case)
    values = full_values(traced, make_inputs(case, gen))
    calls = [n for n in traced.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    for mesh_shape in MESHES:
        table = strategies_of(case, mesh_shape)
        for node in calls:
            for s in table.nodes[node.name].strategies:
                check_strategy(node, s, traced, values, mesh_shape, gen)


def test_where_offers_partial_branches():
    case = Case(("where", "masked_fill_zero", (4, 8), ((4, 8), (4, 8))), ((4, 8), (4, 8)),
                frozenset({aten.where.self}), _FORMS["masked_fill_zero"])
    ns = strategies_of(case, (2,)).nodes["where"]
    assert ns.source == "spmd"
    # (mask, the scalar 0, x) -> out
    assert {str(s) for s in ns.strategies} == {
        "([R], [R], [R]) -> [R]", "([S(0)], [R], [S(0)]) -> [S(0)]", "([S(1)], [R], [S(1)]) -> [S(1)]",
        "([R], [P], [P]) -> [P]"}


def test_boolean_where_has_no_partial():
    """A sum of booleans is not their select: no Partial form for non-float results."""
    case = Case(("where", "bool", (4, 8)), ((4, 8), (4, 8)), frozenset({aten.where.self}),
                lambda m, x: torch.where(m > 0, x > 0, m < 0))
    ns = strategies_of(case, (2,)).nodes["where"]
    assert not any(isinstance(p, Partial) for s in ns.strategies for ps in s.outputs for p in ps)


class _MaskedMatmul(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 256))

    def forward(self, x, mask):
        return (x @ self.w).masked_fill(mask > 0, 0.0).sum(0)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_partial_matmul_output_passes_masked_fill_unreduced(mesh_shape):
    """x split on its columns and w on its rows make x @ w Partial; the masked_fill keeps it Partial and
    the reduction comes at the end, on the [256] result, not on the [4, 256] product (bandwidth-bound
    links make that the cheaper plan). On (2, 2) the batch may also split on dp; its reduction then runs
    as reduce_scatter, all_reduce of the half, all_gather: every collective still starts from the sum."""
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    mesh = spec(mesh_shape, names, link=LinkProfile("test-narrow-link", 1e-6, 1e8))
    split = [Replicate()] * (len(mesh_shape) - 1) + [Shard(1)]
    pins = dict(in_placements={"x": split, "mask": [Replicate()] * len(mesh_shape)},
                param_placements={"w": [Replicate()] * (len(mesh_shape) - 1) + [Shard(0)]},
                out_placements={0: [Replicate()] * len(mesh_shape)})
    torch.manual_seed(0)
    model = _MaskedMatmul()
    x, mask = torch.randn(4, 16), torch.randn(4, 256)
    c = compile_graph(model, (x, mask), mesh, **pins)
    where = next(n for n in c.traced.graph.nodes if n.target is aten.where.self)
    assert isinstance(c.plan.choices[where.name].outputs[0][-1], Partial), c.plan.choices[where.name]
    collectives = [n for n in c.global_gm.graph.nodes if n.op == "call_function" and n.target in
                   (C.all_reduce, C.reduce_scatter, C.all_gather)]
    assert collectives and collectives[0].args[0].target is aten.sum.dim_IntList, c.global_gm.graph
    assert all(n.args[0] in collectives for n in collectives[1:]), c.global_gm.graph
    assert sum(n.target is C.all_reduce for n in collectives) == 1, c.global_gm.graph
    outs = simulate(c, (x, mask))
    want = model(x, mask).detach()
    for rank, out in enumerate(outs):
        torch.testing.assert_close(out[0], local_shard(want, pins["out_placements"][0], mesh.shape, mesh.coordinate(rank)),
                                   rtol=1e-10, atol=1e-10)
