"""Recording a model's construction on the meta device, and replaying it piece by piece.

`spmd.deferred_init(Model, cfg)` builds the model under `torch.device("meta")` (shapes, no memory) while a
dispatch mode writes down every aten op the constructor runs, in order: the `empty` that made each
parameter, each `reset_parameters`, and whatever else `__init__` does (`self.apply(self._init_weights)`,
a `normal_` on some weights afterwards, a `torch.randn(...) * 0.02` made a Parameter, a tie in either
direction, a RoPE table, a `.to(torch.bfloat16)`). `CompiledModule.init_weights(seed)` then replays that
tape on CPU, so each rank's pieces equal those of `torch.manual_seed(seed); Model(cfg)` on one device,
with no guess about which module made a tied tensor or what `__init__` did beyond `reset_parameters`
(the module-by-module replay of runtime/init_replay.py has to guess both).

The tape names tensors by storage and geometry (size, stride, offset), not by object: views and
`nn.Parameter` wrappers need no replay, and a tie is one storage under two names. Replaying it would
hold the whole model at once; instead, reading the tape backwards from the model's final tensors:

    needed      an op writing or making a value the model ends with (or that such an op reads)
    killed      an op overwriting a whole storage without reading it (normal_, zero_, copy_ from
                elsewhere): the storage's earlier values are dead, it is allocated there, empty
    random      an op drawing random numbers runs whatever it writes, to move the generator on as
                construction did; writes to dead storages go to scratch of the same geometry (the
                CPU generator's draws depend on contiguity), and are dropped

so each storage lives from its last kill (or its making) to its last use, where this rank's piece is
cut and the storage dropped: at most about one module in full beside the pieces, as in init_weights.py.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from spmd.core.errors import SpmdError, SpmdInternalError
from spmd.runtime.distribute import local_slices

aten = torch.ops.aten

_KILL = {aten.normal_, aten.uniform_, aten.fill_, aten.zero_, aten.copy_, aten.random_, aten.exponential_,
         aten.bernoulli_, aten.geometric_, aten.cauchy_, aten.log_normal_}


@dataclass(frozen=True)
class _Ref:
    """A tensor argument: a view of one recorded storage."""
    storage: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True)
class _Gen:
    """A torch.Generator argument, with its state when the tape first saw it."""
    index: int


@dataclass(eq=False)
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    outs: list                           # per flat output: the storage it made, or None
    writes: dict[int, bool]              # storage -> whether the whole of it is overwritten unread (a kill)
    reads: frozenset[int]                # storages whose values it reads (partly written ones too)
    random: bool


@dataclass
class _Storage:
    nbytes: int
    dtype: torch.dtype
    made_by: int | None                  # the op that made it; None: not made by any recorded op
    describe: str = ""


@dataclass(eq=False)
class InitTape:
    """The recorded construction of one model (see the module docstring)."""
    ops: list[_Op] = field(default_factory=list)
    storages: list[_Storage] = field(default_factory=list)
    generators: list[torch.Tensor] = field(default_factory=list)   # their states when first seen
    keys: dict[Any, int] = field(default_factory=dict)             # StorageWeakRef -> storage index
    keep: list = field(default_factory=list)                       # the meta tensors, kept alive

    def key_of(self, t: torch.Tensor) -> int | None:
        return self.keys.get(StorageWeakRef(t.untyped_storage()))

    def ref(self, t: torch.Tensor) -> _Ref:
        key = self.key_of(t)
        if key is None:
            key = len(self.storages)
            self.keys[StorageWeakRef(t.untyped_storage())] = key
            self.storages.append(_Storage(t.untyped_storage().nbytes(), t.dtype, None))
            self.keep.append(t)
        return _Ref(key, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    def copy(self) -> "InitTape":
        return InitTape(list(self.ops), list(self.storages), list(self.generators), dict(self.keys), list(self.keep))


# ---- recording -----------------------------------------------------------------------------------

def _where() -> str:
    import traceback

    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/torch/" not in frame.filename and "/spmd/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
    return "?"


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: InitTape):
        super().__init__()
        self.tape = tape
        self.gens: dict[int, int] = {}
        self.calls = _Calls(self)

    def _arg(self, x):
        if isinstance(x, torch.Tensor):
            if not x.is_meta:  # a real tensor made before the build (or from Python data): a constant
                return x.detach().clone()
            return self.tape.ref(x)
        if isinstance(x, torch.Generator):
            if id(x) not in self.gens:
                self.gens[id(x)] = len(self.tape.generators)
                self.tape.generators.append(x.get_state())
                self.tape.keep.append(x)
            return _Gen(self.gens[id(x)])
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        return x

    def record_call(self, fn, values: list) -> None:
        t = values[0]
        key = self.tape.ref(t).storage
        whole = t.storage_offset() == 0 and t.is_contiguous() and t.numel() * t.element_size() == t.untyped_storage().nbytes()
        self.tape.ops.append(_Op(fn, tuple(self._arg(v) for v in values), {}, [None], {key: whole},
                                 frozenset() if whole else frozenset({key}), True))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.calls.inside is not None:  # (inside a recorded call: replayed by calling it)
            return out
        if func in (aten.set_.source_Storage, aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor,
                    aten.resize_.default):
            raise SpmdError(f"deferred_init: the model's construction calls {func} ({_where()}), which changes a "
                            "tensor's storage; the recording cannot follow it. What to do: build the tensor "
                            "at its final size.")
        tape = self.tape
        writes: dict[int, bool] = {}
        reads = set()
        schema = func._schema
        for i, a in enumerate(schema.arguments):
            v = kwargs.get(a.name) if (a.kwarg_only or i >= len(args)) else args[i]
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                if not isinstance(t, torch.Tensor) or not t.is_meta:
                    continue
                key = tape.ref(t).storage
                if a.alias_info is not None and a.alias_info.is_write:
                    whole = (i == 0 and func.overloadpacket in _KILL and t.storage_offset() == 0
                             and t.is_contiguous() and t.numel() * t.element_size() == t.untyped_storage().nbytes())
                    writes[key] = writes.get(key, True) and whole
                else:
                    reads.add(key)
        for k in writes:
            if k in reads:  # (copy_(w, w.t()): the whole is written from itself)
                writes[k] = False
        outs, made = [], False
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and o.is_meta and tape.key_of(o) is None:
                tape.ref(o)
                key = tape.key_of(o)
                tape.storages[key].made_by = len(tape.ops)
                outs.append(key)
                made = True
            else:
                outs.append(None)
        random = torch.Tag.nondeterministic_seeded in func.tags
        if made or writes or random:  # (a view needs no replay: arguments are named by storage and geometry)
            kept = {k for k, whole in writes.items() if not whole}  # a partial write keeps the rest
            tape.ops.append(_Op(func, tree_map(self._arg, tuple(args)), tree_map(self._arg, dict(kwargs)), outs,
                                writes, frozenset(reads | kept), random))
            tape.keep.append(out)
        return out


def _skipped_on_meta() -> dict:
    """torch.nn.init functions that return at once on the meta device: their draws depend on values
    (trunc_normal_ redraws what falls outside [a, b]), so they run no op the dispatch mode could record."""
    fns = [getattr(nn.init, n) for n in ("trunc_normal_", "orthogonal_", "dirac_", "sparse_") if hasattr(nn.init, n)]
    return {f.__code__: (f, tuple(inspect.signature(f).parameters)) for f in fns}


class _Calls:
    """Records each call of a `_skipped_on_meta` function as one op of the tape, replayed by calling it on the
    real tensor. A profile hook sees it however the model imported it (`nn.init.trunc_normal_`, or the
    name alone); the ops it runs inside (none on meta, in this torch) are not recorded."""

    def __init__(self, recorder: "_Recorder"):
        self.recorder, self.codes, self.inside = recorder, _skipped_on_meta(), None

    def __enter__(self):
        self.before = sys.getprofile()
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self.before)

    def _hook(self, frame, event, arg):
        if self.before is not None:
            self.before(frame, event, arg)
        if event == "call" and self.inside is None and frame.f_code in self.codes:
            fn, params = self.codes[frame.f_code]
            values = [frame.f_locals[p] for p in params]
            if isinstance(values[0], torch.Tensor) and values[0].is_meta:
                self.recorder.record_call(fn, values)
                self.inside = frame
        elif event == "return" and frame is self.inside:
            self.inside = None


class _Literals(TorchFunctionMode):
    """`torch.tensor([...])` under the meta device drops its data without an op the dispatch mode sees: make
    it on CPU and move it, so the tape holds the values (a constant) and the copy to meta."""
    _MAKERS = (torch.tensor, torch.as_tensor, torch.asarray)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._MAKERS and kwargs.get("device") in (None, "meta", torch.device("meta")):
            with torch._C.DisableTorchFunction():
                real = func(*args, **{**kwargs, "device": "cpu"})
            return real.to("meta")
        return func(*args, **kwargs)


@contextlib.contextmanager
def _recording(tape: InitTape):
    recorder = _Recorder(tape)
    with torch.device("meta"), _Literals(), recorder, recorder.calls:
        yield


_TAPES: "weakref.WeakKeyDictionary[nn.Module, tuple[InitTape, dict]]" = weakref.WeakKeyDictionary()


def _final(model: nn.Module, tape: InitTape) -> dict[str, _Ref]:
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: tape.ref(t) for name, t in named if t is not None and t.is_meta}


def deferred_init(build: Callable[..., nn.Module], *args, **kwargs) -> nn.Module:
    """`build(*args, **kwargs)` on the meta device (shapes only, no memory), with its construction recorded:
    `spmd.compile` plans it as any meta model, and `compiled.init_weights(seed)` gives each rank the pieces of
    what `torch.manual_seed(seed); build(*args, **kwargs)` holds on one CPU device, whatever `__init__` did
    (a nanoGPT-style `self.apply(self._init_weights)`, ties either way, parameters drawn with torch.randn).
    Conversions belong inside: `deferred_init(lambda: Model(cfg).to(torch.bfloat16))`."""
    tape = InitTape()
    with _recording(tape):
        model = build(*args, **kwargs)
    if not isinstance(model, nn.Module):
        raise SpmdError(f"deferred_init: {getattr(build, '__name__', build)!r} returned a {type(model).__name__}, "
                        "not an nn.Module")
    _TAPES[model] = (tape, _final(model, tape))
    return model


def tape_of(model: nn.Module) -> tuple[InitTape, dict[str, _Ref]] | None:
    """The recorded construction of `model` (or of a model it is part of), with `model`'s tensors at the end of
    it; None for a model not built by `deferred_init`. A tensor replaced since (a `.to()` after the build, a
    module swapped in) is refused: the tape cannot know its values."""
    for root, (tape, final) in list(_TAPES.items()):
        if root is not model and not any(m is model for m in root.modules()):
            continue
        prefix = "" if root is model else next(n for n, m in root.named_modules() if m is model) + "."
        mine = {}
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            if t is None:
                continue
            ref = final.get(prefix + name)
            if ref is None or tape.key_of(t) != ref.storage or tuple(t.shape) != ref.size or t.dtype != ref.dtype:
                raise SpmdError(
                    f"init_weights: {name} is not the tensor spmd.deferred_init recorded (the model was changed after "
                    "it was built: a .to(), a module swapped in). What to do: make the change inside the build "
                    "function, `spmd.deferred_init(lambda: change(Model(cfg)))`, so it is recorded too.")
            mine[name] = ref
        return tape, mine
    return None


def record_init_fn(model: nn.Module, tape: InitTape, final: dict[str, _Ref], init_fn: Callable) -> InitTape:
    """The tape with `model.apply(init_fn)` recorded after the build (on meta; the stored tape is unchanged)."""
    tape = tape.copy()
    slots = [(m, table, name, t) for m in model.modules() for table in (m._parameters, m._buffers)
             for name, t in table.items()]
    with _recording(tape), torch.no_grad():
        model.apply(init_fn)
    for m, table, name, t in slots:
        if table[name] is not t:
            table[name] = t
            raise SpmdError(f"init_fn replaced {name!r} of a {type(m).__name__} with a new tensor instead of writing "
                            "into it; write in place (tensor.normal_(), nn.init.*_) instead")
    return tape


# ---- replay ----------------------------------------------------------------------------------------

@dataclass
class _Schedule:
    needed: list[bool]
    allocate: dict[int, list[int]]       # op -> storages allocated empty just before it (killed there)
    scratch: dict[int, set[int]]         # op -> storages it writes whose values are dead: scratch instead
    last_use: dict[int, int]             # storage -> the last needed op touching it for real


def _schedule(tape: InitTape, finals: Mapping[int, list[str]]) -> _Schedule:
    need = set(finals)
    needed = [False] * len(tape.ops)
    allocate: dict[int, list[int]] = {}
    scratch: dict[int, set[int]] = {}
    for i in range(len(tape.ops) - 1, -1, -1):
        op = tape.ops[i]
        live_writes = [s for s in op.writes if s in need]
        live_makes = [s for s in op.outs if s is not None and s in need]
        if not (live_writes or live_makes or op.random):
            continue
        needed[i] = True
        dead = set(op.writes) - set(live_writes)
        if dead:
            scratch[i] = dead
        for s in live_writes:
            if op.writes[s]:                       # killed: earlier values are dead; allocated here
                need.discard(s)
                allocate.setdefault(i, []).append(s)
        need.difference_update(live_makes)
        need |= op.reads - dead
    if need:  # values no recorded op made
        names = [n for s in need for n in finals.get(s, ())] or ["an intermediate value"]
        raise SpmdError(f"init_weights: the values of {', '.join(sorted(names)[:6])} come from tensors no op of the "
                        "recording made (made before deferred_init's build ran, or in a way the meta device drops). "
                        "What to do: make them inside the build function.")
    last_use: dict[int, int] = {}
    for i, op in enumerate(tape.ops):
        if needed[i]:
            dead = scratch.get(i, set())
            for s in (*op.writes, *op.reads, *(s for s in op.outs if s is not None)):
                if s not in dead:
                    last_use[s] = i
    return _Schedule(needed, allocate, scratch, last_use)


def replay_local_shards(tape: InitTape, final: Mapping[str, _Ref], placements: Mapping[str, tuple], mesh_shape,
                        coord, *, seed: int | None, device="cpu", stats: dict | None = None) -> dict[str, torch.Tensor]:
    """{fqn: this rank's piece} of every tensor in `final`, equal to the pieces of a CPU build seeded with
    `seed` (None: go on from the global generator, which is left where the build would leave it).
    `stats`, if given, gets `peak_bytes`: the most bytes held in full at once (beside the pieces)."""
    mesh_shape, coord = tuple(mesh_shape), tuple(coord)
    by_storage: dict[int, list[str]] = {}
    for name, ref in final.items():
        by_storage.setdefault(ref.storage, []).append(name)
    sched = _schedule(tape, by_storage)
    real: dict[int, torch.Tensor] = {}
    pieces: dict[str, torch.Tensor] = {}
    gens = []
    for state in tape.generators:
        g = torch.Generator()
        g.set_state(state)
        gens.append(g)

    def view(ref: _Ref):
        base = real.get(ref.storage)
        if base is None:
            raise SpmdInternalError(f"init replay: storage {ref.storage} read before it was made")
        if base.dtype != ref.dtype:
            base = base.view(ref.dtype)
        return base.as_strided(ref.size, ref.stride, ref.offset)

    def cut(storage: int):
        made: dict[tuple, torch.Tensor] = {}  # (tied names: one piece)
        for name in by_storage.get(storage, ()):
            ref, ps = final[name], tuple(placements[name])
            if (ref, ps) not in made:
                made[ref, ps] = view(ref)[local_slices(ref.size, ps, mesh_shape, coord)].clone().to(device=device)
            pieces[name] = made[ref, ps]

    peak = 0
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for i, op in enumerate(tape.ops):
            if not sched.needed[i]:
                continue
            for s in sched.allocate.get(i, ()):
                st = tape.storages[s]
                real[s] = torch.empty(st.nbytes // st.dtype.itemsize, dtype=st.dtype)

            dead = sched.scratch.get(i, ())

            def resolve(x):
                if isinstance(x, _Ref):  # (scratch of the same geometry: the CPU generator's draws depend on it)
                    return torch.empty_strided(x.size, x.stride, dtype=x.dtype) if x.storage in dead else view(x)
                if isinstance(x, _Gen):
                    return gens[x.index]
                return x

            out = op.func(*tree_map(resolve, op.args), **tree_map(resolve, op.kwargs))
            for s, o in zip(op.outs, tree_flatten(out)[0]):
                if s is not None and sched.last_use.get(s, -1) >= i:
                    real[s] = o
            peak = max(peak, sum(t.untyped_storage().nbytes() for t in real.values()))
            for s in {*op.writes, *op.reads, *(s for s in op.outs if s is not None)}:
                if sched.last_use.get(s) == i and s in real:
                    cut(s)
                    del real[s]
    if stats is not None:
        stats["peak_bytes"] = peak
    left = [n for n in final if n not in pieces]
    if left:
        raise SpmdInternalError(f"init replay: no piece cut for {left[:6]}")
    return pieces
