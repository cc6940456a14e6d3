"""rules/local_sizes.py: ops whose arguments name sizes of the whole tensors run on each rank's piece with its
own sizes (found by a probe, session 59: a squeeze that dropped a dim split to one row per rank, silently; the
global batch of every data-parallel GroupNorm; new_empty_strided's global shape). Simulated on all ranks."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from spmd.runtime.distribute import local_shard
from spmd.runtime.simulate import simulate
from tests.support import check_simulated_training, compile_graph, spec


@pytest.fixture(autouse=True)
def _float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def _forward_equal(model, x, mesh, **options):
    c = compile_graph(model, (x,), mesh, **options)
    want = model(x).detach()
    ps = c.plan.choices["output_0"].inputs[0]
    for rank, out in enumerate(simulate(c, (x,))):
        torch.testing.assert_close(out[0], local_shard(want, ps, mesh.shape, mesh.coordinate(rank)))
    return c


class _Centered(nn.Module):
    """`squeeze` that does nothing to a batch of 2, then a mean over the batch."""

    def __init__(self, how):
        super().__init__()
        self.fc, self.how = nn.Linear(6, 6), how

    def forward(self, x):
        h = self.fc(x)
        h = h.squeeze(0) if self.how == "dim" else h.squeeze((0, -1)) if self.how == "dims" else h.squeeze()
        return x * (h - h.mean(0))


@pytest.mark.parametrize("how", ["dim", "dims", "all"])
def test_squeeze_keeps_a_dim_that_is_one_only_in_each_piece(how):
    """The batch of 2 split over dp=2 is one row per rank: squeezing it there made a (6,) piece, and the mean
    over the batch became a mean over the features (0.68 off one device, silently)."""
    torch.manual_seed(0)
    model, x = _Centered(how), torch.randn(2, 6)
    mesh = spec((2,), ("dp",))
    c = _forward_equal(model, x, mesh, in_placements={"x": [Shard(0)]},
                       param_placements={n: [Replicate()] for n, _ in model.named_parameters()})
    assert c.plan.choices["output_0"].inputs[0] == (Shard(0),)  # (the case: split down to one row per rank)


class _ConvGroupNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.Linear(8, 5)

    def forward(self, x):
        return self.head(F.relu(self.norm(self.conv(x))).mean((2, 3)))


def test_group_norm_with_the_batch_split_trains_equal_to_one_device():
    """Every data-parallel GroupNorm model failed: the rank graph passed the global batch size to
    native_group_norm (and its backward) with the local batch. Batch split over dp, (2, 2)."""
    torch.manual_seed(0)
    model = _ConvGroupNorm()
    x, y = torch.randn(8, 3, 6, 6), torch.randn(8, 5)
    c = compile_graph(model, (x, y), spec((2, 2), ("dp", "tp")), loss_fn=F.mse_loss,
                      in_placements={"x": [Shard(0), Replicate()]})
    loss = F.mse_loss(model(x), y)
    loss.backward()
    assert check_simulated_training(c, simulate(c, (x, y, torch.ones(()))), loss, model) >= 6
    norms = [n for n in c.plan.choices if "native_group_norm" in n]
    assert norms and any(isinstance(p, Shard) for n in norms for p in c.plan.choices[n].inputs[0]), norms


class _NewEmptyStrided(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        y = self.fc(x)
        return y.new_empty_strided((4, 6), (6, 1)).fill_(1.0) * y


def test_new_empty_strided_makes_this_ranks_piece():
    torch.manual_seed(0)
    _forward_equal(_NewEmptyStrided(), torch.randn(4, 6), spec((2,), ("dp",)), in_placements={"x": [Shard(0)]})
