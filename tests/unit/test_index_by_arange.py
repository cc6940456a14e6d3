"""index_by_arange: lookups by aranges over whole dims become views of their source (and a copy); every other
lookup stays a gather. The values are checked by running the graph before and after the pass."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import spmd
from spmd.passes.index_by_arange import index_by_arange
from spmd.passes.trace_module import trace_module

aten = torch.ops.aten


class _Lookup(nn.Module):
    """transformers' padding-mask lookup (masking_utils' `padding_mask_function`), or a variant of it."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, mask, x):
        b, t = mask.shape
        batch, kv = torch.arange(b), torch.arange(t) + 0
        if self.how == "mask":
            picked = mask[batch[:, None, None, None], kv[None, None, None, :]]
        elif self.how == "leading":  # one index, the rest of the dims taken whole
            picked = x[batch][:, None]
        elif self.how == "shifted":  # kv + 1: not the identity (and out of range at the end, so wrapped)
            picked = mask[batch[:, None], (kv[None, :] + 1) % t]
        elif self.how == "transposed":  # the indices' dims the other way round: a transpose, left a gather
            picked = mask[batch[None, :], kv[:, None]]
        elif self.how == "diagonal":  # both along one dim: one position per row (x[b, b]), a gather along dim 1
            picked = x[batch, batch]
        else:  # "reversed"
            picked = mask[batch[:, None], kv.flip(0)[None, :]]
        return picked.float().sum(-1, keepdim=True) * x.sum()


def _indexes(traced) -> int:
    return sum(n.target is aten.index.Tensor for n in traced.graph.nodes)


@pytest.mark.parametrize("how, rewritten", [("mask", True), ("leading", True), ("shifted", False),
                                             ("transposed", False), ("diagonal", True), ("reversed", False)])
def test_only_a_lookup_by_whole_aranges_in_order_becomes_views_and_the_values_stay(how, rewritten):
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    x = torch.randn(4, 4, 5) if how == "diagonal" else torch.randn(4, 5)
    model = _Lookup(how)
    traced = trace_module(model, (mask, x))
    after = index_by_arange(traced)
    assert (_indexes(after) == 0) == rewritten and _indexes(traced) == 1  # (the traced graph itself untouched)
    if rewritten and how != "diagonal":  # (the diagonal's second arange is its index: a gather along dim 1)
        assert not any(n.target in (aten.arange.start_step, aten.arange.default) for n in after.graph.nodes)
        assert all(n.name in after.tensor_info for n in after.graph.nodes if n.op == "call_function")
    args = [mask, x]
    torch.testing.assert_close(after.gm(*args), traced.gm(*args), rtol=0, atol=0)
    torch.testing.assert_close(after.gm(*args)[0], model(mask, x), rtol=0, atol=0)


def test_a_lookup_of_a_channels_last_source_stays_a_gather():
    """A lookup lays its result out as its source (channels_last strides): the contiguous copy would not, and a
    dropout or `as_strided` after it would read other memory (a review)."""
    class Lookup(nn.Module):
        def forward(self, x):
            return x[torch.arange(x.shape[0])] * 2.0

    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    traced = trace_module(Lookup(), (x,))
    assert index_by_arange(traced) is traced


def test_a_batch_split_plan_of_a_model_with_an_attention_mask_runs_no_collective():
    """transformers' GPT-2 with its attention mask, inputs split on the batch and weights replicated (the
    hand-written data parallel layout): no collective, where the mask lookup gathered the mask at every call."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 64, (4, 8))
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    plan = spmd.plan(model, spmd.MeshSpec((2,), ("dp",)), example_kwargs=kwargs, training=False,
                     in_placements={"input_ids": [Shard(0)], "attention_mask": [Shard(0)]},
                     param_placements={name: [Replicate()] for name, _ in model.named_parameters()})
    assert not plan.collective_summary()


class _RowLookup(nn.Module):
    """One position per row: `x[arange(B), idx]` (sequence classification's last token), or a variant."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.proj = how, nn.Linear(6, 6)

    def forward(self, x, idx):
        h = self.proj(x)
        b = torch.arange(h.shape[0])
        if self.how == "last":  # h [B, S, C], idx [B]
            picked = h[b, idx]
        elif self.how == "negative":  # counted from the end
            picked = h[b, idx - h.shape[1]]
        elif self.how == "int32":
            picked = h[b, idx.to(torch.int32)]
        elif self.how == "one":  # one position for every row: the index broadcasts
            picked = h[b, idx[:1]]
        elif self.how == "heads":  # two leading aranges, h [B, H, S, C] viewed, idx [B, 1]
            g = h.view(h.shape[0], 2, h.shape[1] // 2, 6)
            picked = g[b[:, None], torch.arange(2)[None, :], idx[:, None] % (h.shape[1] // 2)]
        elif self.how == "written":  # an index_put of rows, not accumulating
            picked = h.clone()
            picked[b, idx] = h[b, idx] * 3.0
        else:  # "shifted": arange + 1 is no row of its own: stays a gather
            picked = h[(b + 1) % h.shape[0], idx]
        return picked


@pytest.mark.parametrize("how, rewritten", [("last", True), ("negative", True), ("int32", True), ("one", True),
                                             ("heads", True), ("written", True), ("shifted", False)])
def test_a_lookup_of_one_position_per_row_is_a_gather_in_forward_and_backward(how, rewritten):
    """`x[arange(B), idx]` becomes `gather` along dim 1 (its backward's `index_put`, `scatter_add`), the same
    values and gradients; a lookup whose rows are not the arange stays."""
    import torch.nn.functional as F

    from spmd.passes.trace_joint import trace_joint

    torch.manual_seed(0)
    model = _RowLookup(how)
    x, idx = torch.randn(4, 8, 6), torch.tensor([3, 7, 0, 5])
    t = torch.randn(model(x, idx).shape)
    traced = trace_joint(model, (x, idx, t), F.mse_loss)
    after = index_by_arange(traced)
    ops = {n.target for n in after.graph.nodes}
    assert (aten.index.Tensor not in ops and aten.index_put.default not in ops) == rewritten, after.graph
    if rewritten:
        assert aten.gather.default in ops and (aten.scatter_add.default in ops or aten.scatter.src in ops)
    args = [*(p.detach() for p in model.parameters()), x, idx, t, torch.ones(())]
    run = lambda traced: torch.fx.Interpreter(traced.gm).run(*args, enable_io_processing=False)  # noqa: E731
    got, want = run(after), run(traced)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_batch_split_sequence_classifier_gathers_nothing_but_its_loss_count():
    """transformers' sequence classification picks each row's last token (`logits[arange(batch), last_non_pad]`):
    inputs split on the batch and weights replicated, the plan reduces the gradients and the loss's sum and count of
    its targets, and trains equal to one device. Before, it gathered the logits in forward and their gradient in
    backward (three all_gathers)."""
    import copy

    import torch.nn.functional as F

    from spmd.runtime.simulate import simulate
    from tests.support import LATENCY_LINK, check_simulated_training, compile_graph, spec

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, num_labels=3)

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = transformers.LlamaForSequenceClassification(cfg)

        def forward(self, ids, mask):
            return self.m(input_ids=ids, attention_mask=mask).logits

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = Classifier().eval()
        ids = torch.randint(1, 64, (4, 8))
        ids[0, 5:] = 0
        ids[2, 3:] = 0
        mask, labels = (ids != 0).long(), torch.tensor([0, 2, 1, 2])
        reference = copy.deepcopy(model)
        loss = F.cross_entropy(reference(ids, mask), labels)
        loss.backward()
        c = compile_graph(model, (ids, mask, labels), spec((2,), ("dp",), LATENCY_LINK), loss_fn=F.cross_entropy,
                          in_placements={"ids": [Shard(0)], "mask": [Shard(0)], "target": [Shard(0)]},
                          param_placements={n: [Replicate()] for n, _ in model.named_parameters()})
        inner = [(step.kind, edge.consumer) for edge, step in c.plan.collectives() if not edge.consumer.startswith("output")]
        assert {kind for kind, _ in inner} == {"all_reduce"} and len(inner) <= 2, inner  # (the loss's sum and count)
        assert check_simulated_training(c, simulate(c, (ids, mask, labels, torch.ones(()))), loss, reference) > 10
    finally:
        torch.set_default_dtype(torch.float32)
