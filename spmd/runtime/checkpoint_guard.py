"""Catch torch.distributed.checkpoint handed a rank's plain pieces of a compiled module's sharded tensors.

torch.distributed.checkpoint takes a plain tensor stored under the same key on every rank for one
replicated tensor: it saves one rank's copy and loads that copy into every rank. A rank's piece of a
sharded parameter, or the optimizer state cut like it (AdamW's `exp_avg`), is no such tensor. Saved so,
every rank but one loses its piece, and after the load the ranks train on one rank's pieces, without a word.
(`compiled.state_dict()` and `compiled.optimizer_state_dict(opt)` give DTensors, which it saves right;
`opt.state_dict()` gives the plain pieces.)

`watch(pieces)` remembers (weakly) this rank's pieces of sharded parameters and buffers (cut over a mesh
axis of more than one rank); an optimizer stepping one of them is remembered at its step. From the first
piece on, what `dcp.save` and `dcp.async_save` save (`state_dict_saver._stateful_to_state_dict`, which both
look up at each call, before `async_save` stages copies) and what the default save and load planners are
handed (`DefaultSavePlanner.set_up_planner`, `DefaultLoadPlanner.set_up_planner`: `dcp.load` too) is looked
through, and a plain tensor there that is one of those pieces or their optimizer's state raises `SpmdError`
naming the entry, its parameter and the way out. What is saved is also handed to `source_guard.saving`: the
pieces of a module whose sibling trained since it last had the weights are its old weights. Anything else saves
and loads as before.

Pieces are known by identity: the live tensors (`compiled.parameters()`, the optimizer's state, its
`state_dict()`). Copies of them (`p.detach().clone()`, `copy.deepcopy(opt.state_dict())`) are not caught.
"""
from __future__ import annotations

import functools
import threading
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from spmd.core.errors import SpmdError
from spmd.runtime import source_guard

_lock = threading.Lock()
_watched = WeakIdKeyDictionary()  # piece -> FQN
_optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # those stepping a watched piece
_looked_at: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_torch_planners: dict[type, object] = {}  # planner class -> its own set_up_planner, once ours stands in


def watch(pieces: dict[str, torch.Tensor]) -> None:
    """FQN -> this rank's piece of a sharded parameter or buffer. The hooks go in at the first compiled module
    with a runtime mesh, sharded or not: what `dcp.save` saves is also looked at for a module's old weights, or
    for pieces with no values yet (`source_guard.saving`; found by a review: a data-parallel plan shards nothing,
    and a meta compile's `state_dict()` saved before `init_weights` wrote uninitialized memory)."""
    with _lock:
        for fqn, t in pieces.items():
            _watched[t] = fqn
        if not _torch_planners:
            from torch.distributed.checkpoint import state_dict_saver
            from torch.distributed.checkpoint.default_planner import (
                DefaultLoadPlanner,
                DefaultSavePlanner,
            )

            register_optimizer_step_post_hook(torch.compiler.disable(_seen, recursive=True))
            for cls in (DefaultSavePlanner, DefaultLoadPlanner):
                _torch_planners[cls] = cls.set_up_planner
                cls.set_up_planner = _checked_set_up(cls)
            if hasattr(state_dict_saver, "_stateful_to_state_dict"):
                state_dict_saver._stateful_to_state_dict = _checked_to_state_dict(state_dict_saver._stateful_to_state_dict)


def _piece(t: torch.Tensor) -> str | None:
    return _watched.get(t)


def _seen(optimizer, args, kwargs) -> None:
    """Remember, once per optimizer, one that steps a watched piece (its state is cut like the piece)."""
    if optimizer in _looked_at:
        return
    _looked_at.add(optimizer)
    if any(_piece(p) for g in optimizer.param_groups for p in g["params"]):
        _optimizers.add(optimizer)


def _pieces_and_states() -> dict[int, str]:
    """id -> what it is, for every watched piece and every optimizer state cut like one."""
    found = {}
    for t, fqn in list(_watched.items()):
        found[id(t)] = f"this rank's piece of {fqn}"
    for optimizer in list(_optimizers):
        for p, state in optimizer.state.items():
            fqn = _piece(p)
            if fqn is None:
                continue
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    found[id(value)] = f"this rank's piece of {type(optimizer).__name__}'s {name!r} of {fqn}"
    return found


def _plain_pieces(state, known: dict[int, str], path: str = "") -> list[tuple[str, str]]:
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return []
    if isinstance(state, torch.Tensor):
        return [(path, known[id(state)])] if id(state) in known else []
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    return [hit for key, value in items for hit in _plain_pieces(value, known, f"{path}.{key}" if path else str(key))]


def _check(state_dict, verb: str) -> None:
    if verb == "save":  # (a module's pieces whose sibling trained since: its old weights)
        source_guard.saving(state_dict)
    else:  # (pieces loaded in place: a checkpoint given to their module, once written)
        source_guard.loading(state_dict)
    hits = _plain_pieces(state_dict, _pieces_and_states()) if _watched else []
    if hits:
        listed = "; ".join(f"{path!r} ({what})" for path, what in hits[:3]) + \
            (f"; and {len(hits) - 3} more" if len(hits) > 3 else "")
        raise SpmdError(
            f"torch.distributed.checkpoint was asked to {verb} plain pieces of sharded tensors: {listed}. It "
            "takes a plain tensor under one key on every rank for one replicated tensor, so it would save one "
            "rank's piece and load that piece into every rank: the ranks would go on training other values, "
            "without a word. What to do: checkpoint `compiled.state_dict()` and "
            "`compiled.optimizer_state_dict(optimizer)` (DTensors: each piece where it lies in the whole, "
            "loadable on any mesh), and load them back with `compiled.load_state_dict(...)` and "
            "`compiled.load_optimizer_state_dict(optimizer, ...)`.")


def _checked_to_state_dict(torch_to_state_dict):
    """`dcp.save` and `dcp.async_save` turn their argument into the state dict to save here, before
    `async_save` stages copies of it (which the planner would see instead of the pieces)."""
    @functools.wraps(torch_to_state_dict)
    def to_state_dict(state_dict):
        out = torch_to_state_dict(state_dict)
        _check(out, "save")
        return out

    return to_state_dict


def _checked_set_up(cls):
    torch_set_up = _torch_planners[cls]
    verb = "save" if "Save" in cls.__name__ else "load"

    @functools.wraps(torch_set_up)  # (its signature too: torch passes storage_meta where the signature names it)
    def set_up_planner(self, state_dict, *args, **kwargs):
        _check(state_dict, verb)
        return torch_set_up(self, state_dict, *args, **kwargs)

    return set_up_planner
