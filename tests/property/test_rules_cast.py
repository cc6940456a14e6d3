"""Casts (spmd/passes/rules/cast.py): a Partial(sum) passes a widening cast, never a narrowing one.

Checked like every rule (tests/property/rule_check.py) for a narrowing cast, where every strategy it
still offers (splits, Partial(max/min)) is exact; then which Partial forms each cast offers, and a plan:
an fp32 sum the model rounds to bf16 is reduced in fp32, before the cast (the gloo run with bf16 values
is tests/e2e/test_low_precision.py).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.core import collectives as C
from spmd.core.specs import TensorInfo
from spmd.passes.rules.cast import partial_passes, to_copy
from spmd.passes.rules.registry import RuleInput
from tests.property.rule_check import (MESHES, RUN, Case, _dims, check_strategy, full_values, make_inputs,
                                       strategies_of, traced_of)
from tests.support import compile_graph, spec

aten = torch.ops.aten
f64, f32, bf16, f16, i64 = torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64


def _cast_case(shape, dtype) -> Case:
    return Case(("cast", shape, str(dtype)), (shape,), frozenset({aten._to_copy.default}),
                lambda x: x.to(dtype))


@RUN
@given(data=st.data())
def test_every_strategy_of_a_narrowing_cast_matches_the_op(data):
    m, n = _dims(data.draw, 2)
    case = _cast_case((m, n), f32)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    traced = traced_of(case)
    values = full_values(traced, make_inputs(case, gen))
    node = next(n for n in traced.graph.nodes if n.target is aten._to_copy.default)
    for mesh_shape in MESHES:
        for s in strategies_of(case, mesh_shape).nodes[node.name].strategies:
            check_strategy(node, s, traced, values, mesh_shape, gen)


@pytest.mark.parametrize("src,dst,sum_passes", [
    (f32, f32, True), (bf16, f32, True), (f16, f32, True), (f32, f64, True), (bf16, f64, True),
    (f32, bf16, False), (f32, f16, False), (f64, f32, False), (bf16, f16, False), (f16, bf16, False),
    (f32, i64, False), (i64, f32, True), (i64, torch.int32, True), (f32, torch.bool, False)])
def test_which_casts_a_partial_sum_passes(src, dst, sum_passes):
    assert partial_passes("sum", src, dst) is sum_passes
    assert partial_passes("avg", src, dst) is sum_passes
    assert partial_passes("max", src, dst) is (dst != torch.bool)  # rounding is monotone


@pytest.mark.parametrize("src,dst,sums", [(f32, bf16, False), (bf16, f32, True)])
def test_partial_forms_a_cast_offers(src, dst, sums):
    inp = RuleInput(aten._to_copy.default, (), {"dtype": dst}, (TensorInfo((4, 8), src),), (TensorInfo((4, 8), dst),))
    rows = to_copy(inp)
    partials = {row[0].reduce_op for row in rows if isinstance(row[0], Partial)}
    assert ("sum" in partials) is sums and ("avg" in partials) is sums and {"max", "min"} <= partials
    assert [Shard(0), Shard(0)] in rows and [Shard(1), Shard(1)] in rows
    ns = strategies_of(_cast_case((4, 8), dst), (2,)).nodes["_to_copy"]
    assert ns.source == "spmd"  # ours, not DTensor's


class _Downcast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        return (x @ self.w).to(torch.bfloat16) * 2


def test_an_fp32_sum_is_reduced_before_the_cast_to_bf16():
    """x split on its columns and w on its rows make x @ w a Partial fp32 sum. DTensor's rule let it
    through the cast, and the solver chose the bf16 all_reduce after it (half the bytes): each rank's
    part rounded to bf16 before the sum. Now the reduction reads the fp32 product."""
    torch.manual_seed(0)
    pins = dict(in_placements={"x": [Shard(1)]}, param_placements={"w": [Shard(0)]})
    c = compile_graph(_Downcast(), (torch.randn(3, 64),), spec((2,), ("tp",)), **pins)
    reductions = [n for n in c.global_gm.graph.nodes if n.target in (C.all_reduce, C.reduce_scatter)]
    assert reductions and all(r.args[0].meta["val"].dtype == f32 for r in reductions), c.global_gm.code


def test_the_rule_knows_every_reduction_a_partial_carries():
    """The rule names its reductions itself (torch 2.11 has no Partial.ALL_REDUCE_OPS); a reduction DTensor
    adds later must be reasoned about in partial_passes before the rule offers it."""
    from spmd.passes.rules.cast import REDUCE_OPS

    assert set(getattr(Partial, "ALL_REDUCE_OPS", REDUCE_OPS)) == set(REDUCE_OPS)


def test_a_python_number_made_a_tensor_is_whole():
    """`_to_copy` of a Python number (`h.norm() + 1` under vmap traces a tensor made of the 1): whole, where the rule
    met an IndexError and the warning told the user to write a rule of their own (a probe)."""
    inp = RuleInput(aten._to_copy.default, (1,), {"dtype": f64}, (), (TensorInfo((), f64),))
    assert to_copy(inp) == [[Replicate()]]
