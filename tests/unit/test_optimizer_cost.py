"""The optimizer's step in the cost model (cost_model/compute.py `optimizer_cost`): priced on each trainable
parameter's local piece, so a replicated parameter costs every rank its whole step and a sharded one a
share; the solver weighs it, the symbolic formula carries it, and the host profile fits it from AdamW."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd
from spmd.core.profiles import LinkProfile, device_from_json, device_to_json
from spmd.core.specs import TensorInfo, local_shape
from spmd.cost_model.compute import optimizer_accesses, optimizer_cost, optimizer_seconds_per_byte
from spmd.runtime.measure import OPTIMIZER_CASES, builtin_cpu, fit_device
from tests.models import GPT, MLP, GPTConfig
from tests.support import COMPUTE_BOUND_DEVICE

LINK = LinkProfile("test-link", 1e-5, 1e10)


def mesh(optimizer_bandwidth: float) -> spmd.MeshSpec:
    device = dataclasses.replace(COMPUTE_BOUND_DEVICE, optimizer_bandwidth=optimizer_bandwidth,
                                 optimizer_tensor_overhead_s=1e-5)
    return spmd.MeshSpec((2,), ("dp",), (LINK,), device)


def mlp_training():
    torch.manual_seed(0)
    return MLP(64, 256), (torch.randn(64, 64), torch.randn(64, 64))


def parameter_layouts(plan) -> dict[str, tuple]:
    return {label: plan.choices[name].outputs[0] for name, label in plan.labels.items() if "." in label}


def test_accesses_follow_torchs_optimizers_by_state_factor():
    assert [optimizer_accesses(f) for f in (0.0, 1.0, 2.0)] == [3.0, 8.0, 20.0]  # SGD, momentum, AdamW
    assert optimizer_accesses(0.5) == 5.5 and optimizer_accesses(6.0) == 54.0  # linear between; Adam's beyond


def test_a_piece_costs_its_share_of_the_elements_and_the_whole_fixed_cost():
    device = dataclasses.replace(COMPUTE_BOUND_DEVICE, optimizer_bandwidth=1e9, optimizer_tensor_overhead_s=1e-5)
    whole = optimizer_cost(TensorInfo((1024, 256), torch.float32), device, 2.0)
    half = optimizer_cost(TensorInfo((512, 256), torch.float32), device, 2.0)
    assert whole == pytest.approx(20 * 4 * 1024 * 256 / 1e9 + 1e-5)
    assert whole - half == pytest.approx(20 * 4 * 512 * 256 / 1e9)
    sgd = optimizer_cost(TensorInfo((1024, 256), torch.float32), device, 0.0)
    assert sgd == pytest.approx(3 * 4 * 1024 * 256 / 1e9 + 1e-5 * 3 / 20)
    # unmeasured: the bytes at DRAM's bandwidth (a CPU), else the memory's (GPUs)
    bare = dataclasses.replace(builtin_cpu(), optimizer_bandwidth=None, optimizer_cached_bandwidth=None,
                               optimizer_tensor_overhead_s=0.0)
    assert optimizer_cost(TensorInfo((1000,), torch.float32), bare, 2.0) == pytest.approx(20 * 4000 / bare.dram_bandwidth)


def test_a_piece_pays_more_per_byte_once_it_outgrows_the_caches():
    """1 MiB and less at the cached rate, 16 MiB and more at the streaming one, log-linear between."""
    device = dataclasses.replace(COMPUTE_BOUND_DEVICE, optimizer_cached_bandwidth=40e9, optimizer_bandwidth=20e9)
    assert optimizer_seconds_per_byte(1000, device) == optimizer_seconds_per_byte(1 << 20, device) == 1 / 40e9
    assert optimizer_seconds_per_byte(16 << 20, device) == optimizer_seconds_per_byte(1 << 30, device) == 1 / 20e9
    assert optimizer_seconds_per_byte(4 << 20, device) == pytest.approx((1 / 40e9 + 1 / 20e9) / 2)
    # a cached rate below the streaming one is not believed: never cheaper as it grows
    odd = dataclasses.replace(device, optimizer_cached_bandwidth=10e9)
    assert optimizer_seconds_per_byte(1000, odd) == 1 / 20e9


def test_training_plans_price_each_parameters_step_on_its_piece():
    model, inputs = mlp_training()
    spec = mesh(1e9)
    plan = spmd.plan(model, spec, inputs, loss_fn=F.mse_loss)
    params = dict(model.named_parameters())
    for name, label in plan.labels.items():
        if label in params:
            ps = plan.choices[name].outputs[0]
            local = local_shape(tuple(params[label].shape), ps, spec.shape)
            assert plan.node_costs[name] == pytest.approx(
                optimizer_cost(TensorInfo(local, torch.float32), spec.device, 2.0))
        else:  # inputs, targets, tangents
            assert plan.node_costs.get(name, 0.0) == 0.0
    steps = sum(plan.node_costs[name] for name, label in plan.labels.items() if label in params)
    assert plan.optimizer_cost == pytest.approx(steps) and steps > 0
    assert f"with the optimizer's step {steps * 1e3:.3f} ms" in plan.explain().splitlines()[0]
    # inference steps no optimizer
    forward = spmd.plan(model, spec, inputs[:1])
    assert all(forward.node_costs.get(name, 0.0) == 0.0 for name in forward.labels)
    assert forward.optimizer_cost == 0.0 and "optimizer's step" not in forward.explain().splitlines()[0]


def test_a_dear_optimizer_step_shards_the_parameters():
    """The same model, mesh and link: with a free optimizer step the plan is data parallel (parameters
    replicated, the batch split); where stepping a whole replica costs more than gathering the pieces, the
    parameters are sharded, each rank stepping half."""
    model, inputs = mlp_training()
    cheap = spmd.plan(model, mesh(1e18), inputs, loss_fn=F.mse_loss)
    assert set(parameter_layouts(cheap).values()) == {(Replicate(),)}
    dear = spmd.plan(model, mesh(1e8), inputs, loss_fn=F.mse_loss)
    assert all(ps[0].is_shard() for ps in parameter_layouts(dear).values())
    assert dear.objective > cheap.objective
    # and the same layouts pinned under the dear profile cost what the model says: more than sharding
    pinned = spmd.plan(model, mesh(1e8), inputs, loss_fn=F.mse_loss,
                       param_placements={label: [Replicate()] for label in parameter_layouts(cheap)},
                       in_placements={"x": [Shard(0)], "target": [Shard(0)]})
    assert pinned.objective > dear.objective


def test_the_formula_carries_the_optimizer_step():
    """Exactly the objective at the solved batch, also where a dear step shards the weights and several
    readers share one gathering (priced once, as the rank graph launches it once)."""
    model, inputs = mlp_training()
    plan = spmd.plan(model, mesh(1e8), inputs, loss_fn=F.mse_loss)
    steps = sum(plan.node_costs.get(name, 0.0) for name in plan.labels)
    assert steps > 0.1 * plan.objective
    assert float(plan.cost_formula.subs("batch", 64)) == pytest.approx(plan.objective, rel=1e-9)
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (4, 16))
    gpt = spmd.plan(GPT(GPTConfig()), mesh(1e8), (tokens, tokens),
                    loss_fn=lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()))
    assert any(e.shared for e in gpt.edges)
    assert float(gpt.cost_formula.subs("batch", 4)) == pytest.approx(gpt.objective, rel=1e-9)


POINTS = {"matmul": [(2e9, 0.01), (4e9, 0.02)], "stream": [(12e5, 12e-6), (24e5, 24e-6)],
          "dram": [(12e7, 12e-3)], "op": [(40.0, 5e-6)], "view": [(80.0, 2e-6)]}  # 100 GB/s in cache


def adamw_points(per_tensor=15e-6, cached=40e9, large=25e9, per_step=30e-6):
    (k, n), (k0, n0), (k1, n1), (k2, n2) = OPTIMIZER_CASES
    return [(k, k * n, per_step + k * per_tensor), (k0, k0 * n0, per_step + k0 * per_tensor),
            (k1, k1 * n1, per_step + k1 * per_tensor + 80 * k1 * n1 / cached),
            (k2, k2 * n2, per_step + k2 * per_tensor + 80 * k2 * n2 / large)]


def test_the_host_fits_adamw_and_profiles_keep_it():
    """Per step and per tensor from one and 64 tiny parameters, each bandwidth from its case's accesses
    over the rest."""
    dev = fit_device({**POINTS, "optimizer": adamw_points()}, "test", 8e9)
    assert (dev.optimizer_call_overhead_s, dev.optimizer_tensor_overhead_s) == (pytest.approx(30e-6),
                                                                               pytest.approx(15e-6))
    assert (dev.optimizer_cached_bandwidth, dev.optimizer_bandwidth) == (pytest.approx(40e9), pytest.approx(25e9))
    assert device_from_json(device_to_json(dev)) == dev
    half = dev.scaled(0.5)  # two ranks on a core: half the bandwidths, twice the fixed cost
    assert (half.optimizer_bandwidth, half.optimizer_cached_bandwidth, half.optimizer_tensor_overhead_s,
            half.optimizer_call_overhead_s) == (pytest.approx(12.5e9), pytest.approx(20e9), pytest.approx(30e-6),
                                                pytest.approx(60e-6))


def test_timings_that_say_nothing_sane_give_the_builtins():
    cpu = builtin_cpu()
    builtin = (cpu.optimizer_call_overhead_s, cpu.optimizer_tensor_overhead_s, cpu.optimizer_cached_bandwidth,
               cpu.optimizer_bandwidth)

    def fitted(points):
        dev = fit_device({**POINTS, **({"optimizer": points} if points is not None else {})}, "test", 8e9)
        return (dev.optimizer_call_overhead_s, dev.optimizer_tensor_overhead_s, dev.optimizer_cached_bandwidth,
                dev.optimizer_bandwidth)
    assert fitted(None) == builtin  # timings from before it was timed
    assert fitted(adamw_points()[1:]) == builtin  # a case missing (timings from before the one-tensor case)
    noise = adamw_points()
    noise[3] = (noise[3][0], noise[3][1], 30e-6 + noise[3][0] * 15e-6 * 1.01)  # no slower than its fixed costs
    assert fitted(noise) == builtin
    # faster than an add in cache is not believed (capped at it); larger pieces never cheaper per byte
    assert fitted(adamw_points(cached=200e9, large=150e9))[2:] == (pytest.approx(100e9), pytest.approx(100e9))
    assert fitted(adamw_points(cached=20e9, large=30e9))[2:] == (pytest.approx(20e9), pytest.approx(20e9))
    # one tensor slower than 64 (noise): no per-step cost, each of the 64 pays its share
    slow_one = adamw_points()
    slow_one[0] = (1.0, 16.0, 2e-3)
    assert fitted(slow_one)[:2] == (0.0, pytest.approx(slow_one[1][2] / 64))
    with pytest.raises(ValueError, match="finite"):
        dataclasses.replace(cpu, optimizer_bandwidth=float("inf"))
