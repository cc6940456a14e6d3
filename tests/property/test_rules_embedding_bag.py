"""An EmbeddingBag's table split by columns (spmd/passes/rules/indexing.py) checked like every rule (rule_check.py):
each strategy of `_embedding_bag` and of its backward ops, in every mode, with and without per-sample weights, on
random inputs split as it claims, on simulated ranks, against the unsharded op."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from tests.property.rule_check import RUN, Case, check_case, strategies_of, traced_of

aten = torch.ops.aten
_OPS = frozenset({aten._embedding_bag.default, aten._embedding_bag_forward_only.default,
                  aten._embedding_bag_backward.default,
                  aten._embedding_bag_dense_backward.default, aten._embedding_bag_per_sample_weights_backward.default})


def _bag(weight, indices, offsets, *psw, mode, **options):
    return F.embedding_bag(indices, weight, offsets, mode=mode, per_sample_weights=psw[0] if psw else None, **options)


@st.composite
def bag_case(draw, backward: bool):
    rows, hidden, n = draw(st.sampled_from((6, 9))), draw(st.sampled_from((4, 8))), draw(st.sampled_from((5, 8)))
    mode = draw(st.sampled_from(("sum", "mean", "max")))
    weighted = mode == "sum" and draw(st.booleans())
    options = dict(padding_idx=draw(st.sampled_from((None, 1))), include_last_offset=draw(st.booleans()),
                   scale_grad_by_freq=mode != "max" and draw(st.booleans()))
    shapes = ((rows, hidden), ("index", (n,), rows)) + (((n,),) if weighted else ())

    def fn(weight, indices, *psw):
        offsets = (torch.arange(4) * 2).clamp(max=n - 1)  # (an op of the graph, not a constant; n = 5: an empty bag)
        if not backward:
            return _bag(weight, indices, offsets, *psw, mode=mode, **options)
        weight = weight.detach().requires_grad_()
        psw = tuple(p.detach().requires_grad_() for p in psw)
        out = _bag(weight, indices, offsets, *psw, mode=mode, **options)
        return torch.autograd.grad(out, (weight, *psw), torch.ones_like(out) * torch.arange(hidden))

    forward = aten._embedding_bag.default if backward else aten._embedding_bag_forward_only.default
    key = ("bag", backward, rows, hidden, n, mode, weighted, *options.values())
    return Case(key, shapes, frozenset({forward}), fn, "make_fx")


@RUN
@given(data=st.data())
def test_embedding_bag_dense_backward(data):
    """The dense backward op itself (AOTAutograd's joint graph and make_fx keep `_embedding_bag_backward`, which
    calls it; a review found it met by no test): the gradient split by columns or Partial, max mode's indices split."""
    mode = data.draw(st.sampled_from((0, 1, 2)), label="mode")
    padding = data.draw(st.sampled_from((-1, 1)), label="padding_idx")

    def fn(weight, indices, grad):
        offsets = torch.arange(3) * 2
        _, offset2bag, bag_size, max_indices = aten._embedding_bag.default(weight, indices, offsets, False, mode,
                                                                           False, None, False, padding)
        return aten._embedding_bag_dense_backward.default(grad, indices, offset2bag, bag_size, max_indices, 9,
                                                          mode != 2 and padding == -1, mode, None, padding)

    case = Case(("bag-dense-bwd", mode, padding), ((9, 8), ("index", (7,), 9), (3, 8)),
                frozenset({aten._embedding_bag_dense_backward.default}), fn, "make_fx")
    check_case(case, data.draw(st.integers(0, 2**32 - 1)), only=_OPS)


@RUN
@given(data=st.data())
def test_embedding_bag(data):
    case = data.draw(bag_case(backward=False), label="case")
    check_case(case, data.draw(st.integers(0, 2**32 - 1)), only=_OPS)


@RUN
@given(data=st.data())
def test_embedding_bag_backward(data):
    case = data.draw(bag_case(backward=True), label="case")
    check_case(case, data.draw(st.integers(0, 2**32 - 1)), only=_OPS)


def test_the_table_splits_by_columns_in_every_mode():
    def looked_up(mode):
        return lambda w, i: _bag(w, i, torch.arange(2) * 3, mode=mode)

    for mode in ("sum", "mean", "max"):
        case = Case(("bag-columns", mode), ((9, 8), ("index", (8,), 9)), frozenset(), looked_up(mode), "make_fx")
        node = next(n for n in traced_of(case).graph.nodes if n.target is aten._embedding_bag_forward_only.default)
        got = {(s.outputs[0][0], s.inputs[0][0]) for s in strategies_of(case, (2,)).nodes[node.name].strategies}
        assert got == {(Replicate(), Replicate()), (Shard(1), Shard(1))}, (mode, got)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_a_recommender_trains_equal_with_its_tables_split_by_columns(mode):
    """A DLRM-style model (EmbeddingBag tables, one with per-sample weights in sum mode, a pairwise interaction, an
    MLP) with every table pinned by columns on (2,): the lookups run on each rank's columns, and every rank's loss
    and gradients equal one device's. Before the rule, every table was gathered and looked up whole (a probe)."""
    import copy
    import warnings

    from spmd.passes.enumerate_strategies import UnknownOpWarning
    from spmd.runtime.simulate import simulate
    from tests.support import check_simulated_training, compile_graph, spec

    class Recommender(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.EmbeddingBag(20, 8, mode=mode), torch.nn.EmbeddingBag(12, 8, mode=mode)
            self.top = torch.nn.Linear(8 * 3 + 1, 1)

        def forward(self, ids_a, offsets_a, ids_b, offsets_b, weights_b):
            a = self.a(ids_a, offsets_a)
            b = self.b(ids_b, offsets_b, per_sample_weights=weights_b if mode == "sum" else None)
            return self.top(torch.cat([a, b, a * b, (a * b).sum(-1, keepdim=True)], -1))

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = Recommender()
        reference = copy.deepcopy(model)
        inputs = (torch.randint(0, 20, (10,)), torch.tensor([0, 3, 3, 7]), torch.randint(0, 12, (9,)),
                  torch.tensor([0, 2, 5, 6]), torch.rand(9))
        target = torch.randn(4, 1)
        loss = F.mse_loss(reference(*inputs), target)
        loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnknownOpWarning)
            c = compile_graph(model, (*inputs, target), spec((2,), ("tp",)), loss_fn=F.mse_loss,
                              param_placements={"a.weight": [Shard(1)], "b.weight": [Shard(1)]})
        bags = {n: s for n, s in c.plan.choices.items() if n.startswith("_embedding_bag")}
        assert bags and all(s.inputs[0] == (Shard(1),) for n, s in bags.items() if "backward" not in n), bags
        assert check_simulated_training(c, simulate(c, (*inputs, target, torch.ones(()))), loss, reference) > 3
    finally:
        torch.set_default_dtype(torch.float32)
