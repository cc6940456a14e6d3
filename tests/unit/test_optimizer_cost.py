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
from spmd.cost_model.compute import optimizer_accesses, optimizer_cost
from spmd.runtime.measure import builtin_cpu, fit_device
from tests.models import MLP
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
    # unmeasured: the bytes at DRAM's bandwidth (the built-in cpu), else the memory's (GPUs)
    cpu = builtin_cpu()
    assert optimizer_cost(TensorInfo((1000,), torch.float32), cpu, 2.0) == pytest.approx(20 * 4000 / cpu.dram_bandwidth)


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
    # inference steps no optimizer
    forward = spmd.plan(model, spec, inputs[:1])
    assert all(forward.node_costs.get(name, 0.0) == 0.0 for name in forward.labels)


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
    model, inputs = mlp_training()
    plan = spmd.plan(model, mesh(1e8), inputs, loss_fn=F.mse_loss)
    steps = sum(plan.node_costs.get(name, 0.0) for name in plan.labels)
    assert steps > 0.1 * plan.objective
    assert float(plan.cost_formula.subs("batch", 64)) == pytest.approx(plan.objective, rel=1e-9)


def test_the_host_fits_adamw_and_profiles_keep_it():
    """Per tensor from 64 tiny parameters, the bandwidth from the accesses of 64 large ones over the rest."""
    points = {"matmul": [(2e9, 0.01), (4e9, 0.02)], "stream": [(12e5, 12e-6), (24e5, 24e-6)],
              "dram": [(12e7, 12e-3)], "op": [(40.0, 5e-6)], "view": [(80.0, 2e-6)],
              "optimizer": [(64.0, 1024.0, 64 * 15e-6), (64.0, 64 * 2.0**18, 64 * 15e-6 + 20 * 4 * 64 * 2**18 / 40e9)]}
    dev = fit_device(points, "test", 8e9)
    assert dev.optimizer_tensor_overhead_s == pytest.approx(15e-6)
    assert dev.optimizer_bandwidth == pytest.approx(40e9)
    assert device_from_json(device_to_json(dev)) == dev
    half = dev.scaled(0.5)  # two ranks on a core: half the bandwidth, twice the fixed cost
    assert (half.optimizer_bandwidth, half.optimizer_tensor_overhead_s) == (pytest.approx(20e9), pytest.approx(30e-6))
    # timings from before it was measured: the built-in's (the bytes at DRAM's bandwidth, no fixed cost)
    old = fit_device({k: v for k, v in points.items() if k != "optimizer"}, "test", 8e9)
    assert old.optimizer_bandwidth is None and old.optimizer_tensor_overhead_s == 0.0
