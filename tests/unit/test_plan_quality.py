"""Plans that need no collective beyond what a hand-written plan runs (found by a plan-quality probe): a data
parallel layout (inputs split on the batch, weights replicated) reduces the gradients and nothing else. Each
is also trained, simulated on every rank, equal to one device."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from spmd.runtime.simulate import simulate
from tests.support import check_simulated_training, compile_graph, data_parallel_training, spec


class _ShiftRight(nn.Module):
    """T5's `_shift_right`: the ids moved one step right into new zeros, by slice assignment (`aten.copy` into a
    slice, then `slice_scatter`), then embedded."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        shifted[..., 1:] = ids[..., :-1].clone()
        return self.embed(shifted)


class _RotateHalf(nn.Module):
    """Llama's rotary `rotate_half`: two slices of an activation, swapped, one negated. The backward of a slice
    writes its gradient into `zeros` (`slice_scatter`)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h * torch.cat((-h[..., 4:], h[..., :4]), dim=-1)


def test_the_backward_of_a_slice_keeps_the_batch_split():
    """`zeros`/`full` may be built as any piece of themselves: the slice's backward (`slice_scatter` into zeros,
    whose strategies follow its inputs') had only the whole layout, and every Llama-family training plan
    gathered rotary's activations in backward, two all_gathers per layer."""
    collectives, checked = data_parallel_training(_RotateHalf, lambda: torch.randn(4, 6, 8), lambda: torch.randn(4, 6, 8))
    assert checked == 3
    assert collectives and all(consumer.startswith("output_") for _, _, consumer in collectives), collectives


def test_a_slice_assignment_keeps_the_batch_split():
    """`aten.copy` (the functional form of `shifted[..., 1:] = ids[..., :-1]`) splits as a pointwise op: it had no
    rule, so T5's batch-split plan gathered the labels in its forward."""
    collectives, checked = data_parallel_training(_ShiftRight, lambda: torch.randint(0, 16, (4, 6)),
                                          lambda: torch.randn(4, 6, 8))
    assert checked == 2
    assert collectives and all(consumer.startswith("output_") for _, _, consumer in collectives), collectives


def test_a_whole_sum_of_a_split_value_sums_each_piece():
    """`x.sum()` (torch.export's `sum.dim_IntList(x, [])`, every dim) of a value split on the batch, a float loss
    sum or an integer count of the targets a loss does not ignore: each rank sums its piece and one scalar is
    all-reduced. DTensor's rule read the empty list as no dim and kept the value whole (an all_gather), and an
    integer sum could not be Partial at all."""
    import spmd

    class Counted(nn.Module):
        def forward(self, x, targets):
            kept = targets != -100
            return (x * 2.0).sum() / kept.sum()

    torch.manual_seed(0)
    x, targets = torch.randn(8, 16), torch.randint(-1, 3, (8, 16)).masked_fill_(torch.rand(8, 16) < 0.3, -100)
    targets[:3] = -100  # (the ranks count apart: most of the first half is ignored)
    c = compile_graph(Counted(), (x, targets), spmd.MeshSpec((2,), ("dp",)),
                      in_placements={"x": [Shard(0)], "targets": [Shard(0)]})
    kinds = [step.kind for _, step in c.plan.collectives()]
    assert kinds and set(kinds) == {"all_reduce"}, kinds
    for (out,) in simulate(c, (x, targets)):  # every rank's value, equal to one device's
        torch.testing.assert_close(out, Counted()(x, targets))


class _MixFFN(nn.Module):
    """Segformer's Mix-FFN (ConvNeXt's and MobileNet's blocks alike): a depthwise conv between an MLP's Linears."""

    def __init__(self, d=16, h=32, multiplier=1):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.dw = nn.Conv2d(h, h * multiplier, 3, padding=1, groups=h)
        self.fc2 = nn.Linear(h * multiplier, d)

    def forward(self, x):  # x: (B, 8 * 8, d)
        y = self.fc1(x)
        b, n, c = y.shape
        y = self.dw(y.transpose(1, 2).reshape(b, c, 8, 8)).flatten(2).transpose(1, 2)
        return self.fc2(F.gelu(y))


class _ConvPair(nn.Module):
    """Two dense convs, the first split on its output channels and the second on its input channels, as Megatron
    splits an MLP's Linears."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv1d(8, 16, 3, padding=1), nn.Conv1d(16, 8, 3, padding=1)

    def forward(self, x):
        return self.c2(F.gelu(self.c1(x)))


def _tensor_parallel(model, x, t, mesh, pins) -> tuple[list, int]:
    """`model` trained with an MSE loss on `mesh`, the input whole, `pins` on the weights: (the plan's collectives
    as (kind, value, consumer, forward?), outputs checked equal to one device). In float64."""
    reference = copy.deepcopy(model)
    loss = F.mse_loss(reference(x), t)
    loss.backward()
    c = compile_graph(model, (x, t), mesh, loss_fn=F.mse_loss, param_placements=pins,
                      in_placements={"x": [Replicate()] * len(mesh.shape), "target": [Replicate()] * len(mesh.shape)})
    checked = check_simulated_training(c, simulate(c, (x, t, torch.ones(()))), loss, reference)
    forward = {n.name for n in c.traced.graph.nodes if c.traced.regions().get(n.name) == "is_forward"}
    return [(step.kind, edge.value[0], edge.consumer, edge.consumer in forward)
            for edge, step in c.plan.collectives()], checked


def test_a_depthwise_conv_keeps_megatrons_channel_split():
    """A depthwise conv between a column- and a row-parallel Linear runs on its channels' piece, with its own number
    of groups: one all_reduce after fc2 in forward, as Megatron's MLP. DTensor's only conv layout is the batch
    split, so the activation went from channels to the batch into the conv and the pinned weights were gathered
    (a Segformer probe: 9 forward all_gathers). Also with two output channels per group, and on (2, 2) with both
    axes splitting the channels (a piece of a quarter of the groups)."""
    from tests.support import LATENCY_LINK

    torch.set_default_dtype(torch.float64)
    try:
        for mesh, multiplier in ((spec((2,), ("tp",), LATENCY_LINK), 1), (spec((2,), ("tp",), LATENCY_LINK), 2),
                                 (spec((2, 2), ("a", "b"), LATENCY_LINK), 1)):
            torch.manual_seed(0)
            model = _MixFFN(multiplier=multiplier)
            x, t = torch.randn(4, 64, 16), torch.randn(4, 64, 16)
            both = [Shard(0)] * len(mesh.shape)
            pins = {"fc1.weight": both, "fc1.bias": both, "fc2.weight": [Shard(1)] * len(mesh.shape), "dw.weight": both}
            collectives, checked = _tensor_parallel(model, x, t, mesh, pins)
            assert checked == 7
            forward = [(kind, value) for kind, value, _, fwd in collectives if fwd]
            assert [kind for kind, _ in forward] == ["all_reduce"] * len(mesh.shape), collectives
            assert not [c for c in collectives if c[0] != "all_reduce"], collectives
    finally:
        torch.set_default_dtype(torch.float32)


def test_dense_convs_split_as_megatrons_linears():
    """A conv split on its output channels (column-parallel), then one split on its input channels (row-parallel,
    its bias added on one rank): one all_reduce in forward, none of the weights gathered."""
    from tests.support import LATENCY_LINK

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        x, t = torch.randn(4, 8, 12), torch.randn(4, 8, 12)
        pins = {"c1.weight": [Shard(0)], "c1.bias": [Shard(0)], "c2.weight": [Shard(1)]}
        collectives, checked = _tensor_parallel(_ConvPair(), x, t, spec((2,), ("tp",), LATENCY_LINK), pins)
        assert checked == 5
        assert [kind for kind, _, _, fwd in collectives if fwd] == ["all_reduce"], collectives
        assert not [c for c in collectives if c[0] == "all_gather"], collectives
    finally:
        torch.set_default_dtype(torch.float32)


class _ConstantScale(nn.Module):
    """A constant made in forward with `torch.tensor(...)`: `aten.lift_fresh_copy` of it in a training trace
    (transformers' key/value cache makes `torch.tensor([])`)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * torch.tensor([[0.5 * k for k in range(8)]] * 4)


def test_a_constant_made_in_forward_keeps_the_batch_split():
    """`lift_fresh_copy` had no rule (an UnknownOpWarning on every transformers causal LM trained with its cache on);
    it copies its piece."""
    import warnings

    import spmd

    with warnings.catch_warnings():
        warnings.simplefilter("error", category=spmd.UnknownOpWarning)
        collectives, checked = data_parallel_training(_ConstantScale, lambda: torch.randn(4, 8), lambda: torch.randn(4, 8))
    assert checked == 3
    assert collectives and all(consumer.startswith("output_") for _, _, consumer in collectives), collectives


class _ChannelsLastFill(nn.Module):
    """`torch.empty_like` of a channels_last activation, filled: `aten.empty_permuted` (MobileNetV2 in transformers)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x):
        y = self.c(x.contiguous(memory_format=torch.channels_last))
        return y * torch.empty_like(y).fill_(2.0)


def test_an_empty_permuted_is_built_as_its_piece():
    """`empty_permuted` had no rule (an UnknownOpWarning, built whole on every rank); it is a constant factory, each
    piece built at its own size (a probe's MobileNetV2)."""
    import warnings

    import spmd
    from spmd.passes.rules.registry import RULES

    assert torch.ops.aten.empty_permuted.default in RULES
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=spmd.UnknownOpWarning)
        collectives, checked = data_parallel_training(_ChannelsLastFill, lambda: torch.randn(4, 4, 6, 6),
                                              lambda: torch.randn(4, 8, 6, 6))
    assert checked == 3
    assert collectives and all(consumer.startswith("output_") for _, _, consumer in collectives), collectives
