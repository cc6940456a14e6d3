"""Catch torch's gradient clipping over a compiled module's shards.

`torch.nn.utils.clip_grad_norm_(compiled.parameters(), max_norm)` would compute each rank's norm over the
pieces it holds: a different number on each rank, so each rank scales its gradients by its own factor and
the replicas of one parameter drift apart, without a word. `compiled.clip_grad_norm_` computes the norm of
the full gradients (one small all_reduce per mesh axis) and is what a training loop must call instead.

`watch(parameters)` remembers (weakly) the parameters of a compiled module that a rank holds a piece of;
from the first one on, `torch.nn.utils.clip_grad_norm_` (the name training loops call) checks what it is
handed and raises `SpmdError` with the way out when it is one of those. Anything else clips as before.
"""
from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.utils as nn_utils
import torch.nn.utils.clip_grad as clip_grad

from spmd.core.errors import SpmdError

_lock = threading.Lock()
_watched: dict[int, tuple[weakref.ref, str]] = {}  # id(parameter piece) -> (ref, FQN)
_torch_clip = None  # torch's own clip_grad_norm_, once ours stands in its place


def watch(parameters: dict[str, torch.Tensor]) -> None:
    """FQN -> this rank's piece of a sharded parameter: clipping them with torch's function raises."""
    global _torch_clip
    with _lock:
        for fqn, p in parameters.items():
            _watched[id(p)] = (weakref.ref(p, lambda _, key=id(p): _watched.pop(key, None)), fqn)
        if _torch_clip is None and _watched:
            _torch_clip = clip_grad.clip_grad_norm_
            nn_utils.clip_grad_norm_ = clip_grad.clip_grad_norm_ = clip_grad_norm_


def _sharded(params: list) -> list[str]:
    found = []
    for p in params:
        entry = _watched.get(id(p))
        if entry is not None and entry[0]() is p:
            found.append(entry[1])
    return found


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """torch's `clip_grad_norm_`, unless it is handed pieces of a compiled module's sharded parameters."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    sharded = _sharded(params)
    if sharded:
        names = ", ".join(sharded[:3]) + (f" and {len(sharded) - 3} more" if len(sharded) > 3 else "")
        raise SpmdError(
            f"torch.nn.utils.clip_grad_norm_ was handed this rank's pieces of sharded parameters ({names}): it "
            "would clip by each rank's own norm, a different number on each rank, and the replicas of the "
            "parameters would drift apart. What to do: call compiled.clip_grad_norm_(max_norm, norm_type) on "
            "the compiled module instead (the norm of the full gradients, the same on every rank).")
    return _torch_clip(params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                       foreach=foreach)
