"""compiler/call.py and the names of inputs: keyword inputs become named positional ones, targets take the
loss function's own parameter names (`target0` only for a loss without names), pins use those names."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd
from spmd.compiler.call import Call, positional_call
from tests.models import MLP
from tests.support import one_device, spec

TP = spec((2,), ("tp",))


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, mask=None, *, scale: float = 1.0):
        y = self.fc(x) * scale
        return {"y": y if mask is None else y * mask, "sum": y.sum()}


def test_keyword_inputs_become_named_positional_ones_of_a_view_sharing_the_model():
    model = Masked()
    x, mask = torch.randn(4, 16), torch.ones(4, 16)
    view, flat, call = positional_call(model, (x,), {"mask": mask})
    assert call == Call(("x",), ("mask",)) and flat == (x, mask)
    assert type(view).__name__ == "Masked" and isinstance(view, Masked)
    assert dict(view.named_parameters()) == dict(model.named_parameters())  # the same tensors, same names
    assert torch.equal(view(x, mask)["y"], model(x, mask=mask)["y"])
    assert positional_call(model, (x,), None)[0] is model  # nothing to adapt


def test_calls_that_do_not_match_the_compiled_names_say_so():
    call = Call(("input_ids",), ("attention_mask", "labels"))
    ids = torch.zeros(2, 4, dtype=torch.long)
    assert call.flatten((ids,), {"labels": ids, "attention_mask": ids}) == (ids, ids, ids)  # by name, any order
    with pytest.raises(spmd.SpmdError, match=r"missing \['labels'\].*same names"):
        call.flatten((ids,), {"attention_mask": ids})
    with pytest.raises(spmd.SpmdError, match=r"unknown keywords \['label'\]"):
        call.flatten((ids,), {"attention_mask": ids, "labels": ids, "label": ids})
    with pytest.raises(spmd.SpmdError, match="also given positionally"):
        positional_call(Masked(), (ids,), {"x": ids})
    # positional inputs given by name, as the model's forward takes them
    assert call.flatten((), {"input_ids": ids, "labels": ids, "attention_mask": ids}) == (ids, ids, ids)
    # a keyword the compile left out, given at the forward's default (found by a probe: `attention_mask=None` was
    # an unknown keyword); at another value, refused as before
    _, _, left_out = positional_call(Masked(), (ids,), None)
    assert left_out.flatten((ids,), {"mask": None}) == (ids,) and left_out.flatten((ids,), {"scale": 1.0}) == (ids,)
    with pytest.raises(spmd.SpmdError, match=r"unknown keywords \['scale'\]"):
        left_out.flatten((ids,), {"scale": 2.0})
    with pytest.raises(spmd.SpmdError, match=r"unknown keywords \['mask'\]"):
        left_out.flatten((ids,), {"mask": ids})
    # a keyword that holds no tensor, not given to spmd.compile: the way out says to give it there
    with pytest.raises(spmd.SpmdError, match=r"unknown keywords \['use_cache'\].*use_cache=False\) is fixed when "
                                             r"traced, so give it to spmd.compile too \(example_kwargs\)"):
        call.flatten((ids,), {"attention_mask": ids, "labels": ids, "use_cache": False})


def test_keyword_inputs_are_planned_and_pinned_by_name():
    x, mask = torch.randn(4, 16), torch.ones(4, 16)
    plan = spmd.plan(Masked(), TP, (x,), example_kwargs={"mask": mask}, in_placements={"mask": [Shard(0)]})
    text = plan.table()
    assert "mask" in text and "[S(0)]" in text
    with pytest.raises(spmd.SpmdError, match="Did you mean 'mask'"):
        spmd.plan(Masked(), TP, (x,), example_kwargs={"mask": mask}, in_placements={"msk": [Shard(0)]})


def _cls_loss(logits, labels):
    return F.cross_entropy(logits, labels)


class _Unnamed:
    def __call__(self, *args):
        return F.mse_loss(*args)


@pytest.mark.parametrize("loss_fn,name", [(_cls_loss, "labels"), (F.mse_loss, "target"), (_Unnamed(), "target0")])
def test_targets_take_the_loss_functions_parameter_names(loss_fn, name):
    x = torch.randn(4, 16)
    y = torch.randint(0, 16, (4,)) if loss_fn is _cls_loss else torch.randn(4, 16)
    plan = spmd.plan(MLP(16, 64), TP, (x, y), loss_fn=loss_fn, in_placements={name: [Replicate()]})
    assert f"    {name} " in plan.table()



def test_a_loss_module_of_two_targets_takes_both():
    """Found by a probe: a loss module's own signature is torch's `(*args, **kwargs)`, so `nn.TripletMarginLoss`
    (anchor, positive, negative) was counted one target, and the model was blamed for taking 3 inputs. Its
    forward's parameters count now, and training equals eager."""
    from tests.support import one_device

    torch.manual_seed(0)
    model = MLP(16, 32)
    x, positive, negative = torch.randn(4, 16), torch.randn(4, 16), torch.randn(4, 16)
    loss_fn = nn.TripletMarginLoss(margin=0.5)
    compiled = one_device(model, (x, positive, negative), training=True, loss_fn=loss_fn)
    loss = compiled(x, positive, negative)
    loss.backward()
    want = loss_fn(model(x), positive, negative)
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(compiled.get_parameter("fc1.weight").grad, model.fc1.weight.grad)

def test_keyword_arguments_that_hold_no_tensor_are_fixed_when_traced():
    """CLIP's `return_loss=True`: a bool became a graph input of no tensor, and planning failed (KeyError in
    enumerate_strategies). It is now a constant of the view's call: no input, and a call must pass it alike."""
    model = Masked()
    x = torch.randn(4, 16)
    view, flat, call = positional_call(model, (x,), {"scale": 2.0})
    assert call == Call(("x",), (), (("scale", 2.0),)) and flat == (x,)
    assert torch.equal(view(x)["y"], model(x, scale=2.0)["y"])
    plan = spmd.plan(model, TP, (x,), example_kwargs={"scale": 2.0, "mask": torch.ones(4, 16)})
    assert {n for n in plan.labels.values()} >= {"x", "mask"} and "scale" not in plan.labels.values()
    assert call.flatten((x,), {"scale": 2.0}) == (x,)
    for wrong, said in (({"scale": 3.0}, "got 3.0"), ({}, "got no scale"), ({"scale": 2}, "got 2")):
        with pytest.raises(spmd.SpmdError, match=rf"compiled with scale=2.0, which holds no tensor.*{said}.*What to "
                                                 r"do: pass scale=2.0"):
            call.flatten((x,), wrong)
    # (found by a probe: the value given positionally was told "got no scale"; left out where the forward's default
    # is the traced value, refused)
    with pytest.raises(spmd.SpmdError, match=r"got no scale by keyword, and 1 positional argument more than the 1 "
                                             r"compiled \(x\)\. What to do: pass scale=2.0 by keyword"):
        call.flatten((x, 2.0), {})
    _, _, by_default = positional_call(model, (x,), {"scale": 1.0})
    assert by_default.flatten((x,), {}) == (x,) and by_default.defaulted == ("scale",)
    with pytest.raises(spmd.SpmdError, match=r"got no scale by keyword, and 1 positional argument more"):
        by_default.flatten((x, 1.0), {})  # (its default's value, given positionally: a review)
    with pytest.raises(spmd.SpmdError, match=r"keyword \(none\) inputs \(and the values scale=1.0, fixed when "
                                             r"traced\); got 1 positional, unknown keywords \['mask'\]"):
        by_default.flatten((x,), {"mask": torch.ones(4, 16)})


class _ListIndex(nn.Module):
    """An index given as a Python list (Falcon's `qkv[..., [-2], :]`): a tensor constant in the trace."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 12)

    def forward(self, x):
        return self.fc(x).view(4, 3, 4)[..., [-2, 0], :].sum(1)


def test_an_index_given_as_a_python_list_is_a_constant_input_of_the_training_graph():
    """Falcon's `qkv[..., [-2], :]`: the trace keeps the list as a tensor constant (`get_attr`), which
    planning refused (unsupported node kind get_attr); it is lifted as an input of kind constant, and the
    step trains as eager does."""
    import copy

    from spmd.runtime.simulate import simulate
    from tests.support import check_simulated_training, compile_graph

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model, x, t = _ListIndex(), torch.randn(4, 8), torch.randn(4, 4)
        reference = copy.deepcopy(model)
        loss = F.mse_loss(reference(x), t)
        loss.backward()
        c = compile_graph(model, (x, t), spec((2, 2), ("dp", "tp")), loss_fn=F.mse_loss)
        assert [gi.kind for gi in c.traced.inputs].count("constant") == 1
        assert check_simulated_training(c, simulate(c, (x, t, torch.ones(()))), loss, reference) == 3
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_constant_keyword_changed_in_place_and_an_object_holding_tensors_are_not_taken_as_traced():
    """Only plain values are fixed (copied when traced, compared by value): a list changed in place since
    is another value, and an object that may hold tensors is left to the trace, which refuses it."""
    class Picks(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, cols=None, extra=None):
            y = self.fc(x)[:, cols]
            return y if extra is None else y + extra.t

    cols = [0, 1]
    x = torch.randn(2, 4)
    _, _, call = positional_call(Picks(), (x,), {"cols": cols})
    cols[0] = 3
    with pytest.raises(spmd.SpmdError, match=r"compiled with cols=\[0, 1\].*got \[3, 1\]"):
        call.flatten((x,), {"cols": cols})

    class Holder:
        def __init__(self, t):
            self.t = t

    _, _, call = positional_call(Picks(), (x,), {"cols": [0], "extra": Holder(torch.ones(1))})
    assert [name for name, _ in call.constants] == ["cols"] and call.keywords == ("extra",)


def test_a_state_dict_without_the_lifted_constants_loads():
    """Lifted constants are no state of the model: `load_sharded_state_dict(model.state_dict())` loads."""
    model, x, t = _ListIndex(), torch.randn(4, 8), torch.randn(4, 4)
    compiled = one_device(model, (x, t), training=True, loss_fn=F.mse_loss)
    assert [k for k in compiled._non_persistent if "constant" in k]
    compiled.device_mesh = None
    compiled.load_sharded_state_dict(model.state_dict())
    torch.testing.assert_close(compiled.fc.weight, model.fc.weight)


class _Weighs(torch.autograd.Function):
    """Its backward makes a tensor constant: the joint graph reads it in backward only."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g * torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], dtype=g.dtype)


def test_a_constant_read_only_in_backward_is_an_input_of_the_forward():
    """A lifted constant kept its backward tag, and the forward graph then took one input too few (a
    review's repro): it is an input like any other, saved for backward."""
    import copy

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.b(_Weighs.apply(self.a(x))[:, [1, 3, 5, 7, 0, 2, 4, 6]])

    torch.manual_seed(0)
    model, x, t = Model(), torch.randn(4, 8), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    compiled = one_device(model, (x, t), training=True, loss_fn=F.mse_loss)
    loss = compiled(x, t)
    loss.backward()
    ref_loss = F.mse_loss(reference(x), t)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(compiled.a.weight.grad, reference.a.weight.grad)


def test_a_positional_example_input_holding_no_tensor_names_the_keyword_way():
    """`spmd.compile(model, mesh, (x, 0.5))` crashed with `KeyError: 't'` (the graph has no input for a
    float); it now says to pass the value by keyword, where it is a constant of the call."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x, t):
            return self.fc(x) / t

    with pytest.raises(spmd.SpmdError, match=r"example input t=0\.5 holds no tensor.*example_kwargs=\{'t': \.\.\.\}"):
        positional_call(Scaled(), (torch.randn(2, 4), 0.5), None)
    with pytest.raises(spmd.SpmdError, match=r"example input t=\[.*0\.5\] holds values that are not tensors"):
        positional_call(Scaled(), (torch.randn(2, 4), [torch.ones(1), 0.5]), None)
    positional_call(Scaled(), (torch.randn(2, 4), [torch.ones(1), None]), None)  # (None in a structure is kept)
    positional_call(Scaled(), (torch.randn(2, 4), ()), None)  # (an empty container: nothing to fix, as before)


@pytest.mark.parametrize("graphs", [None, "aot_eager"])
def test_torch_compile_around_a_compiled_module_runs_it_as_it_is(graphs):
    """torch.compile of the compiled module (or of a model holding it) leaves its runtime to run eagerly (dynamo
    tracing its guards recursed without end); its rank graphs go through torch.compile with compile_graphs.
    (aot_eager here: inductor starts a compiler process, which unit tests do not.)"""
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    compiled = one_device(copy.deepcopy(model), (x, y), training=True, loss_fn=F.mse_loss)
    compiled.compile_backend = graphs

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = compiled

        def forward(self, x, y):
            return self.inner(x, y) * 2

    loss = torch.compile(compiled, backend="aot_eager")(x, y)
    (torch.compile(Holder(), backend="aot_eager")(x, y) / 2).backward()
    want = F.mse_loss(model(x), y)
    want.backward()
    torch.testing.assert_close(loss, want)
    for (name, got), ref in zip(compiled.named_parameters(), model.parameters()):
        torch.testing.assert_close(got.grad, ref.grad, msg=name)


def test_the_generator_check_comes_as_often_as_it_costs_a_hundredth_of_a_call():
    """Every rank must compute the same period (each check is collective): from the mesh's links and the plan's
    predicted call alone. A power of two, 1 for calls of seconds, at most 1024."""
    from spmd.core.profiles import LinkProfile
    from spmd.runtime.compiled import GENERATOR_CHECK_EVERY, generator_check_period

    gloo = LinkProfile("gloo-like", 1e-3, 1e9)  # (1 ms per collective: a check is 2 ms per axis of two ranks)
    assert generator_check_period(spec((2,), ("tp",), link=gloo), 3.0) == 1
    assert generator_check_period(spec((2,), ("tp",), link=gloo), 0.05) == 4  # (2 ms / 0.5 ms)
    assert generator_check_period(spec((2, 2), ("dp", "tp"), link=gloo), 0.05) == 8
    assert generator_check_period(spec((1, 2), ("dp", "tp"), link=gloo), 0.05) == 4  # (an axis of one rank: none)
    assert generator_check_period(spec((2,), ("tp",), link=gloo), 1e-3) == 256  # (2 ms / 10 us: 200)
    assert generator_check_period(spec((2,), ("tp",), link=gloo), 1e-4) == GENERATOR_CHECK_EVERY
    assert generator_check_period(spec((2,), ("tp",), link=gloo), 0.0) == GENERATOR_CHECK_EVERY


def test_torch_compile_of_a_wrapper_runs_the_runtime_as_it_is():
    """Found by a probe: `torch.compile` of a wrapper that calls shard_inputs, the module and gather_outputs traced
    their collectives on fake tensors, and the ranks fell out of step (a hang, about one run in two on 2 gloo
    ranks). Each collective-making method is left to run as it is, as forward was."""
    from spmd.runtime.compiled import CompiledModule
    from tests.support import one_device

    for method in ("forward", "shard_inputs", "gather_outputs", "clip_grad_norm_", "grad_norm"):
        assert getattr(getattr(CompiledModule, method), "_torchdynamo_disable", False), method
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).eval()
    x = torch.randn(4, 8)
    compiled = one_device(model, (x,))

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner.gather_outputs(self.inner(*self.inner.shard_inputs(x)))

    torch.testing.assert_close(torch.compile(Wrapper(compiled), backend="eager")(x), model(x))


class _Pairs(nn.Module):
    """A forward that takes a tuple and a dict of tensors (one with None in it)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, pair, extra=None):
        y = self.fc(pair[0]) + pair[1]
        return y if extra is None else y * extra["m"] + (0 if extra["n"] is None else extra["n"])


def test_structured_inputs_are_one_input_per_tensor_named_by_their_path():
    """Found by a probe: a tuple or dict input trained with an IndexError (its tensors were named per
    argument), and a model compiled from one had to be called with the tensors laid flat. Each tensor is an
    input named by its path, as torch.export names them, and calls pass the structures as the example did."""
    a, b, m = torch.randn(4, 8), torch.randn(4, 8), torch.rand(4, 8)
    model = _Pairs()
    view, flat, call = positional_call(model, ((a, b),), {"extra": {"m": m, "n": None}})
    assert call.names == ("pair_0", "pair_1", "extra_m") and flat == (a, b, m)
    torch.testing.assert_close(view(a, b, m), model((a, b), extra={"m": m, "n": None}))
    args, kwargs = call.unflatten(flat)
    assert args[0][0] is a and args[0][1] is b and kwargs["extra"]["m"] is m and kwargs["extra"]["n"] is None
    assert call.flatten(*call.unflatten((b, a, m))) == (b, a, m)
    for wrong, said in ((((a, b, m),), "(tensor, tensor, tensor)"), (([a],), "[tensor]")):
        with pytest.raises(spmd.SpmdError, match=rf"compiled for inputs laid out as \(\(tensor, tensor\), "
                                                 rf"{{'m': tensor, 'n': None}}\); got \({re.escape(said)}, .*What to do: "
                                                 "pass the same structures"):
            call.flatten(wrong, {"extra": {"m": m, "n": None}})
    with pytest.raises(spmd.SpmdError, match=r"got .*\{'m': tensor, 'n': tensor\}"):
        call.flatten(((a, b),), {"extra": {"m": m, "n": m}})
    # a structure holding something that is not a tensor cannot be rebuilt: refused, naming it
    with pytest.raises(spmd.SpmdError, match=r"example_kwargs extra=\{'m': .* holds tensors and other values.*What to "
                                             "do: pass the tensors it holds"):
        positional_call(model, ((a, b),), {"extra": {"m": m, "n": 2.0}})


def test_a_loss_functions_targets_come_after_the_keyword_inputs():
    """Found by a probe: with a loss_fn and a tensor keyword, the target took the name of the forward's next
    parameter (`mask`), so compiling was refused as "also given positionally"; where names did not clash, the
    keyword was taken as the target. The targets are named by the loss and go last."""
    x, y, mask = torch.randn(4, 16), torch.randn(4, 16), torch.ones(4, 16)
    view, flat, call = positional_call(Masked(), (x, y), {"mask": mask}, loss_fn=F.mse_loss)
    assert call.positional == ("x", "target") and call.keywords == ("mask",) and call.names == ("x", "mask", "target")
    assert flat == (x, mask, y)
    args, kwargs = call.unflatten(flat)
    assert args == (x, y) and kwargs == {"mask": mask}
    with pytest.raises(spmd.SpmdError, match=r"the loss's target target is a tuple.*one parameter per tensor"):
        positional_call(Masked(), (x, (y, y)), {}, loss_fn=F.mse_loss)


@pytest.mark.parametrize("inputs, kwargs, names", [
    (((torch.randn(4, 8), torch.randn(4, 8)), torch.randn(4, 8)), {}, ("pair_0", "pair_1", "target")),
    ((torch.randn(4, 8),), {"pair": (torch.randn(4, 8), torch.randn(4, 8)),
                            "extra": {"m": torch.rand(4, 8), "n": torch.randn(4, 8)}},
     ("pair_0", "pair_1", "extra_m", "extra_n", "target")),
])
def test_structured_inputs_plan_for_training(inputs, kwargs, names):
    plan = spmd.plan(_Pairs(), TP, inputs, example_kwargs=kwargs, loss_fn=F.mse_loss)
    assert [plan.labels[n] for n in plan.labels if plan.labels[n] in names] == list(names), plan.labels


def test_structures_are_matched_by_what_they_hold():
    """Found by a review: a dict in another key order, or a list where the example had a tuple (torch's
    `default_collate` turns a dataset's tuples into lists), was refused for a layout that reads the same; a None
    in a positional structure was refused where a keyword's was kept."""
    import collections

    a, m, n = torch.randn(4, 8), torch.rand(4, 8), torch.randn(4, 8)
    _, flat, call = positional_call(_Pairs(), ((a, None),), {"extra": {"m": m, "n": n}})
    assert call.names == ("pair_0", "extra_m", "extra_n") and flat == (a, m, n)
    assert call.flatten(([a, None],), {"extra": {"n": n, "m": m}}) == (a, m, n)
    args, kwargs = call.unflatten(flat)
    assert isinstance(args[0], tuple) and list(kwargs["extra"]) == ["m", "n"]
    with pytest.raises(spmd.SpmdError, match=r"laid out as \(\(tensor, None\), .*got \(\(tensor, tensor\), "):
        call.flatten(([a, a],), {"extra": {"m": m, "n": n}})
    Pair = collections.namedtuple("Pair", "x y")
    _, flat, call = positional_call(_Pairs(), (Pair(a, n),), None)
    assert call.names == ("pair_x", "pair_y") and call.flatten(((a, n),), {}) == (a, n)
    assert type(call.unflatten(flat)[0][0]) is Pair


def test_inputs_on_the_meta_device_are_refused_by_name():
    """Found by a probe: an input on meta (a batch built under `torch.device("meta")` with the model) ran into the
    graphs and came back as torch's "Tensor on device cpu is not on the expected device meta!"."""
    compiled = one_device(nn.Linear(8, 4), (torch.randn(4, 8),))
    x = torch.randn(4, 8, device="meta")
    with pytest.raises(spmd.SpmdError, match=r"input 'input': on the meta device, which holds no values"):
        compiled.shard_inputs(x)
    with pytest.raises(spmd.SpmdError, match=r"input 'input': expected it on the device it was compiled on, got it "
                                             r"on meta, which holds no values\nWhat to do: pass a tensor with values"):
        compiled(x)
