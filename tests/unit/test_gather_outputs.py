"""Which output a tensor given to `gather_outputs` is, in one process (a mesh of one device): the layouts are
trivial there, so these tests are about the finding, not the gathering (tests/e2e/test_silently_wrong.py
gathers on two ranks)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from torch.utils._pytree import tree_map

import spmd
from tests.support import one_device


def _lm():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32))  # (bare logits: the output is one tensor)


@pytest.mark.parametrize("derived", ["softmax", "argmax", "last position"])
def test_a_tensor_computed_from_a_lone_output_is_refused(derived):
    """Found by a probe: where the model returns one tensor, any lone tensor has the output's structure, so
    `gather_outputs(out.softmax(-1))` of vocabulary-sharded logits was gathered as the logits (0.05 off, in the
    right shape), `out.argmax(-1, keepdim=True)` came back twice as wide, and `out[:, -1]` failed in torch."""
    ids = torch.randint(0, 32, (2, 5))
    c = one_device(_lm(), (ids,), training=False)
    out = c(ids)
    made = {"softmax": lambda: out.softmax(-1), "argmax": lambda: out.argmax(-1, keepdim=True),
            "last position": lambda: out[:, -1]}[derived]()
    with pytest.raises(spmd.SpmdError, match="is not one of the last call's outputs"):
        c.gather_outputs(made)


def test_outputs_of_earlier_calls_are_still_gathered():
    """An evaluation loop that keeps every call's output and gathers them afterwards."""
    ids = torch.randint(0, 32, (2, 5))
    c = one_device(_lm(), (ids,), training=False)
    outs = [c(ids), c(ids.flip(0))]
    for out in outs:
        assert torch.equal(c.gather_outputs(out), out)
    assert torch.equal(c.gather_outputs(outs[1].detach()), outs[1])


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.e, self.l = nn.Embedding(32, 8), nn.Linear(8, 32)

    def forward(self, ids):  # (one tensor at two places: HF's last hidden state and hidden_states[-1])
        h = self.l(self.e(ids))
        return {"last": h, "all": (self.e(ids), h)}


@pytest.mark.parametrize("kept", ["as it came", "detached"])
def test_earlier_whole_outputs_are_gathered_with_a_tensor_at_two_places(kept):
    """Found by a review of the first version: an output at two places was found at one only, and an earlier
    call's output detached as a whole (`tree_map(lambda t: t.detach(), out)`) not at all."""
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 5))
    c = one_device(_Twice(), (ids,), training=False)
    keep = (lambda o: o) if kept == "as it came" else (lambda o: tree_map(lambda t: t.detach(), o))
    outs = [keep(c(ids)), keep(c(ids.flip(0)))]
    for out in outs:
        got = c.gather_outputs(out)
        assert torch.equal(got["last"], out["last"]) and torch.equal(got["all"][1], out["last"])
    with pytest.raises(spmd.SpmdError, match="is not one of the last call's outputs"):
        c.gather_outputs(tree_map(lambda t: t * 2, outs[0]))
