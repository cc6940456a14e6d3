"""Symbolic costs: the formula prices the plan exactly at the batch it was solved for, and the plan it
describes at other batches; crossover finds where the best plan changes."""
import re

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd
from tests.models import GPT, MLP, GPTConfig
from tests.support import COMPUTE_BOUND_DEVICE, LATENCY_LINK, SLOW_DEVICE

MESH_1D = spmd.MeshSpec((2,), ("dp",), (LATENCY_LINK,), SLOW_DEVICE)
MESH_2D = spmd.MeshSpec((2, 2), ("dp", "tp"), (LATENCY_LINK, LATENCY_LINK), SLOW_DEVICE)
FAST_MEMORY_1D = spmd.MeshSpec((2,), ("dp",), (LATENCY_LINK,), COMPUTE_BOUND_DEVICE)


def _mlp_training(batch=8):
    torch.manual_seed(0)
    return MLP(64, 256), (torch.randn(batch, 64), torch.randn(batch, 64))


def test_formula_equals_the_objective_at_the_solved_batch():
    model, inputs = _mlp_training()
    plan = spmd.plan(model, MESH_1D, inputs, loss_fn=F.mse_loss)
    formula = plan.cost_formula
    assert formula.free_symbols == {sympy.Symbol("batch")}
    assert float(formula.subs("batch", 8)) == pytest.approx(plan.objective, rel=1e-9)

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(layers=1))
    tokens = torch.randint(0, 128, (4, 32))
    plan = spmd.plan(gpt, MESH_2D, (tokens,))
    assert float(plan.cost_formula.subs("batch", 4)) == pytest.approx(plan.objective, rel=1e-9)

    # a cross-entropy loss: its log_softmax chain runs as one kernel, priced as its share (a docs check found the
    # formula 64 us above the objective, as if each piece ran apart)
    model = torch.nn.Linear(256, 512)
    plan = spmd.plan(model, spmd.MeshSpec((2,), ("dp",)), (torch.randn(8, 256), torch.randint(0, 512, (8,))),
                     loss_fn=F.cross_entropy)
    assert float(plan.cost_formula.subs("batch", 8)) == pytest.approx(plan.objective, rel=1e-9)


def test_formula_prices_the_same_plan_at_another_batch():
    """Pin the plan's inputs and parameters at batch 32: the solver's price is the formula's."""
    model, inputs = _mlp_training()
    plan = spmd.plan(model, MESH_1D, inputs, loss_fn=F.mse_loss)
    placements = {plan.labels[n]: list(s.outputs[0]) for n, s in plan.choices.items() if n in plan.labels}
    params = {k: v for k, v in placements.items() if "." in k}
    ins = {k: placements[k] for k in ("x", "target")}
    big = spmd.plan(model, MESH_1D, (torch.randn(32, 64), torch.randn(32, 64)), loss_fn=F.mse_loss,
                    in_placements=ins, param_placements=params)
    assert float(plan.cost_formula.subs("batch", 32)) == pytest.approx(big.objective, rel=1e-6)


def test_crossover_from_no_sharding_to_data_parallel():
    """On a latency-bound link a tiny batch is cheapest unsharded (no collective at all); past a few
    samples, splitting the batch pays for the gradient all_reduce. ReLU, not the example MLP's GELU: on
    this slow test device GELU's FLOPs make a third plan (forward replicated, backward split) win in
    between, at batch ~1.8-2.8. Memory traffic is free here (the test is latency against FLOPs): at
    SLOW_DEVICE's 1 GB/s, packing the gradient bucket and slicing the batch let tensor parallelism win
    between batch 2.4 and 4.9."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    plan = spmd.plan(model, FAST_MEMORY_1D, (torch.randn(8, 64), torch.randn(8, 64)), loss_fn=F.mse_loss)
    found = plan.crossover()
    assert len(found) == 1, [str(c) for c in found]
    c = found[0]
    assert 1 < c.at < 8
    assert not c.below.collective_summary() and c.above.collective_summary()[("all_reduce", "dp")] > 0
    assert ("input", "[R]", "[S(0)]") in c.changed
    f1, f2 = c.below_formula, c.above_formula
    assert float(f1.subs("batch", c.at)) == pytest.approx(float(f2.subs("batch", c.at)), rel=1e-6)
    assert "at batch ~" in str(c)
    assert re.fullmatch(r"\[Crossover\(batch ~ [\d.]+: \d+ placement\(s\) change; str\(\) lists them, \.below and "
                        r"\.above are the plans\)\]", repr(found))  # (not both whole plans: ~70 kB)


def test_plans_not_made_by_spmd_plan_say_how_to_get_a_formula():
    from spmd.core.plan import Plan
    from spmd.report.result import as_report

    bare = as_report(Plan(MESH_1D, {}, {}, (), 0.0, 0.0, 0.0, 0.0))  # e.g. a compiled model's plan
    with pytest.raises(spmd.SpmdError, match="spmd.plan"):
        bare.cost_formula


def test_formula_equals_the_objective_when_a_gradient_fills_more_than_one_bucket():
    """A gradient larger than a bucket fills one of its own: its share of the axis's launches is 1, not
    bytes / bucket (comm.bucket_share). The formula once charged 2 latencies for this 8 MiB gradient where
    the solver charged 1: 1 ms off on this link. (At SLOW_DEVICE's 1 GB/s, packing 8 MiB into a bucket
    costs more than reduce_scatter + all_gather.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 8))
    x, y = torch.randn(8, 1024), torch.randn(8, 8)
    plan = spmd.plan(model, FAST_MEMORY_1D, (x, y), loss_fn=F.mse_loss, in_placements={"input": [Shard(0)], "target": [Shard(0)]},
                     param_placements={"0.weight": [Replicate()]})
    grads = [e for e in plan.edges if any(s.kind == "all_reduce" and s.in_bytes > plan.stats["bucket_bytes"]
                                          for s in e.steps)]
    assert grads, "the 8 MiB weight gradient is all_reduced in one piece larger than a bucket"
    assert float(plan.cost_formula.subs("batch", 8)) == pytest.approx(plan.objective, rel=1e-9)


def test_crossover_without_a_crossing_names_the_sizes_not_a_midpoint(monkeypatch):
    """Found by a probe: where the two plans' formulas do not cross between the sizes solved, crossover
    reported their midpoint as where they cost the same. It now says between which sizes the plan
    changes (`at` None)."""
    from spmd.report import whatif

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    plan = spmd.plan(model, FAST_MEMORY_1D, (torch.randn(8, 64), torch.randn(8, 64)), loss_fn=F.mse_loss)
    real = whatif.cost_formula
    # the plan above the change priced as if cheaper everywhere: no sign change between the two sizes
    monkeypatch.setattr(whatif, "cost_formula", lambda p, *a: real(p, *a) * (0.01 if p.collective_summary() else 1))
    found = plan.crossover()
    assert len(found) == 1 and found[0].at is None and found[0].between[0] < found[0].between[1]
    assert str(found[0]).startswith(f"between batch {found[0].between[0]} and {found[0].between[1]} the best plan")


def test_crossover_past_a_size_no_formula_covers_reports_the_change_and_goes_on(monkeypatch):
    """Found by a probe: transformers' Llama traced at batch 1 has other nodes than at batch 2 (its masks expand from
    1), so `cost_formula` at batch 1 raised and the whole crossover stopped with it. The pair of sizes is reported
    with no formula (`at` None) and the search goes on."""
    from spmd.core.errors import SpmdError
    from spmd.report import whatif

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    plan = spmd.plan(model, FAST_MEMORY_1D, (torch.randn(8, 64), torch.randn(8, 64)), loss_fn=F.mse_loss)
    real = whatif.cost_formula

    def formula(p, request, symbol="batch", batch=None):
        if batch == 2:  # (as cost_formula says of such a graph at batch 1; the plan here changes between 2 and 4)
            raise SpmdError("cost_formula: node 'expand_1' has a dim that goes from 1 to 128 when the batch goes from 1 "
                            "to 2")
        return real(p, request, symbol, batch)

    monkeypatch.setattr(whatif, "cost_formula", formula)
    found = plan.crossover()
    assert len(found) == 1 and found[0].at is None and found[0].between == (2, 4), [str(c) for c in found]
    assert found[0].above_formula is None and found[0].changed
    assert str(found[0]).startswith("between batch 2 and 4 the best plan changes; where, no formula says: cost_formula: "
                                    "node 'expand_1' has a dim that goes from 1 to 128"), str(found[0])
