"""State a forward makes at its first call and reads at the later ones: refused where it is a snapshot.

A forward that makes a tensor when it finds none (`if self.anchor is None: self.anchor = w.detach().clone()`, an
L2-SP anchor; `self.prev = x.mean(0)` then a running mean of it) keeps, in eager, the first call's value for the
calls after. The trace runs the first call's branch, so the graph makes the value again at every call: from the
parameters as they are then, or from that call's batch (a probe's L2-SP penalty was 0 at every step, the loss
0.09 off at the third). Where the value is made only from constants (a sinusoid table, a causal mask made once),
making it again gives the same tensor, and nothing is wrong.

`refuse_made_snapshots` runs the forward twice more on fake tensors under a dispatch mode that follows where each
tensor's values come from: the first run from the state before the trace (what it makes, and from what), the
second from the state the first left (whether it reads what the first made). A made tensor read at the second
call and computed from the parameters, buffers, inputs or a random draw is refused, naming it and the way out:
make it before compiling. A view of a parameter (`self.w_ref = self.fc.weight.detach()`) follows the parameter
in eager as in the graph, and is not refused. Where the fake runs fail (a forward that reads its values in
Python), nothing is refused."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from spmd.core.errors import SpmdError
from spmd.passes.kept_state import state_kept

# where a tensor's values come from, in growing order: numbers; a parameter or buffer, or a view of one; computed
# from those; computed from an input or a draw
_CONSTANT, _STATE, _FROM_STATE, _VARYING = 0, 1, 2, 3

# ops that read their inputs' shapes and dtypes only
_METADATA_ONLY = {torch.ops.aten.zeros_like.default, torch.ops.aten.ones_like.default,
                  torch.ops.aten.empty_like.default, torch.ops.aten.full_like.default,
                  torch.ops.aten.new_zeros.default, torch.ops.aten.new_ones.default,
                  torch.ops.aten.new_empty.default, torch.ops.aten.new_full.default,
                  torch.ops.aten.new_empty_strided.default}


class _Sources(TorchDispatchMode):
    """Where each tensor's values come from: a constant (made from numbers), the state (a parameter or buffer, or a
    view of one: it follows the module's tensor in eager too), computed from the state (a copy eager keeps and
    the graph makes again: the same while the weights do not change), or varying (computed from an input or a
    draw). `watched`: tensors whose reading is recorded in `read`."""

    def __init__(self, state: list[torch.Tensor], inputs: list[torch.Tensor]):
        super().__init__()
        self.kind = WeakIdKeyDictionary()
        for t in state:
            self.kind[t] = _STATE
        for t in inputs:
            self.kind[t] = _VARYING
        self.watched, self.read = WeakIdKeyDictionary(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        for t in ins:
            if t in self.watched:
                self.read.add(self.watched[t])
        out = func(*args, **kwargs)
        kinds = [self.kind.get(t, _CONSTANT) for t in ins]
        schema = func._schema
        if func in _METADATA_ONLY:
            made = _CONSTANT
        elif torch.Tag.nondeterministic_seeded in func.tags:
            made = _VARYING
        elif any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            made = kinds[0] if kinds else _CONSTANT  # (a view: where its base's values come from)
        else:
            made = max((_FROM_STATE if k == _STATE else k for k in kinds), default=_CONSTANT)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                if self.kind.get(t) != _STATE:  # (a buffer updated in place stays the buffer)
                    self.kind[t] = max(self.kind.get(t, _CONSTANT), made) if any(t is i for i in ins) else made
                if ins and ins[0] in self.watched and schema.returns and schema.returns[0].alias_info is not None:
                    self.watched[t] = self.watched[ins[0]]  # (a view of a watched tensor is watched)
        for arg, t in zip(schema.arguments, args):  # (written in place: from what wrote it, too)
            if isinstance(t, torch.Tensor) and arg.alias_info is not None and arg.alias_info.is_write and \
                    self.kind.get(t) != _STATE:
                self.kind[t] = max(self.kind.get(t, _CONSTANT), made)
        return out


def _value(m: torch.nn.Module, key: str):
    return m._buffers[key] if key in m._buffers else m.__dict__.get(key)


def refuse_made_snapshots(made: list[tuple], root: torch.nn.Module, model: torch.nn.Module, call,
                          inputs: list, where: str, training: bool = True) -> None:
    """Refuse a tensor in `made` (`state_assigned.made`) that the forward reads at its next call and that was computed
    from the state, the inputs or a draw (module docstring); without `training` (weights that do not change
    between calls), from the inputs or a draw only. `call()` runs the forward as the trace did."""
    if not made:
        return
    state = [*root.parameters(), *root.buffers()]
    sources = _Sources(state, [t for t in inputs if isinstance(t, torch.Tensor)])
    try:
        with state_kept(root), FakeTensorMode(allow_non_fake_inputs=True), sources, torch.no_grad():
            call()
            values = {(m, key): _value(m, key) for m, key in made}
            values = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
            for k, v in values.items():
                sources.watched[v] = k
            call()
    except Exception:  # (a forward fake tensors cannot run: nothing to say)
        return
    least = _FROM_STATE if training else _VARYING
    snapshots = [k for k, v in values.items() if k in sources.read and sources.kind.get(v, _CONSTANT) >= least]
    if not snapshots:
        return
    paths = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}
    m, key = snapshots[0]
    path = paths.get(id(m))
    names = ", ".join(f"`{paths[id(m)]}.{key}`" if paths.get(id(m)) else f"`{key}`" for m, key in snapshots)
    source = "the parameters or buffers" if sources.kind.get(values[snapshots[0]]) == _FROM_STATE else \
        "the inputs or a random draw"
    owner = f"model.{path}" if path else "model"
    raise SpmdError(
        f"{where}: the forward makes {names} ({type(m).__name__}) at its first call, from {source}, and reads "
        "it at the calls after, where eager keeps the first call's value. The graph is traced from a first call, "
        "so it would make it again at every call, from that call's weights and batch (an L2-SP anchor made so "
        "held the current weights: its penalty was 0, silently). What to do: make it before compiling, as a "
        f"buffer: `{owner}.register_buffer({key!r}, value)` (after one eager call: "
        f"`{owner}.register_buffer({key!r}, {owner}.__dict__.pop({key!r}))`), or compute it in every call.")
