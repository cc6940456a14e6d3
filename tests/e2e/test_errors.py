"""The messages users read when something goes wrong on live ranks."""
import torch
from torch.distributed.tensor import Shard

import spmd
from spmd import SpmdError
from tests.models import MLP


def _world_mismatch(rank, world):
    try:
        spmd.init_mesh((2, 2), ("dp", "tp"))
    except SpmdError as e:
        return str(e)
    return None


def test_mesh_size_must_match_world_size(ranks):
    messages = ranks(2).run(_world_mismatch)
    assert all(m and "needs 4 processes but the world has 2" in m and "--nproc-per-node 4" in m for m in messages)


def _wrong_local_shape(rank, world):
    torch.manual_seed(0)
    model, x = MLP(16, 64), torch.randn(8, 16)
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(model, mesh, (x,), in_placements={"x": [Shard(0)]})
    try:
        compiled(x)  # the full input, not this rank's shard
    except SpmdError as e:
        return str(e)
    return None


def test_wrong_local_input_shape_at_run_time(ranks):
    messages = ranks(2).run(_wrong_local_shape)
    for m in messages:
        assert m is not None
        assert "input 'x': expected local shape [4, 16] (global [8, 16] laid out as [S(0)]" in m
        assert "got [8, 16]" in m and "compiled.shard_inputs" in m


def _optimizer_over_original(rank, world):
    torch.manual_seed(0)
    model, x = MLP(16, 64), torch.randn(8, 16)
    mesh = spmd.init_mesh((2,), ("dp",))
    compiled = spmd.compile(model, mesh, (x, x), loss_fn=torch.nn.functional.mse_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the trap: not compiled.parameters()
    compiled(*compiled.shard_inputs(x, x)).backward()
    try:
        opt.step()
    except SpmdError as e:
        ok = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
        ok.step()  # the right optimizer steps
        return str(e)
    return None


def test_optimizer_over_the_original_parameters_fails_at_its_first_step(ranks):
    for m in ranks(2).run(_optimizer_over_original):
        assert m is not None
        assert "AdamW steps 4 parameter(s) of the original MLP (fc1.weight, fc1.bias, fc2.weight, fc2.bias)" in m
        assert "AdamW(compiled.parameters(), ...)" in m
