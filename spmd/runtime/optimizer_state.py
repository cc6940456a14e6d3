"""An optimizer's state over a compiled module's pieces, keyed by the model's names, as DTensors.

A torch optimizer built over `compiled.parameters()` keeps, per parameter, state cut like the piece it steps
(AdamW's `exp_avg` and `exp_avg_sq`) and keys it by the parameter's position. Its own `state_dict()` is
right for `torch.save` on each rank and a load on the same mesh and plan, but not for
torch.distributed.checkpoint: a plain tensor under the same key on every rank is taken for one replicated
tensor, and one rank's piece is saved and loaded into all of them.

`named_state_dict` gives the form torch's `get_optimizer_state_dict` gives for FSDP2 modules: `{"state":
{fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}`, each state cut like its parameter a
DTensor over the runtime mesh (where it lies in the whole: a checkpoint loads on any mesh and plan).
`load_named_state_dict` takes that form back (or full tensors: one device's optimizer, keyed by its
model's names) into the optimizer.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from spmd.core.errors import SpmdError
from spmd.runtime import source_guard
from spmd.runtime.optimizer_guard import (SAVED_BY, forget_made_up, made_up as made_up_state, made_up_ids,
                                          refuse_unwritten, step_hooks)


def _names(compiled, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Each param group's parameters by the model's names (an error naming any that is not the module's)."""
    fqn_of = {id(compiled._get(attr)): fqn for fqn, attr in compiled._param_names.items()
              if isinstance(compiled._get(attr), nn.Parameter)}
    names, foreign = [], 0
    for group in optimizer.param_groups:
        names.append([fqn_of.get(id(p)) for p in group["params"]])
        foreign += names[-1].count(None)
    if foreign:
        raise SpmdError(f"{type(optimizer).__name__} holds {foreign} parameter(s) that are not this compiled "
                        "module's: its state cannot be keyed by this model's names. What to do: one optimizer per "
                        "compiled module, over `compiled.parameters()`, or the optimizer's own `state_dict()` saved "
                        "by each rank with torch.save (a load on the same mesh and plan).")
    return names


def _init_state(optimizer: torch.optim.Optimizer, trained: set[int]) -> bool:
    """Give an optimizer that has not stepped yet its state (a step with zero gradients at a learning rate of
    0, as torch's `get_optimizer_state_dict` does), so that a checkpoint has somewhere to load it. Only the
    parameters a gradient reaches (ids in `trained`) get state, as they do when training. Gradients already there
    (a warm-up backward, `zero_grad(set_to_none=False)`) are set aside for that step and given back: torch skips
    such an optimizer, and its empty state loaded nothing (a resume with fresh moments, found by a probe). True
    if it did."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad and id(p) in trained]
    if optimizer.state or not params:
        return False
    everyone = [p for g in optimizer.param_groups for p in g["params"]]
    kept, stepping = [p.grad for p in everyone], {id(p) for p in params}
    for p in everyone:
        p.grad = torch.zeros_like(p) if id(p) in stepping else None
    rates = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    # the optimizer's own step hooks sit this step out: a LARS ratio `p.grad.norm()` of the zero gradients made
    # them NaN, and the step at rate 0 wrote NaN into the weights (found by a review)
    hooks = step_hooks(optimizer)
    held = [dict(table) for table in hooks]
    try:
        for table in hooks:
            table.clear()
        with source_guard.priming():  # (no weight moves: not training, for the guards)
            optimizer.step()
    finally:
        for table, entries in zip(hooks, held):
            table.update(entries)
        for g, lr in zip(optimizer.param_groups, rates):
            g["lr"] = lr
        for p, grad in zip(everyone, kept):
            p.grad = grad
    return True


def named_state_dict(compiled, optimizer: torch.optim.Optimizer) -> dict:
    names = _names(compiled, optimizer)
    grads = compiled.split.grads if compiled.split is not None else ()  # (the parameters a gradient reaches)
    trained = {id(compiled.piece(name)) for name in grads if name in compiled._param_names}
    made_up = _init_state(optimizer, trained)
    torch_form = optimizer.state_dict()
    if made_up:  # (the live optimizer stays as it was: the state of a step at rate 0 is not a fresh one's)
        optimizer.state.clear()
    flat = [fqn for group in names for fqn in group]
    cut = any(n > 1 for n in compiled.mesh_spec.shape)
    state = {}
    for index, entries in torch_form["state"].items():
        fqn = flat[index]
        piece = compiled.piece(fqn)
        state[fqn] = {}
        for key, value in entries.items():
            if made_up and key == "step":  # (the mark of an optimizer that had not stepped: `_unstepped`)
                value = torch.zeros_like(value) if isinstance(value, torch.Tensor) else type(value)(0)
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if tuple(value.shape) != tuple(piece.shape):
                    if cut:  # (Adafactor's row and column factors: not cut like the piece)
                        raise SpmdError(
                            f"{type(optimizer).__name__}'s state {key!r} of {fqn} has shape {tuple(value.shape)}, "
                            f"neither a number nor cut like the parameter's piece {tuple(piece.shape)}: it cannot "
                            "be described as a piece of a whole. What to do: save the optimizer's own "
                            "`state_dict()` on each rank with torch.save (a load on the same mesh and plan).")
                else:
                    value = compiled._as_whole(fqn, value)
            state[fqn][key] = value
    # (whose pieces these are is on each DTensor, which a load checks: not the param groups' `SAVED_BY` entry,
    # which torch.distributed.checkpoint would save once, one rank's, for all)
    groups = [{**{k: v for k, v in group.items() if k not in ("params", SAVED_BY)}, "params": group_names}
              for group, group_names in zip(torch_form["param_groups"], names)]
    if made_up:  # (loaded into in place and left there, the optimizer would start fresh: refused at its step)
        made_up_state(optimizer, [getattr(v, "_local_tensor", v) for entries in state.values()
                                  for v in entries.values() if isinstance(v, torch.Tensor)])
    return {"state": state, "param_groups": groups}


def _own(value, given, made: frozenset = frozenset()):
    """A piece cut from a whole tensor as a tensor of its own: a view (a split on the first dim) kept every rank's
    whole moment alive, and shared it with the state given (found by a probe). So did a whole tensor taken as it is
    (a replicated moment, a `step`): a single-device optimizer's state loaded as training.md shows stepped with both
    optimizers, each moving the other's (found by a probe of the docs: weights 1.4e-4 apart after 2 steps). A
    The local piece of a DTensor of the state `optimizer_state_dict` made up for this fresh optimizer (`made`: their
    ids; a checkpoint loaded into it by torch.distributed.checkpoint, held by no optimizer) is kept: its
    `to_local()` is a view of it, which was cloned too, so a resume held the optimizer's state twice (a memory probe:
    730 MiB more per rank, for a model of 1.4 GiB over 4 ranks). Another optimizer's live state is cloned."""
    if not isinstance(value, torch.Tensor):
        return value
    own = getattr(given, "_local_tensor", given)
    if isinstance(own, torch.Tensor) and id(own) in made and (
            value is own or (value._base is not None and _same_memory(value, own))):
        return own
    if value._base is not None or (isinstance(given, torch.Tensor) and not hasattr(given, "to_local")
                                   and value.untyped_storage().data_ptr() == given.untyped_storage().data_ptr()):
        return value.clone()
    return value


def _same_memory(view: torch.Tensor, tensor: torch.Tensor) -> bool:
    """`view` is `tensor` as a whole: the same memory, shape, strides and offset."""
    return (view.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() and view.shape == tensor.shape
            and view.stride() == tensor.stride() and view.storage_offset() == tensor.storage_offset()
            and view.dtype == tensor.dtype)


def _by_names(named: dict) -> None:
    """Refuse state keyed by position, or whose param groups list parameters so (an optimizer's own `state_dict()`),
    which said "state for 0, which this optimizer does not step", or, with no state yet, that a group "holds other
    parameters" (a probe and a review)."""
    if any(isinstance(n, int) for group in named.get("param_groups", ()) for n in group.get("params", ())) or \
            any(isinstance(fqn, int) for fqn in named.get("state", {})):
        raise SpmdError(
            "load_optimizer_state_dict: the state's param groups list parameters by position, as an optimizer's own "
            "`state_dict()` does, where this loader takes the parameters' names. What to do: give it the state under "
            "the model's names: `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, "
            "single_device_optimizer)`, or `compiled.optimizer_state_dict(optimizer)` as saved.")


def _unstepped(compiled, state: dict) -> bool:
    """Whether `state` is what `named_state_dict` made up for an optimizer that had not stepped. A counting
    optimizer's (AdamW, Adagrad, Rprop, ...) says so by every `step` being 0, which `named_state_dict` writes there
    and a real step never leaves; one that counts nothing (SGD's momentum) by every tensor being zero on every rank,
    which a step with any gradient does not leave. Loaded as it was, a checkpoint saved before the first step resumed
    with AdamW's bias corrections one step on (0.0165 off after 3 steps) and SGD's dampening on its first step (0.047;
    found by a probe)."""
    entries = [e for e in state.values() if isinstance(e, dict)]
    if not entries:
        return False
    if any("step" in e for e in entries):
        return all(isinstance(e.get("step"), (torch.Tensor, int, float)) and float(e["step"]) == 0 for e in entries)
    tensors = [getattr(v, "_local_tensor", v) for e in entries for v in e.values() if isinstance(v, torch.Tensor)]
    if not tensors:
        return False
    moved = any(bool(t.any()) for t in tensors)
    if compiled._on_live_mesh():  # (pieces differ by rank: every rank decides alike)
        moved = compiled._apart_anywhere(moved, "load_optimizer_state_dict's check of the state's values")
    return not moved


def load_named_state_dict(compiled, optimizer: torch.optim.Optimizer, named: dict) -> None:
    refuse_unwritten(named)
    made = made_up_ids(optimizer)
    names = _names(compiled, optimizer)
    index = {fqn: k for k, fqn in enumerate(fqn for group in names for fqn in group)}
    pieces = {}  # (a DTensor entry per parameter: whose pieces, agreed over the mesh before any is taken)
    for fqn, entries in named["state"].items():
        given = next((v for v in entries.values() if hasattr(v, "to_local")), None)
        if given is not None:
            pieces[compiled._aliases.get(fqn, fqn)] = given
    compiled._agree_on_whose_pieces(pieces, lambda _: _by_names(named))  # (every rank refuses alike)
    compiled._agree_on_loaded_state(named["state"])  # (and the whole tensors: alike on every rank)
    if len(named["param_groups"]) != len(names):
        raise SpmdError(f"load_optimizer_state_dict: the state has {len(named['param_groups'])} param groups, the "
                        f"optimizer {len(names)}. What to do: build the optimizer as it was built when saved.")
    state = {}
    for fqn, entries in named["state"].items():
        fqn = compiled._aliases.get(fqn, fqn)
        if fqn not in index:
            raise SpmdError(f"load_optimizer_state_dict: state for {fqn!r}, which this optimizer does not step. "
                            "What to do: load the state of an optimizer over the same model's parameters.")
        piece = compiled.piece(fqn)
        state[index[fqn]] = {key: _own(compiled._piece_of(fqn, value, piece), value, made)
                             for key, value in entries.items()}
    # each of the optimizer's groups takes the saved group of the same parameters, in whatever order either lists
    # them (as torch's set_optimizer_state_dict matches them by name; found by a probe: the groups of a resumed
    # run built in another order were refused as holding other parameters)
    saved_groups: dict[frozenset, list[dict]] = {}  # (a list: empty groups share their key, taken in order)
    for group in named["param_groups"]:
        saved_groups.setdefault(frozenset(compiled._aliases.get(n, n) for n in group["params"]), []).append(group)
    groups = []
    for k, group_names in enumerate(names):
        same = saved_groups.get(frozenset(group_names))
        group = same.pop(0) if same else None
        if group is None:
            saved_of = {compiled._aliases.get(n, n): j for j, g in enumerate(named["param_groups"]) for n in g["params"]}
            mixed = next((n for n in group_names if saved_of.get(n) != saved_of.get(group_names[0])), None) \
                if group_names else None
            why = (f"{group_names[0]!r} and {mixed!r}, together in group {k} now, were saved in groups "
                   f"{saved_of.get(group_names[0])} and {saved_of.get(mixed)}" if mixed is not None else
                   f"group {k} ({', '.join(map(repr, group_names[:3]))}{' ...' if len(group_names) > 3 else ''}) "
                   "holds other parameters than any group saved")
            raise SpmdError(f"load_optimizer_state_dict: {why}. What to do: build the optimizer's param groups as "
                            "they were built when saved (their order may differ).")
        groups.append({**{k: v for k, v in group.items() if k not in ("params", SAVED_BY)},
                       "params": [index[n] for n in group_names]})
    # (saved before its first step: the optimizer starts as that one would have, with its groups' settings)
    optimizer.load_state_dict({"state": {} if _unstepped(compiled, named["state"]) else state,
                              "param_groups": groups})
    forget_made_up(optimizer)  # (loaded: the state made up for it, the dict dcp.load filled, is the caller's to drop)

