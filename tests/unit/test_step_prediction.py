"""What `plan.predicted_step_s` adds to the objective (the wrapper's fixed costs), and the per-element
FLOPs of CPU-heavy elementwise kernels."""
import json

import pytest
import torch
import torch.nn.functional as F

import spmd
from tests.models import MLP
from tests.support import compile_graph
from spmd.cost_model.compute import op_flops
from spmd.core.profiles import DeviceProfile, LinkProfile, device_profile_for, load_profile, save_profile

aten = torch.ops.aten


def _device(**overheads):
    return DeviceProfile("t", 1e11, 5e10, 6e-6, 8e9, "test", 3e-6, **overheads)


def test_attention_is_priced_at_its_efficiency():
    from spmd.cost_model.compute import compute_cost
    from spmd.core.specs import TensorInfo

    q = (4, 4, 64, 64)
    info = TensorInfo(q, torch.float32)
    args = (q, q, q, 0.0, True)
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    full = compute_cost(op, args, {}, [info] * 3, [info], _device())
    slow = compute_cost(op, args, {}, [info] * 3, [info], _device(attention_efficiency=0.4))
    assert slow - 6e-6 == pytest.approx((full - 6e-6) / 0.4)
    mm = aten.mm.default
    m = TensorInfo((64, 64), torch.float32)
    assert (compute_cost(mm, ((64, 64), (64, 64)), {}, [m, m], [m], _device(attention_efficiency=0.4))
            == compute_cost(mm, ((64, 64), (64, 64)), {}, [m, m], [m], _device()))


def _mesh(device):
    return spmd.MeshSpec((1,), ("tp",), (LinkProfile("l", 1e-3, 1e9),), device)


OVERHEADS = dict(call_overhead_s=7e-6, arg_overhead_s=5e-7, backward_overhead_s=4e-5, autograd_tensor_overhead_s=2e-6)


def test_forward_step_adds_the_call_and_its_arguments():
    model, x = MLP(16, 64), torch.randn(8, 16)
    plan = spmd.plan(model, _mesh(_device(**OVERHEADS)), (x,))
    args = 4 + 1  # fc1.weight, fc1.bias, fc2.weight, fc2.bias, x
    assert plan.wrapper_overhead_s == pytest.approx(7e-6 + args * 5e-7)
    assert plan.predicted_step_s == pytest.approx(plan.objective + plan.wrapper_overhead_s)
    bare = spmd.plan(model, _mesh(_device()), (x,))
    assert bare.wrapper_overhead_s == 0.0 and bare.objective == pytest.approx(plan.objective)  # not in the ILP


def test_training_step_adds_autograd_per_parameter_and_saved_value():
    model, x, y = MLP(16, 64), torch.randn(8, 16), torch.randn(8, 16)
    plan = spmd.plan(model, _mesh(_device(**OVERHEADS)), (x, y), loss_fn=F.mse_loss)
    forward_only = 7e-6 + 6 * 5e-7  # 4 parameters and 2 inputs
    extra = plan.wrapper_overhead_s - forward_only - 4e-5
    tensors = extra / 2e-6
    # the 4 parameters' gradients and the values the compiled rank's forward really saves for backward
    split = compile_graph(model, (x, y), _mesh(_device(**OVERHEADS)), 0, loss_fn=F.mse_loss).split
    assert len(split.saved) == 6  # x, target, the two pre-activations, gelu's output, fc2's weight view
    assert tensors == pytest.approx(4 + len(split.saved))


def test_training_step_adds_the_optimizers_step_call_once():
    """`step()` itself costs the same for any parameters (`optimizer_call_overhead_s`, once per training
    step, no plan changes it); a forward has none."""
    model, x, y = MLP(16, 64), torch.randn(8, 16), torch.randn(8, 16)
    mesh, with_step = _mesh(_device(**OVERHEADS)), _mesh(_device(**OVERHEADS, optimizer_call_overhead_s=3e-5))
    plan, stepped = (spmd.plan(model, m, (x, y), loss_fn=F.mse_loss) for m in (mesh, with_step))
    assert stepped.wrapper_overhead_s - plan.wrapper_overhead_s == pytest.approx(3e-5)
    assert stepped.objective == pytest.approx(plan.objective)
    forward, forward_stepped = (spmd.plan(model, m, (x,)) for m in (mesh, with_step))
    assert forward_stepped.wrapper_overhead_s == pytest.approx(forward.wrapper_overhead_s)


def test_scaled_device_divides_every_fixed_cost():
    d = _device(**OVERHEADS, attention_efficiency=0.4).scaled(0.5)
    assert d.attention_efficiency == 0.4
    assert (d.call_overhead_s, d.arg_overhead_s, d.backward_overhead_s, d.autograd_tensor_overhead_s,
            d.view_overhead_s, d.op_overhead_s) == pytest.approx((14e-6, 1e-6, 8e-5, 4e-6, 6e-6, 12e-6))
    assert d.flops == 5e10


def test_profile_file_keeps_the_fixed_costs_and_reads_old_files(tmp_path):
    dev = _device(**OVERHEADS, attention_efficiency=0.4)
    path = tmp_path / "p.json"
    save_profile(str(path), {"tp": LinkProfile("l", 1e-3, 1e9)}, dev)
    assert load_profile(str(path)).device == dev
    doc = json.loads(path.read_text())
    for f in ("view_overhead_s", "call_overhead_s", "arg_overhead_s", "backward_overhead_s",
              "autograd_tensor_overhead_s", "attention_efficiency"):
        del doc["device"][f]  # a file written before these were saved
    path.write_text(json.dumps(doc))
    old = load_profile(str(path)).device
    assert old.op_overhead_s == dev.op_overhead_s and old.call_overhead_s == 0.0 and old.view_overhead_s == 0.0
    assert old.attention_efficiency == 1.0


def test_builtin_cpu_prices_its_wrapper():
    cpu = device_profile_for("cpu")
    assert cpu.call_overhead_s > 0 and cpu.backward_overhead_s > 0 and cpu.autograd_tensor_overhead_s > 0
    assert device_profile_for("h100").call_overhead_s == 0.0  # not measured on GPUs


@pytest.mark.parametrize("op,args,out", [
    (aten.gelu.default, ((64, 256),), [(64, 256)]),
    (aten.gelu_backward.default, ((64, 256), (64, 256)), [(64, 256)]),
    (aten.native_layer_norm.default, ((64, 256), [256], (256,), (256,), 1e-5), [(64, 256), (64, 1), (64, 1)]),
    (aten._log_softmax.default, ((64, 256), 1, False), [(64, 256)]),
])
def test_cpu_heavy_elementwise_kernels_cost_more_than_a_flop_per_element(op, args, out):
    flops = op_flops(op, args, {}, out)
    assert flops >= 20 * 64 * 256
    # still memory-bound on a GPU profile: its FLOPs take less time than reading and writing the elements
    h100 = device_profile_for("h100")
    assert flops / h100.flops < 2 * 4 * 64 * 256 / h100.memory_bandwidth
