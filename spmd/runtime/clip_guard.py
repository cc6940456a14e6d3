"""Catch torch's gradient clipping over a compiled module's shards.

`torch.nn.utils.clip_grad_norm_(compiled.parameters(), max_norm)` would compute each rank's norm over the
pieces it holds: a different number on each rank, so each rank scales its gradients by its own factor and
the replicas of one parameter drift apart, without a word. `compiled.clip_grad_norm_` computes the norm of
the full gradients (one small all_reduce per mesh axis) and is what a training loop must call instead.

`watch(parameters)` remembers (weakly) the parameters of a compiled module that a rank holds a piece of;
from the first one on, torch's scaling step (`torch.nn.utils.clip_grad._clip_grads_with_norm_`, which
`clip_grad_norm_` looks up at each call, and its public name `clip_grads_with_norm_`) checks what it is
handed and raises `SpmdError` with the way out when it is one of those, before any gradient is scaled.
Hooked there, it catches `clip_grad_norm_` however the training loop imported it (`from torch.nn.utils
import clip_grad_norm_` before compiling, too). Anything else clips as before.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.utils as nn_utils
import torch.nn.utils.clip_grad as clip_grad
from torch.utils.weak import WeakIdKeyDictionary

from spmd.core.errors import SpmdError

_lock = threading.Lock()
_watched = WeakIdKeyDictionary()  # parameter piece -> FQN
_torch_scale = None  # torch's own _clip_grads_with_norm_, once ours stands in its place


def watch(parameters: dict[str, torch.Tensor]) -> None:
    """FQN -> this rank's piece of a sharded parameter: clipping them with torch's functions raises."""
    global _torch_scale
    with _lock:
        for fqn, p in parameters.items():
            _watched[p] = fqn
        if _torch_scale is None and _watched:
            _torch_scale = clip_grad._clip_grads_with_norm_
            clip_grad._clip_grads_with_norm_ = _clip_grads_with_norm_
            if getattr(nn_utils, "clip_grads_with_norm_", None) is _torch_scale:
                nn_utils.clip_grads_with_norm_ = _clip_grads_with_norm_


def _sharded(params: list) -> list[str]:
    return [_watched[p] for p in params if p in _watched]


def _clip_grads_with_norm_(parameters, max_norm: float, total_norm: torch.Tensor, foreach: bool | None = None) -> None:
    """torch's scaling of the gradients by `max_norm / total_norm`, unless it is handed pieces of a compiled
    module's sharded parameters (their `total_norm` is this rank's own)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    sharded = _sharded(params)
    if sharded:
        names = ", ".join(sharded[:3]) + (f" and {len(sharded) - 3} more" if len(sharded) > 3 else "")
        raise SpmdError(
            f"torch.nn.utils.clip_grad_norm_ (or clip_grads_with_norm_) was handed this rank's pieces of sharded "
            f"parameters ({names}): it would clip by each rank's own norm, a different number on each rank, and "
            "the replicas of the parameters would drift apart. What to do: call compiled.clip_grad_norm_(max_norm, "
            "norm_type) on the compiled module instead (the norm of the full gradients, the same on every rank).")
    return _torch_scale(params, max_norm, total_norm, foreach)
