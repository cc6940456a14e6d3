"""as_strided_views: an `as_strided` that reads a tensor of its own in order, and an `as_strided_scatter` that
writes all of one, become views (the values checked by running the joint graph before and after the pass), and a
batch-split model with Swin's pooler (`AdaptiveAvgPool1d` over a transposed tensor) trains simulated equal to one
device with no collective but its gradients', where the as_strided ops ran replicated on gathered values."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from spmd.passes.as_strided_views import as_strided_views

aten = torch.ops.aten
STORAGE_OPS = (aten.as_strided.default, aten.as_strided_scatter.default)


class _Pooled(nn.Module):
    """Swin's head: tokens [B, L, C] pooled over L through a transposed view, then a classifier; or an
    `as_strided` that is no view (`how`): overlapping windows, or a tensor read through a transposed view."""

    def __init__(self, how: str = "pooler"):
        super().__init__()
        self.how, self.fc, self.head = how, nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc(x)  # [B, L, C]
        if self.how == "pooler":
            p = F.adaptive_avg_pool1d(h.transpose(1, 2), 1).flatten(1)
        elif self.how == "windows":  # each row's overlapping windows of 3: reads elements twice
            w = h.sum(-1).contiguous()
            p = w.as_strided((w.shape[0], w.shape[1] - 2, 3), (w.shape[1], 1, 1)).sum(-1) @ torch.ones(4, 8)
        else:  # "offset": all but the first row, read from an offset into the storage
            flat = (h * 2).reshape(-1)
            rest = flat.as_strided((h.shape[0] - 1, h.shape[1], h.shape[2]), (h.shape[1] * h.shape[2], h.shape[2], 1),
                                   h.shape[1] * h.shape[2])
            p = torch.cat([rest, h[:1]]).mean(1)
        return self.head(p)


@pytest.mark.parametrize("how, rewritten", [("pooler", True), ("windows", False), ("offset", False)])
def test_an_as_strided_in_order_is_a_view_with_the_same_values(how, rewritten):
    """The pooler's forward `as_strided` and backward `as_strided` / `as_strided_scatter` over a whole buffer are
    views; overlapping windows, or a read from an offset, stay as they are. Values and gradients exactly the same."""
    from spmd.passes.trace_joint import trace_joint

    torch.manual_seed(0)
    model = _Pooled(how)
    x = torch.randn(4, 6, 8)
    t = torch.randn(model(x).shape)
    traced = trace_joint(model, (x, t), F.mse_loss)
    assert any(n.target in STORAGE_OPS for n in traced.graph.nodes)
    after = as_strided_views(traced)
    assert (not any(n.target in STORAGE_OPS for n in after.graph.nodes)) == rewritten, after.graph
    args = [*(p.detach() for p in model.parameters()), x, t, torch.ones(())]
    run = lambda traced: torch.fx.Interpreter(traced.gm).run(*args, enable_io_processing=False)  # noqa: E731
    got, want = run(after), run(traced)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_batch_split_pooler_over_a_transposed_tensor_gathers_nothing():
    """Inputs split on the batch and weights replicated: only the gradients are reduced, no op runs replicated
    (no UnknownOpWarning), and training equals one device. Before, the pooled features were gathered at the
    `as_strided` (forward) and its gradient at the `as_strided_scatter` (backward)."""
    import spmd
    from tests.support import LATENCY_LINK, data_parallel_training

    with warnings.catch_warnings():
        warnings.simplefilter("error", spmd.UnknownOpWarning)
        collectives, checked = data_parallel_training(_Pooled, lambda: torch.randn(4, 6, 8), lambda: torch.randn(4, 3),
                                                      LATENCY_LINK)
    inner = [(kind, consumer) for kind, _, consumer in collectives if not consumer.startswith("output")]
    assert not inner, inner
    assert checked == 5


class _WrittenFromAView(nn.Module):
    """A whole buffer written from a slice (`h[1:]`, a view at an offset), then read by overlapping windows."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        buf = torch.as_strided_scatter(torch.zeros(4, 8), h[1:], (4, 8), (8, 1))
        return buf.as_strided((4, 6, 3), (8, 1, 1)).sum(-1)


def test_a_buffer_written_from_a_view_is_a_copy_of_it():
    """Found by a review: the scatter's source, a view at an offset, became the buffer itself, and the windows' own
    `as_strided` over it was refused as reading through a view; it trains as one device does."""
    from tests.support import one_device

    torch.manual_seed(0)
    model = _WrittenFromAView()
    x, t = torch.randn(5, 8), torch.randn(4, 6)
    reference = copy.deepcopy(model)
    F.mse_loss(reference(x), t).backward()
    compiled = one_device(model, (x, t), training=True, loss_fn=F.mse_loss)
    loss = compiled(x, t)
    loss.backward()
    torch.testing.assert_close(loss, F.mse_loss(reference(x), t), rtol=0, atol=0)
    torch.testing.assert_close(compiled.get_parameter("fc.weight").grad, reference.fc.weight.grad, rtol=0, atol=0)
