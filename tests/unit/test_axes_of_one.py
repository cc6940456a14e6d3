"""A mesh axis of one device (dp of one on (1, 2), tp of one on (2, 1)) holds every tensor whole: the plan lays
everything out Replicate there, pins included, so no collective runs over it and none is priced. Found by a probe:
a GPT on (1, 2) launched 5 all_reduces and an all_gather over its one-device dp, and its plan said
"column-parallel on dp"."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from spmd.runtime.simulate import simulate
from tests.models import GPT, GPTConfig
from tests.support import check_simulated_training, compile_graph, lm_loss, spec


@pytest.fixture(autouse=True)
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("shape,pin", [((1, 2), [Shard(0), Shard(0)]), ((2, 1), [Replicate(), Shard(0)])])
def test_an_axis_of_one_device_has_no_collective_and_trains_equal(shape, pin):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=54, seq=7, dim=24, heads=4, layers=1))
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 54, (6, 7))
    c = compile_graph(model, (tokens, tokens), spec(shape, ("dp", "tp")), loss_fn=lm_loss,
                      param_placements={"lm_head.weight": pin, "tok_emb.weight": pin})
    one = shape.index(1)
    assert c.plan.collectives() and all(step.axis != one for _, step in c.plan.collectives())
    assert all(ps is None or ps[one] == Replicate() for s in c.plan.choices.values() for ps in (*s.inputs, *s.outputs))
    head = next(gi.placeholder for gi in c.traced.inputs if gi.name == "lm_head.weight")
    assert c.plan.choices[head].outputs[0] == tuple(Replicate() if n == 1 else p for p, n in zip(pin, shape))
    loss = lm_loss(reference(tokens), tokens)
    loss.backward()
    assert check_simulated_training(c, simulate(c, (tokens, tokens, torch.ones(()))), loss, reference) > 5
