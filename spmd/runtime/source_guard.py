"""Catch the model a compiled module was made from used after the compiled module trained.

`spmd.compile` copies the model's weights into the compiled module's pieces; training steps those pieces, and
the model itself keeps the weights it had. Evaluating with it afterwards (`model.eval(); model(x_val)`) or
saving it (`torch.save(model.state_dict(), ...)`) would give the numbers of the untrained weights, without a
word. (DDP and FSDP2 train the model's own parameters; spmd cannot: a piece is not the whole.)

`watch(model, compiled)` puts a forward pre-hook and a state_dict pre-hook on the model; once an optimizer has
stepped the compiled module's pieces, calling or saving the model raises `SpmdError` with the way out, until
weights are loaded into the model (`model.load_state_dict(compiled.full_state_dict())`). A copy of the model (`copy.deepcopy`, pickling)
carries a hook that does nothing. A model built on the meta device (it has no weights to go stale) is not
watched.
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from spmd.core.errors import SpmdError

_lock = threading.Lock()
_owners: dict[int, weakref.ref] = {}  # id(compiled parameter) -> the compiled module holding it
_stepping: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> the compiled modules it steps
_hook = None
_inside = threading.local()  # spmd itself running the model (the mode check): no guard


class _Inert:
    """What a watched model's hook becomes in a copy of the model: nothing to guard there."""

    spmd_guard = True  # (not the user's hook: `trace_module.warn_module_hooks` leaves it out)

    def __call__(self, *args, **kwargs):
        return None


class _Guard:
    spmd_guard = True

    def __init__(self, model: torch.nn.Module, compiled, what: str):
        self.model, self.compiled, self.what = weakref.ref(model), weakref.ref(compiled), what

    def __reduce__(self):  # (a copy of the model is another model: its hook does nothing)
        return (_Inert, ())

    def __call__(self, module, *args, **kwargs):
        compiled = self.compiled()
        if module is not self.model() or compiled is None or getattr(_inside, "depth", 0):
            return None
        if self.what is None:  # (a load into the model: its weights are what the user put there now)
            compiled.__dict__["_weights_moved"] = False
            return None
        if not compiled.__dict__.get("_weights_moved"):
            return None
        raise SpmdError(
            f"{type(module).__name__} was compiled by spmd.compile, and the compiled module has trained since: the "
            f"model's own weights are still those it was compiled with, so {self.what} "
            "would give the numbers of the old weights. What to do: call the compiled module (evaluation too: "
            "`compiled.eval()`, with `torch.no_grad()`), save with `compiled.state_dict()`, "
            "`compiled.full_state_dict()` or `compiled.save_safetensors(...)`, or copy its weights back first "
            "(`model.load_state_dict(compiled.full_state_dict())`, on every rank; until the next step).")


def watch(model: torch.nn.Module, compiled) -> None:
    global _hook
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        return
    model.register_forward_pre_hook(_Guard(model, compiled, "calling it"))
    model.register_state_dict_pre_hook(_Guard(model, compiled, "its state_dict()"))
    model.register_load_state_dict_post_hook(_Guard(model, compiled, None))
    with _lock:
        for p in compiled.parameters():
            _owners[id(p)] = weakref.ref(compiled, lambda _, key=id(p): _owners.pop(key, None))
        if _hook is None:
            _hook = register_optimizer_step_post_hook(_stepped)


class inside:
    """spmd running the model itself (the mode check's forward on fake tensors): the guard stands aside."""

    def __enter__(self):
        _inside.depth = getattr(_inside, "depth", 0) + 1

    def __exit__(self, *exc):
        _inside.depth -= 1


def _stepped(optimizer, args, kwargs) -> None:
    """After each step: the compiled modules whose pieces the optimizer steps (found at its first) have moved."""
    stepping = _stepping.get(optimizer)
    if stepping is None:
        found = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                ref = _owners.get(id(p))
                if ref is not None and ref() is not None:
                    found[id(ref())] = ref
        stepping = _stepping[optimizer] = list(found.values())
    for ref in stepping:
        compiled = ref()
        if compiled is not None:
            compiled.__dict__["_weights_moved"] = True
