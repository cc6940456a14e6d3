"""gather_rows: a lookup of one position per row (`x[arange(B), idx]`) becomes a gather along the rows, and its
backward's index_put a scatter; the values and gradients are checked by running the joint graph before and after
the pass, and a transformers sequence classifier's batch-split plan by training it simulated."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from spmd.passes.gather_rows import gather_rows

aten = torch.ops.aten


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
        elif self.how == "argmax":  # never negative: no wrap of negative indices
            picked = h[b, h.sum(-1).argmax(-1)]
        elif self.how == "negative":  # counted from the end
            picked = h[b, idx - h.shape[1]]
        elif self.how == "int32":
            picked = h[b, idx.to(torch.int32)]
        elif self.how == "one":  # one position for every row: the index broadcasts
            picked = h[b, idx[:1]]
        elif self.how == "heads":  # two leading aranges, h [B, H, S, C] viewed, idx [B, 1]
            g = h.view(h.shape[0], 2, h.shape[1] // 2, 6)
            picked = g[b[:, None], torch.arange(2)[None, :], idx[:, None] % (h.shape[1] // 2)]
        elif self.how == "positions":  # three positions per row: idx [B, 3] -> [B, 3, C]
            picked = h[b[:, None], torch.stack([idx, idx.flip(0), idx // 2], 1)]
        elif self.how == "grid":  # positions over two dims of their own: idx [B, 2, 3] -> [B, 2, 3, C]
            picked = h[b[:, None, None], torch.stack([idx, idx.flip(0), idx // 2], 1)[:, None, :].expand(4, 2, 3) - 1]
        elif self.how in ("two", "two-permuted"):  # two indexed dims: merged, one linear index into them
            g = h.view(4, 2, 4, 6)
            g = g.permute(0, 2, 1, 3) if self.how == "two-permuted" else g  # (dims not laid out one after the other)
            i, j = torch.arange(3) - 1, idx[:2] % g.shape[2]  # (i from -1: one counted from the end)
            picked = g[b[:, None, None], i[None, :, None], j[None, None, :]] if self.how == "two" else \
                g[b[:, None, None], (torch.arange(2) * 3).flip(0)[None, :, None], i[None, None, :]]
        elif self.how == "clamped":  # reflection padding's backward: rows clamped to their range, positions along S
            rows = b.clamp(0, h.shape[0] - 1)
            cols = (torch.arange(-1, h.shape[1] + 1).abs() - (h.shape[1] - 1)).abs().neg() + (h.shape[1] - 1)
            picked = h[rows[:, None], cols[None, :]]
        elif self.how == "written":  # an index_put of rows, not accumulating
            picked = h.clone()
            picked[b, idx] = h[b, idx] * 3.0
        else:  # "shifted": arange + 1 is no row of its own: stays a gather
            picked = h[(b + 1) % h.shape[0], idx]
        return picked


@pytest.mark.parametrize("how, rewritten", [("last", True), ("argmax", True), ("negative", True), ("int32", True), ("one", True),
                                             ("heads", True), ("positions", True), ("grid", True), ("two", True),
                                             ("two-permuted", True), ("clamped", True),
                                             ("written", True), ("shifted", False)])
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
    after = gather_rows(traced)
    ops = {n.target for n in after.graph.nodes}
    assert (aten.index.Tensor not in ops and aten.index_put.default not in ops) == rewritten, after.graph
    if rewritten:
        assert aten.gather.default in ops and (aten.scatter_add.default in ops or aten.scatter.src in ops)
        if how in ("argmax", "last"):  # (an argmax is never negative: no wrap; an input may be)
            assert (aten.where.self in ops) == (how == "last")
    args = [*(p.detach() for p in model.parameters()), x, idx, t, torch.ones(())]
    run = lambda traced: torch.fx.Interpreter(traced.gm).run(*args, enable_io_processing=False)  # noqa: E731
    got, want = run(after), run(traced)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [8, -9])
def test_an_index_past_its_own_dim_in_a_merged_lookup_raises_as_the_lookup_does(bad):
    """`g[arange(B), i, j]` merges the two indexed dims into one: a `j` past its dim of 4 (8 // 2), or before its start
    (-9 // 2), named a neighbour in the merged dim (row i + 1's, or i - 1's) where one device raises; found while
    reading. Now the merged index is put past the merged dim there, and the gather raises."""
    import torch.nn.functional as F

    from spmd.passes.trace_joint import trace_joint

    class TwoDims(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(6, 6)

        def forward(self, x, idx):
            return self.proj(x).view(4, 2, 4, 6)[torch.arange(4), idx % 2, idx // 2]

    model, x = TwoDims(), torch.randn(4, 8, 6)
    traced = trace_joint(model, (x, torch.tensor([3, 7, 0, 5]), torch.randn(4, 6)), F.mse_loss)
    after = gather_rows(traced)
    assert aten.index.Tensor not in {n.target for n in after.graph.nodes}
    args = [*(p.detach() for p in model.parameters()), x, torch.tensor([3, bad, 0, 5]), torch.randn(4, 6),
            torch.ones(())]
    for graph in (traced, after):
        with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
            torch.fx.Interpreter(graph.gm).run(*args, enable_io_processing=False)


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
        inner = [(step.kind, edge.consumer) for edge, step in c.plan.collectives()
                 if not edge.consumer.startswith("output")]
        assert {kind for kind, _ in inner} == {"all_reduce"} and len(inner) <= 2, inner  # (the loss's sum and count)
        assert check_simulated_training(c, simulate(c, (ids, mask, labels, torch.ones(()))), loss, reference) > 10
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_batch_split_reflection_pad_gathers_nothing():
    """`nn.ReflectionPad1d`'s and `ReflectionPad2d`'s backwards read their gradient at positions clamped from aranges
    (several per row, over one or two dims): a gather along the positions, split on the batch; each gathered the
    activation's gradient before (a CNN with reflection padding in every layer, every layer's)."""
    from tests.support import LATENCY_LINK, data_parallel_training

    class Padded(nn.Module):
        def __init__(self, dims):
            super().__init__()
            self.c = nn.Conv1d(4, 8, 3) if dims == 1 else nn.Conv2d(4, 8, 3)
            self.pad = nn.ReflectionPad1d(1) if dims == 1 else nn.ReflectionPad2d(1)

        def forward(self, x):
            return self.c(self.pad(x))

    for dims in (1, 2):
        collectives, checked = data_parallel_training(lambda: Padded(dims), lambda: torch.randn((4, 4) + (6,) * dims),
                                                      lambda: torch.randn((4, 8) + (6,) * dims), LATENCY_LINK)
        inner = [(kind, consumer) for kind, _, consumer in collectives if not consumer.startswith("output")]
        assert not inner, inner
        assert checked == 3
