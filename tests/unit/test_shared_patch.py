"""Process-wide patches shared by overlapping traces on several threads (spmd/core/shared_patch.py)."""
from __future__ import annotations

import threading

import torch

from spmd.core.shared_patch import SharedPatch, class_attribute_patch
from spmd.passes.trace_joint import _tensor_hooks, custom_functions


def test_overlapping_users_leaving_out_of_order_put_the_original_back():
    """The first to enter makes the change, the last to leave undoes it, whatever the order they leave in (a
    save-and-restore per use left the first's patch in place for good)."""
    flag = {"on": False}
    patch = SharedPatch(lambda: flag.update(on=True), lambda saved: flag.update(on=False))
    a, b = patch.__enter__(), patch.__enter__()
    assert flag["on"] and patch.active
    a.__exit__(None, None, None)
    assert flag["on"]
    b.__exit__(None, None, None)
    assert not flag["on"] and not patch.active


def test_a_class_attribute_patch_leaves_an_inherited_attribute_inherited():
    class Base:
        def f(self):
            return "base"

    class Child(Base):
        pass

    patch = class_attribute_patch(Child, "f", lambda self: "patched")
    with patch:
        assert Child().f() == "patched" and patch.saved is None
    assert "f" not in Child.__dict__ and Child().f() == "base"


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def test_another_threads_functions_and_hooks_are_not_this_traces():
    """`custom_functions` and `_tensor_hooks` collect what this thread runs: before, a model traced in one thread
    was taken to apply the Functions (and hooks) of one another thread ran meanwhile, and the thread that left
    first put torch's `Function.apply` back under the other's feet, the other then its own patch, for good."""
    opened, ran = threading.Event(), threading.Event()
    seen = {}

    def tracing():
        with custom_functions() as applied, _tensor_hooks() as hooked:
            opened.set()
            ran.wait(10)
            seen.update(applied=set(applied), hooked=list(hooked))

    thread = threading.Thread(target=tracing)
    thread.start()
    opened.wait(10)
    with custom_functions() as mine:
        x = torch.ones(2, requires_grad=True)
        _Double.apply(x).register_hook(lambda g: g)
    ran.set()
    thread.join(10)
    assert mine == {"_Double"}
    assert seen == {"applied": set(), "hooked": []}
    assert "apply" in torch.autograd.Function.__dict__ and torch.autograd.Function.__dict__["apply"].__func__.__name__ \
        == "apply" and "register_hook" in torch.Tensor.__dict__
    assert torch.Tensor.__dict__["register_hook"].__name__ == "register_hook"
