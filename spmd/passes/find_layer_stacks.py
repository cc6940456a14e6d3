"""find_layer_stacks: module lists of identical layers, so tracing can stop after a few of them.

Before: an eager (or fake) nn.Module. After: a tuple of `LayerStack`s, one per container of layers
(`nn.ModuleList`, `nn.Sequential`, or an `nn.ModuleDict` keyed "0", "1", ... as torchtitan keeps them;
subclasses too) whose elements are interchangeable: same class, and for every submodule the same
parameters and buffers (names, shapes, dtypes, requires_grad) and no hooks. Plain attributes that
differ between layers (transformers' `layer_idx`, torchtitan's per-layer init scales) are recorded in
`LayerStack.varying`; `truncated(model, stacks)` lets a tracer see only the first `TRACED` layers of
each and reports which of those attributes the traced forward read. A layer stack whose forward reads
one is traced whole (the caller's decision). `stamp_layers` copies a traced middle layer back up to the
full depth.

Interchangeable layers differ only in their parameter values, which a traced graph does not contain,
and in attributes the forward does not read, so their subgraphs are identical. What this check cannot
see is a forward that reads the depth itself (`len(self.layers)` in an expression, a loop over
`config.n_layers`): a truncated trace of such a model
fails (the index is out of range, caught by the caller) or computes with the wrong depth. That is why
`spmd.compile` checks the stamping first (`check_stamping`: the full-depth forward against the cut one, op
by op on fake tensors); `spmd.plan` skips the check (a plan prices shapes, and planning speed matters).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

TRACED = 3  # layers traced per stack: the middle one is copied, its neighbours show how layers chain
MIN_LAYERS = 8  # below this, tracing everything costs about as much as stamping saves


@dataclass(frozen=True, slots=True)
class LayerStack:
    fqn: str  # "layers", "transformer.h"
    depth: int  # elements in the model
    varying: tuple[tuple[str, str], ...] = ()  # (submodule path in a layer, attribute) differing between layers

    def __post_init__(self):
        if self.depth <= TRACED:
            raise ValueError(f"LayerStack {self.fqn}: depth {self.depth} leaves nothing to stamp")


def find_layer_stacks(model: torch.nn.Module, min_layers: int = MIN_LAYERS) -> tuple[LayerStack, ...]:
    """The outermost module lists of at least `min_layers` interchangeable elements."""
    seen = {}
    for name, module in model.named_modules(remove_duplicate=False):
        seen[id(module)] = seen.get(id(module), 0) + 1
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        seen[id(t)] = seen.get(id(t), 0) + 1  # a tensor tied across layers: copies would untie it
    stacks: list[LayerStack] = []
    for name, module in model.named_modules():
        if not name:
            continue  # (the model itself: a list at the root has no parent to hold it cut; traced whole)
        if any(name.startswith(s.fqn + ".") for s in stacks):
            continue  # inside a stack already found: its own lists are copied with it
        layers = layers_of(module)
        if layers is None or len(layers) < min_layers:
            continue
        shared = any(seen[id(m)] > 1 for layer in layers for m in layer.modules()) or \
            any(seen[id(t)] > 1 for layer in layers for t in [*layer.parameters(), *layer.buffers()])
        varying: set[tuple[str, str]] = set()
        if not shared and all(_interchangeable(layers[0], other, varying) for other in layers[1:]):
            stacks.append(LayerStack(name, len(layers), tuple(sorted(varying))))
    return tuple(stacks)


def layers_of(module: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The layers of a container, in order; None for anything else (a ModuleDict counts when its keys
    are "0", "1", ..., the names stamping renumbers)."""
    if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
        return list(module)
    if isinstance(module, torch.nn.ModuleDict) and list(module.keys()) == [str(i) for i in range(len(module))]:
        return list(module.values())
    return None


_MODULE_FIELDS = frozenset(vars(torch.nn.Module()))  # nn.Module's own bookkeeping (hooks checked apart)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


def _hooked(module: torch.nn.Module) -> bool:
    """Whether `module` has a hook of its own (spmd's guards aside: they compute nothing)."""
    return any(not getattr(hook, "spmd_guard", False)
               for h in _HOOKS for hook in (getattr(module, h, None) or {}).values())


def _interchangeable(a: torch.nn.Module, b: torch.nn.Module, varying: set[tuple[str, str]]) -> bool:
    """Same structure, classes, parameters and buffers, no hooks (`_hooked`); plain attributes that differ are
    added to `varying` (whether the forward reads them is found when tracing)."""
    sub_a, sub_b = dict(a.named_modules()), dict(b.named_modules())
    if sub_a.keys() != sub_b.keys():
        return False
    for name, ma in sub_a.items():
        mb = sub_b[name]
        if type(ma) is not type(mb) or _hooked(ma) or _hooked(mb):
            return False
        if _tensors(ma._parameters) != _tensors(mb._parameters) or _tensors(ma._buffers) != _tensors(mb._buffers):
            return False
        plain_a = {k: v for k, v in vars(ma).items() if k not in _MODULE_FIELDS}
        plain_b = {k: v for k, v in vars(mb).items() if k not in _MODULE_FIELDS}
        if plain_a.keys() != plain_b.keys():
            return False
        varying.update((name, k) for k in plain_a if not _same(plain_a[k], plain_b[k]))
    return True


def _tensors(table: dict) -> dict:
    return {k: None if t is None else (tuple(t.shape), t.dtype, t.requires_grad) for k, t in table.items()}


def _same(x, y) -> bool:
    """Equal plain attributes; a tensor attribute (a constant in the graph) only if it is the same one."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return x is y
    try:
        return bool(x == y)
    except Exception:
        return x is y


@contextlib.contextmanager
def truncated(model: torch.nn.Module, stacks: tuple[LayerStack, ...]):
    """`model` with each stack cut to its first TRACED layers (restored on exit). Yields a set that,
    after the traced forward, holds the `varying` attributes it read ("layers.*.attention.layer_idx")."""
    originals, watched, read = [], [], set()
    try:
        for stack in stacks:
            parent_name, _, child = stack.fqn.rpartition(".")
            parent = model.get_submodule(parent_name)
            full = parent._modules[child]
            short = _cut(full)
            parent._modules[child] = short
            originals.append((parent, child, full))
            by_path = _by_path(stack.varying)
            for layer in layers_of(short):
                for path, attrs in by_path.items():
                    module = layer.get_submodule(path)
                    watched.append((module, type(module)))
                    where = f"{stack.fqn}.*.{path + '.' if path else ''}"
                    module.__class__ = _watching(type(module), attrs, where, read)
        yield read
    finally:
        for module, cls in watched:
            module.__class__ = cls
        for parent, child, full in reversed(originals):
            parent._modules[child] = full


def _cut(full: torch.nn.Module) -> torch.nn.Module:
    """The container holding only its first TRACED layers, of its own class where that class builds
    from the layers as its base does."""
    layers = layers_of(full)
    items = {str(i): m for i, m in enumerate(layers[:TRACED])} if isinstance(full, torch.nn.ModuleDict) \
        else layers[:TRACED]
    try:
        return type(full)(items)
    except Exception:
        base = next(c for c in (torch.nn.ModuleDict, torch.nn.Sequential, torch.nn.ModuleList)
                    if isinstance(full, c))
        return base(items) if base is not torch.nn.Sequential else base(*items)


def _by_path(varying) -> dict[str, frozenset[str]]:
    out: dict[str, set[str]] = {}
    for path, attr in varying:
        out.setdefault(path, set()).add(attr)
    return {p: frozenset(a) for p, a in out.items()}


def _watching(cls: type, attrs: frozenset[str], where: str, read: set) -> type:
    """A subclass of `cls`, named as it is, that notes reads of `attrs` in `read`."""
    def __getattribute__(self, name):
        if name in attrs:
            read.add(where + name)
        return cls.__getattribute__(self, name)

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                                        "__qualname__": cls.__qualname__})
