"""Catch the optimizer trap: an optimizer built over the original model's parameters after compile.

The compiled module holds its own parameters (this rank's shards); the original model's parameters
never get a gradient from it, so `torch.optim.AdamW(model.parameters())` would step nothing and the
loss would stay flat without a word. `watch(model)` remembers the original parameters (weakly), and one
process-wide optimizer step pre-hook checks each optimizer once, at its first step: if it holds any of
them, the step raises `SpmdError` naming them and the fix.
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from spmd.core.errors import SpmdError

_lock = threading.Lock()
_watched: dict[int, tuple[weakref.ref, str, str]] = {}  # id(parameter) -> (ref, FQN, model class)
_checked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_hook = None


def watch(model: torch.nn.Module) -> None:
    """Remember `model`'s parameters as ones no optimizer may step once it is compiled."""
    global _hook
    with _lock:
        for fqn, p in model.named_parameters():
            key = id(p)
            _watched[key] = (weakref.ref(p, lambda _, key=key: _watched.pop(key, None)), fqn, type(model).__name__)
        if _hook is None:
            _hook = register_optimizer_step_pre_hook(_check)


def _check(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer in _checked:
        return
    _checked.add(optimizer)
    stale = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _watched.get(id(p))
            if entry is not None and entry[0]() is p:
                stale.append(entry)
    if stale:
        names = ", ".join(fqn for _, fqn, _ in stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
        raise SpmdError(
            f"{type(optimizer).__name__} steps {len(stale)} parameter(s) of the original {stale[0][2]} ({names}), "
            "which the compiled module does not use: they never get a gradient, so training would change "
            "nothing. What to do: build the optimizer over the compiled module's parameters, "
            f"`{type(optimizer).__name__}(compiled.parameters(), ...)` (each rank's shards).")
