"""overlap_collectives: where all_reduces are launched and waited for, and that the values stay the same."""
from __future__ import annotations


import pytest
import torch
import torch.fx as fx

from spmd.compiler.verify import check_overlap
from spmd.core import collectives as C
from spmd.core.errors import SpmdInternalError
from spmd.passes.overlap_collectives import Estimates, overlap_collectives

aten = torch.ops.aten


def _kw(group="g0"):
    return {"reduce_op": "sum", "group": group, "world": 1}


def _order(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "call_function"]


def _backward_of_a_column_parallel_linear() -> fx.Graph:
    """dW first (the trace's order), then dX, reduced and read: the dW matmul does not need the reduction."""
    g = fx.Graph()
    dy, w, x = g.placeholder("dy"), g.placeholder("w"), g.placeholder("x")
    dyt = g.call_function(aten.t.default, (dy,), name="dy_t")
    dw = g.call_function(aten.mm.default, (dyt, x), name="dw")
    dx = g.call_function(aten.mm.default, (dy, w), name="dx")
    r = g.call_function(C.all_reduce, (dx,), _kw(), name="ar_dx")
    out = g.call_function(aten.relu.default, (r,), name="reader")
    g.output((dw, out))
    return g


def test_the_launch_moves_up_and_the_wait_down_around_work_that_needs_neither():
    gm = fx.GraphModule(torch.nn.Module(), _backward_of_a_column_parallel_linear())
    before = _order(gm)
    out = overlap_collectives(gm)
    assert _order(gm) == before  # the given graph is left as it is
    assert _order(out) == ["dx", "ar_dx_start", "dy_t", "dw", "ar_dx_wait", "reader"]


@pytest.mark.parametrize("collective_s, moved", [(0.0, []), (2.5, ["w2", "w3", "w4"]), (float("inf"),
                                                                                      ["w1", "w2", "w3", "w4"])])
def test_the_launch_moves_up_past_as_much_work_as_its_collective_takes(collective_s, moved):
    """Four weight-gradient matmuls of 1 s each before a launch they do not feed: the last ones in the trace's
    order move after it, as many as hide it; each moved one holds what it reads until it runs, so moving more
    held more for nothing (a step's peak grew 17% where the collective took 16 us)."""
    g = fx.Graph()
    dy, x = g.placeholder("dy"), g.placeholder("x")
    work = [g.call_function(aten.mm.default, (dy, x), name=f"w{i}") for i in range(1, 5)]
    r = g.call_function(C.all_reduce, (g.call_function(aten.relu.default, (dy,), name="dx"),), _kw(), name="ar")
    g.output((*work, r))
    estimates = Estimates(lambda n: 1.0 if n.name.startswith("w") else 0.0, lambda launch: collective_s)
    order = _order(overlap_collectives(fx.GraphModule(torch.nn.Module(), g), estimates))
    start = order.index("ar_start")
    assert [n for n in order[start:] if n.startswith("w")] == moved
    assert [n for n in order[:start] if n.startswith("w")] == [f"w{i}" for i in range(1, 5 - len(moved))]


def test_one_collective_in_flight_per_group_and_several_across_groups():
    g = fx.Graph()
    a, b, c = g.placeholder("a"), g.placeholder("b"), g.placeholder("c")
    r1 = g.call_function(C.all_reduce, (g.call_function(aten.relu.default, (a,), name="x1"),), _kw("g0"), name="ar1")
    r2 = g.call_function(C.all_reduce, (g.call_function(aten.relu.default, (b,), name="x2"),), _kw("g0"), name="ar2")
    r3 = g.call_function(C.all_reduce, (g.call_function(aten.relu.default, (c,), name="x3"),), _kw("g1"), name="ar3")
    g.output((r1, r2, r3))
    out = overlap_collectives(fx.GraphModule(torch.nn.Module(), g))
    order = _order(out)
    # ar1 must end before ar2 starts (same group); ar3's group is another: ar2 stays in flight beside it
    assert order.index("ar1_wait") < order.index("ar2_start")
    assert order.index("ar3_start") < order.index("ar2_wait")
    check_overlap("overlap_collectives", {"rank_gm": out})


def test_collectives_on_the_group_and_random_draws_keep_their_place_before_a_launch():
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    gathered = g.call_function(C.all_gather, (a,), {"dim": 0, "group": "g0", "world": 1}, name="gather")
    drop = g.call_function(aten.native_dropout.default, (b, 0.5, True), name="dropout")
    ok = g.call_function(aten.relu.default, (b,), name="free_work")
    x = g.call_function(aten.mm.default, (b, b), name="x")
    r = g.call_function(C.all_reduce, (x,), _kw(), name="ar")
    g.output((gathered, drop, ok, r))
    order = _order(overlap_collectives(fx.GraphModule(torch.nn.Module(), g)))
    assert order.index("gather") < order.index("ar_start") and order.index("dropout") < order.index("ar_start")
    assert order.index("free_work") > order.index("ar_start")


def test_nothing_moves_past_a_write_it_may_read_before():
    """relu reads b before add_ writes it: moved after the launch, it would read the written b."""
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    early = g.call_function(aten.relu.default, (b,), name="reads_b")
    g.call_function(aten.add_.Tensor, (b, a), name="writes_b")
    later = g.call_function(aten.neg.default, (a,), name="after_the_write")
    x = g.call_function(aten.mm.default, (a, a), name="x")
    r = g.call_function(C.all_reduce, (x,), _kw(), name="ar")
    g.output((early, later, r))
    order = _order(overlap_collectives(fx.GraphModule(torch.nn.Module(), g)))
    assert order.index("reads_b") < order.index("writes_b") < order.index("ar_start")
    assert order.index("after_the_write") > order.index("ar_start")


def test_a_graph_without_all_reduces_is_returned_as_it_is():
    g = fx.Graph()
    a = g.placeholder("a")
    g.output(g.call_function(aten.relu.default, (a,)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert overlap_collectives(gm) is gm


def test_the_check_names_a_second_collective_in_flight_on_a_group():
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    s1 = g.call_function(C.all_reduce_start, (a,), _kw(), name="first")
    s2 = g.call_function(C.all_reduce_start, (b,), _kw(), name="second")
    w1 = g.call_function(C.all_reduce_wait, (s1,), {"reduce_op": "sum", "world": 1, "group": "g0"})
    w2 = g.call_function(C.all_reduce_wait, (s2,), {"reduce_op": "sum", "world": 1, "group": "g0"})
    g.output((w1, w2))
    with pytest.raises(SpmdInternalError, match="second uses group g0 while first is in flight"):
        check_overlap("overlap_collectives", {"rank_gm": fx.GraphModule(torch.nn.Module(), g)})


def test_the_reordered_graph_computes_the_same_values(one_rank):
    g = _backward_of_a_column_parallel_linear()
    for n in g.nodes:
        if n.target is C.all_reduce:
            n.kwargs = {**n.kwargs, "group": one_rank, "inplace": True}
    gm = fx.GraphModule(torch.nn.Module(), g)
    out = overlap_collectives(gm)
    args = [torch.randn(4, 3), torch.randn(3, 5), torch.randn(4, 6)]
    for want, got in zip(gm(*args), out(*args)):
        assert torch.equal(want, got)
