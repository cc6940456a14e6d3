"""reduce_in_place: which all_reduces reduce their input where it is, and what the steps then run."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from spmd.core import collectives as C
from spmd.passes.bucket_gradients import bucket_gradients
from spmd.passes.reduce_in_place import reduce_in_place

aten = torch.ops.aten
KW = {"reduce_op": "sum", "group": "g0", "world": 2}


def _in_place(graph: fx.Graph, tangents=frozenset()) -> dict[str, bool]:
    """all_reduce node name -> whether the pass reduces it in place (the given graph left as it is)."""
    before = {n.name: dict(n.kwargs) for n in graph.nodes}
    out = reduce_in_place(fx.GraphModule(torch.nn.Module(), graph), frozenset(tangents))
    assert {n.name: dict(n.kwargs) for n in graph.nodes} == before
    return {n.name: bool(n.kwargs.get("inplace")) for n in out.graph.nodes if n.target is C.all_reduce}


def test_a_fresh_value_read_by_its_all_reduce_alone_is_reduced_in_place():
    g = fx.Graph()
    a, w = g.placeholder("a"), g.placeholder("w")
    mm = g.call_function(aten.mm.default, (a, w))
    r = g.call_function(C.all_reduce, (mm,), KW, name="ar_mm")
    g.output(r)
    assert _in_place(g) == {"ar_mm": True}


def test_values_other_nodes_read_or_see_stay_out_of_place():
    g = fx.Graph()
    a, w = g.placeholder("a"), g.placeholder("w")
    mm = g.call_function(aten.mm.default, (a, w))
    shared = g.call_function(C.all_reduce, (mm,), KW, name="ar_read_twice")
    also = g.call_function(aten.relu.default, (mm,))  # a second reader: it must see mm unreduced
    placeholder = g.call_function(C.all_reduce, (a,), KW, name="ar_placeholder")  # the caller's tensor
    base = g.call_function(aten.mm.default, (a, w))
    view = g.call_function(aten.view.default, (base, [-1]))
    seen = g.call_function(aten.sum.default, (base,))  # reads the view's base
    through_view = g.call_function(C.all_reduce, (view,), KW, name="ar_view_of_read_base")
    param_view = g.call_function(aten.t.default, (w,))
    of_param = g.call_function(C.all_reduce, (param_view,), KW, name="ar_view_of_placeholder")
    g.output((shared, also, placeholder, seen, through_view, of_param))
    assert _in_place(g) == {"ar_read_twice": False, "ar_placeholder": False, "ar_view_of_read_base": False,
                            "ar_view_of_placeholder": False}


def test_views_and_fresh_pieces_whose_buffer_nothing_else_reads_are_reduced_in_place():
    g = fx.Graph()
    a, w, b = g.placeholder("a"), g.placeholder("w"), g.placeholder("b")
    mm = g.call_function(aten.mm.default, (a, w))
    view = g.call_function(aten.view.default, (mm, [-1]))
    r1 = g.call_function(C.all_reduce, (view,), KW, name="ar_view_chain")
    ln = g.call_function(aten.native_layer_norm.default, (a, [4], None, None, 1e-5))
    out = g.call_function(operator.getitem, (ln, 0))
    r2 = g.call_function(C.all_reduce, (out,), KW, name="ar_layer_norm_output")
    gathered = g.call_function(C.all_gather, (b,), {"dim": 0, "group": "g0", "world": 2})
    r3 = g.call_function(C.all_reduce, (gathered,), KW, name="ar_collective_output")
    mm2 = g.call_function(aten.mm.default, (a, w))
    split = g.call_function(aten.split.Tensor, (mm2, 2))  # its pieces are views of mm2: not owned
    piece = g.call_function(operator.getitem, (split, 0))
    r4 = g.call_function(C.all_reduce, (piece,), KW, name="ar_split_piece")
    g.output((r1, r2, r3, r4))
    assert _in_place(g) == {"ar_view_chain": True, "ar_layer_norm_output": True, "ar_collective_output": True,
                            "ar_split_piece": False}


def test_a_joint_graph_value_saved_for_backward_stays_out_of_place():
    """Run before the cut: a value backward reads has that reader in the joint graph."""
    g = fx.Graph()
    a, w, tangent = g.placeholder("a"), g.placeholder("w"), g.placeholder("tangents_1")
    mm = g.call_function(aten.mm.default, (a, w))
    fwd = g.call_function(C.all_reduce, (mm,), KW, name="ar_forward")
    grad = g.call_function(aten.mul.Tensor, (tangent, mm))  # backward reads mm
    g.output((fwd, grad))
    assert _in_place(g) == {"ar_forward": False}


def test_a_backward_step_never_reduces_a_forward_value_in_place():
    """Backward reads what forward saved: a tensor autograd hands back (and again on a second backward)."""
    g = fx.Graph()
    a, w, tangent = g.placeholder("a"), g.placeholder("w"), g.placeholder("tangents_1")
    saved = g.call_function(aten.mm.default, (a, w), name="saved")
    in_backward = g.call_function(C.all_reduce, (saved,), KW, name="ar_of_saved")
    in_backward.meta["partitioner_tag"] = "is_backward"
    grad = g.call_function(aten.mm.default, (tangent, w), name="grad")
    own = g.call_function(C.all_reduce, (grad,), KW, name="ar_of_backward_value")
    g.output((g.call_function(aten.mul.Tensor, (in_backward, tangent)), own))
    assert _in_place(g, {"tangents_1"}) == {"ar_of_saved": False, "ar_of_backward_value": True}


def test_results_that_are_views_whatever_their_schema_says_are_not_owned():
    g = fx.Graph()
    a, w = g.placeholder("a"), g.placeholder("w")
    mm = g.call_function(aten.mm.default, (a, w))
    unsafe = g.call_function(aten._unsafe_view.default, (mm, [-1]))  # declared fresh, a view of mm
    r1 = g.call_function(C.all_reduce, (unsafe,), KW, name="ar_unsafe_view")
    seen = g.call_function(aten.sum.default, (mm,))
    ln = g.call_function(aten.native_layer_norm.default, (a, [4], None, None, 1e-5))
    twice = g.call_function(operator.getitem, (ln, 0))
    again = g.call_function(operator.getitem, (ln, 0))  # the same result picked out twice
    r2 = g.call_function(C.all_reduce, (twice,), KW, name="ar_picked_twice")
    g.output((r1, seen, r2, again))
    assert _in_place(g) == {"ar_unsafe_view": False, "ar_picked_twice": False}


def test_the_in_place_step_reduces_the_buffer_it_is_given(one_rank):
    x = torch.arange(6.0).reshape(2, 3)
    kept = x.clone()
    out = C.all_reduce(x, "sum", one_rank, 1)
    assert out.data_ptr() != x.data_ptr() and torch.equal(out, kept)
    y = C.all_reduce(x, "sum", one_rank, 1, inplace=True)
    assert y.data_ptr() == x.data_ptr() and torch.equal(y, kept)
    avg = C.all_reduce(x, "avg", one_rank, 1, inplace=True)
    assert avg.data_ptr() == x.data_ptr() and torch.equal(avg, kept)
    t = x.t()  # not contiguous: reduced in a contiguous copy, the input untouched
    z = C.all_reduce(t, "sum", one_rank, 1, inplace=True)
    assert z.is_contiguous() and torch.equal(z, kept.t())


def test_where_autograd_records_the_call_the_step_reduces_out_of_place(one_rank):
    """An inference module called with grad enabled: autograd may have saved x for its backward, and the
    in-place collective would change it without bumping its version."""
    x = torch.arange(6.0, requires_grad=True) * 1.0
    y = C.all_reduce(x, "sum", one_rank, 1, inplace=True)
    assert y.data_ptr() != x.data_ptr()
    with torch.no_grad():
        z = x * 1.0
        assert C.all_reduce(z, "sum", one_rank, 1, inplace=True).data_ptr() == z.data_ptr()
    pending = C.all_reduce_start(x, "sum", one_rank, 1, inplace=True)
    assert C.all_reduce_wait(pending, "sum", 1).data_ptr() != x.data_ptr()


def test_a_bucket_hands_back_views_only_where_asked(one_rank):
    grads = [torch.randn(3, 4), torch.randn(5)]
    flat = C.bucket_start(grads, "sum", one_rank, 1)
    views = C.bucket_wait(flat, [g.shape for g in grads], "sum", 1, views=True)
    assert all(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in views)
    assert all(torch.equal(v, g) for v, g in zip(views, grads))
    flat = C.bucket_start(grads, "avg", one_rank, 1)
    copies = C.bucket_wait(flat, [g.shape for g in grads], "avg", 1)
    assert all(c.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr() for c in copies)
    assert all(torch.equal(c, g) for c, g in zip(copies, grads))


def test_bucket_pieces_are_views_where_every_piece_leaves_the_graph_or_goes_into_another_bucket():
    """A gradient reduced over one axis and then another feeds the second bucket, whose launch copies it: its first
    bucket hands out views (it copied them, and so held the gradients twice, 1.10x the predicted peak); a piece
    read by anything else is a copy."""
    def waits(read_by_another_op: bool) -> dict:
        g = fx.Graph()
        a, b, c = g.placeholder("a"), g.placeholder("b"), g.placeholder("c")
        for x in (a, b, c):
            x.meta["val"] = torch.empty(64)
            x.meta["spmd_placements"] = ((),)
        ga = g.call_function(C.all_reduce, (a,), {"reduce_op": "sum", "group": "g0", "world": 2})
        gb = g.call_function(C.all_reduce, (b,), {"reduce_op": "sum", "group": "g0", "world": 2})
        gc = g.call_function(C.all_reduce, (c,), {"reduce_op": "sum", "group": "g1", "world": 2})
        gc2 = g.call_function(C.shard_local, (gc,), {"dim": 0, "index": 0, "world": 2}) if read_by_another_op else \
            g.call_function(C.all_reduce, (gc,), {"reduce_op": "sum", "group": "g0", "world": 2})
        for n in (ga, gb, gc, gc2):
            n.meta = dict(a.meta)
        g.output((ga, gb, gc2))
        out = bucket_gradients(fx.GraphModule(torch.nn.Module(), g), (2, 2), bucket_bytes=1e9)
        waits = [n for n in out.graph.nodes if n.target is C.bucket_wait]
        # (a wait reads its launch alone: the gradients, copied into the bucket, die at the launch)
        assert all(n.all_input_nodes == [n.args[0]] and n.args[1] == [(64,)] * len(n.args[1]) for n in waits)
        return {n.kwargs["group"]: n.kwargs["views"] for n in waits}

    assert waits(read_by_another_op=False) == {"g1": True, "g0": True}
    assert waits(read_by_another_op=True) == {"g1": False, "g0": True}  # (its piece cut by shard_local: a copy)


def test_gradients_reduced_over_two_axes_in_both_orders_make_no_buckets_that_wait_on_each_other():
    """Found by a review: a gradient reduced on g0 then g1 and another on g1 then g0 put into one bucket per
    group, each bucket would wait for the other's results. A bucket holding one that a later member reads takes no
    more members; chains through other resharding steps (a shard_local between) are bucketed too."""
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    for x in (a, b):
        x.meta["val"] = torch.empty(64)
        x.meta["spmd_placements"] = ((),)
    a0 = g.call_function(C.all_reduce, (a,), {"reduce_op": "sum", "group": "g0", "world": 2})
    b1 = g.call_function(C.all_reduce, (b,), {"reduce_op": "sum", "group": "g1", "world": 2})
    a_cut = g.call_function(C.shard_local, (a0,), {"dim": 0, "index": 0, "world": 2})
    a1 = g.call_function(C.all_reduce, (a_cut,), {"reduce_op": "sum", "group": "g1", "world": 2})
    b0 = g.call_function(C.all_reduce, (b1,), {"reduce_op": "sum", "group": "g0", "world": 2})
    for n in (a0, b1, a_cut, a1, b0):
        n.meta = dict(a.meta)
    g.output((a1, b0))
    out = bucket_gradients(fx.GraphModule(torch.nn.Module(), g), (2, 2), bucket_bytes=1e9)
    out.graph.lint()  # (each node after its inputs: no cycle)
    starts = [n.kwargs["group"] for n in out.graph.nodes if n.target is C.bucket_start]
    assert sorted(starts) == ["g0", "g0", "g1"] and not [n for n in out.graph.nodes if n.target is C.all_reduce]
