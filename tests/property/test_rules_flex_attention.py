"""FlexAttention's rule (spmd/passes/rules/flex_attention.py) checked like every rule (rule_check.py): each
strategy of the forward and backward higher-order ops, on random inputs split as it claims, on simulated
ranks, against the unsharded op; with a causal block mask, a score_mod that reads the head index (ALiBi),
and grouped or single kv heads.

torch refuses FlexAttention's backward on CPU at its entry point (its compiled CPU kernel has none); the
higher-order ops themselves run their dense reference on any device, so the oracle lifts that check.
Only the flex ops' strategies are checked: make_fx keeps the block mask's in-place index_put_, so the
oracle's record of the tensors it fills is not their value at their own node.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as flex
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from tests.property.rule_check import RUN, Case, _dims, check_case, strategies_of, traced_of

HOP = torch.ops.higher_order


@pytest.fixture(autouse=True)
def _cpu_backward(monkeypatch):
    monkeypatch.setattr(flex, "_validate_device", lambda *args: None)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _alibi(score, b, h, q_idx, kv_idx):
    return score - (h + 1).to(score.dtype) / 8 * (q_idx - kv_idx).abs().to(score.dtype)


def _attend(q, k, v, score: str, mask: bool):
    block_mask = flex.create_block_mask(_causal, None, None, q.shape[2], k.shape[2], device="cpu") if mask else None
    return flex.flex_attention(q, k, v, score_mod=_alibi if score == "alibi" else None, block_mask=block_mask,
                               enable_gqa=k.shape[1] != q.shape[1])


@st.composite
def flex_case(draw, backward: bool):
    b, h, s, d = _dims(draw, 4)
    kv_heads = draw(st.sampled_from((h, 1)))
    score, mask = draw(st.sampled_from((("none", True), ("alibi", True), ("alibi", False))))
    shapes = ((b, h, s, d), (b, kv_heads, s, d), (b, kv_heads, s, d))

    if backward:
        def fn(q, k, v, g):
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            return torch.autograd.grad(_attend(q, k, v, score, mask), (q, k, v), g)
        return Case(("flex_bwd", b, h, kv_heads, s, d, score, mask), shapes + ((b, h, s, d),),
                    frozenset({HOP.flex_attention, HOP.flex_attention_backward}), fn, "make_fx")
    return Case(("flex", b, h, kv_heads, s, d, score, mask), shapes, frozenset({HOP.flex_attention}),
                lambda q, k, v: _attend(q, k, v, score, mask), "export")


@RUN
@given(data=st.data())
def test_flex_attention(data):
    case = data.draw(flex_case(backward=False), label="case")
    check_case(case, data.draw(st.integers(0, 2**32 - 1)), only=case.ops)


@RUN
@given(data=st.data())
def test_flex_attention_backward(data):
    case = data.draw(flex_case(backward=True), label="case")
    check_case(case, data.draw(st.integers(0, 2**32 - 1)), only=case.ops)


def _flex_strategies(case: Case, op) -> list:
    traced = traced_of(case)
    node = next(n for n in traced.graph.nodes if n.target is op)
    return strategies_of(case, (2,)).nodes[node.name].strategies


def test_heads_split_only_where_no_user_function_reads_the_head():
    """A causal mask reads positions only: batch or heads may split. ALiBi reads h: heads stay whole."""
    mask = Case(("flex", 4, 4, 4, 8, 8, "none", True), ((4, 4, 8, 8),) * 3, frozenset(),
                lambda q, k, v: _attend(q, k, v, "none", True), "make_fx")
    alibi = Case(("flex", 4, 4, 4, 8, 8, "alibi", True), ((4, 4, 8, 8),) * 3, frozenset(),
                 lambda q, k, v: _attend(q, k, v, "alibi", True), "make_fx")
    split = {s.outputs[0][0] for s in _flex_strategies(mask, HOP.flex_attention)}
    assert split == {Replicate(), Shard(0), Shard(1)}, split
    split = {s.outputs[0][0] for s in _flex_strategies(alibi, HOP.flex_attention)}
    assert split == {Replicate(), Shard(0)}, split


def test_one_kv_head_is_read_whole_and_its_gradient_comes_out_partial():
    """MQA: one kv head serves every query head, so heads split with k and v replicated; in backward each
    rank's dk, dv sums over its own query heads."""
    def fn(q, k, v, g):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        return torch.autograd.grad(_attend(q, k, v, "none", True), (q, k, v), g)
    case = Case(("flex_bwd", 4, 4, 1, 8, 8, "none", True), ((4, 4, 8, 8), (4, 1, 8, 8), (4, 1, 8, 8), (4, 4, 8, 8)),
                frozenset(), fn, "make_fx")
    heads = [s for s in _flex_strategies(case, HOP.flex_attention_backward) if s.outputs[0][0] == Shard(1)]
    assert heads, "heads should split under a causal mask"
    for s in heads:
        assert s.inputs[1][0] == s.inputs[2][0] == Replicate(), s
        assert s.outputs[1][0] == s.outputs[2][0] == Partial(), s
