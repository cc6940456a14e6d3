"""State a forward makes at its first call and reads at the later ones: refused where it is a snapshot.

A forward that makes a tensor when it finds none (`if self.anchor is None: self.anchor = w.detach().clone()`, an
L2-SP anchor; `self.prev = x.mean(0)` then a running mean of it) keeps, in eager, the first call's value for the
calls after. The trace runs the first call's branch, so the graph makes the value again at every call: from the
parameters as they are then, or from that call's batch (a probe's L2-SP penalty was 0 at every step, the loss
0.09 off at the third). Where the value is made only from constants (a sinusoid table, a causal mask made once),
making it again gives the same tensor, and nothing is wrong.

`refuse_made_snapshots` runs the forward twice more on fake tensors under a dispatch mode that follows where each
tensor's values come from: the first run from the state before the trace (what it makes, and from what), the
second from the state the first left (whether it reads what the first made). A made tensor (or one a list, tuple
or dict holds) read at the second call and computed from an input, a random draw, buffers the forward writes or, in
training, the parameters or a buffer (running statistics, whose op does not say it writes them; an EMA teacher's,
which the loop updates), is refused, naming it and the way out: make it before compiling. A cache made from
non-persistent buffers the forward does not write (RoPE's cos/sin from `inv_freq`) is one, and a view of a
parameter (`self.w_ref = self.fc.weight.detach()`) follows the parameter in eager as in the graph: neither is
refused. Where the fake runs fail (a forward that reads its values in Python), nothing is refused."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from spmd.core.errors import SpmdError
from spmd.passes.kept_state import state_kept

# ops that read their inputs' shapes and dtypes only
_METADATA_ONLY = {torch.ops.aten.zeros_like.default, torch.ops.aten.ones_like.default,
                  torch.ops.aten.empty_like.default, torch.ops.aten.full_like.default,
                  torch.ops.aten.new_zeros.default, torch.ops.aten.new_ones.default,
                  torch.ops.aten.new_empty.default, torch.ops.aten.new_full.default,
                  torch.ops.aten.new_empty_strided.default}


@dataclass(frozen=True)
class _From:
    """Where a tensor's values come from: the parameter or buffer it is, or a view of (`alias`, its id: it
    follows that tensor in eager too); else computed from parameters (`params`), from an input or a draw
    (`varying`), from buffers (`buffers`, their ids); from none of them, a constant."""
    alias: int | None = None
    params: bool = False
    varying: bool = False
    buffers: frozenset = frozenset()


_CONSTANT = _From()


class _Sources(TorchDispatchMode):
    """`from_`: where each tensor's values come from (`_From`), op by op; `written`: the ids of the parameters
    and buffers the forward writes in place (batch norm's running statistics); `watched`: tensors whose reading
    is recorded in `read`."""

    def __init__(self, params: list[torch.Tensor], buffers: list[torch.Tensor], inputs: list[torch.Tensor]):
        super().__init__()
        self.from_ = WeakIdKeyDictionary()
        self.param_ids = {id(t) for t in params}
        for t in (*params, *buffers):
            self.from_[t] = _From(alias=id(t))
        for t in inputs:
            self.from_[t] = _From(varying=True)
        self.written: set[int] = set()
        self.watched, self.read = WeakIdKeyDictionary(), set()

    def _computed(self, sources: list[_From]) -> _From:
        """Where a tensor computed from tensors whose values come from `sources` gets its values."""
        return _From(params=any(f.params or f.alias in self.param_ids for f in sources),
                     varying=any(f.varying for f in sources),
                     buffers=frozenset().union(*(f.buffers | ({f.alias} if f.alias is not None
                                                               and f.alias not in self.param_ids else set())
                                                 for f in sources)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        for t in ins:
            if t in self.watched:
                self.read.add(self.watched[t])
        out = func(*args, **kwargs)
        sources = [self.from_.get(t, _CONSTANT) for t in ins]
        schema = func._schema
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        if func in _METADATA_ONLY:
            made = _CONSTANT
        elif torch.Tag.nondeterministic_seeded in func.tags:
            made = _From(varying=True)
        elif view:
            made = sources[0] if sources else _CONSTANT  # (a view: where its base's values come from)
        else:
            made = self._computed(sources)
        for arg, t in zip(schema.arguments, args):  # (written in place)
            if isinstance(t, torch.Tensor) and arg.alias_info is not None and arg.alias_info.is_write:
                was = self.from_.get(t, _CONSTANT)
                if was.alias is not None:  # (the module's own tensor, written by the forward)
                    self.written.add(was.alias)
                else:
                    self.from_[t] = self._computed([was, made])
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not any(t is i for i in ins):
                self.from_[t] = made
                if view and ins and ins[0] in self.watched:
                    self.watched[t] = self.watched[ins[0]]  # (a view of a watched tensor is watched)
        return out


def _leaves(value) -> list[torch.Tensor]:
    """The tensors of a made value: itself, or those a list, tuple or dict holds."""
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _value(m: torch.nn.Module, key: str):
    return m._buffers[key] if key in m._buffers else m.__dict__.get(key)


def refuse_made_snapshots(made: list[tuple], root: torch.nn.Module, model: torch.nn.Module, call,
                          inputs: list, where: str, training: bool = True) -> None:
    """Refuse a tensor in `made` (`state_assigned.made`) that the forward reads at its next call and that was computed
    from the state, the inputs or a draw (module docstring); without `training` (weights that do not change
    between calls), from the inputs or a draw only. `call()` runs the forward as the trace did."""
    if not made:
        return
    sources = _Sources(list(root.parameters()), list(root.buffers()),
                       [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)])
    try:
        with state_kept(root), FakeTensorMode(allow_non_fake_inputs=True), sources, torch.no_grad():
            call()
            values = {(m, key): _leaves(_value(m, key)) for m, key in made}
            values = {k: v for k, v in values.items() if v}
            for k, leaves in values.items():
                for t in leaves:
                    sources.watched[t] = k
            call()
    except Exception:  # (a forward fake tensors cannot run: nothing to say)
        return

    # buffers taken for constants in training: non-persistent ones the forward does not write (RoPE's `inv_freq`);
    # any other may move between calls, by the forward (batch norm's running statistics, whose op does not say it
    # writes them) or by the loop (an EMA teacher's), and a cache of it would keep the first call's (a review)
    still = {id(b) for m in root.modules() for name, b in m._buffers.items()
             if b is not None and name in m._non_persistent_buffers_set} - sources.written

    def snapshot(t) -> _From | None:
        f = sources.from_.get(t, _CONSTANT)
        moving = f.varying or bool(f.buffers & sources.written) or (training and (f.params or bool(f.buffers - still)))
        return f if f.alias is None and moving else None

    found = {}
    for k, leaves in values.items():
        moving = [f for t in leaves if (f := snapshot(t)) is not None] if k in sources.read else []
        if moving:
            found[k] = moving[0]
    snapshots = list(found)
    if not snapshots:
        return
    paths = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}
    m, key = snapshots[0]
    path = paths.get(id(m))
    names = ", ".join(f"`{paths[id(m)]}.{key}`" if paths.get(id(m)) else f"`{key}`" for m, key in snapshots)
    first = found[snapshots[0]]
    source = "the inputs or a random draw" if first.varying else "the parameters" if training and first.params else \
        "buffers, which may change between calls"
    owner = f"model.{path}" if path else "model"
    raise SpmdError(
        f"{where}: the forward keeps {names} ({type(m).__name__}) from one call to the next (made at its first "
        f"call, or replaced at each), from {source}, and reads it at the next call, where eager reads what the "
        "call before left. The graph is traced from one call, so it would make it again at every call, from that "
        "call's weights and batch (an L2-SP anchor made so held the current weights: its penalty was 0, "
        "silently). What to do: make it before compiling, as a "
        f"buffer: `{owner}.register_buffer({key!r}, value)` (after one eager call: "
        f"`{owner}.register_buffer({key!r}, {owner}.__dict__.pop({key!r}))`), which the forward, where it "
        f"changes it, updates in place under torch.no_grad() (`self.{key}.copy_(new)`: inference and training "
        "graphs carry that out); or compute it in every call.")
