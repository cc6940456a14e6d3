"""check_stamping: does the model at full depth run the traced layers repeated, and nothing else?

Before: a model, its example inputs and its layer stacks (`find_layer_stacks`), whose truncated trace
stamping will grow to full depth (`stamp_layers`). After: nothing changes; the answer is None when the
full-depth forward is what stamping builds, else a sentence saying where it is not.

Stamping copies the middle traced layer, so it is right when the model at full depth runs (1) the same
ops outside its layers as the model cut to `TRACED` layers, and (2) in each layer the ops of the traced
layer it stands for: the first and last as traced, every other one as the middle one (`MIDDLE`). A forward that
reads its own depth breaks one of them: `if i == config.n_layer - 1: x = norm(x)` in the parent runs an op
the cut model never does; `x * (1 / len(self.layers))` passes another constant; a layer index used in
arithmetic changes a layer's constants. Both forwards run on fake tensors (no kernels, real weights
untouched) and are compared op by op: the ATen op, the shapes and dtypes of its tensors, its other
arguments. The cost is one forward of the model without computing anything (~0.1 s per 1,000 ops).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from spmd.passes.find_layer_stacks import TRACED, LayerStack, layers_of, truncated
from spmd.passes.stamp_layers import MIDDLE


class _Recorder(TorchDispatchMode):
    """Each ATen op as (op, its arguments with tensors as (shape, dtype)), under the label of the layer
    that runs it (None: outside every layer)."""

    def __init__(self):
        super().__init__()
        self.label = None
        self.ops: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        key = (func, tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in flat))
        self.ops.setdefault(self.label, []).append(key)
        return func(*args, **kwargs)


def _run(root: torch.nn.Module, inputs: tuple, layers: dict[int, tuple]) -> dict:
    """The ops `root(*inputs)` dispatches, per label; `layers`: id(layer module) -> its label."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    recorder = _Recorder()
    handles = []
    for module in root.modules():
        label = layers.get(id(module))
        if label is None:
            continue

        def enter(m, a, label=label):
            recorder.label = label

        def leave(m, a, out):
            recorder.label = None

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    mode = detect_fake_mode(inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode, recorder, torch.no_grad():
            root(*inputs)
    finally:
        for h in handles:
            h.remove()
    return recorder.ops


def check_stamping(root: torch.nn.Module, inputs: tuple, model: torch.nn.Module,
                   stacks: tuple[LayerStack, ...]) -> str | None:
    """None if `root(*inputs)` (the model, or the model with its loss) at full depth runs what stamping
    `model`'s `stacks` from their first TRACED layers builds; else where it does not."""
    labels: dict[int, tuple] = {}
    for s, stack in enumerate(stacks):
        for k, layer in enumerate(layers_of(model.get_submodule(stack.fqn))):
            labels[id(layer)] = (s, k)
    try:
        full = _run(root, inputs, labels)
        with truncated(model, stacks):
            cut = _run(root, inputs, labels)
    except Exception as e:  # the forward does not run on fake tensors: nothing to compare it with
        return f"the forward did not run on fake tensors to check the stamped layers ({type(e).__name__}: {e})"
    if full.get(None, []) != cut.get(None, []):
        return "the forward outside the layers differs at full depth (it reads the number of layers)"
    for s, stack in enumerate(stacks):
        for k in range(stack.depth):
            stands_for = 0 if k == 0 else TRACED - 1 if k == stack.depth - 1 else MIDDLE
            if full.get((s, k), []) != cut.get((s, stands_for), []):
                return (f"layer {k} of {stack.fqn} runs other ops or constants than traced layer {stands_for} "
                        "(it reads its index or the depth)")
    return None
