"""find_layer_stacks: module lists of identical layers, so tracing can stop after a few of them.

Before: an eager (or fake) nn.Module. After: a tuple of `LayerStack`s, one per `nn.ModuleList` /
`nn.Sequential` whose elements are interchangeable: same class, and for every submodule the same
parameters and buffers (names, shapes, dtypes, requires_grad), the same plain attributes, and no hooks.
`truncated(model, stacks)` then lets a tracer see only the first `TRACED` layers of each;
`stamp_layers` copies a traced middle layer back up to the full depth.

Interchangeable layers differ only in their parameter values, which a traced graph does not contain,
so their subgraphs are identical. What this check cannot see is a forward that reads the depth itself
(`len(self.layers)` in an expression, a loop over `config.n_layers`): a truncated trace of such a model
fails (the index is out of range, caught by the caller) or computes with the wrong depth. That is why
`spmd.plan` stamps by default (a plan prices shapes, not values) and `spmd.compile` only when asked.
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
        if any(name.startswith(s.fqn + ".") for s in stacks):
            continue  # inside a stack already found: its own lists are copied with it
        if type(module) not in (torch.nn.ModuleList, torch.nn.Sequential) or len(module) < min_layers:
            continue
        layers = list(module)
        shared = any(seen[id(m)] > 1 for layer in layers for m in layer.modules()) or \
            any(seen[id(t)] > 1 for layer in layers for t in [*layer.parameters(), *layer.buffers()])
        if not shared and all(_interchangeable(layers[0], other) for other in layers[1:]):
            stacks.append(LayerStack(name, len(layers)))
    return tuple(stacks)


_MODULE_FIELDS = frozenset(vars(torch.nn.Module()))  # nn.Module's own bookkeeping (hooks checked apart)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


def _interchangeable(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sub_a, sub_b = dict(a.named_modules()), dict(b.named_modules())
    if sub_a.keys() != sub_b.keys():
        return False
    for name, ma in sub_a.items():
        mb = sub_b[name]
        if type(ma) is not type(mb) or any(getattr(m, h, None) for m in (ma, mb) for h in _HOOKS):
            return False
        if _tensors(ma._parameters) != _tensors(mb._parameters) or _tensors(ma._buffers) != _tensors(mb._buffers):
            return False
        plain_a = {k: v for k, v in vars(ma).items() if k not in _MODULE_FIELDS}
        plain_b = {k: v for k, v in vars(mb).items() if k not in _MODULE_FIELDS}
        if plain_a.keys() != plain_b.keys() or not all(_same(plain_a[k], plain_b[k]) for k in plain_a):
            return False
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
    """`model` with each stack cut to its first TRACED layers (restored on exit)."""
    originals = []
    try:
        for stack in stacks:
            parent_name, _, child = stack.fqn.rpartition(".")
            parent = model.get_submodule(parent_name)
            full = parent._modules[child]
            parent._modules[child] = type(full)(list(full)[:TRACED])
            originals.append((parent, child, full))
        yield model
    finally:
        for parent, child, full in reversed(originals):
            parent._modules[child] = full
