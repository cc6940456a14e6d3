"""The model's Python state across a trace: put back as it was after it (`state_kept`), and the numbers the
forward changed, refused where the graph depends on them (`refuse_counted`). Both traces use them: the joint
graph's (trace_joint) and the forward's (trace_module)."""
from __future__ import annotations

import enum
import functools
import logging
import types

import torch

from spmd.core.errors import SpmdError


class state_kept:
    """The model's state as it was before the trace, put back after it, whatever the trace did: the
    attributes a forward assigns (`self.last = h.detach()`, a cache made at the first call) would keep
    the tracer's tensors, which broke the model and the road through torch.export after a failed trace
    (torch.export puts them back too). `registered_changed`: some parameter, buffer or submodule had
    to be put back, so the trace ran on a model that was not the user's. The plain objects the modules hold
    (`held_objects`: a cache object and its layers) are put back and watched so too."""

    def __init__(self, root: torch.nn.Module):
        self.saved = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules))
                      for m in root.modules()]
        # and the hooks a forward registers on its modules (transformers installs its output-capturing hooks at
        # the first call asking for hidden states or attentions, and marks the model with an attribute): put
        # back with the attribute, or a second trace installed them again and every capture came out twice
        self.hooks = [(table, dict(table)) for m in root.modules() for name, table in m.__dict__.items()
                      if "hooks" in name and isinstance(table, dict)]
        # and the plain objects the modules hold, their attributes (a transformers cache kept on the model: its
        # layers' fill level is a Python number the forward advances; a probe)
        self.held = [(o, dict(vars(o))) for o, _ in held_objects(root)]
        owners = [*(m for m, *_ in self.saved), *(o for o, _ in self.held)]
        # and the contents of the plain lists and dicts they hold (an activation log the forward appends to kept
        # the trace's fake tensors: `torch.stack(model.log)` gave a FakeTensor after compiling; a probe)
        self.contents = [(value, list(value) if isinstance(value, list) else dict(value))
                         for o in owners for name, value in vars(o).items()
                         if type(value) in (list, dict) and "hook" not in name and name not in _REGISTRIES
                         and (isinstance(o, torch.nn.Module) or len(value) <= _MOST)]
        self.registered_changed = False
        # (module, buffer name) of the buffers registered as None that the forward gave a tensor (a cache made
        # at the first call), put back to None
        self.made: list[tuple] = []
        # (module, attribute, the value one run left or _MISSING): numbers the forward changed, `refuse_counted`
        self.counted: list[tuple] = []
        # (id(module), attribute) -> (module, the value one run of the forward left): a flag it flips at each call
        # is back where it was after the trace's runs, and seen only run by run (the root's hooks)
        self.next_values: dict[tuple, object] = {}
        self._root, self._hooks, self._owners = root, [], owners

    def _numbers(self) -> dict[tuple, object]:
        # (by identity: a held object may be unhashable; modes are their holders' business)
        return {(id(m), key): (m, v) for m in self._owners for key, v in vars(m).items()
                if type(v) in (int, float, bool) and key != "training"}

    def __enter__(self) -> "state_kept":
        before: list[dict] = []
        self._hooks = [self._root.register_forward_pre_hook(lambda *_: before.append(self._numbers())),
                       self._root.register_forward_hook(lambda *_: self._ran(before.pop() if before else None))]
        return self

    def _ran(self, before: dict | None) -> None:
        if before is None:
            return
        for at, (m, was) in before.items():
            now = vars(m).get(at[1], was)
            if now != was and type(now) is type(was):
                self.next_values.setdefault(at, (m, now))

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        counted = []
        for m, attrs, params, buffers, modules in self.saved:
            self.made += [(m, key) for key, before in buffers.items() if before is None
                          and m._buffers.get(key) is not None]
            counted += _numbers_changed(m, attrs)
            for now, before, registered in ((m._parameters, params, True), (m._buffers, buffers, True),
                                            (m._modules, modules, True), (m.__dict__, attrs, False)):
                if now is not before and _put_back(now, before):
                    self.registered_changed |= registered
        for o, attrs in self.held:
            counted += _numbers_changed(o, attrs)
            _put_back(vars(o), attrs)
        for table, before in self.hooks:
            _put_back(table, before)
        for container, before in self.contents:
            if isinstance(container, list):
                if len(container) != len(before) or any(a is not b for a, b in zip(container, before)):
                    container[:] = before
            else:
                _put_back(container, before)
        # (a number the forward made at its first call, `getattr(self, "calls", 0) + 1`, is gone again after the
        # put-back: not one the model keeps; a review found it crashing the check)
        seen = {(id(m), key) for m, key in counted}
        counted += [(m, key) for (_, key), (m, _) in self.next_values.items() if (id(m), key) not in seen
                    and key in vars(m)]
        self.counted = [(m, key, self.next_values.get((id(m), key), (m, _MISSING))[1]) for m, key in counted]


def _numbers_changed(owner, before: dict) -> list[tuple]:
    """(owner, attribute) of each Python number `owner` held in `before` (its attributes then) that is another now."""
    now = vars(owner)
    return [(owner, key) for key, was in before.items() if type(was) in (int, float)
            and type(now.get(key)) in (int, float) and now[key] != was]


def _cache_hint(counted: list[tuple]) -> str:
    """The way out for a transformers cache the model holds, by what its layers changed."""
    changed = {key for m, key in counted if type(m).__module__.startswith("transformers.")}
    hints = []
    if "is_initialized" in changed:  # (a static cache's layers make their tensors at the first call)
        hints.append("set the cache up before compiling, as transformers' export wrapper does "
                     "(`cache.early_initialization(batch_size, num_heads, head_dim, dtype, device)`)")
    if changed - {"is_initialized"}:  # (a sliding-window layer's fill level picks writing or rolling)
        hints.append("for layers that count in Python (a sliding window's fill level), pass `use_cache=False`, or "
                     "give the cache static layers without a window, as that wrapper does (generation past the "
                     "window is then not supported)")
    return f" A transformers cache on the model: {'; '.join(hints)}." if hints else ""


def held_objects(root: torch.nn.Module) -> list[tuple[object, str]]:
    """The plain objects `root`'s modules hold, up to three objects deep and through lists, tuples and dicts of at
    most `_MOST` entries (a transformers cache kept on the model, its layers in a list; a configuration object),
    each with its path from `root` (`cache.layers[0]`); the first path where one is held twice. Modules, tensors,
    classes, functions and objects without attributes of their own are not holders."""
    found: dict[int, tuple[object, str]] = {}

    def visit(value, path: str, depth: int) -> None:
        if type(value) in (list, tuple, dict):
            if len(value) <= _MOST:
                items = value.items() if isinstance(value, dict) else enumerate(value)
                for key, item in items:
                    if isinstance(key, (str, int)):
                        visit(item, f"{path}[{key!r}]", depth)
        elif depth < 3 and _holder(value) and id(value) not in found:
            found[id(value)] = (value, path)
            for key, item in list(vars(value).items()):
                visit(item, f"{path}.{key}", depth + 1)

    for path, m in root.named_modules():
        for key, value in m.__dict__.items():
            if key not in _REGISTRIES and "hook" not in key:
                visit(value, f"{path}.{key}" if path else key, 0)
    return list(found.values())


def _holder(value) -> bool:
    """Whether `value` is a plain object with attributes of its own (not a module, tensor, class, function, ...)."""
    if isinstance(value, (torch.nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType,
                          types.MethodType, types.BuiltinFunctionType, functools.partial, enum.Enum, logging.Logger,
                          logging.LoggerAdapter, logging.Handler)) or type(value).__module__ == "logging":
        # (a logger leads to every logger of the process: the program's, not the model's)
        return False
    try:
        return bool(vars(value))
    except TypeError:  # (no __dict__: numbers, strings, extension types)
        return False


_MOST = 1024  # (a container longer than this holds data, not state: a vocabulary, a table)


def _put_back(now: dict, before: dict) -> bool:
    """`now` made equal to `before` (entry by entry, by identity); whether anything differed."""
    changed = False
    for key in [k for k in now if k not in before]:
        del now[key]
        changed = True
    for key, value in before.items():
        if now.get(key, _MISSING) is not value:
            now[key] = value
            changed = True
    return changed


_MISSING = object()
_REGISTRIES = frozenset({"_parameters", "_buffers", "_modules"})  # (a module's own tables: put back apart)


def refuse_counted(counted: list[tuple], trace, signature, model: torch.nn.Module,
                   where: str = "trace_joint") -> None:
    """Refuse where the forward changed numbers it keeps on its modules (`self.calls += 1` for a warm-up factor, a
    queue's Python pointer) and the graph depends on them: traced again with each held far from its value, or at
    it, through every run of the forward (one trace for all each time), it is another graph. The compiled graph fixes what the trace computed from the values then, and
    would never count on (a probe's warm-up: 1.07 where eager gave 1.06, then 0.98 against 0.94; a MoCo queue
    filled 8 of its 32 rows). A number only kept (a call count for the log) changes no graph and passes; it does
    not count on either. A flag flipped at each call, which the trace's runs bring back to its value, is seen run
    by run (`state_kept.next_values`) and traced again at the value the next call would see. Not seen: a branch
    neither the far value nor the next one crosses."""
    nexts, unique = {}, {}
    for m, key, after in counted:
        unique.setdefault((id(m), key), (m, key))
        if after is not _MISSING:
            nexts.setdefault((id(m), key), after)
    counted = list(unique.values())
    values = [vars(m)[key] for m, key in counted]

    def traced_with(value_of) -> bool:
        """Whether the graph traced with each number held at `value_of` in every run of the forward differs (held:
        the trace runs the forward several times, and a flag set at the first call, `if not self.done: ...;
        self.done = True`, would leave the later runs on the other value)."""
        pinned = [((m, key), value_of(m, key, was)) for (m, key), was in zip(counted, values)]

        def pin(*_):
            for (m, key), value in pinned:
                vars(m)[key] = value

        hook = model.register_forward_pre_hook(pin)
        try:
            pin()
            return signature is None or trace() != signature
        except Exception:  # (a value no call would see breaks the forward: a cache's length held past it, with the
            return False   # cache it would have built put back; found by a review. The other value still counts)
        finally:
            hook.remove()
            for (m, key), was in zip(counted, values):
                vars(m)[key] = was

    def far(m, key, was):  # far, and odd: past a threshold, another residue mod 2^k (a flag: flipped)
        return (not was) if type(was) is bool else was + 1_000_003 if type(was) is int else was * 1.5 + 1000.5

    # the kept graph mixes the trace's runs, each on the value the one before left: traced with the values held
    # at both ends (found by a probe: a branch taken at the first call only, `if not self.first_done`, gave the
    # graph of the calls after it to the first call, 0.34 off in training, or the first call's to every later one)
    differs = traced_with(far) or traced_with(lambda m, key, was: was)
    # and the value one run of the forward leaves, the next call's: a flag flipped at each call, which the
    # trace's runs bring back (a probe: every other call eager flipped the sequence and the graph did not)
    if not differs and any(nexts.get((id(m), key), v) not in (v, far(m, key, v))
                           for (m, key), v in zip(counted, values)):
        differs = traced_with(lambda m, key, was: nexts.get((id(m), key), was))
    if differs:
        paths = {id(o): path for o, path in held_objects(model)}
        paths.update({id(m): path for path, m in model.named_modules(remove_duplicate=False)})
        shown = ", ".join(f"`{paths.get(id(m)) or type(m).__name__}.{key}`" for m, key in counted[:3]) + (
            " and others" if len(counted) > 3 else "")
        raise SpmdError(
            f"{where}: the forward changes {shown}, Python numbers the model keeps (a call counter, a queue's "
            "pointer), and the graph depends on their values: the compiled graph fixes what the trace computed "
            "from the values then, and would not count on, silently. What to do: keep such a number in a buffer "
            "updated in place (`self.register_buffer('calls', torch.zeros((), dtype=torch.long))`, `self.calls += "
            "1`), or compute the value outside the model and pass it as an input." + _cache_hint(counted))
