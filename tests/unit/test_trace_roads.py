"""trace_joint's two roads: AOTAutograd over the model itself first, torch.export first where that cannot be
trusted or fails. The model comes back as it was either way, and the graph's source lines are the model's."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd.passes.trace_joint as trace_joint_module
from spmd.core.errors import SpmdError
from spmd.passes.trace_joint import trace_joint
from spmd.passes.trace_module import distinct_inputs
from spmd.runtime.simulate import simulate
from tests.support import check_simulated_training, compile_graph, spec


class _SharedLayer(nn.Module):
    """One Linear registered twice (ALBERT's shared layers, `self.b = self.a`)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = self.a

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


class _KeepsLast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.last = nn.Linear(8, 8), None

    def forward(self, x):
        h = self.fc(x)
        self.last = h.detach()  # an attribute the forward assigns
        return h


class _LazyCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.cache = nn.Linear(8, 8), None

    def forward(self, x):
        if self.cache is None:
            self.cache = torch.arange(8.0)  # made at the first call
        return self.fc(x) + self.cache


def _export_road_calls(monkeypatch) -> list:
    calls = []
    road = trace_joint_module._aot_over_export
    monkeypatch.setattr(trace_joint_module, "_aot_over_export", lambda *a: (calls.append(1), road(*a))[1])
    return calls


def _trained_on_two_ranks(make) -> tuple:
    """`make()`'s model in float64 compiled with an MSE loss on (dp=2) and run once in eager: (model, x, y,
    how many of the outputs every simulated rank gives equal the eager loss and gradients)."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = make()
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        c = compile_graph(model, (x, y), spec((2,), ("dp",)), loss_fn=F.mse_loss)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return model, x, y, check_simulated_training(c, simulate(c, (x, y, torch.ones(()))), loss, model)
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_layer_registered_twice_trains_equal_and_stays_the_users(monkeypatch):
    """AOTAutograd over such a model left its tracer's tensors in the layer (torch 2.13): the model broke at
    its next call. It takes the road through torch.export, and every rank trains equal to one device."""
    calls = _export_road_calls(monkeypatch)
    model, _, _, checked = _trained_on_two_ranks(_SharedLayer)
    assert calls and type(model.a.weight) is nn.Parameter
    assert checked == 3


def test_attributes_the_forward_assigns_are_put_back(monkeypatch):
    calls = _export_road_calls(monkeypatch)
    model, x = _KeepsLast(), torch.randn(4, 8)
    traced = trace_joint(model, (x, x.clone()), F.mse_loss)
    assert model.last is None and not calls  # (the direct road, its tracer's tensor not left behind)
    assert any(n.op == "call_function" for n in traced.graph.nodes)

    lazy = _LazyCache()  # the direct road fails on the cache it makes; the model is the user's again for
    trace_joint(lazy, (x, x.clone()), F.mse_loss)  # the road through torch.export, and after
    assert calls and lazy.cache is None
    torch.testing.assert_close(lazy(x), lazy.fc(x) + torch.arange(8.0))


def test_source_lines_are_the_models_not_the_callers():
    model, x = _KeepsLast(), torch.randn(4, 8)
    traced = trace_joint(model, (x, x.clone()), F.mse_loss)  # CALLER
    traces = [n.meta.get("stack_trace") or "" for n in traced.graph.nodes if n.op == "call_function"]
    assert any("h = self.fc(x)" in t for t in traces)
    assert not any("# CALLER" in t or "test_source_lines_are" in t for t in traces)


class _EmbedThenTable(nn.Module):
    """An embedding followed by ops that make no autograd node (a rotary table from positions), as
    transformers' Llama builds its cos/sin after the embedding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)

    def forward(self, ids):
        h = self.embed(ids)  # EMBED
        table = torch.arange(ids.shape[1], dtype=torch.float32).cos()  # TABLE
        return h * table[:, None]


def test_a_gradient_names_the_op_it_differentiates_not_the_ops_after_it():
    """A backward node takes the source line of the forward op whose autograd node it runs: the first forward op
    of that sequence number (the ops after it that make no node carry the same number; the last of them was
    named: verify blamed a rotary line for the embedding's gradient)."""
    ids = torch.randint(0, 16, (2, 4))
    traced = trace_joint(_EmbedThenTable(), (ids, torch.randn(2, 4, 8)), F.mse_loss)
    (grad,) = [n for n in traced.graph.nodes if n.target is torch.ops.aten.embedding_dense_backward.default]
    assert "# EMBED" in grad.meta["stack_trace"] and "# TABLE" not in grad.meta["stack_trace"]


def test_distinct_inputs_copies_what_shares_memory_and_only_that():
    t = torch.randn(4, 8, requires_grad=True)
    view = t.detach()[1:]
    sparse = torch.eye(4).to_sparse()
    (a, b, c, d, e), kw = distinct_inputs((t, t, view, sparse, 3), {"again": t})
    assert a is t and b is not t and torch.equal(b, t) and b.requires_grad
    assert c is not view and torch.equal(c, view)  # (a view of an earlier input)
    assert d is sparse and e == 3  # (no storage to share: kept; not a tensor: kept)
    assert kw["again"] is not t and torch.equal(kw["again"], t)


class _HalvesItsGradient(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc1(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * 0.5)
        return self.fc2(h)


def test_gradient_hooks_are_applied_or_the_trace_fails(monkeypatch):
    """The direct road applies a gradient hook as eager does; the road through torch.export drops it, so a
    model with one never takes that road quietly (its gradients would not be the model's)."""
    model, x, y, checked = _trained_on_two_ranks(_HalvesItsGradient)
    assert checked == 5

    def fails(*args):
        raise RuntimeError("the direct road failed")

    monkeypatch.setattr(trace_joint_module, "_aot_over_module", fails)
    with pytest.raises(SpmdError, match="the direct road failed"):
        trace_joint(model, (x, y), F.mse_loss)
    model.fc2.register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 3,))
    model.forward = lambda x: model.fc2(model.fc1(x))  # (no tensor hook: the module's own is enough)
    with pytest.raises(SpmdError, match="the direct road failed"):
        trace_joint(model, (x, y), F.mse_loss)


class _LogitsAndLoss(nn.Module):
    """A causal LM's outputs: its loss, and 3-D logits (a view of the head's matmul) beside a hidden state of
    its own (a value no other output shares) and the input itself (a block's residual)."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 5)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        logits = self.head(h)
        return logits.square().mean(), logits, h, x


def test_outputs_are_traced_once_and_copied_only_where_they_alias(monkeypatch):
    """Outputs that alias another value (the logits, a view of the head's matmul; the input) used to be found
    after the trace, and the model traced again with them copied: transformers' causal LMs were traced twice,
    half of a 2-layer Llama's plan. They are copied before the one trace now, and the copies of outputs that
    are values of their own dropped after it."""
    calls = []
    road = trace_joint_module._aot_over_module
    monkeypatch.setattr(trace_joint_module, "_aot_over_module", lambda *a: (calls.append(1), road(*a))[1])
    x = torch.randn(2, 3, 8, requires_grad=True)
    traced = trace_joint(_LogitsAndLoss(), (x,))
    assert len(calls) == 1
    outs = [a for a in traced.graph.output_node().args[0] if isinstance(a, torch.fx.Node)][:4]
    assert [o.target is torch.ops.aten.clone.default for o in outs] == [False, True, False, True], outs
    assert outs[2].target is torch.ops.aten.tanh.default  # (the hidden state itself: its copy dropped)
    assert outs[3].args[0].op == "placeholder"
    copies = [n for n in traced.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert len(copies) == 2  # (nothing else: the loss and the hidden state are returned as they are)


class _KeepsAuxLoss(nn.Module):
    """A Switch-style layer that keeps its load-balancing loss on itself (or appends it to a list it holds)."""

    def __init__(self, in_list: bool):
        super().__init__()
        self.fc, self.gate, self.in_list = nn.Linear(8, 8), nn.Linear(8, 4), in_list
        self.aux_loss, self.aux_losses = torch.zeros(()), []

    def forward(self, x):
        p = self.gate(x).softmax(-1)
        if self.in_list:
            self.aux_losses.append((p.mean(0) ** 2).sum())
        else:
            self.aux_loss = (p.mean(0) ** 2).sum()
        return self.fc(x) * p.max(-1, keepdim=True).values


class _HoldsAuxLayer(nn.Module):
    def __init__(self, in_list: bool):
        super().__init__()
        self.moe = _KeepsAuxLoss(in_list)

    def forward(self, x):
        return self.moe(x)


@pytest.mark.parametrize("in_list", [False, True])
def test_a_tensor_with_a_gradient_kept_on_a_module_is_said(in_list):
    """Found by a probe: a loss the forward keeps on its layer (`self.aux_loss = ...`, a Switch layer's) kept its
    value from before compiling after every compiled call, and a loop adding it trained no gate (3.9e-2 off after
    3 steps), silently. An attribute given a tensor without a gradient (an activation kept to look at) is not."""
    x = torch.randn(4, 8)
    name = "moe.aux_losses" if in_list else "moe.aux_loss"
    with pytest.warns(UserWarning, match=f"keeps a tensor that requires grad on `{name}`.*return it from the forward"):
        trace_joint(_HoldsAuxLayer(in_list), (x, x.clone()), F.mse_loss)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        trace_joint(_KeepsLast(), (x, x.clone()), F.mse_loss)
        # (nor the model's own parameters in a list: nn.LSTM's `_flat_weights`, set again at each forward)
        trace_joint(_Recurrent(), (x.view(2, 2, 8), x.view(2, 2, 8).clone()), F.mse_loss)
        # (nor a weight torch's utilities compute in a forward pre-hook, which the graph computes too; a review)
        for reparametrized in (nn.utils.spectral_norm(nn.Linear(8, 8)), nn.utils.weight_norm(nn.Linear(8, 8))):
            trace_joint(reparametrized, (x, x.clone()), F.mse_loss)


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 8, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


class _Branches(nn.Module):
    """`torch.cond` whose branches call submodules."""

    def __init__(self, sign: float):
        super().__init__()
        self.sign = sign
        self.fc1, self.a, self.b, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc1(x)
        h = torch.cond(self.sign * h.mean() > -1e3, lambda t: self.a(t), lambda t: self.b(t), (h,))
        return self.fc2(torch.tanh(h))


@pytest.mark.parametrize("sign", [1.0, -1e6])
def test_torch_cond_with_submodules_in_its_branches_trains_equal(sign):
    """Found by a probe: the trace's watch on each module's state (`state_assigned`) wrote to a dict inside the
    branches, which dynamo traces, and refused (\"Unsafe side effect\"), so such a model was refused for training
    and inference alike, while torch.export traces it. Each branch, taken, trains equal to one device."""
    _, _, _, checked = _trained_on_two_ranks(lambda: _Branches(sign))
    assert checked == 9


class _MaskedEmbed(nn.Module):
    """Wav2Vec2's SpecAugment with its mask given: `h[mask] = self.masked_spec_embed` (a learned vector written
    over the picked time steps)."""

    def __init__(self, index):
        super().__init__()
        self.index = index
        self.fc, self.embed = nn.Linear(8, 8), nn.Parameter(torch.randn(8))

    def forward(self, x, mask):
        h = self.fc(x)
        h[self.index(mask)] = self.embed.to(h.dtype)
        return torch.tanh(h)


@pytest.mark.parametrize("index", [lambda m: m, lambda m: (m[:, 0],)], ids=["mask", "rows"])
@pytest.mark.parametrize("shape", [(2,), (2, 2)])
def test_a_masked_write_of_a_tensor_with_a_gradient_trains_equal(index, shape):
    """Found by a probe: its backward (`index_put` by a bool mask) finds the picked positions with `nonzero`, so
    the trace failed (`aten.nonzero.default`, with a way out about losses); traced as a `torch.where`, every rank
    trains equal to one device, the vector's gradient summed over the picked positions."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = _MaskedEmbed(index)
        x, t = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
        mask = torch.rand(4, 6) < 0.4
        c = compile_graph(model, (x, mask, t), spec(shape, ("dp", "tp")[:len(shape)]), loss_fn=F.mse_loss)
        loss = F.mse_loss(model(x, mask), t)
        loss.backward()
        assert check_simulated_training(c, simulate(c, (x, mask, t, torch.ones(()))), loss, model) == 4
        assert model.embed.grad.abs().sum() > 0
        assert "__setitem__" not in torch.Tensor.__dict__  # (torch's own again after the trace)
    finally:
        torch.set_default_dtype(torch.float32)


class _WritesAPartOfItself(nn.Module):
    def __init__(self, rows: bool):
        super().__init__()
        self.fc, self.rows = nn.Linear(4, 8), rows

    def forward(self, x, mask):
        out = self.fc(x)
        h = out[:2]
        h[mask] = h[0, 0, 0] if self.rows else out[2, 0]  # (a number of h; a row of out past h)
        return out


@pytest.mark.parametrize("rows", [True, False], ids=["own-scalar", "disjoint-view"])
def test_a_masked_write_of_a_part_of_its_own_tensor_trains_equal(rows):
    """`h[mask] = h[0, 0, 0]` (a number of h) and a value from another part of the same storage, which eager takes:
    the rewrite as a `torch.where` reads the value first, as eager does (a first version refused both, as eager
    refuses an overlap; a review)."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = _WritesAPartOfItself(rows)
        x, t = torch.randn(3, 6, 4), torch.randn(3, 6, 8)
        mask = (torch.arange(2)[:, None] + torch.arange(6)) % 3 == 1
        c = compile_graph(model, (x, mask, t), spec((2,), ("dp",)), loss_fn=F.mse_loss)
        loss = F.mse_loss(model(x, mask), t)
        loss.backward()
        assert check_simulated_training(c, simulate(c, (x, mask, t, torch.ones(()))), loss, model) == 3
    finally:
        torch.set_default_dtype(torch.float32)


_WEIGHTS = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def _weighted_sum(out, target):
    """A loss reading a module-level tensor: the trace makes it a constant read by forward and backward."""
    return (out * _WEIGHTS).sum() + F.mse_loss(out, target)


def test_a_constant_read_twice_by_the_joint_graph_is_lifted_once():
    """Found by a probe: Wav2Vec2 built on meta, its loss_fn weighting the output by a global tensor (traced as a
    constant there, through fake tensors that allow real ones), failed with a raw `AttributeError: 'inner_f' object
    has no attribute '_tensor_constant0'`: forward and backward each read the constant, and lifting it deleted it
    at the first. On 2 gloo ranks that model now trains equal to one device (4e-15 after an SGD step)."""
    from spmd.compiler.meta import fake_model

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, t = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    traced = trace_joint(*fake_model(model, (x, t)), _weighted_sum)
    constants = [gi for gi in traced.inputs if gi.kind == "constant"]
    assert len(constants) == 1, constants
    assert torch.equal(traced.state[constants[0].name], _WEIGHTS)


class _Curvature(nn.Module):
    """A physics-informed net's loss term: the Hessian of its output in its input, per sample."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(2, 16), nn.Linear(16, 1)

    def u(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))

    def forward(self, x):
        return torch.func.vmap(torch.func.hessian(lambda xi: self.u(xi).squeeze(-1)))(x).flatten(1)


def test_a_hessian_in_the_forward_trains_equal_on_the_runtime():
    """Found by a probe: `vmap(hessian(...))` in a forward, compiled for training, crashed at its first step with
    torch's "data pointer on an invalid python storage": the runtime counted the bytes of what the forward saves,
    and one was an efficient zero tensor, which has no storage (the simulated run, which counts nothing, was
    equal)."""
    from tests.support import one_device, one_step_checked

    torch.manual_seed(0)
    model = _Curvature().double()
    reference = _Curvature().double()
    reference.load_state_dict(model.state_dict())
    x, t = torch.randn(8, 2, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (torch.func's zeros have a rule: no warning of an op without)
        compiled = one_device(model, (x, t), loss_fn=F.mse_loss)
    one_step_checked(compiled, reference, x, t)


class _Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.sub = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.sub(self.pre(x))


@pytest.mark.parametrize("training", [False, True])
def test_a_torch_compiled_model_takes_its_own_input_names(training):
    """Found by a probe: `spmd.compile(torch.compile(model), ...)` named the input `args_0` for inference and `arg0`
    for training (the compiled module's forward takes `*args`), so the user's pin on `x` was refused in both."""
    from torch.distributed.tensor import Shard

    x = torch.randn(4, 8)
    args, opts = ((x, torch.randn(4, 8)), {"loss_fn": F.mse_loss}) if training else ((x,), {})
    c = compile_graph(torch.compile(_Stem(), backend="eager"), args, spec((2,), ("dp",)),
                      in_placements={"x": [Shard(0)]}, **opts)
    assert [gi.name for gi in c.traced.inputs if gi.kind == "input"][0] == "x"


def test_a_submodule_the_user_torch_compiled_traces_without_guard_errors():
    """Found by a probe: dynamo, compiling the user's submodule inside the trace, traced spmd's stack-recording mode
    too and logged ~25 lines of "Error while creating guard" about its cache of call sites."""
    import logging

    class Kept(logging.Handler):
        def __init__(self):
            super().__init__(logging.ERROR)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    kept, logger = Kept(), logging.getLogger("torch._guards")
    logger.addHandler(kept)
    try:
        model = _Stem()
        model.sub = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), backend="eager")
        compile_graph(model, (torch.randn(4, 8), torch.randn(4, 8)), spec((2,), ("dp",)), loss_fn=F.mse_loss)
    finally:
        logger.removeHandler(kept)
    assert not kept.messages, kept.messages[:2]
