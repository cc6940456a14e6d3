"""The messages users read when something cannot be done as asked."""
import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import spmd
from examples.models import MLP
from spmd import SpmdError, UnknownOpWarning
from tests.cases import spec


def test_pin_that_cannot_be_met_names_the_pin_and_the_way_out():
    with pytest.raises(SpmdError, match=r"pin \[S\(0\)\] for input 'x' cannot be met.*shape \(3, 16\).*uneven"):
        spmd.plan(MLP(16, 64), spec((2,), ("tp",)), (torch.randn(3, 16),), in_placements={"x": [Shard(0)]})


def test_pin_with_wrong_number_of_placements():
    with pytest.raises(SpmdError, match=r"2 placements but the mesh \(tp=2\) has 1 axes"):
        spmd.plan(MLP(16, 64), spec((2,), ("tp",)), (torch.randn(4, 16),),
                  param_placements={"fc1.weight": [Shard(0), Replicate()]})


def test_pin_of_unknown_name_lists_known_names():
    with pytest.raises(SpmdError, match=r"names 'fc3.weight', which is not an input or parameter.*Did you mean.*fc1.weight"):
        spmd.plan(MLP(16, 64), spec((2,), ("tp",)), (torch.randn(4, 16),),
                  param_placements={"fc3.weight": [Shard(0)]})


class _UsesSearchsorted(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("edges", torch.linspace(-2, 2, 8))
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        buckets = torch.searchsorted(self.edges, x)
        return self.fc(x) + buckets


def test_unknown_op_falls_back_to_replicate_with_a_warning_naming_op_and_line():
    with pytest.warns(UnknownOpWarning, match=r"aten.searchsorted.Tensor.*test_errors.py:\d+.*searchsorted.*"
                                              r"runs replicated on every rank.*@rule\(aten.searchsorted.Tensor\)"):
        plan = spmd.plan(_UsesSearchsorted(), spec((2,), ("tp",)), (torch.randn(4, 16),))
    name = next(n for n in plan.choices if n.startswith("searchsorted"))
    assert plan.choices[name].outputs[0] == (Replicate(),)


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
