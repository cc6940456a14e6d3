"""Whether a model's forward runs other ops in train mode than in eval mode, found by running it.

A compiled graph does what the model did in the mode it was traced in. `CompiledModule` knows the usual
reasons a call in the other mode would differ without running anything (dropout modules, batch norm with
running statistics: `compiled._mode_dependent`). Code that reads `self.training` itself escapes that:
`F.dropout(x, p, self.training)`, a branch taken only in training. So the first call in the other mode,
where nothing known depends on it, runs the traced forward in both modes on fake tensors (no memory, no
values: FakeTensorMode) and compares the floating-point ATen ops each ran, in order, with their arguments.
Different ops, or the same ops with other constants or slices, mean the compiled graph would compute what the
traced mode computes, not what this one does.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from spmd.runtime.distribute import values_digest


# ops that only move or re-wrap a tensor: how a forward hands values around, not what it computes
_BOOKKEEPING = frozenset({"lift_fresh", "lift_fresh_copy", "alias", "detach", "_to_copy", "clone"})


_CONCRETE_NUMEL = 1 << 20  # integer and boolean tensors worked out for real up to this size (masks, indices)


class _Ops(TorchDispatchMode):
    """The ATen ops run under it that compute floating-point values, in order, each with its arguments: a
    parameter or buffer by its name (an EMA copy of a head read in eval mode alone, `self.fc.weight if
    self.training else self.ema.weight`, runs the same ops on another tensor), a small constant by its values
    (`torch.tensor(0.5 if self.training else 1.0)`), an integer or boolean tensor that depends on no input by
    its values, worked out for real (a mask `torch.arange(n) < (16 if self.training else 32)`, a
    `torch.full(..., self.training)`, an index `arange(n) % k`), any other tensor by its shape and dtype, and the
    rest as written (a constant or a slice that only one mode uses, `x * (2.0 if self.training else 3.0)`). The
    first three were taken for one another by shape and dtype alone, so such a forward ran the traced mode's
    graph in the other mode, silently (found by a probe: 1.5e-2 to 3.5e-2 off). Integer and boolean work is known
    by what it makes, not how: positions made by other ops in one mode (transformers' cache positions, which
    it switches off in training) are the same positions. A random one (`randperm`) is known by how it is drawn.
    Bookkeeping (copies, aliases) is the tensor it copies."""

    def __init__(self, names: dict[int, str] | None = None):
        super().__init__()
        self.calls: list[tuple] = []  # (op name, overload, arguments)
        self.names = dict(names or {})  # id(tensor) -> how it is known: a state tensor's name, a drawn one's draw
        self.values: dict[int, torch.Tensor] = {}  # id(integer or boolean fake) -> its values, worked out
        self.kept: list[torch.Tensor] = []  # (the tensors known by id, kept alive while it runs)

    def _concrete(self, a):
        """`a`'s values where they are known (worked out, or a fake's small constant), else None."""
        if id(a) in self.values:
            return self.values[id(a)]
        constant = getattr(a, "constant", None)
        return constant if constant is not None and constant.numel() <= _CONCRETE_NUMEL else None

    def _known(self, a):
        if not isinstance(a, torch.Tensor):
            return repr(a)
        if id(a) in self.names:
            return self.names[id(a)]
        values = self._concrete(a)
        if values is not None:
            return ("values", tuple(a.shape), str(a.dtype), _digest(values))
        return (tuple(a.shape), a.dtype)

    def _keep(self, out, how=None, values=None) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                if how is not None:
                    self.names[id(t)] = how
                self.kept.append(t)
        if values is not None and isinstance(out, torch.Tensor):
            self.values[id(out)] = values

    def _worked_out(self, func, args, kwargs):
        """`func` on the known values of its tensor arguments (None where one is not known)."""
        flat, spec = tree_flatten((args, kwargs))
        real = []
        for a in flat:
            if isinstance(a, torch.Tensor):
                a = self._concrete(a)
                if a is None:
                    return None
            real.append(a)
        args, kwargs = tree_unflatten(real, spec)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": "cpu"}
        try:
            with unset_fake_temporarily():
                out = func(*args, **kwargs)
        except Exception:
            return None
        return out if isinstance(out, torch.Tensor) else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace != "aten":
            return out
        name = func._overloadpacket.__name__
        if name in _BOOKKEEPING:  # (an alias or a copy of a tensor is known as that tensor)
            first = next((a for a in tree_leaves(args) if isinstance(a, torch.Tensor)), None)
            if first is not None and (id(first) in self.names or id(first) in self.values):
                self._keep(out, self.names.get(id(first)), self.values.get(id(first)))
            elif name.startswith("lift_fresh") and first is not None and not isinstance(first, FakeTensor) and \
                    first.numel() <= _CONCRETE_NUMEL:  # (a constant `torch.tensor([1, 2])`: its values)
                with unset_fake_temporarily():  # (a real copy: made under the fake mode, it would be a fake)
                    self._keep(out, values=first.detach().clone())
            return out
        known = tuple(self._known(a) for a in tree_leaves((args, kwargs or {})))
        if func._schema.is_mutable:  # (written in place: what was known of its values no longer holds)
            for a in tree_leaves((args, kwargs or {})):
                if isinstance(a, torch.Tensor):
                    self.values.pop(id(a), None)
        if any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tree_leaves(out)):
            self.calls.append((name, str(func), known))
        elif torch.Tag.nondeterministic_seeded in func.tags:  # (drawn: the same draw in both modes is the same)
            self._keep(out, ("drawn", str(func), known))
        elif isinstance(out, torch.Tensor) and not func._schema.is_mutable and "empty" not in name and \
                out.numel() <= _CONCRETE_NUMEL:  # (not uninitialized memory; nothing large made for real)
            values = self._worked_out(func, args, kwargs or {})
            if values is not None:
                self._keep(out, values=values)
        return out


def _digest(values: torch.Tensor) -> int:
    """`values_digest` of real `values`, read outside the fake mode the check runs under."""
    with unset_fake_temporarily():
        return values_digest(values)


def ops_differ_by_mode(root: torch.nn.Module, inputs: list[tuple[tuple[int, ...], torch.dtype]]) -> str | None:
    """The floating-point ops `root`'s forward runs in only one of the two modes (a short description), or
    None where both run the same ones. `inputs`: the shape and dtype of each positional input of `root`
    (the traced call). The forward runs on fake copies of the parameters and buffers (an in-place update of
    a buffer, a step counter, changes nothing real), with grad enabled and the attention fast path off as in
    a training step (torch's eval-only fast paths are what the graph was traced without, not a difference
    of the model's). A forward that cannot run on fake tensors (data-dependent Python, say) answers None:
    nothing is known. `root` and its submodules keep their modes and attributes."""
    return _differ(root, inputs, {"train mode": _Setting(training=True), "eval mode": _Setting(training=False)})


def ops_differ_by_grad(root: torch.nn.Module, inputs: list[tuple[tuple[int, ...], torch.dtype]],
                       inference: bool = False) -> str | None:
    """As `ops_differ_by_mode`, between grad enabled (as every graph is traced) and disabled (a call under
    `torch.no_grad()`, or with `inference` under `torch.inference_mode()`), in the modules' own modes: a forward
    that branches on `torch.is_grad_enabled()` or `torch.is_inference_mode_enabled()` itself."""
    off = "inference_mode" if inference else "no_grad"
    return _differ(root, inputs, {"grad on": _Setting(), off: _Setting(grad=off)})


def ops_differ_by_input_grads(root: torch.nn.Module, inputs: list[tuple[tuple[int, ...], torch.dtype]],
                              traced: tuple[bool, ...], now: tuple[bool, ...]) -> str | None:
    """As `ops_differ_by_mode`, between the inputs' `requires_grad` as traced and as now (a forward that branches on
    `x.requires_grad`), with grad on and the modules in their own modes."""
    return _differ(root, inputs, {"the example's case": _Setting(input_grads=traced),
                                  "this call's case": _Setting(input_grads=now)})


def grad_mode(grad: str):
    """A context that runs code as under `grad`: "on", "no_grad", or "inference_mode" (no_grad, with
    `torch.is_inference_mode_enabled()` saying True: a trace can run in no other way; see `_Setting.context`)."""
    return _Setting(grad=grad).context()


def ops_differ_by_frozen(root: torch.nn.Module, inputs: list[tuple[tuple[int, ...], torch.dtype]],
                         traced: frozenset[int], now: frozenset[int]) -> str | None:
    """As `ops_differ_by_mode`, between `root`'s parameters frozen as when traced and as now (sets of the ids of
    those with requires_grad=False): a forward that branches on a parameter's `requires_grad`."""
    return _differ(root, inputs, {"as compiled": _Setting(frozen=traced), "as now": _Setting(frozen=now)})


@dataclasses.dataclass(frozen=True)
class _Setting:
    """How the forward runs: `training` (None: each module's own mode), `grad`, "on", "no_grad" or
    "inference_mode", `input_grads`, each floating-point input's requires_grad (None: none requires it), and
    `frozen`, the ids of the parameters without requires_grad (None: each as it is)."""

    training: bool | None = None
    grad: str = "on"
    input_grads: tuple[bool, ...] | None = None
    frozen: frozenset[int] | None = None

    @contextlib.contextmanager
    def context(self):
        """Grad on or off; for "inference_mode", off with `torch.is_inference_mode_enabled()` saying True: under
        inference mode itself torch leaves composite ops whole (`linear`, where grad mode runs `t` and `addmm`),
        which would differ in every forward."""
        if self.grad == "on":
            with torch.enable_grad():
                yield
            return
        asked = torch.is_inference_mode_enabled
        held = _holders_of(asked) if self.grad == "inference_mode" else []
        try:
            for names, name in held:
                names[name] = _inference_mode_on
            with torch.no_grad():
                yield
        finally:
            for names, name in held:
                names[name] = asked


def _inference_mode_on() -> bool:
    return True


def _holders_of(fn) -> list[tuple[dict, str]]:
    """(globals, name) of each module's global that holds `fn`: torch's own name, and every module of the user's
    that imported it by name (`from torch import is_inference_mode_enabled`, which patching `torch.` alone
    missed: the forward ran its other branch, 0.98 off; a review). torch's submodules are left alone."""
    found = [(vars(torch), "is_inference_mode_enabled")]
    for module_name, module in list(sys.modules.items()):
        names = getattr(module, "__dict__", None)
        if module is torch or module_name.startswith("torch.") or not isinstance(names, dict):
            continue
        found += [(names, name) for name, value in list(names.items()) if value is fn]
    return found


def _differ(root, inputs, settings: dict[str, _Setting]) -> str | None:
    """The difference between the ops the forward runs under the two `settings`, described with their labels,
    or None."""
    from torch._export.utils import _compiling_state_context
    from torch._subclasses.fake_tensor import FakeTensorMode

    from spmd.passes.kept_state import state_kept

    device = next((t.device for t in root.parameters()), torch.device("cpu"))
    seen = {}
    fastpath = torch.backends.mha.get_fastpath_enabled()
    params = {id(t) for t in root.parameters()}  # (what a setting's `frozen` may hold)
    stack = contextlib.ExitStack()
    try:
        torch.backends.mha.set_fastpath_enabled(False)
        stack.enter_context(torch.inference_mode(False))  # (asked under the user's inference mode: fakes need grad)
        for label, setting in settings.items():
            with state_kept(root), FakeTensorMode(allow_non_fake_inputs=True), _compiling_state_context(), \
                    torch.enable_grad():
                # (one name per tensor: functional_call ties the others, and refused a tied weight given under
                # each name, which the `except` below took for a forward it cannot run: the check was off for
                # GPT-2, BERT and T5; a review)
                state = {name: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device
                                                   ).requires_grad_(t.requires_grad if setting.frozen is None
                                                                    else id(t) in params and id(t) not in setting.frozen)
                         for kind in (root.named_parameters(), root.named_buffers())
                         for name, t in kind if t is not None}
                flags = setting.input_grads or (False,) * len(inputs)
                args = [torch.empty(shape, dtype=dtype, device=device).requires_grad_(flag and dtype.is_floating_point)
                        for (shape, dtype), flag in zip(inputs, flags)]
                if setting.training is not None:
                    root.train(setting.training)
                with setting.context(), _Ops({id(t): ("state", name) for name, t in state.items()}) as ops:
                    torch.func.functional_call(root, state, tuple(args), tie_weights=True, strict=False)
            seen[label] = ops.calls
    except Exception:  # (the trace ran this forward under AOTAutograd; a plain fake run may still not)
        return None
    finally:
        stack.close()
        torch.backends.mha.set_fastpath_enabled(fastpath)
    (a, first), (b, second) = seen.items()
    if first == second:
        return None
    counts = {a: Counter(name for name, _, _ in first), b: Counter(name for name, _, _ in second)}
    only = {a: sorted(set(counts[a]) - set(counts[b])), b: sorted(set(counts[b]) - set(counts[a]))}
    parts = [f"{', '.join(ops[:6])}{f' and {len(ops) - 6} more' if len(ops) > 6 else ''} only in {label}"
             for label, ops in only.items() if ops]
    if parts:
        return "; ".join(parts)
    if counts[a] != counts[b]:
        return "the same ops, run a different number of times"
    k, (x, y) = next((k, pair) for k, pair in enumerate(zip(first, second)) if pair[0] != pair[1])
    if x[1] != y[1]:
        return f"the same ops in another order (op {k}: {x[1]} in {a}, {y[1]} in {b})"
    return f"{x[1]} with other arguments (op {k}: {_shown(x[2])} in {a}, {_shown(y[2])} in {b})"


def _shown(args: tuple) -> str:
    def one(a) -> str:
        if not isinstance(a, tuple):
            return a
        if a[0] == "state":
            return a[1]
        if a[0] == "values":
            return f"a {a[2].replace('torch.', '')} tensor{list(a[1])} of other values"
        if a[0] == "drawn":
            return f"a tensor drawn by {a[1]}"
        return f"tensor{list(a[0])}"
    return ", ".join(one(a) for a in args)
