"""Mixed precision with torch.autocast on gloo ranks: a GPT compiled under autocast trains as the eager
model does under the same autocast (its matmuls in bf16, its loss in fp32), with its weights split."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import spmd
from examples.models import GPT, GPTConfig
from tests.support import spec

STEPS = 2


def _lm_loss(out, targets):
    return F.cross_entropy(out.flatten(0, 1).float(), targets.flatten())


def _train_under_autocast(rank: int, world: int) -> dict:
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=1))
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 128, (4, 32), generator=g), torch.randint(0, 128, (4, 32), generator=g)
    mesh = spmd.init_mesh((2,), ("tp",))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with autocast:  # pinned column- then row-parallel: the MLP's partial sums are reduced (in bf16)
        compiled = spmd.compile(model, mesh, (tokens, targets), loss_fn=_lm_loss, mesh_spec=spec((2,), ("tp",)),
                                param_placements={"blocks.0.mlp.fc1.weight": [Shard(0)],
                                                  "blocks.0.mlp.fc2.weight": [Shard(1)]})
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    out = {"losses": [], "ref_losses": [], "collectives": dict(compiled.plan.collective_summary())}
    local = compiled.shard_inputs(tokens, targets)
    for _ in range(STEPS):
        with autocast:
            loss = compiled(*local)
            ref_loss = _lm_loss(reference(tokens), targets)
        loss.backward()
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        out["losses"].append((loss.item(), str(loss.dtype)))
        out["ref_losses"].append(ref_loss.item())
    full = compiled.full_state_dict()
    out["weights"] = max(float((full[k] - v).abs().max() / v.abs().max().clamp_min(1e-6))
                         for k, v in reference.state_dict().items())
    try:  # evaluating in fp32 would run the graph's bf16 casts: refused
        with torch.no_grad():
            compiled(*local)
        out["fp32_call"] = None
    except spmd.SpmdError as e:
        out["fp32_call"] = str(e)
    return out


def test_training_under_autocast_equals_eager_autocast(ranks):
    """The losses of two SGD steps and the weights after them equal eager autocast's within bf16's rounding of
    the partial sums (their all_reduce runs in bf16, as DTensor's would); a call outside autocast is refused."""
    for r in ranks(2).run(_train_under_autocast):
        assert any("all_reduce" in k for k in r["collectives"]), r["collectives"]
        for (loss, dtype), want in zip(r["losses"], r["ref_losses"]):
            assert dtype == "torch.float32"  # (the loss computed in fp32, as autocast does for cross_entropy)
            assert abs(loss - want) <= 4 * 2**-7 * abs(want), (loss, want)
        # (a wrong reduction or a missed cast is off by O(1) of the weights' scale; bf16's eps is 2**-7)
        assert r["weights"] <= 4 * 2**-7, r["weights"]
        assert r["fp32_call"] and "compiled under torch.autocast('cpu', dtype=torch.bfloat16)" in r["fp32_call"]
