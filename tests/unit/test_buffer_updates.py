"""Buffers the forward updates in place (batch norm's running statistics in train mode): the graph returns
their new values (`GraphOutput("buffer_update", fqn)`, placed as the buffer) and the runtime copies them into
the buffers' pieces. Before, both trace roads refused such a model."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd
from spmd.core.mesh import MeshSpec
from spmd.runtime.distribute import local_shard
from spmd.runtime.measure import builtin_cpu
from spmd.runtime.simulate import simulate
from tests.support import compile_graph, one_device, spec

RUNNING = ("1.running_mean", "1.running_var", "1.num_batches_tracked")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8)).train()


def _buffers(module) -> dict:
    return {fqn: module.get_buffer(fqn) for fqn in RUNNING}


def test_the_joint_graph_returns_each_updated_buffer_placed_as_the_buffer():
    """Simulated on 2 ranks with the batch split on dp: the statistics are the whole batch's (as
    SyncBatchNorm's), and every rank's new running statistics, loss and gradients equal one device's."""
    torch.set_default_dtype(torch.float64)
    try:
        model = _model()
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        reference = copy.deepcopy(model)
        loss = F.mse_loss(reference(x), y)
        loss.backward()
        c = compile_graph(model, (x, y), spec((2,), ("dp",)), loss_fn=F.mse_loss,
                          in_placements={"input": [Shard(0)], "target": [Shard(0)]})
        kinds = c.traced.output_kinds()
        assert [k.name for k in kinds if k.kind == "buffer_update"] == list(RUNNING)
        want = {**dict(reference.named_buffers()), **{n: p.grad for n, p in reference.named_parameters()}}
        outs = simulate(c, (x, y, torch.ones(())))
        checked = 0
        for k, kind in enumerate(kinds):
            if kind.kind not in ("buffer_update", "grad", "output"):
                continue
            ps = c.plan.choices[f"output_{k}"].inputs[0]
            if kind.kind == "buffer_update":  # (placed as the buffer, whatever the plan chose for it)
                assert ps == c.plan.choices[next(i.placeholder for i in c.traced.inputs if i.name == kind.name)].outputs[0]
            expected = loss.detach() if kind.kind == "output" else want[kind.name]
            for rank, out in enumerate(outs):
                torch.testing.assert_close(out[k], local_shard(expected, ps, (2,), (rank,)))
            checked += 1
        assert checked == 3 + 6 + 1  # the buffers, the parameters' gradients, the loss
    finally:
        torch.set_default_dtype(torch.float32)


def test_training_updates_the_running_statistics_as_eager_does():
    model = _model()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    compiled = one_device(model, (x, y), training=True, loss_fn=F.mse_loss)
    opt, ref_opt = torch.optim.SGD(compiled.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        a, b = torch.randn(4, 8), torch.randn(4, 8)
        for run, o in ((lambda: compiled(a, b), opt), (lambda: F.mse_loss(reference(a), b), ref_opt)):
            run().backward()
            o.step()
            o.zero_grad()
    for fqn, value in _buffers(compiled).items():
        torch.testing.assert_close(value, reference.get_buffer(fqn))
    assert int(_buffers(compiled)["1.num_batches_tracked"]) == 3


def test_a_forward_in_train_mode_updates_the_running_statistics_too():
    """The forward-only road (torch.export's buffer mutations): compiled without training, in train mode."""
    model = _model()
    reference = copy.deepcopy(model)
    compiled = one_device(model, (torch.randn(4, 8),))
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, 8)
            torch.testing.assert_close(compiled(x), reference(x))
    for fqn, value in _buffers(compiled).items():
        torch.testing.assert_close(value, reference.get_buffer(fqn))


class _Blocks(nn.Module):
    def __init__(self, depth: int = 8):  # (stacks of 8 or more are stamped)
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_layers_that_update_buffers_are_traced_whole_not_stamped():
    """Stamped copies of a layer would leave their own buffers' new values out of the graph: such layers
    are traced every one (the plan's note says why), and each layer's buffers are updated."""
    model = _Blocks().train()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    plan = spmd.plan(model, MeshSpec((2,), ("dp",), device=builtin_cpu()), (x, y), loss_fn=F.mse_loss)
    assert "updated in place (layers.0.1.running_mean)" in plan.stats["stamped_layers"], plan.stats
    c = compile_graph(model, (x, y), spec((2,), ("dp",)), loss_fn=F.mse_loss)
    updated = {k.name for k in c.traced.output_kinds() if k.kind == "buffer_update"}
    assert updated == {f"layers.{i}.1.{b}" for i in range(8) for b in ("running_mean", "running_var", "num_batches_tracked")}


def test_an_input_updated_in_place_is_still_refused_with_the_way_out():
    class Mutates(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            x.mul_(2)
            return self.fc(x)

    with pytest.raises(spmd.SpmdError, match=r"updates an input in place\. What to do: return the new value"):
        compile_graph(Mutates(), (torch.randn(4, 8), torch.randn(4, 8)), spec((2,), ("dp",)), loss_fn=F.mse_loss,
                      in_placements={"x": [Replicate()]})


def test_the_users_outputs_come_first_so_tangents_pins_and_gathers_find_them():
    """torch lists a mutated buffer before the user's outputs; the graph puts the user's first, so the
    user's output i is `output_{i}`: the incoming gradient is tied to it (not to running_mean: on 2 ranks a
    batch-split output's tangent came in replicated), `out_placements={0: ...}` pins it, and
    `gather_outputs` reads its placement."""
    model = _model()
    x = torch.randn(4, 8)
    c = compile_graph(model, (x,), spec((2,), ("dp",)), training=True, in_placements={"input": [Shard(0)]},
                      out_placements={0: [Shard(0)]}, param_placements={"1.running_mean": [Shard(0)]})
    kinds = c.traced.output_kinds()
    assert [k.kind for k in kinds[:4]] == ["output", "buffer_update", "buffer_update", "buffer_update"]
    tangent = next(i.placeholder for i in c.traced.inputs if i.kind == "tangent")
    assert c.plan.choices[tangent].outputs[0] == c.plan.choices["output_0"].inputs[0] == (Shard(0),)
    assert c.plan.choices["output_1"].inputs[0] == (Shard(0),)  # (running_mean, as pinned)
    forward = compile_graph(_model(), (x,), spec((2,), ("dp",)), in_placements={"input": [Shard(0)]},
                            out_placements=[[Shard(0)]])
    assert forward.traced.output_kinds()[0].kind == "output"
    assert forward.plan.choices["output_0"].inputs[0] == (Shard(0),)


class _Decays(nn.Module):
    """A buffer given a new value in the forward: assigned (`in_place=False`) or copied in place."""

    def __init__(self, in_place: bool):
        super().__init__()
        self.in_place, self.fc = in_place, nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        if not self.in_place:
            y = self.fc(x) * self.scale
            self.scale = self.scale * 0.5 + 0.25
            return y
        y = self.fc(x) * self.scale.clone()
        with torch.no_grad():
            self.scale.copy_(self.scale * 0.5 + 0.25)
        return y


def test_a_buffer_assigned_in_training_fails_and_the_in_place_update_it_names_works():
    """AOTAutograd keeps the module's own tensor where the forward assigns a new one, and torch.export's road
    lost it too: the buffer kept its old value, silently. Now the trace stops and names the in-place update,
    which trains as eager does."""
    x, t = torch.randn(3, 4), torch.randn(3, 4)
    with pytest.raises(spmd.SpmdError, match=r"assigns a new tensor to buffer _Decays\.scale.*What to do: update "
                                             r"the buffer \(or parameter\) in place under torch\.no_grad\(\)"):
        one_device(_Decays(in_place=False), (x, t), training=True, loss_fn=F.mse_loss)
    torch.manual_seed(0)
    model = _Decays(in_place=True)
    reference = copy.deepcopy(model)
    compiled = one_device(model, (x, t), training=True, loss_fn=F.mse_loss)
    for _ in range(2):
        compiled(x, t).backward()
        F.mse_loss(reference(x), t).backward()
    torch.testing.assert_close(compiled.scale, reference.scale)
    torch.testing.assert_close(compiled.fc.weight.grad, reference.fc.weight.grad)


class _LazyMask(nn.Module):
    """A cache registered as None and made at the first forward (rotary tables, causal masks)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("mask", None, persistent=False)

    def forward(self, x):
        if self.mask is None:
            self.mask = torch.ones(x.shape[1], x.shape[1]).tril()
        return self.fc(x) @ self.mask


def test_a_cache_made_at_the_first_forward_is_no_assigned_buffer():
    """The assigned-buffer check's first version refused this (a regression a review found)."""
    torch.manual_seed(0)
    model, x, y = _LazyMask(), torch.randn(4, 8), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    compiled = one_device(model, (x, y), training=True, loss_fn=F.mse_loss)
    torch.testing.assert_close(compiled(x, y), F.mse_loss(reference(x), y))


def test_load_state_dict_takes_the_models_own_state_dict():
    """`compiled.load_state_dict(model.state_dict())`, the usual line after `torch.load`, failed with
    missing keys `0__weight`: the model's names go to `load_sharded_state_dict` (each rank cuts its
    pieces); the module's own names load as torch loads them."""
    model = _model()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    compiled = one_device(copy.deepcopy(model), (x, y), training=True, loss_fn=F.mse_loss)
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
        other[1].running_mean.fill_(0.5)
    assert compiled.load_state_dict(other.state_dict()) is not None
    torch.testing.assert_close(compiled.get_parameter("0.weight"), other[0].weight)
    torch.testing.assert_close(compiled.get_buffer("1.running_mean"), other[1].running_mean)
    with pytest.raises(spmd.SpmdError, match=r"keys that are not the model's: extra"):
        compiled.load_state_dict({**other.state_dict(), "extra": torch.ones(1)})
    assert compiled.load_state_dict({**other.state_dict(), "extra": torch.ones(1)}, strict=False).unexpected_keys == \
        ["extra"]
    own = {k: v.clone() for k, v in compiled.state_dict().items()}
    compiled.load_state_dict(one_device(model, (x, y), training=True, loss_fn=F.mse_loss).state_dict())
    compiled.load_state_dict(own)  # (its own names: torch's load)
    torch.testing.assert_close(compiled.get_parameter("0.weight"), other[0].weight)


class _RootParam(nn.Module):
    """A parameter at the model's root (ViT's cls_token): its attribute name is its model name too."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * self.scale


def test_load_state_dict_with_a_root_parameter_and_partial_dicts():
    """Found by a review: a root parameter sent the model's dict to torch's load (missing `fc__weight`),
    and strict=False with a partial dict raised where torch reports the missing keys."""
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    compiled = one_device(_RootParam(), (x, y), training=True, loss_fn=F.mse_loss)
    other = _RootParam()
    assert compiled.load_state_dict(other.state_dict()) is not None
    torch.testing.assert_close(compiled.get_parameter("fc.weight"), other.fc.weight)
    partial = {k: v + 1 for k, v in other.state_dict().items() if k != "fc.bias"}
    with pytest.raises(spmd.SpmdError, match=r"1 entries missing: fc.bias"):
        compiled.load_state_dict(partial)
    result = compiled.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["fc.bias"] and result.unexpected_keys == []
    torch.testing.assert_close(compiled.get_parameter("fc.weight"), other.fc.weight + 1)
    torch.testing.assert_close(compiled.get_parameter("fc.bias"), other.fc.bias)  # (left as it was)


class _Replaces(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.how = how
        self.register_buffer("ema", torch.zeros(8))
        self.w_ema = nn.Parameter(torch.zeros(8), requires_grad=False)
        self.t = torch.zeros(8)

    def forward(self, x):
        h = self.fc(x)
        new = 0.5 * self.ema + 0.5 * h.detach().mean(0)
        if self.how == "data":
            self.ema.data = new
        elif self.how == "_buffers":
            self._buffers["ema"] = new
        elif self.how == "parameter":
            self.w_ema = nn.Parameter(self.w_ema * 0.5 + new, requires_grad=False)
        elif self.how == "attribute":
            self.t = 0.5 * self.t + 0.5 * h.mean(0)
            return h - self.t
        elif self.how == "setattr":
            self.ema = new
        return h - self.ema + self.w_ema


@pytest.mark.parametrize("how,said", [("data", "ema new `.data`"), ("_buffers", "buffer ema a new tensor through"),
                                      ("parameter", "parameter w_ema a new tensor"),
                                      ("attribute", "t, a plain tensor attribute the graph reads")])
def test_state_a_forward_replaces_in_ways_no_graph_carries_out_is_refused(how, said):
    """Found by a probe: `self.ema.data = new`, `self._buffers["ema"] = new`, a parameter given a new tensor (a
    VQ-VAE's EMA codebook) and a plain tensor attribute the forward reads (a streaming mean) kept the traced value
    in the graph: outputs 0.065-0.23 off from the second call in eval, 0.4 off on the buffer after 3 training steps,
    silently. Refused in both; `self.ema = new` on a buffer, which export carries out, stays exact in eval."""
    x = torch.randn(4, 8)
    with pytest.raises(spmd.SpmdError, match="trace_module: the forward gives " + re.escape(said)):
        one_device(_Replaces(how).eval(), (x,))
    with pytest.raises(spmd.SpmdError, match=r"trace_joint: the forward assigns a new tensor|register .* as a buffer"):
        one_device(_Replaces(how), (x, torch.randn(4, 8)), training=True, loss_fn=F.mse_loss)
    torch.manual_seed(0)
    model = _Replaces("setattr").eval()
    reference = copy.deepcopy(model)
    compiled = one_device(model, (x,))
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), reference(x))


def test_a_buffer_the_forward_resizes_is_refused_with_the_way_out():
    """Found by a probe: prepare_qat's per-channel fake-quant scale starts [1] and the forward sizes it to the
    channels; the compiled call failed with torch's broadcast error. It now names the buffer and the way out (one
    eager call before compiling), which trains."""
    from torch.ao.quantization import get_default_qat_qconfig, prepare_qat

    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).train()
        m.qconfig = get_default_qat_qconfig("fbgemm")
        return prepare_qat(m)

    x, y = torch.randn(8, 16), torch.randn(8, 16)
    compiled = one_device(build(), (x, y), training=True, loss_fn=F.mse_loss)
    with pytest.raises(spmd.SpmdError, match=r"buffer '0.weight_fake_quant.scale' changes its shape in the forward "
                                             r"\(\[1\] when compiled, \[32\] after the call.*run the model once"):
        compiled(x, y)
    model = build()
    model(x)
    reference = copy.deepcopy(model)
    compiled = one_device(model, (x, y), training=True, loss_fn=F.mse_loss)
    torch.testing.assert_close(compiled(x, y), F.mse_loss(reference(x), y))
