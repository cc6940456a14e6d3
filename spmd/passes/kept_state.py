"""The model's Python state across a trace: put back as it was after it (`state_kept`), and the numbers the
forward changed, refused where the graph depends on them (`refuse_counted`). Both traces use them: the joint
graph's (trace_joint) and the forward's (trace_module)."""
from __future__ import annotations

import torch

from spmd.core.errors import SpmdError


class state_kept:
    """The model's state as it was before the trace, put back after it, whatever the trace did: the
    attributes a forward assigns (`self.last = h.detach()`, a cache made at the first call) would keep
    the tracer's tensors, which broke the model and the road through torch.export after a failed trace
    (torch.export puts them back too). `registered_changed`: some parameter, buffer or submodule had
    to be put back, so the trace ran on a model that was not the user's."""

    def __init__(self, root: torch.nn.Module):
        self.saved = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules))
                      for m in root.modules()]
        # and the hooks a forward registers on its modules (transformers installs its output-capturing hooks at
        # the first call asking for hidden states or attentions, and marks the model with an attribute): put
        # back with the attribute, or a second trace installed them again and every capture came out twice
        self.hooks = [(table, dict(table)) for m in root.modules() for name, table in m.__dict__.items()
                      if "hooks" in name and isinstance(table, dict)]
        # and the contents of the plain lists and dicts the modules hold (an activation log the forward appends to
        # kept the trace's fake tensors: `torch.stack(model.log)` gave a FakeTensor after compiling; a probe)
        self.contents = [(value, list(value) if isinstance(value, list) else dict(value))
                         for m in root.modules() for name, value in m.__dict__.items()
                         if type(value) in (list, dict) and "hook" not in name and name not in _REGISTRIES]
        self.registered_changed = False
        # (module, buffer name) of the buffers registered as None that the forward gave a tensor (a cache made
        # at the first call), put back to None
        self.made: list[tuple] = []
        # (module, attribute, the value one run left or _MISSING): numbers the forward changed, `refuse_counted`
        self.counted: list[tuple] = []
        # (module, attribute) -> the value one run of the forward left: a flag it flips at each call is back
        # where it was after the trace's runs, and seen only run by run (the root's hooks)
        self.next_values: dict[tuple, object] = {}
        self._root, self._hooks, self._modules = root, [], [m for m, *_ in self.saved]

    def _numbers(self) -> dict[tuple, object]:
        return {(m, key): v for m in self._modules for key, v in m.__dict__.items()
                if type(v) in (int, float, bool) and key != "training"}  # (modes: the holders' business)

    def __enter__(self) -> "state_kept":
        before: list[dict] = []
        self._hooks = [self._root.register_forward_pre_hook(lambda *_: before.append(self._numbers())),
                       self._root.register_forward_hook(lambda *_: self._ran(before.pop() if before else None))]
        return self

    def _ran(self, before: dict | None) -> None:
        if before is None:
            return
        for (m, key), was in before.items():
            now = m.__dict__.get(key, was)
            if now != was and type(now) is type(was):
                self.next_values.setdefault((m, key), now)

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        counted = []
        for m, attrs, params, buffers, modules in self.saved:
            self.made += [(m, key) for key, before in buffers.items() if before is None
                          and m._buffers.get(key) is not None]
            counted += [(m, key) for key, before in attrs.items() if type(before) in (int, float)
                        and type(m.__dict__.get(key)) in (int, float) and m.__dict__[key] != before]
            for now, before, registered in ((m._parameters, params, True), (m._buffers, buffers, True),
                                            (m._modules, modules, True), (m.__dict__, attrs, False)):
                if now is not before and _put_back(now, before):
                    self.registered_changed |= registered
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
        counted += [k for k in self.next_values if k not in counted and k[1] in k[0].__dict__]
        self.counted = [(m, key, self.next_values.get((m, key), _MISSING)) for m, key in counted]


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
    nexts = {}
    for m, key, after in counted:
        if after is not _MISSING:
            nexts.setdefault((m, key), after)
    counted = list(dict.fromkeys((m, key) for m, key, _ in counted))
    values = [m.__dict__[key] for m, key in counted]

    def traced_with(value_of) -> bool:
        """Whether the graph traced with each number held at `value_of` in every run of the forward differs (held:
        the trace runs the forward several times, and a flag set at the first call, `if not self.done: ...;
        self.done = True`, would leave the later runs on the other value)."""
        pinned = [((m, key), value_of(m, key, was)) for (m, key), was in zip(counted, values)]

        def pin(*_):
            for (m, key), value in pinned:
                m.__dict__[key] = value

        hook = model.register_forward_pre_hook(pin)
        try:
            pin()
            return signature is None or trace() != signature
        except Exception:  # (a value no call would see breaks the forward: a cache's length held past it, with the
            return False   # cache it would have built put back; found by a review. The other value still counts)
        finally:
            hook.remove()
            for (m, key), was in zip(counted, values):
                m.__dict__[key] = was

    def far(m, key, was):  # far, and odd: past a threshold, another residue mod 2^k (a flag: flipped)
        return (not was) if type(was) is bool else was + 1_000_003 if type(was) is int else was * 1.5 + 1000.5

    # the kept graph mixes the trace's runs, each on the value the one before left: traced with the values held
    # at both ends (found by a probe: a branch taken at the first call only, `if not self.first_done`, gave the
    # graph of the calls after it to the first call, 0.34 off in training, or the first call's to every later one)
    differs = traced_with(far) or traced_with(lambda m, key, was: was)
    # and the value one run of the forward leaves, the next call's: a flag flipped at each call, which the
    # trace's runs bring back (a probe: every other call eager flipped the sequence and the graph did not)
    if not differs and any(nexts.get(k, v) not in (v, far(*k, v)) for k, v in zip(counted, values)):
        differs = traced_with(lambda m, key, was: nexts.get((m, key), was))
    if differs:
        paths = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}
        shown = ", ".join(f"`{paths.get(id(m)) or type(m).__name__}.{key}`" for m, key in counted[:3]) + (
            " and others" if len(counted) > 3 else "")
        raise SpmdError(
            f"{where}: the forward changes {shown}, Python numbers the model keeps (a call counter, a queue's "
            "pointer), and the graph depends on their values: the compiled graph fixes what the trace computed "
            "from the values then, and would not count on, silently. What to do: keep such a number in a buffer "
            "updated in place (`self.register_buffer('calls', torch.zeros((), dtype=torch.long))`, `self.calls += "
            "1`), or compute the value outside the model and pass it as an input.")
