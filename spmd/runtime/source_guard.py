"""Catch the model a compiled module was made from, and the other modules compiled from it, used after the
compiled module trained.

`spmd.compile` copies the model's weights into the compiled module's pieces; training steps those pieces, and
the model itself keeps the weights it had (DDP and FSDP2 train the model's own parameters; spmd cannot: a
piece is not the whole). So does every other module compiled from the same model: an evaluation module
compiled with `spmd.compile(model.eval(), ...)` beside the training one. Evaluating or saving with any of
them afterwards would give the numbers of the untrained weights, without a word.

`watch(model, compiled)` puts hooks on the model; once an optimizer has stepped a compiled module's pieces, or
its forward updated its copies of the model's buffers (batch norm recalibrated in train mode: `buffers_moved`):
- calling the model, its `state_dict()`, copying it (`copy.deepcopy`, `torch.save(model)`) or compiling it
  again raises `SpmdError` with the way out, until weights are loaded into the model
  (`model.load_state_dict(compiled.full_state_dict(persistent_only=True))`, with nothing missing);
- another module compiled from the model raises at its next call (`stale`) until weights are loaded into it
  (or given in place, under the same plan), whether it trained itself or not: two that both train step two
  copies of the weights apart; so do its `full_state_dict()` and `save_safetensors`;
- a module compiled from another model holding some of the same parameters (two heads over one encoder
  module) raises at its next call once the other's optimizer stepped one of them (`_shared_stale`), until
  it is given their values; compiling such a model raises as compiling the first one again would.
- a submodule of the model whose weights a compiled module wrote since, called, saved or copied on its own
  (`model.encoder(x)`, another model over the same encoder module called eagerly), raises until the weights
  are copied back, or loaded into the part itself (`_PartGuard`, `_PartLoad`).
A checkpoint loaded whole into one module compiled from the model while none of the others has trained (a
resumed run) makes the others stale the same way, and the model behind until it is copied back (`given`,
`from_elsewhere`).
Before a compiled module has trained, the other way round: weights given to the model after compiling (a
checkpoint loaded into it, an init function applied) never reach the pieces, and its next call raises
(`model_changed`, by the parameters' version counters) until they are given to it. The model's buffers, at
any time (`buffers_changed`): one set on the model after compiling (`model.temperature.fill_(t)`, a new
tensor assigned) never reaches the compiled module's own copy, and its next call raises unless the copy
already holds the same values; what the model's own forward changes in them (its running statistics) is
the model's business (`_OwnForward`).
A copy of the model made before any step is another model: its hooks do nothing. spmd's own mode check runs
the model past them (`inside`). A model built on the meta device (no weights to go stale) is not watched.
"""
from __future__ import annotations

import functools
import threading
import warnings
import weakref

import torch
from torch.distributed.tensor import Replicate
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from spmd.core.errors import SpmdError, user_stacklevel
from spmd.core.specs import placements_str
from spmd.runtime.distribute import local_slices, spread_values
from spmd.passes.trace_module import GLOBAL_HOOKS, MODULE_HOOKS, user_hook

_lock = threading.Lock()
_owners = WeakIdKeyDictionary()  # compiled parameter -> the compiled module holding it (a weak reference)
_stepping: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> (its parameter count, modules)
_compiled_from: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its compiled modules (refs)
_hook = None
# Ticks at every optimizer step that moves a compiled module's pieces (`_stepped`). Each compiled module keeps
# `_moved_at` (the tick of its last step, or forward that moved its buffers; `_stepped_at`: of its last step) and
# `_synced` (the tick at which it last held its model's newest
# weights: compiled, loaded whole, its own step, or given them in place): one whose sibling moved after it synced
# holds old weights (`stale`)
_clock = [0]
# A parameter of two models (a submodule both hold: a shared encoder, a model inside a wrapper both compiled):
# source parameter -> the compiled modules holding a piece of it, (a weak reference, its name there); and the
# tick of its last step, with the module that stepped it. Each module compiled from one of the models holds its
# own copy, so one that steps it leaves the others on the old values (`_shared_stale`)
_holders = WeakIdKeyDictionary()
_param_moved = WeakIdKeyDictionary()
_gathered = WeakIdKeyDictionary()  # a whole tensor `full_state_dict` gathered -> the compiled module (a weak ref)
_inside = threading.local()  # spmd itself running the model (the mode check): no guard

# Bumped by every parameter or submodule set on any module (torch's global registration hooks, below): the model's
# tree is walked again, to find a parameter or module replaced after compiling, only after one (`model_changed`)
_registered = [0]


def _eager(hook):
    """A guard's hook, run as Python even where torch.compile traces the model's modules (`torch.compile(model)`
    after spmd.compile): dynamo took its weak reference to a compiled module for a call of that module."""
    return torch.compiler.disable(hook, recursive=True)


def _bump(module, name, value) -> None:
    _registered[0] += 1  # (returns None: the registration goes on as it was)


torch.nn.modules.module.register_module_parameter_registration_hook(_bump)
torch.nn.modules.module.register_module_module_registration_hook(_bump)
torch.nn.modules.module.register_module_buffer_registration_hook(_bump)

# The copy of a compiled module's trained weights back into the model, as every guard's way out names it
COPY_BACK = "model.load_state_dict(compiled.full_state_dict(persistent_only=True))"


class _Inert:
    """What a watched model's hook becomes in a copy of the model made before any step: nothing to guard."""

    spmd_guard = True  # (not the user's hook: `trace_module.warn_module_hooks` leaves it out)

    def __call__(self, *args, **kwargs):
        return None


def _trained(model) -> bool:
    """Whether a module compiled from `model` holds newer weights than the model: it trained, its forward
    updated its buffers (`buffers_moved`), or it was given a checkpoint whole (`given`), since the model was
    compiled or last had them copied back."""
    if _loading:
        _settle_loads()
    return any(_ahead(c) or c.__dict__.get("_moved_np") for ref in _compiled_from.get(model, ())
               if (c := ref()) is not None)


def _ahead(compiled) -> bool:
    """Whether `compiled` holds newer values than its model since it was compiled or they were copied back: it
    stepped, its forward moved buffers, or it was given a checkpoint whole."""
    return bool(compiled.__dict__.get("_weights_moved") or compiled.__dict__.get("_buffers_moved")
                or compiled.__dict__.get("_given_elsewhere"))


_BUFFERS_MOVED = ("updated its buffers in a forward (batch norm's running statistics in train mode, a key/value cache "
                  "written in place)")


def _how(model) -> str:
    """How a module compiled from `model` came by newer weights than the model's (`_trained`)."""
    modules = [c for ref in _compiled_from.get(model, ()) if (c := ref()) is not None]
    if any(c.__dict__.get("_weights_moved") for c in modules):
        return "has trained"
    if any(c.__dict__.get("_buffers_moved") for c in modules):
        return _BUFFERS_MOVED
    behind = sorted({n for c in modules for n in c.__dict__.get("_moved_np", ())})  # (copied back but these)
    if behind:
        return (f"{_BUFFERS_MOVED}, and its non-persistent ones ({', '.join(f'`{n}`' for n in behind[:3])}) are not in "
                f"a state dict, so copying it back left them behind: copy them too (`model.get_buffer('{behind[0]}')"
                f".copy_(compiled.full_state_dict()['{behind[0]}'])`, on every rank)")
    return "was given weights from elsewhere (a checkpoint loaded into it)"


class _Guard:
    spmd_guard = True

    def __init__(self, model: torch.nn.Module, what: str | None):
        self.model, self.what = weakref.ref(model), what

    def __reduce__(self):
        model = self.model()
        if model is not None and _trained(model) and not getattr(_inside, "depth", 0):
            raise _stale_model(model, "copying it (copy.deepcopy, torch.save of the whole model)")
        return (_Inert, ())  # (a copy of the model is another model)

    @_eager
    def __call__(self, module, *args):
        if module is not self.model() or getattr(_inside, "depth", 0):
            return None
        if self.what is None:  # a load into the model: its weights are what the user put there, if whole
            if not args or not getattr(args[0], "missing_keys", ()):
                modules = [c for ref in _compiled_from.get(module, ()) if (c := ref()) is not None]
                if _trained(module):
                    # the trained weights copied back (`COPY_BACK`): the
                    # model agrees again with the module that trained, and with those given its weights since
                    # its last step. (Into a model whose modules have not trained, a load is new weights the
                    # modules do not have: `model_changed` says so.)
                    _copied_back_shared(module, _copying.pop(module, ()))
                    for c in modules:
                        if c.__dict__.get("_weights_moved") or c.__dict__.get("_buffers_moved") \
                                or c.__dict__.get("_loaded"):
                            c.__dict__["_weights_moved"] = c.__dict__["_given_elsewhere"] = False
                            c.__dict__["_buffers_moved"] = False
                            mark_model(c)
                            _not_copied(c, module)
            return None
        if _trained(module) and not _all_copied(module, self.what == "its state_dict()"):
            raise _stale_model(module, self.what)
        return None


def _not_copied(compiled, model) -> list[str]:
    """The non-persistent buffers `compiled`'s forwards moved whose values the model does not hold as `compiled`
    does (kept as `_moved_np`): a state dict does not carry them, so the copy back (`COPY_BACK`) left them behind
    (found by a review: a running mean registered with persistent=False, 0.31 off after the copy back)."""
    left = [n for n in sorted(compiled.__dict__.get("_moved_np", ())) if (b := _buffer(compiled, model, n)) is None
            or not _holds(compiled, n, b)]
    compiled.__dict__["_moved_np"] = frozenset(left)
    return left


def _all_copied(model, saving: bool = False) -> bool:
    """Whether the only thing the model was behind on is non-persistent buffers (`_not_copied`), since copied into
    it by hand, or not in what is `saving` (its state dict)."""
    modules = [c for ref in _compiled_from.get(model, ()) if (c := ref()) is not None]
    if any(_ahead(c) for c in modules):
        return False
    return saving or not any(_not_copied(c, model) for c in modules if c.__dict__.get("_moved_np"))


class _PartGuard:
    """On a submodule of a watched model (its forward pre-hook, its state_dict pre-hook): used on its own
    (`model.encoder(x)`, `model.encoder.state_dict()`, a copy of it, or another model holding it and called as it
    is: two heads over one encoder, one of them compiled) once a module compiled from the model wrote its pieces
    of the part's weights, it raises until they are copied back (`_part_moved`). The part is found by identity,
    not by its name, so one deleted from the model or replaced in it (and still held elsewhere) stays watched.
    A look that found nothing is kept (`ok_at`) until a step, a load or a registration anywhere, or until one
    of the part's buffer pieces changes (batch norm's statistics, in a compiled forward with no step)."""
    spmd_guard = True

    def __init__(self, model: torch.nn.Module, part: torch.nn.Module, name: str, what: str):
        self.model, self.part, self.name, self.what = weakref.ref(model), weakref.ref(part), name, what
        self.ok_at, self.ok_buffers = None, ()

    def __reduce__(self):
        self._check("copying it (copy.deepcopy, torch.save of the module)")
        return (_Inert, ())  # (a copy of the submodule is another module)

    def __call__(self, module, *args):
        # (until a compiled module has trained or been given a checkpoint in this process nothing can be stale,
        # and a call costs this compare; torch.compile reads the tick as a constant and guards on it. After, a
        # look kept is read here, outside `_eager`'s wrapper, except where torch.compile traces)
        if _clock[0] and (torch.compiler.is_compiling() or not self._kept()):
            self._check(self.what)

    def _kept(self) -> bool:
        """Whether the last look found nothing, and nothing stepped, loaded or was set since, nor was one of
        the part's buffer pieces written."""
        return self.ok_at == (_clock[0], _registered[0], _marked[0]) and all(
            b._version == v for b, v in self.ok_buffers)

    @_eager
    def _check(self, what: str) -> None:
        model, part = self.model(), self.part()
        if model is None or part is None or getattr(_inside, "depth", 0) or not _trained(model):
            return
        now = (_clock[0], _registered[0], _marked[0])
        if self._kept():
            return
        # (its buffer pieces written since its last look, with no step: what was found for every part is old too)
        moved, swapped, buffers, walked = _part_moved(model, part, now, fresh=self.ok_at == now)
        if not moved:  # (weights of its own passed in, `functional_call`'s: good for this call only)
            # (and for the parts inside it, whose weights were all looked at: a model 100 modules deep looked at
            # the innermost 100 times after each step)
            guards = _parts_watched.get(model, {})
            for m in walked:
                for guard in guards.get(m, ()):
                    guard.ok_at, guard.ok_buffers = (None if swapped else now), buffers
            return
        raise SpmdError(
            f"{type(part).__name__} `{self.name}` is a part of {type(model).__name__}, which was compiled by "
            f"spmd.compile, and the compiled module {_how(model)} since: the part's own weights "
            f"({', '.join(f'`{n}`' for n in moved[:3])}{', ...' if len(moved) > 3 else ''}) are still those it "
            f"was compiled with, so {what} would give the numbers of the old weights. What to do: copy the "
            f"trained weights back into {type(model).__name__} first (`{COPY_BACK}`, on every rank; until the "
            "next step), or call the compiled module.")


class _PartLoad:
    """On a submodule of a watched model (its load_state_dict pre- and post-hooks): the weights it holds itself
    that a load gave without an error (`model.encoder.load_state_dict(trained)`, a load into the model with only
    some entries, `assign=True` too) hold what the user put there; they, and the compiled modules' pieces of
    them as they are now, are the new mark (`_mark_parts`)."""
    spmd_guard = True

    def __init__(self, model: torch.nn.Module, after: bool):
        self.model, self.after = weakref.ref(model), after

    def __reduce__(self):
        return (_Inert, ())  # (a copy of the submodule is another module)

    @_eager
    def __call__(self, module, *args):
        model = self.model()
        if model is None or getattr(_inside, "depth", 0):
            return None
        if not self.after:  # (module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
            state_dict, prefix, errors = args[0], args[1], args[6]
            _loading_into[module] = ({k: t for table in (module._parameters, module._buffers) for k, t in table.items()
                                      if t is not None and prefix + k in state_dict}, errors, len(errors))
            return None
        found, errors, before = _loading_into.pop(module, ({}, (), 0))
        if found and len(errors) == before:
            given = [(t, now) for k, t in found.items()
                     if (now := module._parameters.get(k, module._buffers.get(k))) is not None]
            for ref in _compiled_from.get(model, ()):
                if (c := ref()) is not None and "_part_marks" in c.__dict__:
                    _mark_parts(c, model, given)
        return None


# a module of a model `load_state_dict` is loading into -> (names the load gives, its errors, their count before)
# (a dict of its own: it shared `_loading`'s name, and torch.distributed.checkpoint's loads met its entries)
_loading_into = WeakIdKeyDictionary()


def _part_moved(model: torch.nn.Module, part: torch.nn.Module, now: tuple,
                fresh: bool = False) -> tuple[list[str], bool, tuple, list]:
    """The names of `part`'s weights that a module compiled from `model` holds newer values of (`_verdict`);
    whether one of the part's tensors is none the model's modules were marked with (`torch.func.functional_call`
    passing weights of its own); (piece, version) of each of its buffer pieces found unwritten; and the modules
    it holds."""
    moved_ids, marked, unwritten = _verdict(model, now, fresh)
    moved, swapped, buffers, walked = [], False, [], _walk(part)
    for m in walked:
        for table in (m._parameters, m._buffers):
            for t in table.values():
                if t is None:
                    continue
                key = id(t)
                if key in moved_ids:
                    if moved_ids[key] not in moved:
                        moved.append(moved_ids[key])
                elif key not in marked:
                    swapped = True
                else:
                    buffers.extend(unwritten.get(key, ()))
    return moved, swapped, tuple(buffers), walked


def _walk(module: torch.nn.Module) -> list[torch.nn.Module]:
    """`module` and every module under it, once each (`Module.modules()` yields through a generator per level:
    a part 100 deep took 33 ms to walk them all)."""
    seen, stack, found = set(), [module], []
    while stack:
        m = stack.pop()
        if id(m) not in seen:
            seen.add(id(m))
            found.append(m)
            stack.extend(child for child in m._modules.values() if child is not None)
    return found


_verdicts = WeakIdKeyDictionary()  # model -> `_verdict`'s answer, with the `now` it was found at


def _verdict(model: torch.nn.Module, now: tuple, fresh: bool = False) -> tuple[dict, set, dict]:
    """For the weights of `model` that its trained compiled modules marked (`_mark_parts`): id -> name of those a
    module holds newer values of (its piece written since the mark: an optimizer's step, batch norm's statistics;
    or marked before a checkpoint was given to it whole), the ids of all marked, and id -> ((piece, version),)
    of the buffers found unwritten. Found once per `now` (a step, a load, a registration) for all the parts, and
    again when a part finds one of its buffer pieces written since (`fresh`)."""
    found = _verdicts.get(model)
    if found is not None and found[0] == now and not fresh:
        return found[1]
    moved, marked, unwritten = {}, set(), {}
    for ref in _compiled_from.get(model, ()):
        c = ref()
        if c is None or not _ahead(c):
            continue
        elsewhere = c.__dict__.get("_elsewhere_mark", -1) if c.__dict__.get("_given_elsewhere") else -1
        buffers = c.__dict__.get("_part_buffers", ())
        for key, (_, name, piece, version, when) in c.__dict__.get("_part_marks", {}).items():
            marked.add(key)
            held = c.piece(name)
            if when <= elsewhere or held is not piece or held._version != version:
                moved.setdefault(key, name)
            elif name in buffers:
                unwritten.setdefault(key, []).append((held, version))
    answer = (moved, marked, unwritten)
    _verdicts[model] = (now, answer)
    return answer


_marked = [0]  # ticks whenever weights are marked (`_mark_parts`): a part's last look is out of date


def _mark_parts(compiled, model: torch.nn.Module, given=None) -> None:
    """The model's weights (`given`: (the tensor a load found, the one it left) pairs, the second a new one
    under `assign=True`; None: all its parameters and persistent buffers) and `compiled`'s pieces of them as they
    are now: a piece written since holds newer values than the model's (`_part_moved`)."""
    _marked[0] += 1
    if given is None:  # (the model's weights, each under the name the compiled module holds it by)
        aliases, keep = compiled.__dict__.get("_aliases", {}), compiled._persistent_names()
        names = {id(t): aliases.get(n, n) for n, t in (*model.named_parameters(), *model.named_buffers())
                 if aliases.get(n, n) in keep}
        compiled.__dict__["_part_names"] = names
        compiled.__dict__["_part_buffers"] = {aliases.get(n, n) for n, _ in model.named_buffers()}
        marks, given = {}, [(t, t) for t in (*model.parameters(), *model.buffers())]
    else:
        names = dict(compiled.__dict__.get("_part_names", {}))
        marks = dict(compiled.__dict__.get("_part_marks", {}))
    for before, now in given:
        name = names.get(id(before))
        if name is None:
            continue
        if now is not before:  # (the tensor the load assigned holds the name now)
            marks.pop(id(before), None)
            names[id(now)] = name
        piece = compiled.piece(name)
        marks[id(now)] = (now, name, piece, piece._version, _marked[0])
    compiled.__dict__["_part_names"], compiled.__dict__["_part_marks"] = names, marks


_parts_watched = WeakIdKeyDictionary()  # model -> {submodule: its `_PartGuard`s} for those carrying its guards


def _watch_parts(model: torch.nn.Module) -> None:
    """Guards on each submodule of `model` holding weights (those added since it was last compiled too)."""
    watched = _parts_watched.setdefault(model, WeakIdKeyDictionary())
    for name, part in model.named_modules():
        if name and part not in watched and (any(True for _ in part.parameters()) or any(True for _ in part.buffers())):
            call, state = _PartGuard(model, part, name, "calling it"), _PartGuard(model, part, name, "its state_dict()")
            watched[part] = (call, state)
            part.register_forward_pre_hook(call, prepend=True)
            part.register_state_dict_pre_hook(state)
            part.register_load_state_dict_pre_hook(_PartLoad(model, after=False))
            part.register_load_state_dict_post_hook(_PartLoad(model, after=True))


def _current(compiled, fqn: str, p) -> bool:
    """Whether `compiled` holds the newest values of `p` (its shared parameter `fqn`): no other module stepped
    it since it last had them, and its own steps began from them."""
    moved = _param_moved.get(p)
    if fqn in compiled.__dict__.get("_shared_diverged", ()):
        return False
    return moved is None or moved[1]() is compiled or moved[0] <= max(
        compiled.__dict__.get("_synced", 0), compiled.__dict__.get("_shared_synced", {}).get(fqn, 0))


_copying = WeakIdKeyDictionary()  # model -> the shared parameters a load into it is copying back (`_CopyBack`)


class _CopyBack:
    """Before a load into the model: the shared parameters whose entries are the trained weights copied back
    (`full_state_dict()` of a module compiled from it that holds their newest values), as against a checkpoint's."""
    spmd_guard = True

    def __init__(self, model: torch.nn.Module):
        self.model = weakref.ref(model)

    def __reduce__(self):
        return (_Inert, ())  # (a copy of the model is another model)

    @_eager
    def __call__(self, module, state_dict, prefix, *args):
        if module is not self.model() or prefix:
            return None
        copied = []
        for ref in _compiled_from.get(module, ()):
            c = ref()
            for fqn, p in (() if c is None else c.__dict__.get("_shared", {}).items()):
                if _gathered_from(state_dict.get(fqn))[0] is c and _current(c, fqn, p):
                    copied.append(p)
        _copying[module] = copied
        return None


def _other_holders(p, model):
    """(module, the name of `p` there) for each live module holding a piece of `p` compiled from a model other
    than `model`."""
    for ref, there in _holders.get(p, ()):
        if (other := ref()) is not None and other.__dict__.get("_source_model") is not model:
            yield other, there


def _copied_back_shared(model, copied) -> None:
    """The trained weights copied back into `model` (`COPY_BACK`) rewrote the parameters it shares with other
    models (`copied`): a module compiled from one of those that holds their newest values too holds what was
    written, and takes the new versions as its own (`model_changed` refused it, a frozen shared encoder's values
    unchanged). A checkpoint loaded into the model is no such copy: the other module is refused."""
    for p in copied:
        for other, there in _other_holders(p, model):
            if _current(other, there, p):
                mark_model(other, {there})


def _way_out(model) -> str:
    """What to do with a model whose compiled module holds newer weights. Evaluation goes through the compiled
    module (`compiled.eval()`), except where a module compiled from `model` in train mode has a graph that does
    what that mode does (dropout, batch statistics), which refuses `eval()`: a probe followed that advice into the
    next refusal."""
    modules = [c for ref in _compiled_from.get(model, ()) if (c := ref()) is not None]
    evaluate = ("to evaluate: its graph does what train mode does, so copy its weights back as below and compile "
                "`model.eval()` for evaluation"
                if any(c.__dict__.get("_mode_dependent") and c.__dict__.get("_traced_mode") for c in modules) else
                "evaluation too: `compiled.eval()`, with `torch.no_grad()`")
    return (f"call the compiled module that trained ({evaluate}), save with `compiled.state_dict()`, "
            "`compiled.full_state_dict()` or `compiled.save_safetensors(...)`, or copy its weights back first "
            f"(`{COPY_BACK}`, on every rank; until the next step)")


def _stale_model(model, what: str) -> SpmdError:
    return SpmdError(
        f"{type(model).__name__} was compiled by spmd.compile, and the compiled module {_how(model)} since: the "
        f"model's own weights are still those it was compiled with, so {what} would give the numbers of the old "
        f"weights. What to do: {_way_out(model)}.")


def check_compile(model: torch.nn.Module) -> None:
    """Compiling a model again after a module compiled from it trained would start from the old weights; so
    would compiling one that holds a parameter of another model (a shared encoder) whose module trained it."""
    if _trained(model) and not _all_copied(model):
        raise SpmdError(
            f"spmd.compile: a module compiled from this {type(model).__name__} {_how(model)} since, and the model's "
            "own weights are still those it was compiled with: a new compile would start from them. What to do: "
            f"copy the trained weights back first (`{COPY_BACK}`, on every rank), then compile.")
    for fqn, p in model.named_parameters():
        for other, there in _other_holders(p, model):
            if other.__dict__.get("_weights_moved") and other.piece(there).requires_grad:
                raise SpmdError(
                    f"spmd.compile: `{fqn}` is also a parameter of {type(other._source_model).__name__} (`{there}`), "
                    "and a module compiled from that model has trained since: this model's own value of it is still "
                    "the one that module was compiled with, so a compile would start from it. What to do: copy "
                    f"the trained weights back into that model first (`{COPY_BACK}` with its module, on every "
                    "rank), then compile.")


class _LossGuard:
    """A loss_fn module with parameters of its own: the compiled module trains them (`loss_fn.log_var`), the
    module keeps the old ones; calling it or its `state_dict()` after a step raises, until they are loaded
    into it (its load hook)."""
    spmd_guard = True

    def __init__(self, what: str | None):
        self.what = what

    @_eager
    def __call__(self, module, *args):
        if getattr(_inside, "depth", 0):
            return None
        users = [c for ref in _loss_users.get(module, ()) if (c := ref()) is not None]
        if self.what is None:  # a load into it: its values are the trained ones now, if whole
            if not args or not getattr(args[0], "missing_keys", ()):
                for c in users:
                    c.__dict__["_loss_moved"] = False
            return None
        if any(c.__dict__.get("_loss_moved") for c in users):
            names = sorted(n for n, _ in module.named_parameters())
            raise SpmdError(
                f"the loss_fn {type(module).__name__} has parameters of its own ({', '.join(names[:3])}), which the "
                f"compiled module trains as loss_fn.*: its own are still those it was compiled with, so {self.what} "
                "would give the numbers of the old ones. What to do: load the trained ones into it first, on every "
                "rank: `loss_fn.load_state_dict({k.removeprefix('loss_fn.'): v for k, v in "
                "compiled.full_state_dict().items() if k.startswith('loss_fn.')})`.")
        return None


_loss_users = WeakIdKeyDictionary()  # loss_fn module -> the compiled modules training its parameters (refs)


def _watch_loss(loss_fn, compiled) -> None:
    if not isinstance(loss_fn, torch.nn.Module) or not any(True for _ in loss_fn.parameters()) \
            or any(t.is_meta for t in loss_fn.parameters()):
        return
    users = _loss_users.setdefault(loss_fn, [])
    if not users:
        loss_fn.register_forward_pre_hook(_LossGuard("calling it"))
        loss_fn.register_state_dict_pre_hook(_LossGuard("its state_dict()"))
        loss_fn.register_load_state_dict_post_hook(_LossGuard(None))
    users.append(weakref.ref(compiled))


def watch(model: torch.nn.Module, compiled, loss_fn=None) -> None:
    global _hook
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        return
    with _lock:
        _watch_loss(loss_fn, compiled)
        siblings = _compiled_from.setdefault(model, [])
        siblings[:] = [ref for ref in siblings if ref() is not None]  # (modules dropped since)
        if not siblings:  # (the model's hooks once, however many modules are compiled from it)
            model.register_forward_pre_hook(_Guard(model, "calling it"))
            model.register_state_dict_pre_hook(_Guard(model, "its state_dict()"))
            model.register_load_state_dict_pre_hook(_CopyBack(model))
            model.register_load_state_dict_post_hook(_Guard(model, None))
            model.register_forward_pre_hook(_OwnForward(model, after=False))
            model.register_forward_hook(_OwnForward(model, after=True))
        siblings.append(weakref.ref(compiled))
        compiled.__dict__["_siblings"] = siblings
        _watch_parts(model)
        given(compiled)  # (its weights as compiled: the mark its in-place changes are seen against)
        compiled.__dict__["_loaded"], compiled.__dict__["_given"] = False, set()
        compiled.__dict__["_synced"], compiled.__dict__["_moved_at"] = _clock[0], 0
        for p in compiled.parameters():
            _owners[p] = weakref.ref(compiled)
        _share(model, compiled)
        if _hook is None:
            # (as Python where torch.compile traces the step, `torch.compile(opt.step)`: dynamo called a compiled
            # module through its weak reference with no inputs; found by a probe)
            _hook = (register_optimizer_step_pre_hook(_eager(_stepping_now)), register_optimizer_step_post_hook(_eager(_stepped)))
            _guard_averaging()


def _guard_averaging() -> None:
    """`AveragedModel.update_parameters(model)` (an EMA or SWA of the weights) reads the model's parameters, which
    no hook sees: over a model whose compiled module trained, it averaged the weights the model was compiled with
    at every step (0.070 off one device after 3 steps, silently; found by a probe). Refused there, with the way
    out: average the compiled module (`AveragedModel(compiled)`, `ema.update_parameters(compiled)`)."""
    from torch.optim import swa_utils

    update = swa_utils.AveragedModel.update_parameters
    if getattr(update, "spmd_guard", False):
        return

    @functools.wraps(update)
    def update_parameters(self, model):
        # (the model, or a part of it compiled alone: `spmd.compile(model.encoder)`; found by a review)
        stale = next(((name, m) for name, m in model.named_modules() if _trained(m) and not _all_copied(m)), None) \
            if isinstance(model, torch.nn.Module) else None
        if stale is not None:
            name, part = stale
            raise SpmdError(
                f"{type(part).__name__}{f' ({name!r} of {type(model).__name__})' if name else ''} was compiled by "
                f"spmd.compile, and the compiled module {_how(part)} since: "
                "the model's own weights are still those it was compiled with, so averaging them "
                "(`AveragedModel.update_parameters(model)`) would average the old weights at every step. What to do: "
                "average the compiled module (`ema = AveragedModel(compiled)`, `ema.update_parameters(compiled)`: "
                "each rank averages its pieces, as the average is taken element by element), or copy its weights "
                f"back first (`{COPY_BACK}`, on every rank).")
        return update(self, model)

    update_parameters.spmd_guard = True
    swa_utils.AveragedModel.update_parameters = update_parameters


def _share(model: torch.nn.Module, compiled) -> None:
    """List `compiled` as a holder of each of the model's parameters and buffers it has a piece of, and mark those
    that modules compiled from other models hold too (`_shared`: name here -> the source tensor), on both sides."""
    compiled.__dict__["_shared"] = {}
    for fqn, p in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        if fqn not in compiled._param_names:
            continue
        holders = _holders.setdefault(p, [])
        holders[:] = [(ref, there) for ref, there in holders if ref() is not None]  # (modules dropped since)
        for other, there in _other_holders(p, model):
            compiled.__dict__["_shared"][fqn] = p
            other.__dict__["_shared"] = {**other.__dict__.get("_shared", {}), there: p}
        holders.append((weakref.ref(compiled), fqn))


class _OwnForward:
    """Around the model's own forward (a pre-hook, then a hook): the buffers it changes (batch norm's running
    statistics, a counter) are its own state, not values given to the modules compiled from it, whose marks
    (`buffers_changed`) move with them; so are the hooks it registers on itself (transformers' output capture,
    installed at the first call asking for hidden states: the trace ran them), which `hooks_changed` then
    takes as the model's. A buffer set outside since (`model.t.fill_(0.5)`, then a call of the
    model) stays changed."""
    spmd_guard = True

    def __init__(self, model: torch.nn.Module, after: bool):
        self.model, self.after = weakref.ref(model), after

    def __reduce__(self):
        return (_Inert, ())  # (a copy of the model is another model)

    @_eager
    def __call__(self, module, *args):
        if module is not self.model():
            return None
        modules = [c for ref in _compiled_from.get(module, ()) if (c := ref()) is not None]
        if not self.after:
            _versions_before[module] = {id(b): b._version for c in modules
                                        for b, _ in c.__dict__.get("_buffer_marks", {}).values()}
            _hooks_before[module] = RemovableHandle.next_id
            return None
        before = _versions_before.pop(module, {})
        first = _hooks_before.pop(module, RemovableHandle.next_id)
        if RemovableHandle.next_id != first:  # (hooks the forward registered: transformers' output capture)
            for c in modules:
                if "_model_hooks" in c.__dict__:
                    now = _hooks(c._hooked_modules, c._hooked_params)
                    c.__dict__["_model_hooks"] = c._model_hooks | {k for k in now if k[2] >= first}
        for c in modules:
            marks = c.__dict__.get("_buffer_marks")
            if marks and any(b._version != v and before.get(id(b)) == v for b, v in marks.values()):
                c.__dict__["_buffer_marks"] = {fqn: (b, b._version if before.get(id(b)) == v else v)
                                               for fqn, (b, v) in marks.items()}
        return None


_versions_before = WeakIdKeyDictionary()  # model -> its buffers' versions when its forward began
_hooks_before = WeakIdKeyDictionary()  # model -> the next hook handle id when its forward began


def _loss_module(compiled):
    """The loss_fn module `compiled` was compiled with (its buffers copied as `loss_fn.*`), or None."""
    loss = getattr(compiled.__dict__.get("_traced_root"), "loss_fn", None)
    return loss if isinstance(loss, torch.nn.Module) and compiled.__dict__.get("_loss_names") else None


def _mark_buffers(compiled, model: torch.nn.Module, fqns=None) -> None:
    """The model's buffers, and a loss_fn module's (`loss_fn.weight` of `nn.CrossEntropyLoss(weight=w)`), those
    named `fqns` (None: all) that `compiled` holds a copy of, as they are now."""
    marks = {} if fqns is None else dict(compiled.__dict__.get("_buffer_marks", {}))
    pieces = {} if fqns is None else dict(compiled.__dict__.get("_piece_marks", {}))
    loss = _loss_module(compiled)
    named = [*model.named_buffers(remove_duplicate=False),
             *(() if loss is None else ((f"loss_fn.{n}", b) for n, b in loss.named_buffers(remove_duplicate=False)
                                        if f"loss_fn.{n}" in compiled._loss_names))]
    for fqn, b in named:
        if fqn in compiled._param_names and (fqns is None or fqn in fqns):
            marks[fqn] = (b, b._version)
            pieces[fqn] = _piece_mark(compiled, fqn)
    compiled.__dict__["_buffer_marks"] = marks
    compiled.__dict__["_piece_marks"] = pieces
    compiled.__dict__["_buffers_at"] = _registered[0]


def _buffer(compiled, model: torch.nn.Module, fqn: str):
    loss = _loss_module(compiled) if fqn.startswith("loss_fn.") and fqn in compiled._loss_names else None
    try:
        return model.get_buffer(fqn) if loss is None else loss.get_buffer(fqn.removeprefix("loss_fn."))
    except AttributeError:
        return None


def _piece_mark(compiled, fqn: str):
    """(this rank's piece of the buffer `fqn`, its version) now."""
    piece = compiled._get(compiled._param_names[fqn])
    return piece, piece._version


def _seen_alike(compiled, fqn: str, value) -> bool:
    """Whether the model's new `value` of the buffer `fqn` can be taken as seen by every rank alike: this
    rank's piece holds its piece of it, and the buffer is whole on every rank, or the compiled module's copy
    was set too since it was marked (a load into both, trained statistics copied back). A sharded buffer
    changed on the model alone, in rows another rank holds (a pruning mask), left this rank's piece equal:
    this rank went on into the step's collectives while the other refused, and waited there for good."""
    if not _holds(compiled, fqn, value):
        return False
    if all(isinstance(p, Replicate) for p in compiled._state_placements[fqn]):
        return True
    marked = compiled.__dict__.get("_piece_marks", {}).get(fqn)
    piece, version = _piece_mark(compiled, fqn)
    return marked is None or piece is not marked[0] or version != marked[1]


def _holds(compiled, fqn: str, value) -> bool:
    """Whether `compiled`'s piece of `fqn` is this rank's piece of `value`."""
    piece = compiled._get(compiled._param_names[fqn])
    try:
        expected = compiled._piece_of(fqn, value, piece)
    except Exception:  # noqa: BLE001 - (another shape: not what it holds)
        return False
    return isinstance(expected, torch.Tensor) and expected.shape == piece.shape and torch.equal(
        expected.to(piece.dtype), piece)


def buffers_changed(compiled) -> None:
    """Raise where a buffer of the model was set after `compiled` copied it (in place, by version counter, or
    a new tensor assigned), and the compiled module's copy does not hold the same values: a temperature
    annealed on the model (`model.t.fill_(0.5)`), a mask replaced. The compiled module would run with its old
    copy, silently. Equal values (the trained buffers copied back, a load into both) are taken as seen."""
    marks = compiled.__dict__.get("_buffer_marks")
    if not marks or compiled.__dict__.get("_copy"):
        return
    model = compiled._source_model
    walk = compiled.__dict__.get("_buffers_at") != _registered[0]  # (something was set on some module)
    changed, seen = [], {}
    for fqn, (b, version) in marks.items():
        now = _buffer(compiled, model, fqn) if walk else b
        if now is b and b._version == version:
            continue
        if now is not None and _seen_alike(compiled, fqn, now):
            seen[fqn] = (now, now._version)
        else:
            changed.append(fqn)
    if seen:
        compiled.__dict__["_buffer_marks"] = {**marks, **seen}
        compiled.__dict__["_piece_marks"] = {**compiled.__dict__.get("_piece_marks", {}),
                                             **{fqn: _piece_mark(compiled, fqn) for fqn in seen}}
    if changed:
        loss = _loss_module(compiled) if changed[0] in compiled._loss_names else None
        whose = f"{type(model).__name__}'s" if loss is None else f"the loss_fn {type(loss).__name__}'s"
        first = changed[0]
        piece = compiled.get_buffer(first)
        whole = tuple(compiled._global_shapes.get(first, piece.shape))
        if tuple(piece.shape) != whole:  # (a piece: a whole tensor copied into it fails on its size; a probe)
            set_it = (f"`compiled.get_buffer('{first}')` is this rank's piece ({list(piece.shape)} of {list(whole)}): "
                      "set a value the same everywhere in place (`.zero_()`, `.fill_(v)`: a cache reset between "
                      f"prompts), or load whole tensors, `compiled.load_state_dict({{'{first}': new}}, strict=False)`, "
                      "on every rank")
        else:
            set_it = f"`compiled.get_buffer('{first}').copy_(new)`, on every rank"
        if loss is None and not compiled.__dict__.get("_buffers_moved"):  # (else its state_dict is refused: stale)
            set_it += ", or give it the model's (`compiled.load_state_dict(model.state_dict())`, for persistent ones)"
        raise SpmdError(
            f"{whose} buffer(s) {', '.join(f'`{n}`' for n in changed[:4])}"
            f"{', ...' if len(changed) > 4 else ''} changed after it was compiled (set in place or assigned), and "
            "the compiled module holds its own copy of each: this call would run with the old values. What to do: "
            f"set them on the compiled module as well ({set_it}).")
    if walk:
        compiled.__dict__["_buffers_at"] = _registered[0]


def mark_model(compiled, fqns=None) -> None:
    """The model's parameters (those named `fqns`; None: all) as they are now: what `compiled`'s pieces hold
    (`model_changed` compares)."""
    model = compiled.__dict__.get("_source_model")
    if model is None:
        return
    if compiled.__dict__.get("_siblings") is None:  # (a model built on meta is not watched: nothing goes stale)
        return
    tree = compiled.__dict__.get("_model_tree")
    named = dict(model.named_parameters(remove_duplicate=False))
    if fqns is None:
        marks, params = {}, model.parameters()
    else:
        marks, params = dict(compiled.__dict__.get("_model_versions", {})), [named[f] for f in fqns if f in named]
    if tree is None:  # (when compiled: the model's tree as it is now, walked again after any registration)
        tree = _tree(model)
        compiled.__dict__["_tree_at"] = _registered[0]
    else:
        # the parameters given (under every name of each, a tie's too) are the model's now; its modules stay as
        # compiled (a module swapped is not undone by a load: its forward is not the traced one), and the next
        # call walks the tree again (`_tree_at` kept), so nothing replaced before this load goes unseen
        given = {id(named[f]) for f in (named if fqns is None else fqns) if f in named}
        tree = {**tree, **{("parameter", n): p for n, p in named.items() if id(p) in given}}
    # (new dicts each time: a copy of the compiled module starts with its original's)
    compiled.__dict__["_model_versions"] = {**marks, **{id(p): _look(p) for p in params}}
    compiled.__dict__["_model_tree"] = tree
    if "_source_rows" in compiled.__dict__:  # (the values the model holds now are seen: `_rows_moved`)
        _keep_rows(compiled, fqns)
    _mark_buffers(compiled, model, fqns)
    if fqns is None:
        _mark_parts(compiled, model)
    else:
        weights = {**dict(model.named_parameters(remove_duplicate=False)),
                   **dict(model.named_buffers(remove_duplicate=False))}
        _mark_parts(compiled, model, [(weights[f], weights[f]) for f in fqns if f in weights])


def _tree(model: torch.nn.Module) -> dict[tuple[str, str], object]:
    """("parameter" or "module", name) -> the object the model holds there; ("buffers", module name) -> the
    names of the module's buffers, with which are None (compared by value: a buffer registered as None and set
    later, or a buffer registered after compiling, which the graph never read; found by a probe, 0.24 off)."""
    return {**{("parameter", n): p for n, p in model.named_parameters(remove_duplicate=False)},
            **{("module", n): m for n, m in model.named_modules(remove_duplicate=False) if n},
            **{("buffers", n): tuple((k, b is None) for k, b in m._buffers.items())
               for n, m in model.named_modules(remove_duplicate=False)}}


def model_changed(compiled) -> None:
    """Raise where the model's weights changed in place after `compiled` cut its pieces from them (or was last
    given weights), before it trained: a checkpoint loaded into the model after compiling
    (`model.load_state_dict(torch.load(...))`), an init function applied (`model.apply(init_weights)`). The
    module holds the weights it was compiled with and would train from them, silently. Once it has trained,
    the model's weights are the old ones (`stale`'s business), and only a change of its structure is looked for
    (`_replaced`: a module or parameter set on it), at a counter's cost."""
    if compiled.__dict__.get("_copy"):  # (a copy: a snapshot)
        return
    # (something was set on some module since the last look: a module swapped or a parametrization registered
    # changes the computation, trained or not; a probe found such changes after a step unseen, 0.068 off)
    trained = bool(compiled.__dict__.get("_weights_moved"))
    if compiled.__dict__.get("_tree_at") != _registered[0] and "_model_tree" in compiled.__dict__:
        _replaced(compiled, trained)
    if trained:
        return
    versions = compiled.__dict__.get("_model_versions")
    if not versions:
        return
    if any(_ahead(c) for ref in _compiled_from.get(compiled._source_model, ()) if (c := ref()) is not None
           and c is not compiled):
        # a sibling trained: the model's tensors its replicated pieces share moved with its steps (`stale` says
        # whether this module was given the new weights since; a probe found an evaluation module given them in
        # place refused here, with a way out that could not work)
        return
    changed = [p for p, v, at, layout in versions.values()
               if p._version != v or p.data_ptr() != at and _set_through_data(compiled, p, layout)]
    model = compiled._source_model
    read = compiled.__dict__.get("_values_read")
    # the first call (or the next, after a refusal) reads every value; calls 2, 4, 8, ... and every 1024th after it
    # a sample of each against the one seen at the last read (a probe loaded weights through `.data` after a warm-up
    # call, and the old ones trained)
    if not read or _sample_due(compiled._calls + 1):
        if not changed and compiled._cut_here:  # (a rank whose pieces came from rank src_data_rank's: not its own)
            changed = _rows_moved(compiled) if read else _written_unseen(compiled)
        # every rank raises or none does: one that went on would wait in the forward's collectives for good
        anywhere = compiled._apart_anywhere(bool(changed), "models' weights") \
            if torch.distributed.is_initialized() else bool(changed)
        compiled.__dict__["_values_read"] = not anywhere  # (read again at the next call until they are given)
        if not anywhere and compiled._cut_here:
            _keep_rows(compiled)
        if anywhere and not changed:
            raise SpmdError(
                f"{type(model).__name__}'s weights changed after it was compiled on another rank of the mesh (loaded, "
                "set in place or through `.data`; that rank names them), and the compiled module holds the pieces cut "
                "from them when compiled: it would run and train on the old weights. What to do: give it the new ones "
                "(`compiled.load_state_dict(model.state_dict())`, on every rank), or load and initialize the model "
                "before spmd.compile.")
    if not changed:
        return
    name_of = {id(p): n for n, p in model.named_parameters()}
    names = [name_of.get(id(p), "?") for p in changed]
    raise SpmdError(
        f"{type(model).__name__}'s weights changed after it was compiled ({', '.join(names[:4])}"
        f"{', ...' if len(names) > 4 else ''}: loaded, set in place or through `.data`), and the compiled module "
        "holds the pieces it cut from them when compiled: it would run and train on the old weights. What to do: "
        "give it the new ones (`compiled.load_state_dict(model.state_dict())`, on every rank), or load and "
        "initialize the model before spmd.compile.")


def _written_unseen(compiled) -> list[torch.Tensor]:
    """The model's parameters whose values are no longer those `compiled` cut its pieces from, though nothing
    `model_changed` reads moved: written through `.data` (`p.data.copy_(pretrained)`, `p.data.mul_(0.5)`: the
    tensor `.data` returns counts versions of its own). Read once, at the first call, where such a load goes (after
    compiling, before training): this rank's share of each parameter against its piece, unless the piece was given
    other values since (a load into the compiled module, set in place there). Every value is compared (bench/results_call_checks.md:
    48 ms for GPT-2's 124M parameters; 64 slices of each large tensor would let a write into a few rows pass)."""
    changed = []
    with torch.no_grad():
        for fqn, p, piece in _unchanged_pieces(compiled):
            placements = compiled._state_placements[fqn]
            mine = p.detach()[local_slices(tuple(p.shape), placements, compiled.mesh_spec.shape, compiled.coord)]
            if mine.shape != piece.shape:
                continue  # (laid out otherwise since: `_set_through_data`'s business)
            # (in the model's dtype: a conversion since, `model.bfloat16()`, rounds the piece's values as it did the
            # model's; a review found the first version refusing it)
            theirs = piece.detach().to(mine.dtype)
            if _differ(mine.to(theirs.device), theirs):
                changed.append(p)
    return changed


def _differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape hold other values (NaN where the other has NaN: the same)."""
    return not torch.equal(a, b) and not torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


def _unchanged_pieces(compiled):
    """(FQN, the model's parameter, this rank's piece) of each parameter whose values the model holds as its own
    (`_source_params`) and whose piece nobody set in place since it was last marked (`_weights_at`): a piece set
    so holds values the user gave it, whatever the model holds."""
    marked = {id(piece): v for piece, v in compiled.__dict__.get("_weights_at", ())}
    for fqn, p in _source_params(compiled).items():
        piece = compiled.piece(fqn)
        if marked.get(id(piece)) == piece._version:
            yield fqn, p, piece


_SAMPLED = 256
_SAMPLE_EVERY = 1024  # (past the powers of two: an inference module's sample costs ~0.03 ms per parameter)


def _sample_due(n: int) -> bool:
    """Whether call `n` of a module that has not trained reads the sample (`_rows_moved`): the same calls on every
    rank (its flag is reduced over the mesh). Not the generators' schedule, which checks every call where a call
    costs seconds, or on one device (the bench found 0.8 ms on each call of a 2-layer model)."""
    return n & (n - 1) == 0 or n % _SAMPLE_EVERY == 0


def _rows(p: torch.Tensor) -> torch.Tensor:
    """A sample of a parameter's values, spread evenly over it (the whole of a small one): what a load or an init
    written through `.data` changes too. (First designed as 8 rows, which a review found kept a whole copy of a
    stacked experts' weight, 8 x 512 x 2048.)"""
    return spread_values(p, _SAMPLED).clone()


def _source_params(compiled) -> dict[str, torch.Tensor]:
    """The model's parameters that have values of their own: not given to the compiled module since, nor meta."""
    from spmd.runtime.materialize import is_placeholder_value

    given = compiled.__dict__.get("_given", set())
    named = dict(compiled._source_model.named_parameters(remove_duplicate=False))
    return {fqn: p for fqn, p in named.items() if fqn in compiled._state_placements and fqn not in given
            and not p.is_meta and type(p.data) is torch.Tensor and not is_placeholder_value(p)}


def _keep_rows(compiled, fqns=None) -> None:
    """The model's values as read now (`_rows`), those named `fqns` (None: all), for `_rows_moved` at the next
    checked call. (Given a part, only its names: a review found a `.data` write into another part taken as seen.)"""
    with torch.no_grad():
        kept = dict(compiled.__dict__.get("_source_rows", {})) if fqns is not None else {}
        kept.update({fqn: _rows(p) for fqn, p in _source_params(compiled).items() if fqns is None or fqn in fqns})
        compiled.__dict__["_source_rows"] = kept


def _rows_moved(compiled) -> list[torch.Tensor]:
    """The model's parameters whose sampled values changed since the last read, though no version counter moved:
    written through `.data` after the first call (a warm-up call, then `p.data.copy_(pretrained)`). Model against
    model, not against the pieces: those may change in place on their own (an EMA teacher's `lerp_`), and one
    set in place since they were last marked is the user's own, as at the first call. A write into rows the
    sample misses is not seen."""
    kept = compiled.__dict__.get("_source_rows", {})
    changed = []
    with torch.no_grad():
        for fqn, p, _ in _unchanged_pieces(compiled):
            before = kept.get(fqn)
            if before is None:
                continue
            now = _rows(p)
            if now.shape == before.shape and now.dtype == before.dtype and _differ(now, before):
                changed.append(p)
    return changed


def _layout(p: torch.Tensor) -> tuple:
    return p.shape, p.stride(), p.dtype, p.device, p.is_shared()


def _look(p: torch.Tensor) -> tuple:
    """What `model_changed` compares a parameter of the model by: its version counter, and where and how its
    values lie (`p.data = new` changes those, not the counter)."""
    return p, p._version, p.data_ptr(), _layout(p)


def _set_through_data(compiled, p: torch.Tensor, layout) -> bool:
    """Whether `p`, whose storage is another now, was given new values through `.data` (`p.data = pretrained`):
    in the same layout as before. A conversion lays it out otherwise (`model.to("cuda")`, `.double()`,
    channels_last, `share_memory()`, the source's memory freed with `p.data = torch.empty(0)`): the same
    weights, or none the compiled module would read, and taken as seen. (`p.data.copy_(...)` writes the same
    storage: `_written_unseen` reads the values at the first call.)"""
    if _layout(p) == layout:
        return True
    compiled.__dict__["_model_versions"][id(p)] = _look(p)
    was = layout[2]
    if p.dtype != was and p.numel() and p.is_floating_point() and not compiled.__dict__.get("_warned_converted"):
        compiled.__dict__["_warned_converted"] = True
        # (found by a probe: `model.half()` after compiling, and the compiled module went on in float32 where the
        # model, called eagerly, computes in float16; for a model of token ids nothing else would say so)
        warnings.warn(
            f"{type(compiled._source_model).__name__}'s weights were converted from {was} to {p.dtype} after it was "
            f"compiled (`model.half()`, `.to(dtype)`): the compiled module goes on with its {was} pieces and graph. "
            "What to do: convert the model before compiling it (or compile it again).", stacklevel=user_stacklevel())
    return False


def _replaced(compiled, trained: bool = False) -> None:
    """Raise where a parameter or submodule of the model was replaced or removed since `compiled` cut its pieces
    (`model.lm_head.weight = nn.Parameter(...)`, transformers' `resize_token_embeddings`, a `load_state_dict(...,
    assign=True)`, an activation module swapped): the version counters `model_changed` reads are the old
    objects', which nothing changed. Once `compiled` has `trained`, the model's values are its own business (a
    part given the trained pieces with `assign=True` goes on), and only its structure is looked at: a module
    swapped, a parameter gone or reshaped (a parametrization registered, weight norm removed)."""
    model = compiled._source_model
    before, now = compiled.__dict__["_model_tree"], _tree(model)
    gone = [name for (kind, name), obj in before.items() if kind != "buffers" and now.get((kind, name)) is not obj
            and not (trained and kind == "parameter" and (kind, name) in now and now[(kind, name)].shape == obj.shape)]
    gone += sorted({f"{name}.{k}" if name else k for (kind, name), obj in before.items()
                    if kind == "buffers" and (kind, name) in now for k, _ in set(obj) ^ set(now[(kind, name)])})
    if not gone:
        compiled.__dict__["_tree_at"] = _registered[0]
        return
    shown = [n for n in gone if not any(n.startswith(m + ".") for m in gone)]  # (a module replaced: not its parts)
    raise SpmdError(
        f"{type(model).__name__} was changed after it was compiled: {', '.join(shown[:4])}"
        f"{', ...' if len(shown) > 4 else ''} replaced, added or removed (a new parameter, buffer or module set on "
        "the model, a buffer registered as None given a tensor, resize_token_embeddings, a load with assign=True), "
        "and the compiled module holds the graph traced and the pieces cut from the old ones: it would run and train "
        "on those, silently. What to do: compile the model again after changing it; where only values changed (the "
        "same shapes and modules), give them to the compiled module instead (`compiled.load_state_dict(model.state_dict())`, on every rank).")


# the hooks a parameter holds (a module's: trace_module.MODULE_HOOKS; both dicts keyed by the handle's id)
_TENSOR_HOOK_DICTS = ("_backward_hooks", "_post_accumulate_grad_hooks")


_EVERY_MODULE = "every module"


def _global_tables() -> dict[tuple[str, str], dict]:
    """(`_EVERY_MODULE`, hook dict as a module names it) -> the table of the hooks every module runs."""
    return {(_EVERY_MODULE, d.replace("_global", "")): getattr(torch.nn.modules.module, d)
            for d in GLOBAL_HOOKS if hasattr(torch.nn.modules.module, d)}


def _hooks(modules, params) -> dict[tuple[str, str, int], object]:
    """(module or parameter name, hook dict, handle id) -> the hook, for every hook on `modules` and `params`
    ((name, module) and (name, parameter) pairs: a model's, listed once by `mark_hooks`), and every module's
    (named `_EVERY_MODULE`)."""
    found = {}
    for (name, d), hooks in _global_tables().items():
        found.update(((name, d, key), hook) for key, hook in hooks.items())
    for name, m in modules:
        for d in MODULE_HOOKS:
            hooks = getattr(m, d)
            if hooks:
                found.update(((name, d, key), hook) for key, hook in hooks.items())
    for name, p in params:
        for d in _TENSOR_HOOK_DICTS:
            hooks = getattr(p, d, None)
            if hooks:
                found.update(((name, d, key), hook) for key, hook in hooks.items())
    return found


def mark_hooks(compiled, loss_fn=None) -> None:
    """The model's hooks as they are when compiled, and a loss module's (`loss_fn`, named `loss_fn.*`: a probe's
    hook added on `nn.CrossEntropyLoss` after compiling never ran): those `hooks_changed` compares with; and
    their modules and parameters, listed once, so a look after a registration elsewhere reads their hook
    tables without walking the module tree again (a 32-layer Llama: 0.33 ms, against 2.2 ms with the walk)."""
    model = compiled._source_model
    loss = isinstance(loss_fn, torch.nn.Module)
    compiled.__dict__["_hooks_at"] = RemovableHandle.next_id
    compiled.__dict__["_hooked_modules"] = (*model.named_modules(remove_duplicate=False),
                                            *(loss_fn.named_modules(prefix="loss_fn") if loss else ()))
    compiled.__dict__["_hooked_params"] = (*model.named_parameters(remove_duplicate=False),
                                           *(loss_fn.named_parameters(prefix="loss_fn") if loss else ()))
    hooks = _hooks(compiled._hooked_modules, compiled._hooked_params)
    compiled.__dict__["_model_hooks"] = frozenset(hooks)
    # the user's hooks the trace ran (module and every-module hooks: traced into the graph), each with the
    # table that holds it, so that a call sees one removed by looking in a few tables (most models: none)
    tables = {**{(name, d): getattr(m, d) for name, m in compiled._hooked_modules for d in MODULE_HOOKS},
              **_global_tables()}
    compiled.__dict__["_traced_hooks"] = tuple(
        (_shown(name, d, compiled._source_model), tables[name, d], key) for (name, d, key), hook in hooks.items()
        if (name, d) in tables and user_hook(hook))


def _shown(name: str, d: str, model) -> str:
    return f"{name or type(model).__name__} ({d.strip('_').replace('_hooks', '')})"


def hooks_changed(compiled) -> None:
    """Raise where a hook was registered on the model's modules or parameters, or on every module, after
    compiling (`model.fc.register_forward_pre_hook(...)`, `model.fc.weight.register_hook(...)`): the compiled
    module runs its own graph on its own pieces, so it would never run, and what it changes in a value or a
    gradient would not happen, silently. Likewise where a module hook the model had when compiled was removed
    (`handle.remove()`): the graph holds what it computed, and would go on applying it. Every hook registration
    takes the next handle id (`RemovableHandle.next_id`, global), so the model is walked again only after one
    somewhere: a call pays one integer compare, and a look in the tables of the hooks traced."""
    removed = [shown for shown, table, key in compiled.__dict__.get("_traced_hooks", ()) if key not in table]
    if removed:
        model = compiled._source_model
        names = list(dict.fromkeys(removed))
        raise SpmdError(
            f"{len(removed)} hook(s) that {type(model).__name__} had when it was compiled were removed after "
            f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): the compiled graph holds what they "
            "computed (they ran in the trace, as part of the forward), so it would go on applying them. What to do: "
            "compile the model again after removing them.")
    if compiled.__dict__.get("_hooks_at") == RemovableHandle.next_id:
        return
    at = RemovableHandle.next_id
    model = compiled._source_model
    now = _hooks(compiled._hooked_modules, compiled._hooked_params)
    new = [(name, d, hook) for (name, d, key), hook in now.items()
           if (name, d, key) not in compiled._model_hooks and user_hook(hook)]
    if not new:
        compiled.__dict__["_hooks_at"] = at  # (removed ones, or another module's: nothing to see until the next)
        return
    names = list(dict.fromkeys(_shown(name, d, model) for name, d, _ in new))
    raise SpmdError(
        f"{len(new)} hook(s) were registered on {type(model).__name__} after it was compiled ({', '.join(names[:4])}"
        f"{', ...' if len(names) > 4 else ''}): the compiled module runs its own graph on its own pieces of the "
        "weights, so they would never run, and what they change in a value or a gradient would not happen. What to "
        "do: a module hook that changes values, register it before compiling (it is traced into the graph); a "
        "gradient hook, register it on the compiled module's parameter (`compiled.get_parameter(name).register_hook"
        "(...)`: it gets this rank's piece of the gradient); a hook for the model's own use, remove it "
        "(`handle.remove()`) before calling the compiled module.")


def gathered(compiled, tensors) -> None:
    """`tensors` are whole ones `compiled.full_state_dict()` gathered: loaded into a sibling, they are its
    weights, not new ones (`from_elsewhere`)."""
    for t in tensors:
        _gathered[t] = (weakref.ref(compiled), _clock[0])


def from_elsewhere(compiled, values) -> bool:
    """Whether some of `values`, loaded into `compiled`, come from neither its model nor a module compiled from it:
    a checkpoint read from a file, or loaded in place into its own pieces (torch.distributed.checkpoint), rather
    than a sibling's `state_dict()` (DTensors over its pieces) or `full_state_dict()`, or `model.state_dict()`."""
    siblings = [c for ref in compiled.__dict__.get("_siblings", ()) if (c := ref()) is not None and c is not compiled]
    model = compiled.__dict__.get("_source_model")
    ours = [t for m in (*siblings, *(() if model is None else (model,))) for t in (*m.parameters(), *m.buffers())]
    storages = {_storage(t) for t in ours} - {None}
    for v in values:
        if not isinstance(v, torch.Tensor):  # (a module's extra state)
            continue
        came, at = _gathered_from(v)
        # (its own or a sibling's weights as gathered, where that module has not stepped nor been given a
        # checkpoint since: an older snapshot, `best = trained.full_state_dict()` restored later, is a checkpoint)
        if came is not None and (came is compiled or any(came is c for c in siblings)) and max(
                came.__dict__.get("_moved_at", 0), came.__dict__.get("_loaded_at", 0)) <= at:
            continue
        handed = _handed.get(v)
        if handed is not None and handed[0]() is compiled and getattr(v, "_local_tensor", v)._version == handed[2]:
            continue  # (its own `state_dict()`, written by nothing since: `c.load_state_dict(c.state_dict())`, no
            # checkpoint; torch.distributed.checkpoint's load writes into it in place first; a probe of the docs)
        if _storage(getattr(v, "_local_tensor", v)) not in storages:
            return True
    return False


# a DTensor `state_dict()` gave -> (the compiled module whose piece it holds (a ref), its name)
_handed = WeakIdKeyDictionary()


def handed_out(compiled, items) -> None:
    """`items` are (name, DTensor) as `compiled.state_dict()` gave them (over its pieces; the pieces themselves
    without a runtime mesh): saved by torch.distributed.checkpoint, they are its weights (`saving`); loaded back
    unwritten, no checkpoint (`from_elsewhere`)."""
    for fqn, v in items:
        _handed[v] = (weakref.ref(compiled), fqn, getattr(v, "_local_tensor", v)._version)


# a module whose `state_dict()` DTensors torch.distributed.checkpoint was set up to load into -> {FQN: (its piece,
# the piece's version then)}: once written, a checkpoint was loaded into it (`_settle_loads`)
_loading = WeakIdKeyDictionary()


def loading(state) -> None:
    """torch.distributed.checkpoint about to load into `state` (nested dicts and lists): the DTensors a compiled
    module's `state_dict()` gave there are remembered with their pieces' versions. FSDP2's way, `dcp.load({"model":
    compiled.state_dict()})` with no `load_state_dict` after it, fills the pieces in place, and nothing said the
    module had been given a checkpoint: an evaluation module beside it and the model itself went on with the old
    weights, silently (found by a probe)."""
    if isinstance(state, torch.Tensor):
        handed = _handed.get(state) if hasattr(state, "to_local") else None
        if handed is not None and (compiled := handed[0]()) is not None:
            piece = state._local_tensor
            _loading.setdefault(compiled, {})[handed[1]] = (piece, piece._version)
        return
    items = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    for value in items:
        loading(value)


def _settle_loads() -> None:
    """The pieces torch.distributed.checkpoint wrote since `loading`: given from elsewhere (`given`), as
    `load_state_dict` after the load would say. Run before any guard reads who holds the newest weights, and before
    an optimizer steps (whose writes are no load)."""
    for compiled in list(_loading):
        entries = _loading.pop(compiled, None)  # (settled already by the `given` of another: it re-enters here)
        if entries is None:
            continue
        written = {fqn for fqn, (piece, version) in entries.items() if piece._version != version}
        if written:
            given(compiled, written, elsewhere=True)


def saving(state) -> None:
    """torch.distributed.checkpoint saving `state` (nested dicts and lists): raise where it holds the pieces of a
    module whose sibling trained since it last had the weights (the evaluation module's `state_dict()`, saved with
    `dcp.save`): the old weights; or pieces never given values (a meta compile before `init_weights`), or no longer
    the module's (taken before `init_weights` put them in new memory). (Its `state_dict()` itself is not refused: a
    load through torch.distributed.checkpoint reads it first, to load into.)"""
    if isinstance(state, torch.Tensor):
        ref, fqn, _ = _handed.get(state, (None, None, None)) if hasattr(state, "to_local") else (None, None, None)
        if ref is not None and (compiled := ref()) is not None:
            stale(compiled)
            compiled._require_values((fqn,))  # (a meta compile's pieces before init_weights or a load: garbage)
            if _storage(state.to_local()) != _storage(compiled._get(compiled._param_names[fqn])):
                # (found by a review: `sd = compiled.state_dict()` before init_weights, saved after, held the
                # memory init_weights had replaced: loaded back, 1.9e38 off or NaN)
                raise SpmdError(
                    f"`{fqn}` given to torch.distributed.checkpoint is from a state_dict() the compiled module gave "
                    "before its pieces were put in new memory (init_weights, a load with assign=True): it holds the "
                    "old memory, not the weights. What to do: take compiled.state_dict() again after that, and save "
                    "it.")
        return
    items = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    for value in items:
        saving(value)


def _gathered_from(value) -> tuple:
    """(the compiled module whose `full_state_dict()` gathered `value`, the tick it was gathered at), or
    (None, 0)."""
    entry = _gathered.get(value) if isinstance(value, torch.Tensor) else None
    return (None, 0) if entry is None else (entry[0](), entry[1])


def _storage(t):
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError, AttributeError):  # (a meta or fake tensor: no storage)
        return None


def _newer(compiled) -> list:
    """The siblings that stepped, or were given weights from elsewhere, after `compiled` last held the newest."""
    if _loading:
        _settle_loads()
    synced = compiled.__dict__.get("_synced", 0)
    return [c for ref in compiled.__dict__.get("_siblings", ()) if (c := ref()) is not None and c is not compiled
            and max(c.__dict__.get("_moved_at", 0), c.__dict__.get("_loaded_at", 0)) > synced]


def given(compiled, fqns=None, elsewhere: bool = False) -> None:
    """Weights were loaded into `compiled` (those named `fqns`; None: all): the model's parameters they came from
    are marked (`model_changed`), and once every persistent entry was given since a sibling last stepped, it
    is not stale until one steps again. Its parameters' versions now are the mark `_untouched` compares with.
    Given whole from `elsewhere` (a checkpoint: `from_elsewhere`) while it held the newest weights, and no
    sibling ever trained (a resumed run, the best checkpoint restored into the module that trained), they are
    the newest now: its siblings are stale until given them too (an evaluation module beside the one a
    checkpoint was loaded into evaluated the old weights), and the model until they are copied back into it
    (`_trained`: calling it, compiling it again). Into a module that was behind, or beside one that has
    trained (an older checkpoint evaluated while training goes on), they are only its own."""
    # (a copy, `copy.deepcopy(compiled)`, is a snapshot of its own: an EMA given its checkpoint leaves the module
    # that trains as it was; found by a probe, whose resume was refused and, following the advice, trained the EMA)
    ahead = elsewhere and not compiled.__dict__.get("_copy") and not _newer(compiled) and not any(
        (c := ref()) is not None and c is not compiled and c.__dict__.get("_stepped_at", 0)
        for ref in compiled.__dict__.get("_siblings", ()))
    mark_model(compiled, fqns)
    # (a new set, not one updated in place: a copy of the compiled module starts with its original's)
    got = compiled.__dict__["_given"] = compiled.__dict__.get("_given", set()) | set(
        compiled._param_names if fqns is None else fqns)
    compiled.__dict__["_loaded"] = not (compiled._persistent_names() - got)
    if compiled.__dict__["_loaded"]:
        compiled.__dict__["_diverged"] = False
        if ahead:
            _clock[0] += 1
            compiled.__dict__["_loaded_at"] = _clock[0]
            compiled.__dict__["_given_elsewhere"] = True  # (newer than the model too: `_trained`)
            compiled.__dict__["_elsewhere_mark"] = _marked[0]  # (parts marked up to now hold the old weights)
            _behind_now(compiled)
    if compiled.__dict__.get("_shared"):  # (given a shared parameter's newest values, whole or not)
        now = {fqn for fqn in compiled._shared if fqns is None or fqn in fqns}
        compiled.__dict__["_shared_synced"] = {**compiled.__dict__.get("_shared_synced", {}),
                                               **dict.fromkeys(now, _clock[0])}
        compiled.__dict__["_shared_diverged"] = compiled.__dict__.get("_shared_diverged", frozenset()) - now
    if compiled.__dict__["_loaded"]:
        compiled.__dict__["_synced"] = _clock[0]
    _mark_pieces(compiled)
    mark_written(compiled)


def _mark_pieces(compiled) -> None:
    compiled.__dict__["_weights_at"] = tuple((p, p._version) for p in compiled.parameters())


def _moved(compiled) -> bool:
    """Whether the optimizer step just taken moved its weights: a gradient reached one of its pieces (torch's
    optimizers step only those; one that writes through `p.data`, as transformers' Adafactor, does too). A
    module whose pieces an optimizer holds but no gradient reached (an EMA teacher updated in place, held by
    an optimizer over a wrapper's `parameters()`) did not train."""
    return any(p.grad is not None for p in compiled.parameters())


def _untouched(compiled) -> bool:
    """Whether `compiled`'s parameters are as they were when it was compiled, last loaded, or when a sibling last
    stepped: no in-place change since (a module its user updates in place, `p.lerp_(trained, 1 - decay)`,
    holds the weights given to it: not stale). (Changes through `.data` are not seen.)"""
    return all(p._version == v for p, v in compiled.__dict__.get("_weights_at", ()))


_ZEROS = ("(a gradient of zeros counts: `zero_grad(set_to_none=False)` leaves one on a module that computed "
          "nothing, and momentum or weight decay move its weights)")
_BOTH_TRAIN = (
    "this module and another compiled from the same model both train, and each steps its own copy of the weights "
    "(an optimizer steps the pieces of the module that computed them): a model called twice through two compiled "
    "modules, or one module per batch size trained in turns, trains two models apart, neither of them what one "
    f"device trains {_ZEROS}. What to do: train through one compiled module (compile the whole computation that "
    "calls the model twice; after a step through both, neither holds what one device would: start again from a "
    "checkpoint); to switch modules between steps, give the next one the trained weights first "
    "(`this.load_state_dict(trained.state_dict())`, on every rank); or compile each from its own copy of the model "
    "(`spmd.compile(copy.deepcopy(model), ...)`) where they are meant to train apart.")


def stale(compiled) -> None:
    """Raise where another module compiled from the same model has trained since this one last held the model's
    newest weights (compiled, loaded whole, its own step, or given them in place since): its weights are older.
    So are two that both train (a model called twice through two compiled modules, one per batch size trained
    in turns): each steps its own copy, and neither holds what one device would."""
    if compiled.__dict__.get("_copy"):  # (`copy.deepcopy(compiled)`: a snapshot the user keeps, an EMA)
        return
    synced = compiled.__dict__.get("_synced", 0)
    if compiled.__dict__.get("_shared"):
        _shared_stale(compiled)
    if compiled.__dict__.get("_diverged"):
        raise SpmdError(_BOTH_TRAIN)
    newer = _newer(compiled)
    if not newer:
        return
    trained = compiled.__dict__.get("_stepped_at", 0)
    if not trained and not _untouched(compiled):  # given weights in place since they stepped (an EMA teacher's
        for other in newer:                       # `p.lerp_(q, 1 - decay)`)
            _same_plan_or_refuse(compiled, other)
        compiled.__dict__["_synced"] = _clock[0]
        _mark_pieces(compiled)
        return
    stepped = [c for c in newer if c.__dict__.get("_stepped_at", 0) > synced]
    if not stepped and all(c.__dict__.get("_loaded_at", 0) <= synced for c in newer):
        raise SpmdError(
            f"another module compiled from the same model {_BUFFERS_MOVED} since this one last had them, and this "
            "one still holds the old values (a counter an evaluation forward moves too, a batch norm recalibrated "
            "in the other module). What to do: give it that module's state first (`this.load_state_dict("
            "other.state_dict())`, on every rank), or compile each from its own copy of the model "
            "(`spmd.compile(copy.deepcopy(model), ...)`) where they are meant to keep their own.")
    if trained:  # (an in-place change after its own steps, a max-norm clamp, gives it nothing)
        raise SpmdError(_BOTH_TRAIN)
    if not stepped:
        raise SpmdError(
            "another module compiled from the same model was given weights from elsewhere (a checkpoint loaded into "
            "it) since this one last had the model's weights, and this one still holds those: a module for "
            "evaluation beside the one a checkpoint was loaded into? What to do: give it the same weights "
            "(`this.load_state_dict(other.state_dict())`, or the same checkpoint, on every rank).")
    raise SpmdError(
        "another module compiled from the same model has trained since this one last had the model's weights, "
        "and this one still holds those (the weights it was compiled with, or its own trained ones as they were "
        "copied back into the model): a module for evaluation beside the one for training, or one for another "
        "batch size? "
        "What to do: give it the trained weights first (`this.load_state_dict(trained.state_dict())`, on every "
        "rank, after each stretch of training), or compile each from its own copy of the model "
        "(`spmd.compile(copy.deepcopy(model), ...)`) where they are meant to train apart.")


def _shared_stale(compiled) -> None:
    """Raise where a module compiled from another model stepped a parameter the two models share after this one
    last had its newest values (compiled, its own step, or given them by a load): two multi-task heads over one
    encoder, each compiled and trained with one optimizer, stepped two copies of the encoder apart (a loss 0.005
    off after one step, silently); a model fine-tuned after another over the same encoder would start from the
    encoder as it was compiled."""
    if compiled.__dict__.get("_shared_seen_at") == _clock[0]:  # (nothing stepped since the last look)
        return
    diverged = compiled.__dict__.get("_shared_diverged", ())
    for fqn, p in compiled._shared.items():
        if _current(compiled, fqn, p):
            continue
        _, ref, there, shown = _param_moved[p]
        if (other := ref()) is compiled:  # (it stepped last, from values behind another's: that one is named)
            found = next(_other_holders(p, compiled.__dict__.get("_source_model")), None)
            if found is None:
                continue
            other, there = found
            shown = type(other._source_model).__name__
        apart = fqn in diverged or (other is not None and there in other.__dict__.get("_shared_diverged", ()))
        what = (f"the two stepped their copies apart, each from values the other's step had left behind {_ZEROS}"
                if apart else "the other's copy was stepped since this one last had its values, which it still holds")
        switch = ("neither copy is what one device trains now: start again from a checkpoint" if apart else
                  f"to switch from one to the other, give this one the trained values first (`this.load_state_dict("
                  f"{{'{fqn}': trained.state_dict()['{there}'], ...}}, strict=False)`, on every rank, for every shared "
                  "parameter)")
        raise SpmdError(
            f"`{fqn}` is a {'parameter' if isinstance(p, torch.nn.Parameter) else 'buffer'} this module's model "
            f"shares with another model ({shown}, where it is "
            f"`{there}`), and each module compiled from one of them holds its own copy of it: {what}: not what one "
            "device computes with one tensor. What to do: compile one module for the whole computation (an "
            "nn.Module holding both models, whose forward returns the summed losses), and train through it; "
            f"{switch}; or freeze what the models share (`requires_grad_(False)` before compiling) where it is not "
            "trained.")
    compiled.__dict__["_shared_seen_at"] = _clock[0]


def _same_plan_or_refuse(compiled, trained) -> None:
    """Weights given in place (zipped over both modules' parameters) are right only where a rank's pieces of
    one are its pieces of the other: the same plan on the same mesh. Pieces of other layouts whose shapes
    coincide (on (2, 2), `[S(0), R]` against `[R, S(0)]`) were mixed up without a word (an EMA teacher 0.13
    off)."""
    shape = tuple(compiled.mesh_spec.shape)
    params = [fqn for fqn, _ in compiled.named_parameters()]  # (what an update in place goes over)
    if shape == tuple(trained.mesh_spec.shape):
        differ = [fqn for fqn in params if _pieces(trained, fqn) != _pieces(compiled, fqn)]
    else:
        differ = params
    if not differ:
        return
    fqn = differ[0]
    raise SpmdError(
        f"this module's weights were set in place since another module compiled from the same model trained, "
        f"but the two lay them out differently ({fqn}: {placements_str(compiled._state_placements[fqn])} here, "
        f"{placements_str(trained._state_placements.get(fqn, ()))} there, on meshes {tuple(compiled.mesh_spec.shape)} "
        f"and {tuple(trained.mesh_spec.shape)}; {len(differ)} parameter(s) in all): a rank's piece of "
        "one is not its piece of the other, so copying or averaging them piece by piece mixes parts of different "
        "rows. What to do: give weights across plans with `this.load_state_dict(trained.state_dict())` (DTensors: "
        "any plan, any mesh); keep an EMA teacher as `copy.deepcopy(trained)` (the same plan) and update it in "
        "place from the trained module.")


def mark_written(compiled) -> None:
    """The versions of `compiled`'s pieces now: what `written_across_plans` sees them written in place against
    (marked when it is compiled or copied, given weights by spmd, or given its values by `init_weights`); and
    its pieces, whose optimizer steps are counted from now on (`_count_step`)."""
    global _count_hook
    compiled.__dict__["_written_mark"] = tuple((fqn, p, p._version) for fqn, p in compiled.named_parameters())
    for _, p, _ in compiled.__dict__["_written_mark"]:
        _counted[p] = weakref.ref(compiled)
    if _count_hook is None:
        _count_hook = register_optimizer_step_post_hook(_eager(_count_step))


_counted = WeakIdKeyDictionary()  # piece -> its compiled module (a weak reference), meta-built ones too
_counting: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> (its parameter count, modules)
_count_hook = None


def _count_step(optimizer, args, kwargs) -> None:
    """Each optimizer step that a gradient of a compiled module's pieces took part in counts one for it
    (`_steps`): the same on every rank of its mesh, where the calls of one rank alone move it apart (compared at
    the checked calls: `CompiledModule._agree_on_call`)."""
    for ref in _modules_stepped(optimizer, _counted, _counting)[1]:
        if (compiled := ref()) is not None and _moved(compiled):
            compiled.__dict__["_steps"] = compiled.__dict__.get("_steps", 0) + 1


def written_across_plans(compiled, others) -> None:
    """Raise where the pieces of `compiled`, a module compiled for inference, were written in place outside
    spmd's loads (an EMA teacher's `t.lerp_(s, 1 - decay)` over `zip(teacher.parameters(),
    student.parameters())`) while a module among `others()` that trains, with the same parameters, lays some of
    them out otherwise in pieces of the same shapes, and none that trains lays them out alike: a rank's piece of
    one is not its piece of the other, and nothing else sees the mix-up.
    Modules compiled from one model are seen by `stale` (`_same_plan_or_refuse`); this is for a teacher compiled
    from its own copy of the model (known since session 84: a teacher compiled for inference, its student for
    training, on (2, 2), `[R, S(0)]` against `[S(0), R]`: each rank averaged pieces of other rows)."""
    if compiled.split is not None:  # (a module that trains writes its own pieces: steps of its own, SAM's
        return                      # perturbation, a clamp after the step; a review found those refused)
    mark = compiled.__dict__.get("_written_mark")
    if not mark or all(p._version == v for _, p, v in mark):
        return
    written = {fqn for fqn, p, v in mark if p._version != v}
    layouts = compiled.__dict__.setdefault("_twin_layouts", weakref.WeakKeyDictionary())
    otherwise, alike = {}, set()
    for other in others():
        if other is compiled or other.split is None:  # (where given weights come from: a module that trains;
            continue                                  # an evaluation module laid out alike is none: a review)
        if other not in layouts:
            layouts[other] = _laid_out(compiled, other)
        apart, same = layouts[other]
        alike |= same & written
        for fqn in apart & written:
            otherwise.setdefault(fqn, other)
    # (a module that lays them out alike may be where they came from: an EMA kept as `copy.deepcopy(student)` beside
    # an evaluation module of another plan is right)
    differ = [fqn for fqn, _, _ in mark if fqn in otherwise and fqn not in alike]  # (in the module's order)
    if differ:
        fqn = differ[0]
        other = otherwise[fqn]
        raise SpmdError(
            f"this module's weights were set in place since it was compiled or loaded ({len(written)} "
            f"parameter(s) written: an EMA teacher updated from a student, weights copied over "
            f"`zip(a.parameters(), b.parameters())`), and another compiled module with the same parameters "
            f"({type(other._source_model).__name__}) lays them out otherwise in pieces of the same shapes "
            f"({fqn}: {placements_str(compiled._state_placements[fqn])} here, "
            f"{placements_str(other._state_placements[fqn])} in the other, on mesh "
            f"{tuple(compiled.mesh_spec.shape)}; {len(differ)} parameter(s) in all), and none lays them out as "
            "this one does: a rank's piece of one is not its piece of the other, so copying or averaging them "
            "piece by piece mixes parts of different rows. What to do: keep the teacher as "
            "`copy.deepcopy(student)` (the same plan), or compile it with the student's layouts "
            "(`param_placements=` pins naming each parameter's placements in the student's plan); to give weights "
            "across plans, `this.load_state_dict(other.state_dict())` (DTensors: any plan, any mesh).")
    compiled.__dict__["_written_mark"] = tuple((fqn, p, p._version) for fqn, p, _ in mark)


def _laid_out(compiled, other) -> tuple[frozenset, frozenset]:
    """Of the parameters of two modules with the same parameters in the same order (as a zip over both pairs
    them) on meshes of one shape, those laid out otherwise in pieces of the same shapes, and those laid out
    alike; both empty for modules of other parameters."""
    mine, theirs = list(compiled.named_parameters()), list(other.named_parameters())
    if [n for n, _ in mine] != [n for n, _ in theirs] or compiled.mesh_spec.shape != other.mesh_spec.shape:
        return frozenset(), frozenset()
    same = frozenset(fqn for fqn, _ in mine if _pieces(compiled, fqn) == _pieces(other, fqn))
    return frozenset(fqn for (fqn, p), (_, q) in zip(mine, theirs) if p.shape == q.shape and fqn not in same), same


def _pieces(module, fqn: str) -> tuple:
    """How `module` cuts `fqn` (a placement on an axis of size 1 cuts nothing: `CompiledModule._layout_key`)."""
    return module._layout_key(module._state_placements.get(fqn, ()))


class inside:
    """spmd running the model itself (the mode check's forward on fake tensors): the guard stands aside."""

    def __enter__(self):
        _inside.depth = getattr(_inside, "depth", 0) + 1

    def __exit__(self, *exc):
        _inside.depth -= 1


_priming = threading.local()  # spmd giving an optimizer its state (a step at a learning rate of 0)


class priming:
    """A step that moves no weight (`optimizer_state._init_state`'s): not training."""

    def __enter__(self):
        _priming.depth = getattr(_priming, "depth", 0) + 1

    def __exit__(self, *exc):
        _priming.depth -= 1


_fresh: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> it had no state before this step


def _stepping_now(optimizer, args, kwargs) -> None:
    if _loading:
        _settle_loads()
    if not optimizer.state:
        _fresh[optimizer] = True
    elif optimizer in _fresh:
        del _fresh[optimizer]


def _moves_nothing(optimizer) -> bool:
    """spmd's own step giving an optimizer its state, or a step at a learning rate of 0 (on the CPU) in every
    group of an optimizer that had no state before it (torch's way of giving one its state, as
    `get_optimizer_state_dict` does). (A later step at lr 0 may move weights: Rprop's step sizes are state.)"""
    if getattr(_priming, "depth", 0):
        return True
    if not _fresh.pop(optimizer, False):
        return False
    rates = [g.get("lr", 1.0) for g in optimizer.param_groups]
    if any(isinstance(r, torch.Tensor) and r.device.type != "cpu" for r in rates):
        return False  # (no device sync for this)
    try:
        return all(float(r) == 0.0 for r in rates)
    except (TypeError, ValueError, RuntimeError):
        return False


def _stepped_shared(compiled, held) -> list[str]:
    """The names of `compiled`'s shared parameters this step moves: a gradient reached its piece, and the
    optimizer holds it (an encoder left out of the optimizer over the head does not move)."""
    return [fqn for fqn in compiled.__dict__.get("_shared", {})
            if (piece := compiled.piece(fqn)).grad is not None and id(piece) in held]


def _diverge(compiled, stepped) -> None:
    """Before `compiled`'s step is counted: where a sibling (or a module of another model, for a parameter they
    share) stepped after `compiled` last held the newest weights, this step moved weights that were already
    behind (two modules' forwards, then one step over both): its copy is not what one device trains either,
    and stays refused (`_diverged`, `_shared_diverged`) until it is given weights, as the one it got ahead of."""
    if _newer(compiled):
        compiled.__dict__["_diverged"] = True
    behind = {fqn for fqn in stepped if not _current(compiled, fqn, compiled._shared[fqn])}
    if behind:
        compiled.__dict__["_shared_diverged"] = compiled.__dict__.get("_shared_diverged", frozenset()) | behind


def _modules_stepped(optimizer, owners, known: "weakref.WeakKeyDictionary") -> tuple:
    """(the optimizer's parameter count, weak references to the compiled modules whose pieces it steps, the ids of
    those pieces), by `owners` (piece -> module), found at its first step and again when its param groups grow
    (kept in `known`)."""
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    found = known.get(optimizer)
    if found is None or found[0] != count:
        modules, held = {}, set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                ref = owners.get(p)
                if ref is not None and ref() is not None:
                    modules[id(ref())] = ref
                    held.add(id(p))
        found = known[optimizer] = (count, list(modules.values()), frozenset(held))
    return found


def _stepped(optimizer, args, kwargs) -> None:
    """After each step: the compiled modules whose pieces the optimizer steps have moved (found at its first
    step, and again when its param groups grow); their siblings' loads are out of date."""
    if _moves_nothing(optimizer):
        return
    known = _modules_stepped(optimizer, _owners, _stepping)
    for ref in known[1]:
        compiled = ref()
        if compiled is None or not _moved(compiled):  # (no gradient reached it: an optimizer over several modules)
            continue
        if compiled.__dict__.get("_copy"):  # (a copy's pieces are its own: two fine-tunes from one start leave
            continue                        # the original and the model as they were; found by a probe)
        stepped = _stepped_shared(compiled, known[2])
        _diverge(compiled, stepped)
        _moved_ahead(compiled, stepped)
        compiled.__dict__["_stepped_at"] = _clock[0]
        compiled.__dict__["_weights_moved"] = compiled.__dict__["_loss_moved"] = True


def _moved_ahead(compiled, shared) -> None:
    """`compiled` moved (a step, a forward moving buffers): the clock ticks, it holds the newest values, so do its
    pieces of the tensors it shares with other models among `shared` (names), and its siblings are behind."""
    _clock[0] += 1
    compiled.__dict__["_moved_at"] = compiled.__dict__["_synced"] = _clock[0]
    shown = type(compiled._source_model).__name__
    for fqn in shared:
        _param_moved[compiled._shared[fqn]] = (_clock[0], weakref.ref(compiled), fqn, shown)
    _behind_now(compiled)


def buffers_moved(compiled, names) -> None:
    """`compiled`'s forward updated its copies of the model's buffers (batch norm's running statistics in train
    mode, a counter) with no optimizer step: the model's own buffers, and its siblings' copies, are behind it
    now, as after a step (`_trained`, `stale`), until it gives them its own. (Found by a probe: batch norm
    recalibrated by forwards of a module compiled in train mode, then evaluated through the model, or through a
    module compiled from it for evaluation, used the old statistics, 0.19 off, silently.)"""
    if compiled.__dict__.get("_copy") or compiled.__dict__.get("_siblings") is None:
        return
    compiled.__dict__["_buffers_moved"] = True
    moved = {n for n in names if n in compiled._non_persistent}
    if moved:
        compiled.__dict__["_moved_np"] = compiled.__dict__.get("_moved_np", frozenset()) | moved
    if compiled.__dict__.get("_moved_at", 0) == _clock[0] > 0 and not any(
            s.__dict__.get("_given") or s.__dict__.get("_synced", 0) >= _clock[0]
            for ref in compiled._siblings if (s := ref()) is not None and s is not compiled):
        return  # (it moved last, and no sibling was given anything since, whole or in part: all are behind it; a
        # review measured the marks redone at every forward, 160 us on a 40-layer model beside one sibling)
    # (a sibling given some of its values since is behind again; a batch norm in an encoder another model holds too
    # leaves that model's modules behind: a review)
    _moved_ahead(compiled, [n for n in names if n in compiled.__dict__.get("_shared", {})])


def _behind_now(compiled) -> None:
    """`compiled` holds the newest weights, which its siblings do not: what they were given before counts no
    more."""
    for sibling in compiled.__dict__.get("_siblings", ()):
        if (s := sibling()) is not None and s is not compiled:
            s.__dict__["_loaded"], s.__dict__["_given"] = False, set()
            _mark_pieces(s)  # (given weights from now on, or stale: not by what was done before)
