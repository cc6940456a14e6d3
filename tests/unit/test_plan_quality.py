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
from tests.support import check_simulated_training, compile_graph, spec


class _RotateHalf(nn.Module):
    """Llama's rotary `rotate_half`: two slices of an activation, swapped, one negated. The backward of a slice
    writes its gradient into `zeros` (`slice_scatter`)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h * torch.cat((-h[..., 4:], h[..., :4]), dim=-1)


def _data_parallel(model, shape: tuple, mesh_shape: tuple, names: tuple):
    """`model()` trained with an MSE loss on inputs of `shape` on a mesh, split on the batch over its first axis,
    weights replicated: (the plan's collectives as (kind, value, consumer), outputs checked equal to one device)."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = model()
        x, t = torch.randn(*shape), torch.randn(*shape)
        reference = copy.deepcopy(model)
        loss = F.mse_loss(reference(x), t)
        loss.backward()
        rest = [Replicate()] * (len(mesh_shape) - 1)
        c = compile_graph(model, (x, t), spec(mesh_shape, names), loss_fn=F.mse_loss,
                          in_placements={"x": [Shard(0), *rest], "target": [Shard(0), *rest]},
                          param_placements={n: [Replicate(), *rest] for n, _ in model.named_parameters()})
        checked = check_simulated_training(c, simulate(c, (x, t, torch.ones(()))), loss, reference)
        return [(step.kind, edge.value[0], edge.consumer) for edge, step in c.plan.collectives()], checked
    finally:
        torch.set_default_dtype(torch.float32)


def test_the_backward_of_a_slice_keeps_the_batch_split():
    """`zeros`/`full` may be built as any piece of themselves: the slice's backward (`slice_scatter` into zeros,
    whose strategies follow its inputs') had only the whole layout, and every Llama-family training plan
    gathered rotary's activations in backward, two all_gathers per layer."""
    collectives, checked = _data_parallel(_RotateHalf, (4, 6, 8), (2,), ("dp",))
    assert checked == 3
    assert collectives and all(consumer.startswith("output_") for _, _, consumer in collectives), collectives
