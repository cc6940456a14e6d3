"""Catch torch's gradient clipping and gradient norm over a compiled module's shards.

`torch.nn.utils.clip_grad_norm_(compiled.parameters(), max_norm)` would compute each rank's norm over the
pieces it holds: a different number on each rank, so each rank scales its gradients by its own factor and
the replicas of one parameter drift apart, without a word. `torch.nn.utils.get_total_norm` over their
gradients (the norm a training loop logs) would be each rank's own number too. `compiled.clip_grad_norm_`
and `compiled.grad_norm` compute the norm of the full gradients (one small all_reduce per mesh axis) and
are what a training loop must call instead.

`watch(parameters)` remembers (weakly) the parameters of a compiled module that a rank holds a piece of;
from the first one on, torch's two steps of clipping, the norm (`torch.nn.utils.clip_grad._get_total_norm`,
public as `get_total_norm`) and the scaling (`_clip_grads_with_norm_`, public as `clip_grads_with_norm_`),
check what they are handed and raise `SpmdError` with the way out when it is one of those (or their
gradients), before any gradient is scaled. `clip_grad_norm_` looks both up at each call, so it is caught
however the training loop imported it (`from torch.nn.utils import clip_grad_norm_` before compiling,
too). Anything else runs as before.

`watch_source(model, compiled)` covers the model `compiled` was compiled from, whose own parameters no
backward of the compiled module reaches: clipping them raises once the compiled module has gradients (the
norm was 0 and nothing was clipped), and `model.zero_grad()` (torch's `Module.zero_grad`, which this module
stands in for from then on) zeroes the compiled modules' gradients too, as it would on one device.
"""
from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.utils as nn_utils
import torch.nn.utils.clip_grad as clip_grad
from torch.utils.weak import WeakIdKeyDictionary

from spmd.core.errors import SpmdError

_lock = threading.Lock()
_watched = WeakIdKeyDictionary()  # parameter piece -> FQN
_torch_scale = None  # torch's own _clip_grads_with_norm_, once ours stands in its place
_torch_norm = None  # torch's own _get_total_norm, likewise
# The model spmd.compile compiled keeps its own parameters, which no compiled module's backward reaches: a loop's
# `clip_grad_norm_(model.parameters(), ...)` found no gradient (norm 0, nothing clipped) and `model.zero_grad()`
# zeroed nothing (the pieces' gradients summed over steps), both silently (found by a probe).
# a parameter of a compiled model -> (its FQN, the last module compiled from it (weakly), the model's id in `_models`)
_sources = WeakIdKeyDictionary()
# id of a compiled model -> its compiled modules (weak references), the entry dropped with the model: plain ids, so
# that `Module.zero_grad` stays cheap on a model of thousands of modules and traceable by torch.compile
_models: dict[int, list] = {}
_torch_zero_grad = None  # torch.nn.Module.zero_grad, once ours stands in its place


def watch(parameters: dict[str, torch.Tensor]) -> None:
    """FQN -> this rank's piece of a sharded parameter: clipping them with torch's functions raises."""
    global _torch_scale, _torch_norm
    with _lock:
        for fqn, p in parameters.items():
            _watched[p] = fqn
        if _watched:
            _install()


def _install() -> None:
    global _torch_scale, _torch_norm
    if _torch_scale is None:
        _torch_scale, _torch_norm = clip_grad._clip_grads_with_norm_, clip_grad._get_total_norm
        clip_grad._clip_grads_with_norm_, clip_grad._get_total_norm = _clip_grads_with_norm_, _get_total_norm
        if getattr(nn_utils, "clip_grads_with_norm_", None) is _torch_scale:
            nn_utils.clip_grads_with_norm_ = _clip_grads_with_norm_
        if getattr(nn_utils, "get_total_norm", None) is _torch_norm:
            nn_utils.get_total_norm = _get_total_norm


def watch_source(model: torch.nn.Module, compiled) -> None:
    """`model` was compiled into `compiled`: clipping its own parameters raises once the compiled module has
    gradients, and `model.zero_grad()` zeroes the compiled module's gradients too."""
    global _torch_zero_grad
    with _lock:
        ref = weakref.ref(compiled)
        for fqn, p in model.named_parameters():
            _sources[p] = (fqn, ref, id(model))
        if id(model) not in _models:
            weakref.finalize(model, _models.pop, id(model), None)
        _models[id(model)] = [r for r in _models.get(id(model), ()) if r() is not None] + [ref]
        _install()
        if _torch_zero_grad is None:
            _torch_zero_grad = torch.nn.Module.zero_grad
            torch.nn.Module.zero_grad = _zero_grad


def _zero_grad(self, set_to_none: bool = True) -> None:
    """torch's `Module.zero_grad`; on a model spmd.compile compiled (or one holding a compiled part: `model.encoder`
    compiled alone), also the compiled modules' gradients (what the model's own parameters would hold on one
    device)."""
    _torch_zero_grad(self, set_to_none)
    if not _models:
        return
    whole = set()
    for module in self.modules():
        for ref in _models.get(id(module), ()):
            compiled = ref()
            if compiled is not None and compiled is not self:
                compiled.zero_grad(set_to_none)
                whole.add(id(compiled))
    # a part of a compiled model (`model.head.zero_grad()`, a loop over the model's children): the pieces of its
    # parameters (before, they kept their gradients, which piled up over the steps: a probe, 0.25 off after 3)
    for p in self.parameters():
        fqn, _, model = _sources.get(p, (None, None, None))
        # (every module compiled from that model: `_sources` names the last; a review found a second compile, for
        # inference, left the training module's pieces to pile up again)
        for other in _models.get(model, ()) if fqn is not None else ():
            compiled = other()
            if compiled is not None and compiled is not self and id(compiled) not in whole:
                try:
                    piece = compiled.get_parameter(fqn)
                except AttributeError:  # (not one it holds)
                    continue
                _torch_zero_grad_of(piece, set_to_none)


def _torch_zero_grad_of(p: torch.Tensor, set_to_none: bool) -> None:
    """What torch's `Module.zero_grad` does to each of its parameters."""
    if p.grad is None:
        return
    if set_to_none:
        p.grad = None
        return
    if p.grad.grad_fn is not None:
        p.grad.detach_()
    else:
        p.grad.requires_grad_(False)
    p.grad.zero_()


_zero_grad.__doc__ = (torch.nn.Module.zero_grad.__doc__ or "") + "\n" + _zero_grad.__doc__


def _of_source(params: list) -> list[str]:
    """The compiled models' own parameters among `params` that have no gradient while their compiled module's
    pieces have one (the gradients a loop over `model.parameters()` means)."""
    found = []
    for p in params:
        entry = _sources.get(p) if isinstance(p, torch.Tensor) else None
        if entry is None or p.grad is not None:
            continue
        compiled = entry[1]()
        if compiled is not None and any(q.grad is not None for q in compiled.parameters()):
            found.append(entry[0])
    return found


def _sharded(params: list) -> list[str]:
    return [_watched[p] for p in params if p in _watched]


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _refuse(sharded: list[str]) -> None:
    if sharded:
        names = _listed(sharded)
        raise SpmdError(
            f"torch.nn.utils.clip_grad_norm_ (or get_total_norm, or clip_grads_with_norm_) was handed this rank's "
            f"pieces of sharded parameters or their gradients ({names}): the norm would be each rank's own, a "
            "different number on each rank, and clipping by it would make the replicas of the parameters drift "
            "apart. What to do: call compiled.clip_grad_norm_(max_norm, norm_type) on the compiled module to clip "
            "(`also=(other_compiled, plain_module)`: what the same optimizer steps beside it, by one norm; "
            "`parameters=group['params']`: a subset of its parameters, by their own norm), "
            "or compiled.grad_norm(norm_type) for the norm alone (the norm of the full gradients, the same on "
            "every rank).")


def _get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """torch's norm of `tensors` together, unless they include the gradients of pieces of a compiled
    module's sharded parameters (their norm is this rank's own)."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    grads = {id(p.grad): fqn for p, fqn in list(_watched.items()) if p.grad is not None}
    _refuse([grads[id(t)] for t in tensors if id(t) in grads] + _sharded(tensors))
    return _torch_norm(tensors, norm_type, error_if_nonfinite, foreach)


def _clip_grads_with_norm_(parameters, max_norm: float, total_norm: torch.Tensor, foreach: bool | None = None) -> None:
    """torch's scaling of the gradients by `max_norm / total_norm`, unless it is handed pieces of a compiled
    module's sharded parameters (their `total_norm` is this rank's own)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    _refuse(_sharded(params))
    source = _of_source(params)
    if source:
        raise SpmdError(
            f"torch.nn.utils.clip_grad_norm_ (or clip_grads_with_norm_) was handed the parameters of the model "
            f"spmd.compile compiled ({_listed(source)}): the compiled module holds its own (this rank's pieces), which the "
            "backward reached, and the model's own get no gradient, so the norm would be 0 and nothing would be "
            "clipped. What to do: call compiled.clip_grad_norm_(max_norm, norm_type) on the compiled module "
            "(compiled.grad_norm(norm_type) for the norm alone).")
    return _torch_scale(params, max_norm, total_norm, foreach)
