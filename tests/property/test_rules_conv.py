"""Convolutions' rules (spmd/passes/rules/conv.py), checked like every rule (tests/property/rule_check.py): each
strategy on random inputs split as it claims, on simulated ranks, against the unsharded op. The channel rows
(column, row, depthwise) are spmd's; a depthwise piece runs its own number of groups."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Shard

from tests.property.rule_check import RUN, Case, _dims, check_case, strategies_of, traced_of

aten = torch.ops.aten


def _shapes(draw):
    """(x, w, bias length, groups, spatial dims) of a conv: one group, depthwise (a channel multiplier of 1 or 2)
    or two groups of several channels (which keeps DTensor's rows alone)."""
    n, c, length = _dims(draw, 3)
    length += 2  # (a kernel of 3 fits without padding)
    kind = draw(st.sampled_from(("dense", "depthwise", "grouped")))
    spatial = draw(st.sampled_from((1, 2)))
    if kind == "dense":
        groups, c_out, per_group = 1, draw(st.sampled_from((4, 8))), c
    elif kind == "depthwise":
        groups, c_out, per_group = c, c * draw(st.sampled_from((1, 2))), 1
    else:
        c = 2 * c
        groups, c_out, per_group = 2, 4, c // 2
    x = (n, c) + (length,) * spatial
    w = (c_out, per_group) + (3,) * spatial
    return x, w, groups, spatial


@st.composite
def convolution(draw):
    x, w, groups, spatial = _shapes(draw)
    biased = draw(st.booleans())
    stride, padding = draw(st.sampled_from((1, 2))), draw(st.sampled_from((0, 1)))

    def fn(x, w, *b):
        return aten.convolution(x, w, b[0] if b else None, [stride] * spatial, [padding] * spatial, [1] * spatial,
                                False, [0] * spatial, groups)
    shapes = (x, w) + (((w[0],),) if biased else ())
    return Case(("conv", x, w, groups, biased, stride, padding), shapes, frozenset({aten.convolution.default}),
                fn, "make_fx")


@st.composite
def convolution_backward(draw):
    x, w, groups, spatial = _shapes(draw)
    mask = draw(st.sampled_from(((True, True, True), (True, True, False), (False, True, True))))
    out = (x[0], w[0]) + x[2:]  # (stride 1, padding 1, kernel 3: the input's length)

    def fn(g, x_, w_):
        return aten.convolution_backward(g, x_, w_, [w[0]] if mask[2] else None, [1] * spatial, [1] * spatial,
                                         [1] * spatial, False, [0] * spatial, groups, list(mask))
    return Case(("conv_bwd", x, w, groups, mask), (out, x, w), frozenset({aten.convolution_backward.default}),
                fn, "make_fx")


@pytest.mark.parametrize("case", [convolution, convolution_backward], ids=lambda case: case.__name__)
@RUN
@given(data=st.data())
def test_every_strategy_matches_the_unsharded_op(case, data):
    check_case(data.draw(case(), label="case"), data.draw(st.integers(0, 2**32 - 1)))


@pytest.mark.parametrize("groups, c_out", [(1, 8), (8, 8), (8, 16), (2, 4)])
def test_each_kind_of_conv(groups, c_out):
    """Every row of each kind, forward and backward, biased, on every mesh: the random cases above draw each
    kind's biased form in one of eight examples."""
    x, w = (4, 8, 6, 6), (c_out, 8 // groups, 3, 3)
    forward = Case(("conv", x, w, groups), (x, w, (c_out,)), frozenset({aten.convolution.default}),
                   lambda x, w, b: aten.convolution(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], groups), "make_fx")
    backward = Case(("conv_bwd", x, w, groups), ((4, c_out, 6, 6), x, w),
                    frozenset({aten.convolution_backward.default}),
                    lambda g, x, w_: aten.convolution_backward(g, x, w_, [c_out], [1, 1], [1, 1], [1, 1], False, [0, 0],
                                                              groups, [True, True, True]), "make_fx")
    check_case(forward, 0)
    check_case(backward, 1)


def _rows(case: Case, op) -> list[tuple]:
    traced = traced_of(case)
    node = next(n for n in traced.graph.nodes if n.target is op)
    return [(s.outputs, s.inputs) for s in strategies_of(case, (2,)).nodes[node.name].strategies]


def test_only_whole_groups_split_the_channels():
    """A conv of two groups of four channels is not split on them (two ranks' halves would cut no group apart, but
    four ranks' quarters would); a depthwise one is, on any even piece."""
    def case(c, groups):
        return Case(("conv", c, groups), ((4, c, 8), (8, c // groups, 3)), frozenset({aten.convolution.default}),
                    lambda x, w: aten.convolution(x, w, None, [1], [1], [1], False, [0], groups), "make_fx")

    channels = lambda rows: [r for r in rows if (Shard(1),) in r[1][:1]]  # noqa: E731
    assert channels(_rows(case(8, 2), aten.convolution.default)) == []
    assert channels(_rows(case(8, 8), aten.convolution.default)) == [(((Shard(1),),), ((Shard(1),), (Shard(0),)))]
