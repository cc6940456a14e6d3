"""unmerge_bmm: torch.matmul of 4-D tensors, decomposed to a bmm over merged leading dims, is one matmul again,
so a head-parallel plan keeps q, k and v split on heads. Values checked by running the graphs before and after the
pass; a Megatron plan trained (simulated) equal to one device."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from spmd.passes.trace_joint import trace_joint
from spmd.passes.trace_module import trace_module
from spmd.passes.unmerge_bmm import unmerge_bmm
from spmd.runtime.simulate import simulate
from tests.support import LATENCY_LINK, SLOW_DEVICE, check_simulated_training, compile_graph, spec

aten = torch.ops.aten


class _EagerAttention(nn.Module):
    """Attention as BERT's and T5's eager path computes it: two torch.matmul over [batch, heads, seq, dim]."""

    def __init__(self, d: int = 16, heads: int = 4, chained: bool = False):
        super().__init__()
        self.heads, self.chained = heads, chained
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        split = lambda t: t.view(b, s, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = torch.matmul(q, k.transpose(-1, -2))
        if self.chained:  # a product read straight by the next one (no softmax between)
            y = torch.matmul(torch.matmul(scores, v), v.transpose(-1, -2)).matmul(v)
        else:
            y = torch.matmul(F.dropout(scores.softmax(-1), 0.0), v)
        return self.o(y.transpose(1, 2).reshape(b, s, d))


def _count(traced, op) -> int:
    return sum(n.target is op for n in traced.graph.nodes)


@pytest.mark.parametrize("chained", [False, True])
@pytest.mark.parametrize("joint", [False, True])
def test_every_bmm_over_merged_heads_becomes_a_matmul_with_the_same_values(joint, chained):
    torch.manual_seed(0)
    model, x, t = _EagerAttention(chained=chained), torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    traced = trace_joint(model, (x, t), F.mse_loss) if joint else trace_module(model, (x,))
    after = unmerge_bmm(traced)
    assert _count(traced, aten.bmm.default) > 0 and _count(after, aten.bmm.default) == 0
    assert _count(after, aten.matmul.default) == _count(traced, aten.bmm.default)
    assert all(n.name in after.tensor_info for n in after.graph.nodes if n.op == "call_function")
    args = [*(p.detach() for p in model.parameters()), x, *((t, torch.ones(())) if joint else ())]
    run = lambda traced: torch.fx.Interpreter(traced.gm).run(*args, enable_io_processing=False)  # noqa: E731
    got, want = run(after), run(traced)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_bmm_whose_result_is_read_merged_stays():
    """A product whose merged result something reads as it is (not split back into batch and heads) is left."""
    class Merged(nn.Module):
        def forward(self, a, b):
            return torch.bmm(a.reshape(8, 3, 5), b.reshape(8, 5, 2)).sum(0)

    traced = trace_module(Merged(), (torch.randn(2, 4, 3, 5), torch.randn(2, 4, 5, 2)))
    assert unmerge_bmm(traced) is traced


def test_megatron_attention_trains_equal_with_its_heads_split_and_one_all_reduce():
    """Column-parallel q, k, v and a row-parallel o on tp: heads split through both products, one all_reduce
    in forward (Megatron's), where the merged bmm gathered q, k and v or sent them from heads to batch."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model, x, t = _EagerAttention(), torch.randn(2, 6, 16), torch.randn(2, 6, 16)
        reference = copy.deepcopy(model)
        loss = F.mse_loss(reference(x), t)
        loss.backward()
        pins = {"q.weight": [Shard(0)], "k.weight": [Shard(0)], "v.weight": [Shard(0)], "o.weight": [Shard(1)]}
        c = compile_graph(model, (x, t), spec((2,), ("tp",), LATENCY_LINK, SLOW_DEVICE), loss_fn=F.mse_loss,
                          param_placements=pins, in_placements={"x": [Replicate()], "target": [Replicate()]})
        assert check_simulated_training(c, simulate(c, (x, t, torch.ones(()))), loss, reference) == 5
        forward = [(step.kind, edge.consumer) for edge, step in c.plan.collectives()
                   if c.traced.regions().get(edge.consumer) == "is_forward"]
        assert [kind for kind, _ in forward] == ["all_reduce"], forward
    finally:
        torch.set_default_dtype(torch.float32)


def test_every_layout_of_the_matmul_rule_computes_the_product():
    """Each single-axis row of rules/matmul.py, run on two pieces and put together, is the whole product."""
    from torch.distributed.tensor import Partial

    from spmd.core.specs import TensorInfo
    from spmd.passes.rules.matmul import matmul
    from spmd.passes.rules.registry import RuleInput

    torch.manual_seed(0)
    a, b = torch.randn(2, 4, 6, 8, dtype=torch.float64), torch.randn(2, 4, 8, 10, dtype=torch.float64)
    whole = torch.matmul(a, b)
    info = lambda t: TensorInfo(tuple(t.shape), t.dtype)  # noqa: E731
    rows = matmul(RuleInput(aten.matmul.default, (a, b), {}, (info(a), info(b)), (info(whole),)))
    assert len(rows) == 2 + 3

    def piece(t, p, r):
        return t.chunk(2, p.dim)[r] if isinstance(p, Shard) else t

    for out, pa, pb in rows:
        pieces = [torch.matmul(piece(a, pa, r), piece(b, pb, r)) for r in range(2)]
        got = sum(pieces) if isinstance(out, Partial) else torch.cat(pieces, out.dim)
        torch.testing.assert_close(got, whole)


def test_a_plans_cost_formula_prices_the_products_the_pass_made():
    """cost_formula traces the model again at other batch sizes: through the same rewrites, so its formula at the
    solved batch is the plan's objective (the plain trace had bmm nodes, no choice for them: too low; a review)."""
    import spmd

    torch.manual_seed(0)
    x, t = torch.randn(4, 6, 16), torch.randn(4, 6, 16)
    plan = spmd.plan(_EagerAttention(), spec((2,), ("dp",)), (x, t), loss_fn=F.mse_loss)
    assert float(plan.cost_formula.subs("batch", 4)) == pytest.approx(plan.objective, rel=1e-9)


def test_under_autocast_the_products_keep_the_dtype_the_graph_computes():
    """A product the model runs in float32 inside `torch.autocast(enabled=False)` was given bfloat16 values (the
    fake call ran under the user's autocast), and its collectives and memory were priced at half (a review)."""
    class Scores(nn.Module):
        def forward(self, q, k):
            with torch.autocast("cpu", enabled=False):
                return torch.matmul(q.float(), k.float().transpose(-1, -2))

    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        traced = trace_module(Scores(), (q, k))
        after = unmerge_bmm(traced)
    (product,) = [n for n in after.graph.nodes if n.target is aten.matmul.default]
    assert product.meta["val"].dtype == torch.float32 and after.tensor_info[product.name].dtype == torch.float32
