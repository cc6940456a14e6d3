"""The plain attributes of the model's modules that its forward reads, and a guard on their values.

A trace turns what the forward reads from its modules into constants of the graph: a temperature
(`self.temperature`, annealed by the training loop through `model.set_gumbel_temperature(t)`), a dropout
probability (`nn.Dropout.p`), a flag (`self.gradient_checkpointing`), a layer-drop rate. Set on the model
after compiling, the new value reaches nothing: the compiled module goes on with the old one, silently
(torch.compile guards on them and recompiles; spmd compiles once).

`reading(model)` notes, while the model is traced, which plain attributes (None, bools, numbers, strings,
dtypes, devices, and tuples of them; `training` aside: `CompiledModule` checks the mode itself) each module
reads from its own `__dict__`. `AttributeGuard` holds their values on the user's model when compiled and
names any that changed when the compiled module is called.
"""
from __future__ import annotations

import contextlib
import copy

import torch

from spmd.core.errors import SpmdError

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
_recorders: dict[type, type] = {}  # a module class -> its recording subclass
_active: list[tuple[dict[int, str], set]] = []  # (id(module) -> path, reads) of the traces under way


def plain(value) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(plain(v) for v in value))


def _recording(cls: type) -> type:
    """A subclass of `cls`, named as it is, that notes reads of plain instance attributes."""
    if cls not in _recorders:
        def __getattribute__(self, name):
            value = cls.__getattribute__(self, name)
            if _active and name != "training" and not name.startswith("__") and plain(value):
                paths, reads = _active[-1]
                path = paths.get(id(self))
                if path is not None and name in object.__getattribute__(self, "__dict__"):
                    reads.add((path, name))
            return value

        _recorders[cls] = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                                      "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _recorders[cls]


@contextlib.contextmanager
def reading(model: torch.nn.Module):
    """Yields a set that holds, after the block, the (module path, attribute) pairs of plain values the
    block read from `model`'s modules (each module's class is a recording subclass while the block runs)."""
    modules = list(model.named_modules(remove_duplicate=False))
    paths = {id(m): path for path, m in reversed(modules)}  # (a shared module: its first name)
    reads: set = set()
    swapped = []
    try:
        for _, m in modules:
            if type(m) not in _recorders.values() and not any(s is m for s, _ in swapped):
                swapped.append((m, type(m)))
                m.__class__ = _recording(type(m))
        _active.append((paths, reads))
        yield reads
    finally:
        if _active and _active[-1][1] is reads:
            _active.pop()
        for m, cls in reversed(swapped):
            m.__class__ = cls


def for_every_layer(reads: set, stacks) -> set:
    """`reads` of a model traced with each stack cut to its first layers, also for the layers stamped after
    them ("layers.0.attn.scaling" -> "layers.k.attn.scaling" for every k of the stack's depth)."""
    out = set(reads)
    for path, name in reads:
        for stack in stacks:
            head = stack.fqn + "."
            if path.startswith(head):
                rest = path[len(head):].split(".", 1)
                tail = "." + rest[1] if len(rest) > 1 else ""
                out.update((f"{head}{k}{tail}", name) for k in range(stack.depth))
    return out


def _both_nan(a, b) -> bool:
    return isinstance(a, float) and isinstance(b, float) and a != a and b != b


class AttributeGuard:
    """The values of `reads` on `model` now; `check()` raises, naming each that changed since."""

    def __init__(self, model: torch.nn.Module, reads):
        self._entries = []
        for path, name in sorted(reads):
            try:
                module = model.get_submodule(path)
            except AttributeError:
                continue  # (a path of a wrapper the trace made, not of the user's model)
            if name in module.__dict__:
                self._entries.append((module, name, path, copy.copy(module.__dict__[name])))

    def __len__(self) -> int:
        return len(self._entries)

    def watched(self) -> set[tuple[str, str]]:
        """The (module path, attribute) pairs checked."""
        return {(path, name) for _, name, path, _ in self._entries}

    def refresh(self) -> None:
        """Take the values as they are now (after spmd itself ran the forward again: `mode_check`)."""
        self._entries = [(m, name, path, copy.copy(m.__dict__.get(name))) for m, name, path, _ in self._entries]

    def check(self) -> None:
        changed = [(path, name, old, new) for m, name, path, old in self._entries
                   if (new := m.__dict__.get(name)) is not old and new != old and not _both_nan(new, old)]
        if changed:
            listed = ", ".join(f"`{path + '.' if path else ''}{name}` ({old!r} -> {new!r})"
                               for path, name, old, new in changed[:4]) + (", ..." if len(changed) > 4 else "")
            raise SpmdError(
                f"the model's {listed} changed after compiling. The forward read the value when it was traced, "
                "and the compiled graph holds that value: this call would run with the old one. What to do: "
                "compile again after the change; for a value that changes during training (a temperature, a "
                "rate), keep it in a buffer updated in place (`self.register_buffer('t', torch.tensor(1.0))`, "
                "`model.t.fill_(new)`) and read that in the forward.")
