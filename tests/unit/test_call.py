"""compiler/call.py and the names of inputs: keyword inputs become named positional ones, targets take the
loss function's own parameter names (`target0` only for a loss without names), pins use those names."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd
from spmd.compiler.call import Call, positional_call
from tests.models import MLP
from tests.support import spec

TP = spec((2,), ("tp",))


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, mask=None, *, scale: float = 1.0):
        y = self.fc(x) * scale
        return {"y": y if mask is None else y * mask, "sum": y.sum()}


def test_keyword_inputs_become_named_positional_ones_of_a_view_sharing_the_model():
    model = Masked()
    x, mask = torch.randn(4, 16), torch.ones(4, 16)
    view, flat, call = positional_call(model, (x,), {"mask": mask})
    assert call == Call(("x",), ("mask",)) and flat == (x, mask)
    assert type(view).__name__ == "Masked" and isinstance(view, Masked)
    assert dict(view.named_parameters()) == dict(model.named_parameters())  # the same tensors, same names
    assert torch.equal(view(x, mask)["y"], model(x, mask=mask)["y"])
    assert positional_call(model, (x,), None)[0] is model  # nothing to adapt


def test_calls_that_do_not_match_the_compiled_names_say_so():
    call = Call(("input_ids",), ("attention_mask", "labels"))
    ids = torch.zeros(2, 4, dtype=torch.long)
    assert call.flatten((ids,), {"labels": ids, "attention_mask": ids}) == (ids, ids, ids)  # by name, any order
    with pytest.raises(spmd.SpmdError, match=r"missing \['labels'\].*same names"):
        call.flatten((ids,), {"attention_mask": ids})
    with pytest.raises(spmd.SpmdError, match=r"unknown keywords \['label'\]"):
        call.flatten((ids,), {"attention_mask": ids, "labels": ids, "label": ids})
    with pytest.raises(spmd.SpmdError, match="also given positionally"):
        positional_call(Masked(), (ids,), {"x": ids})


def test_keyword_inputs_are_planned_and_pinned_by_name():
    x, mask = torch.randn(4, 16), torch.ones(4, 16)
    plan = spmd.plan(Masked(), TP, (x,), example_kwargs={"mask": mask}, in_placements={"mask": [Shard(0)]})
    text = plan.table()
    assert "mask" in text and "[S(0)]" in text
    with pytest.raises(spmd.SpmdError, match="Did you mean 'mask'"):
        spmd.plan(Masked(), TP, (x,), example_kwargs={"mask": mask}, in_placements={"msk": [Shard(0)]})


def _cls_loss(logits, labels):
    return F.cross_entropy(logits, labels)


class _Unnamed:
    def __call__(self, *args):
        return F.mse_loss(*args)


@pytest.mark.parametrize("loss_fn,name", [(_cls_loss, "labels"), (F.mse_loss, "target"), (_Unnamed(), "target0")])
def test_targets_take_the_loss_functions_parameter_names(loss_fn, name):
    x = torch.randn(4, 16)
    y = torch.randint(0, 16, (4,)) if loss_fn is _cls_loss else torch.randn(4, 16)
    plan = spmd.plan(MLP(16, 64), TP, (x, y), loss_fn=loss_fn, in_placements={name: [Replicate()]})
    assert f"    {name} " in plan.table()
