"""The messages users read when something cannot be done as asked."""
import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import spmd
from tests.models import MLP
from spmd import SpmdError, UnknownOpWarning
from tests.support import spec


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
