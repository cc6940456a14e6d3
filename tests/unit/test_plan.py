"""Planning without processes: the plans the solver finds, and their determinism."""
import torch
from torch.distributed.tensor import Replicate, Shard

import spmd
from tests.models import GPT, MLP, GPTConfig
from spmd.core.mesh import MeshSpec
from tests.support import LATENCY_LINK, SLOW_DEVICE, spec


def _gpt_tp_plan(layers=2):
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=layers))
    # batch 1 and an odd sequence: the token dim cannot be split on 2 ranks, so only weights can be.
    tokens = torch.randint(0, 128, (1, 31))
    mesh = spec((2,), ("tp",), link=LATENCY_LINK, device=SLOW_DEVICE)
    return spmd.plan(model, mesh, (tokens,)), model


def _param_placement(plan, model, fqn):
    name = "p_" + fqn.replace(".", "_")
    return plan.choices[name].outputs[0]


def test_gpt_on_tp_mesh_finds_the_megatron_plan():
    plan, model = _gpt_tp_plan()
    # Megatron: one all_reduce per attention and one per MLP in forward, nothing else.
    assert dict(plan.collective_summary()) == {("all_reduce", "tp"): 4}
    activation_bytes = 1 * 31 * 64 * 4
    assert [s.in_bytes for _, s in plan.collectives()] == [activation_bytes] * 4
    for layer in range(2):
        pre = f"blocks.{layer}."
        for col in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc1"):  # column-parallel
            assert _param_placement(plan, model, pre + col + ".weight") == (Shard(0),), col
            assert _param_placement(plan, model, pre + col + ".bias") == (Shard(0),), col
        for row in ("attn.o_proj", "mlp.fc2"):  # row-parallel
            assert _param_placement(plan, model, pre + row + ".weight") == (Shard(1),), row
            assert _param_placement(plan, model, pre + row + ".bias") == (Replicate(),), row
    assert plan.gap <= 1e-6


def test_plan_is_deterministic():
    a, _ = _gpt_tp_plan()
    b, _ = _gpt_tp_plan()
    assert a.fingerprint() == b.fingerprint()
    assert a.objective == b.objective


def test_gloo_at_tiny_size_does_not_shard():
    """On the measured gloo profile a tiny model is all latency: replicating beats tensor parallelism."""
    from spmd.core.profiles import device_profile_for, link_profile_for

    torch.manual_seed(0)
    mesh = MeshSpec((2,), ("tp",), (link_profile_for("gloo"),), device_profile_for("cpu"))
    plan = spmd.plan(GPT(GPTConfig()), mesh, (torch.randint(0, 128, (1, 31)),))
    assert plan.collectives() == []


def test_data_parallel_when_the_batch_splits():
    """With a batch that splits, forward needs no communication at all: shard the batch, replicate weights."""
    mesh = spec((2,), ("dp",))
    plan = spmd.plan(MLP(16, 64), mesh, (torch.randn(8, 16),))
    assert plan.collectives() == []
    assert plan.choices["x"].outputs[0] == (Shard(0),)


def test_2d_mesh_puts_tensor_parallelism_on_the_fast_axis():
    """Batch 2 splits once, the odd sequence never: the second factor of 2 must come from weights.
    Tensor parallelism talks in every layer, so it belongs on the faster (inner) link."""
    from spmd.core.profiles import LinkProfile

    torch.manual_seed(0)
    slow_outer = LinkProfile("test-outer", 10 * LATENCY_LINK.latency_s, LATENCY_LINK.bandwidth / 10)
    mesh = MeshSpec((2, 2), ("dp", "tp"), (slow_outer, LATENCY_LINK), SLOW_DEVICE)
    plan = spmd.plan(GPT(GPTConfig()), mesh, (torch.randint(0, 128, (2, 31)),))
    assert dict(plan.collective_summary()) == {("all_reduce", "tp"): 4}
    assert plan.choices["embedding"].outputs[0][0] == Shard(0)  # data parallel on dp
