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
        elif self.how == "diagonal":  # both along one dim (one position per row: gather_rows's)
            picked = x[batch, batch]
        else:  # "reversed"
            picked = mask[batch[:, None], kv.flip(0)[None, :]]
        return picked.float().sum(-1, keepdim=True) * x.sum()


def _indexes(traced) -> int:
    return sum(n.target is aten.index.Tensor for n in traced.graph.nodes)


@pytest.mark.parametrize("how, rewritten", [("mask", True), ("leading", True), ("shifted", False),
                                             ("transposed", False), ("diagonal", False), ("reversed", False)])
def test_only_a_lookup_by_whole_aranges_in_order_becomes_views_and_the_values_stay(how, rewritten):
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    x = torch.randn(4, 4, 5) if how == "diagonal" else torch.randn(4, 5)
    model = _Lookup(how)
    traced = trace_module(model, (mask, x))
    after = index_by_arange(traced)
    assert (_indexes(after) == 0) == rewritten and _indexes(traced) == 1  # (the traced graph itself untouched)
    if rewritten:
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

