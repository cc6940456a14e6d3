"""The grouped matmul of transformers' mixture-of-experts layers (spmd/passes/rules/grouped_mm.py) checked like every
rule (rule_check.py): each strategy of `grouped_mm_fallback` and its backward, on random inputs split as it claims,
on simulated ranks, against the unsharded op; the experts' row counts (offs) drawn sorted, empty experts included."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from tests.property.rule_check import RUN, Case, _dims, check_case, strategies_of, traced_of

pytest.importorskip("transformers.integrations.moe")


def _ops():
    return torch.ops.transformers.grouped_mm_fallback.default, torch.ops.transformers.grouped_mm_fallback_backward.default


def _grouped(x, w, raw):
    return torch.ops.transformers.grouped_mm_fallback(x, w, torch.sort(raw).values)


@st.composite
def grouped_case(draw, backward: bool):
    s, k, n = _dims(draw, 3)
    experts = draw(st.sampled_from((1, 3, 4)))
    shapes = ((s, k), (experts, k, n), ("index", (experts,), s + 1))
    forward, backward_op = _ops()
    if backward:
        def fn(x, w, raw, g):
            x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
            return torch.autograd.grad(_grouped(x, w, raw), (x, w), g)
        return Case(("grouped_mm_bwd", s, k, n, experts), shapes + ((s, n),), frozenset({forward, backward_op}), fn,
                    "make_fx")
    return Case(("grouped_mm", s, k, n, experts), shapes, frozenset({forward}), _grouped, "make_fx")


@RUN
@given(data=st.data())
def test_grouped_mm(data):
    case = data.draw(grouped_case(backward=False), label="case")
    check_case(case, data.draw(st.integers(0, 2**32 - 1)), only=case.ops)


@RUN
@given(data=st.data())
def test_grouped_mm_backward(data):
    case = data.draw(grouped_case(backward=True), label="case")
    check_case(case, data.draw(st.integers(0, 2**32 - 1)), only=case.ops)


def test_each_experts_columns_or_inner_dim_split_and_offs_whole():
    """Column- and row-parallel experts, as a Linear's; the rows of x (sorted by expert, named by offs) never split."""
    case = Case(("grouped_mm", 8, 8, 8, 4), ((8, 8), (4, 8, 8), ("index", (4,), 9)), frozenset(), _grouped, "make_fx")
    node = next(n for n in traced_of(case).graph.nodes if n.target is _ops()[0])
    strategies = strategies_of(case, (2,)).nodes[node.name].strategies
    got = {(s.outputs[0][0], s.inputs[0][0], s.inputs[1][0]) for s in strategies}
    assert got == {(Replicate(), Replicate(), Replicate()), (Shard(1), Replicate(), Shard(2)),
                   (Partial(), Shard(1), Shard(1)), (Partial(), Partial(), Replicate())}, got
    assert all(s.inputs[2] == (Replicate(),) for s in strategies)


@pytest.mark.parametrize("pins", ["megatron", "free"])
def test_a_mixtral_trains_equal_with_its_experts_split(pins):
    """transformers' Mixtral with its default experts (the grouped matmul, fallback kernel in float32 on CPU) on
    (2,): every expert split by columns (gate/up) and by its inner dim (down), or as the solver picks them on a
    compute-bound device; every rank's loss and gradients equal one device's. Before the rule, the experts ran
    whole on every rank, an unknown op."""
    import copy
    import warnings

    import torch.nn.functional as F
    from transformers import MixtralConfig, MixtralForCausalLM

    from spmd.passes.enumerate_strategies import UnknownOpWarning
    from spmd.runtime.simulate import simulate
    from tests.support import COMPUTE_BOUND_DEVICE, check_simulated_training, compile_graph, spec

    class Logits(torch.nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.m = MixtralForCausalLM(cfg)

        def forward(self, ids):
            return self.m(input_ids=ids).logits

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, use_cache=False)
    model = Logits(cfg)
    reference = copy.deepcopy(model)
    ids, labels = torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))
    loss_fn = lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten())  # noqa: E731
    loss = loss_fn(reference(ids), labels)
    loss.backward()
    experts = "m.model.layers.0.mlp.experts"
    given = {f"{experts}.gate_up_proj": [Shard(1)], f"{experts}.down_proj": [Shard(2)]} if pins == "megatron" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownOpWarning)
        c = compile_graph(model, (ids, labels), spec((2,), ("tp",), device=COMPUTE_BOUND_DEVICE), loss_fn=loss_fn,
                          param_placements=given, in_placements={"ids": [Replicate()], "t": [Replicate()]})
    grouped = {n: s for n, s in c.plan.choices.items() if n.startswith("grouped_mm_fallback")}
    assert len(grouped) == 4 and all(s.inputs[1][0] in (Shard(1), Shard(2)) for s in grouped.values()), grouped
    assert check_simulated_training(c, simulate(c, (ids, labels, torch.ones(()))), loss, reference,
                                    rtol=1e-4, atol=1e-6) > 10


def test_grouped_matmuls_cost_a_matmuls_flops():
    """torch's FLOP counter has no grouped matmul: they were priced as elementwise ops of their outputs (a Mixtral
    layer's experts at 1/(2K) of their work, 1/64 at hidden 32). Each row meets one expert's matrix: an mm's FLOPs."""
    from spmd.cost_model.compute import op_flops

    aten = torch.ops.aten
    forward, backward = _ops()
    mm = op_flops(aten.mm.default, ((32, 16), (16, 64)), {}, [(32, 64)])
    assert op_flops(forward, ((32, 16), (4, 16, 64), (4,)), {}, [(32, 64)]) == mm
    assert op_flops(aten._grouped_mm.default, ((32, 16), (4, 16, 64), (4,)), {}, [(32, 64)]) == mm
    assert op_flops(aten._grouped_mm.default, ((16, 32), (32, 64), (4,)), {}, [(4, 16, 64)]) == mm  # a weight's gradient
    assert op_flops(aten._grouped_mm.default, ((4, 32, 16), (16, 64), (4,)), {}, [(32, 64)]) == mm
    assert op_flops(backward, ((32, 16), (4, 16, 64), (4,), (32, 64)), {}, [(32, 16), (4, 16, 64)]) == 2 * mm
