"""check_stamping: does the model at full depth run the traced layers repeated, and nothing else?

Before: a model, its example inputs and its layer stacks (`find_layer_stacks`), whose truncated trace
stamping will grow to full depth (`stamp_layers`). After: nothing changes (the model's parameters,
buffers and plain attributes are as they were); the answer is None when the full-depth forward is what
stamping builds, else a sentence saying where it is not.

Stamping copies the middle traced layer, so it is right when the model at full depth runs (1) the same
ops outside its layers as the model cut to `TRACED` layers, and (2) in each layer the ops of the traced
layer it stands for: the first and last as traced, every other one as the middle one (`MIDDLE`), on
the same values. A forward that reads its own depth breaks (1) or the ops of (2):
`if i == config.n_layer - 1: x = norm(x)` in the parent runs an op the cut model never does;
`x * (1 / len(self.layers))` passes another constant; a layer index used in arithmetic changes a
layer's constants. A parent that hands each layer its own tensor breaks the values of (2) with the same
ops: `layer(x, self.gates[i])`, a buffer picked by `i % 2`, the rows of one parameter zipped with the
layers, a list of per-layer inputs, layer 0's output mixed into every layer, `torch.tensor(scale_i)`.
So each op's tensors are recorded by where they come from, relative to the layer that reads them: made
by an earlier op of this layer, by the layer `d` before it, outside the layers; this layer's own
parameter or buffer (by its name in the layer), another module's (by its full name), an input, or a
constant (by its values).

For a training step the forwards run with autograd on, and each layer's autograd is compared too: whether
each op is recorded (a parent that runs layer 5 under no_grad), the hooks registered on its tensors, and the
plain values an `autograd.Function` keeps on its `ctx` for its backward; all three change the gradients and
no op of the forward (found by a probe: 0.24, 0.61 and 0.016 off one device, stamped).

Both forwards run on fake tensors, with the model's parameters and buffers swapped for fake copies
(`torch.func.functional_call`: a forward that counts its calls in a buffer, `self.step += 1`, writes
the copy) and its modules' plain attributes put back after (`state_kept`: a Python counter), then are
compared op by op. The cost is one forward of the model without computing anything (~0.1 s per 1,000 ops).
"""
from __future__ import annotations

import hashlib

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from spmd.passes.find_layer_stacks import TRACED, LayerStack, layers_of, truncated
from spmd.passes.kept_state import state_kept
from spmd.passes.stamp_layers import MIDDLE


def _stands_for(k: int, depth: int) -> int:
    """The traced layer that layer `k` of a stack of `depth` is stamped from."""
    return 0 if k == 0 else TRACED - 1 if k == depth - 1 else MIDDLE


class _Recorder(TorchDispatchMode):
    """Each ATen op as (op, its arguments: tensors as (shape, dtype, where the tensor comes from), the rest
    as text, and in training whether autograd records it), under the label of the layer that runs it
    ((stack, index); None: outside every layer)."""

    def __init__(self, state: dict[int, str], own: dict[int, dict[int, str]], inputs: dict[int, int],
                 depths: dict[int, int], joint: bool = False):
        super().__init__()
        self.label, self.joint = None, joint
        self.ops: dict = {}
        self.state, self.own, self.inputs, self.depths = state, own, inputs, depths
        self.made: dict[int, tuple] = {}  # id(tensor) -> (label, op position in its label's list, output index)
        self.held: list = []  # the outputs, alive for the run (ids stay theirs)

    def _where(self, t: torch.Tensor) -> tuple:
        here = self.label
        made = self.made.get(id(t))
        if made is not None:
            label, position, output = made
            if label == here:
                return ("here", position, output)
            if label is None:
                return ("outside", position, output)
            s, j = label
            if here is not None and here[0] == s:
                return ("layer before", here[1] - j, position, output)
            return ("layer", s, _stands_for(j, self.depths[s]), position, output)
        key = id(t)
        if here is not None and key in self.own.get(here, {}):
            return ("own", self.own[here][key])
        for (s, j), tensors in self.own.items():
            if key in tensors:
                if here is not None and here[0] == s:
                    return ("state of the layer before", here[1] - j, tensors[key])
                return ("state of layer", s, _stands_for(j, self.depths[s]), tensors[key])
        if key in self.state:
            return ("state", self.state[key])
        if key in self.inputs:
            return ("input", self.inputs[key])
        if isinstance(t, FakeTensor) or t.is_meta or t.layout != torch.strided:
            return ("tensor",)
        with unset_fake_temporarily():  # (a constant: `torch.tensor(scale)`, a plain attribute; read for real)
            values = t.detach().to("cpu").contiguous().flatten()
            if values.numel() <= 16:
                return ("constant", tuple(values.tolist()))
            raw = values.view(torch.uint8) if values.dtype != torch.bool else values.to(torch.uint8)
            return ("constant", hashlib.sha1(raw.numpy().tobytes()).hexdigest())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "prim":  # (a query of a tensor's device or layout, which autograd makes as it likes:
            return func(*args, **kwargs)  # more for a layer whose input needs no gradient)
        flat, _ = tree_flatten((args, kwargs))
        key = (func, tuple((tuple(a.shape), a.dtype, self._where(a)) if isinstance(a, torch.Tensor) else repr(a)
                           for a in flat), self.joint and torch.is_grad_enabled())
        ops = self.ops.setdefault(self.label, [])
        position = len(ops)
        ops.append(key)
        out = func(*args, **kwargs)
        for i, o in enumerate(tree_flatten(out)[0]):
            if isinstance(o, torch.Tensor) and id(o) not in self.made and id(o) not in self.state:
                self.made[id(o)] = (self.label, position, i)
                self.held.append(o)
        return out


class _Hooks(TorchFunctionMode):
    """A hook registered on a tensor (`register_hook`, a post-accumulate one, `retain_grad`), as one more entry of
    the ops of the layer that registers it: in training it changes the gradients, which no op shows."""

    WATCHED = frozenset({"register_hook", "register_post_accumulate_grad_hook", "retain_grad"})

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.WATCHED:
            self.recorder.ops.setdefault(self.recorder.label, []).append((_AUTOGRAD, name))
        return func(*args, **(kwargs or {}))


_AUTOGRAD = "autograd"  # (the first item of an entry that is not an op: a hook, an autograd.Function's backward)


def _custom_backwards(recorder: _Recorder) -> None:
    """In training, each tensor an `autograd.Function` made: its backward's class and the plain values its forward
    kept on `ctx` for it (`ctx.scale = s`), as one more entry of the ops of the layer that made it: a per-layer
    value only the backward reads changes no op (found by a probe: 0.016 off after 3 steps, stamped)."""
    for t in recorder.held:
        node = getattr(t, "grad_fn", None)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            label, position, output = recorder.made[id(t)]
            kept = tuple(sorted((k, _kept_value(v)) for k, v in vars(node).items() if not isinstance(v, torch.Tensor)))
            recorder.ops.setdefault(label, []).append((_AUTOGRAD, type(node).__name__, position, output, kept))


def _kept_value(v) -> str:
    """A value kept on an autograd.Function's `ctx`, as compared: a number, a string or None (and tuples of them) by
    its value; anything else by its type (a function by its name: a checkpoint's closure made anew for each layer
    has its own address, which a review found compared, so that layer 0 differed from itself)."""
    if v is None or isinstance(v, (bool, int, float, complex, str, torch.dtype, torch.device)):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return f"{type(v).__name__}({', '.join(map(_kept_value, v))})"
    return getattr(v, "__qualname__", None) or type(v).__qualname__


def _run(root: torch.nn.Module, inputs: tuple, layers: dict[int, tuple], depths: dict[int, int],
         joint: bool = False) -> dict:
    """The ops `root(*inputs)` dispatches, per label; `layers`: id(layer module) -> its label. Runs on fake
    copies of the parameters, buffers and inputs; the modules' plain attributes are put back after. `joint`: a
    training step's forward, run with autograd on (the ops it records, the hooks, the autograd.Functions)."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}

    def fake(t):
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in fakes:
            fakes[id(t)] = t if isinstance(t, FakeTensor) else mode.from_tensor(t, static_shapes=True)
        return fakes[id(t)]

    named = [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]
    swapped = {name: fake(t) for name, t in named}
    state = {}
    for name, t in named:
        state.setdefault(id(swapped[name]), name)
    own: dict[tuple, dict[int, str]] = {}
    for module in root.modules():
        label = layers.get(id(module))
        if label is not None:
            own[label] = {id(fake(t)): n for n, t in [*module.named_parameters(remove_duplicate=False),
                                                      *module.named_buffers(remove_duplicate=False)]}
    flat_inputs = tree_flatten(inputs)[0]
    fake_inputs = tree_map(fake, inputs)
    input_ids = {id(fake(t)): i for i, t in enumerate(flat_inputs) if isinstance(t, torch.Tensor)}

    recorder = _Recorder(state, own, input_ids, depths, joint)
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
    # (in training with autograd on: a layer its parent runs under no_grad, by its index, trained stamped with the
    # others' gradients, 0.24 off after 3 steps; found by a probe)
    grad = torch.enable_grad() if joint else torch.no_grad()
    try:  # (`state_kept`: a forward that counts its calls in a plain attribute, or caches a tensor)
        with state_kept(root), mode, recorder, _Hooks(recorder), grad:
            torch.func.functional_call(root, swapped, fake_inputs, tie_weights=False)
        if joint:
            _custom_backwards(recorder)
    finally:
        for h in handles:
            h.remove()
    return recorder.ops


def _unsourced(ops: list) -> list:
    """`ops` without where their tensors come from: the ops, their tensors' shapes and dtypes, the rest."""
    return [(op[0], tuple(a[:2] if isinstance(a, tuple) else a for a in op[1])) for op in _ops_alone(ops)]


def _ops_alone(ops: list) -> list:
    """`ops` without what autograd does with them: whether it records them, the hooks, the Functions' backwards."""
    return [(op[0], op[1]) for op in ops if op[0] != _AUTOGRAD]


def check_stamping(root: torch.nn.Module, inputs: tuple, model: torch.nn.Module,
                   stacks: tuple[LayerStack, ...], joint: bool = False) -> str | None:
    """None if `root(*inputs)` (the model, or the model with its loss) at full depth runs what stamping
    `model`'s `stacks` from their first TRACED layers builds; else where it does not. `joint`: for a training
    step, autograd compared too (each op recorded or not, hooks on tensors, what an autograd.Function's
    backward keeps)."""
    labels: dict[int, tuple] = {}
    for s, stack in enumerate(stacks):
        for k, layer in enumerate(layers_of(model.get_submodule(stack.fqn))):
            labels[id(layer)] = (s, k)
    try:
        full = _run(root, inputs, labels, {s: stack.depth for s, stack in enumerate(stacks)}, joint)
        with truncated(model, stacks):
            cut = _run(root, inputs, labels, {s: TRACED for s in range(len(stacks))}, joint)
    except Exception as e:  # the forward does not run on fake tensors: nothing to compare it with
        return f"the forward did not run on fake tensors to check the stamped layers ({type(e).__name__}: {e})"
    if full.get(None, []) != cut.get(None, []):
        return ("the forward outside the layers differs at full depth (it reads the number of layers, or does "
                "something between the layers by their index)")
    for s, stack in enumerate(stacks):
        for k in range(stack.depth):
            stands_for = _stands_for(k, stack.depth)
            theirs, ours = full.get((s, k), []), cut.get((s, stands_for), [])
            if theirs != ours:
                what = (f"the ops of traced layer {stands_for} with other autograd (under another grad mode, a hook "
                        "on its tensors, or other values kept for an autograd.Function's backward)"
                        if _ops_alone(theirs) == _ops_alone(ours) else
                        f"the ops of traced layer {stands_for} on other values (the parent hands each layer its own "
                        "tensor: a parameter or buffer picked by the layer's index, a row of one, a per-layer input, "
                        "an earlier layer's output, or a constant)" if _unsourced(theirs) == _unsourced(ours) else
                        f"other ops or constants than traced layer {stands_for} (it reads its index or the depth)")
                return f"layer {k} of {stack.fqn} runs {what}"
    return None
