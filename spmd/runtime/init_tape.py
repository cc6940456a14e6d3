"""Recording a model's construction on the meta device, and replaying it piece by piece.

`spmd.deferred_init(Model, cfg)` builds the model under `torch.device("meta")` (shapes, no memory) while a
dispatch mode writes down every aten op the constructor runs, in order: the `empty` that made each
parameter, each `reset_parameters`, and whatever else `__init__` does (`self.apply(self._init_weights)`,
a `normal_` on some weights afterwards, a `torch.randn(...) * 0.02` made a Parameter, a tie in either
direction, a RoPE table, a `.to(torch.bfloat16)`). `CompiledModule.init_weights(seed)` then replays that
tape on CPU, so each rank's pieces equal those of `torch.manual_seed(seed); Model(cfg)` on one device,
with no guess about which module made a tied tensor or what `__init__` did beyond `reset_parameters`
(the module-by-module replay of runtime/init_replay.py has to guess both).

What the dispatch mode cannot see is recorded at the Python level, by a profile hook: the `nn.init`
functions torch returns from at once on meta (`trunc_normal_`, whose redraws depend on values,
`orthogonal_`, `dirac_`, `sparse_`: replayed by calling them on the real tensor) and `torch.manual_seed`
(replayed). What cannot be replayed is refused: a generator state set from a saved state, a tensor's
values read while building (`.item()`, `.tolist()`), a storage swapped by `set_`.

The tape names tensors by storage and geometry (size, stride, offset), not by object: views and
`nn.Parameter` wrappers need no replay, and a tie is one storage under two names. Replaying it would
hold the whole model at once; instead, reading the tape backwards from the model's final tensors:

    needed      an op writing or making a value the model ends with (or that such an op reads)
    killed      an op overwriting a whole storage without reading it (normal_, zero_, copy_ from
                elsewhere): the storage's earlier values are dead, it is allocated there, empty
    random      an op drawing random numbers runs whatever it writes, to move the generator on as
                construction did; writes to dead storages go to scratch of the same geometry (the
                CPU generator's draws depend on contiguity), and are dropped

and the ops that draw nothing and read something (a `.to(torch.bfloat16)`, a `mul_` after the init) run as
early as their data allows, between the random ones, which keep their order. Each storage lives from its
last kill (or its making) to its last use, where this rank's piece is cut and the storage dropped: about
one module in full beside the pieces, as in init_weights.py.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import random
import re
import sys
import traceback
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from spmd.core.autocast import autocast_off
from spmd.core.errors import SpmdError, SpmdInternalError
from spmd.runtime.distribute import local_slices
from spmd.runtime.init_weights import is_transformers

aten = torch.ops.aten

_KILL = {aten.normal_, aten.uniform_, aten.fill_, aten.zero_, aten.copy_, aten.random_, aten.exponential_,
         aten.bernoulli_, aten.geometric_, aten.cauchy_, aten.log_normal_}
# ops that read only the shape, dtype and strides of their first argument
_SHAPE_ONLY = {aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like, aten.randn_like,
               aten.randint_like, aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty_strided}


@dataclass(frozen=True)
class _Ref:
    """A tensor argument: a view of one recorded storage."""
    storage: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True)
class _Shape:
    """An argument whose values the op does not read (`zeros_like(w)`): scratch of its geometry."""
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _Gen:
    """A torch.Generator argument, with its state when the tape first saw it."""
    index: int


@dataclass(eq=False)
class _Op:
    func: Any                            # an aten op, or a Python function (`_Calls`)
    args: tuple
    kwargs: dict
    outs: list                           # per flat output: the storage it made, or None
    writes: dict[int, bool]              # storage -> whether the whole of it is overwritten unread (a kill)
    reads: frozenset[int]                # storages whose values it reads (partly written ones too)
    random: bool                         # draws random numbers, or reseeds: keeps its place
    # the default dtype when it ran: an integer tensor times a Python float (`arange(6) * 0.5`, a sinusoid table)
    # is in it (found by a review: a build under `set_default_dtype(torch.float64)` replayed outside it)
    default_dtype: torch.dtype = field(default_factory=torch.get_default_dtype)


@dataclass
class _Storage:
    nbytes: int
    dtype: torch.dtype
    made_by: int | None                  # the op that made it; None: made before the recording
    constant: torch.Tensor | None = None  # a real tensor made before the recording: its values (1-D)


@dataclass(eq=False)
class InitTape:
    """The recorded construction of one model (see the module docstring)."""
    ops: list[_Op] = field(default_factory=list)
    storages: list[_Storage] = field(default_factory=list)
    generators: list[torch.Tensor] = field(default_factory=list)   # their states when first seen
    keys: dict[Any, int] = field(default_factory=dict)             # StorageWeakRef -> storage index
    keep: list = field(default_factory=list)                       # the recorded tensors, kept alive

    def key_of(self, t: torch.Tensor) -> int | None:
        return self.keys.get(StorageWeakRef(t.untyped_storage()))

    def ref(self, t: torch.Tensor, made_by: int | None = None) -> _Ref:
        """`t` as a view of its storage, registering the storage the first time: made by op `made_by`, or else
        before the recording (a real one with its values)."""
        key = self.key_of(t)
        if key is None:
            key = len(self.storages)
            self.keys[StorageWeakRef(t.untyped_storage())] = key
            constant = None
            if made_by is None and not t.is_meta:
                constant = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage()).detach().clone()
            self.storages.append(_Storage(t.untyped_storage().nbytes(), t.dtype, made_by, constant))
            self.keep.append(t)
        return _Ref(key, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    def copy(self) -> "InitTape":
        return InitTape(list(self.ops), list(self.storages), list(self.generators), dict(self.keys), list(self.keep))


# ---- recording -----------------------------------------------------------------------------------

def _user_line(frames) -> str:
    """The innermost frame of the user's code (not torch's, this file's, nor the standard library's)."""
    stdlib = contextlib.__file__.rsplit("/", 1)[0] + "/"
    for frame in reversed(frames):
        if "/torch/" not in frame.filename and "/spmd/runtime/init_tape" not in frame.filename \
                and not (frame.filename.startswith(stdlib) and "site-packages" not in frame.filename):
            return f"{frame.filename}:{frame.lineno}: {frame.line}"
    return "?"


def _whole(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.is_contiguous() and t.numel() * t.element_size() == t.untyped_storage().nbytes()


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: InitTape):
        super().__init__()
        self.tape = tape
        self.gens: dict[int, int] = {}
        self.drawn: dict[int, torch.Generator] = {}  # those drawn from since seen or set: still where they were
        self.setting = False  # (a generator seen as it is set, not drawn from)
        self.on_meta = True  # (whether the op being recorded runs on the meta device)
        self.calls = _Calls(self)

    def _arg(self, x):
        if isinstance(x, torch.Tensor):
            return self.tape.ref(x)
        if isinstance(x, torch.Generator):  # (the dispatcher hands its own wrapper of the user's generator)
            if x._cdata not in self.gens and not self.setting:
                earlier = _META_DRAWN.get(x._cdata)
                if earlier is not None and earlier[1]() is not self.tape and torch.equal(x.get_state(), earlier[2]):
                    raise SpmdError(
                        f"deferred_init: the construction draws from a torch.Generator an earlier deferred_init build "
                        f"drew from ({_user_line(traceback.extract_stack()[:-1])}): the meta device draws nothing, "
                        "so the generator is where that build found it, and this one would draw the same numbers "
                        "again (one device draws the next ones). What to do: make the generator inside the build, or "
                        "seed it there before drawing (`g.manual_seed(n)`, recorded and replayed; a reseed between the "
                        "builds is not seen, so one meant to draw the same numbers again belongs inside too).")
            if not self.setting and self.on_meta:  # (a draw on a real tensor moved it, as on one device)
                self.drawn[x._cdata] = x
            if x._cdata not in self.gens:
                self.gens[x._cdata] = len(self.tape.generators)
                self.tape.generators.append(x.get_state())
                self.tape.keep.append(x)
            return _Gen(self.gens[x._cdata])
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        return x

    def record_call(self, fn, values: list) -> None:
        """A Python function recorded whole (`_Calls`): `fn(*values)`, writing its first argument if a tensor."""
        t = values[0]
        writes, reads = {}, frozenset()
        if isinstance(t, torch.Tensor):
            key = self.tape.ref(t).storage
            writes = {key: _whole(t)}
            reads = frozenset() if writes[key] else frozenset({key})
        self.tape.ops.append(_Op(fn, tuple(self._arg(v) for v in values), {}, [None], writes, reads, True))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.calls.inside is not None:  # (inside a recorded call: replayed by calling it)
            return out
        if func.overloadpacket in (aten.set_, aten.resize_):
            if not args[0].is_meta:  # (a real tensor's copy, `copy.deepcopy` of a generator's state: no model tensor)
                return out
            raise SpmdError(
                f"deferred_init: the construction calls {func} ({_user_line(traceback.extract_stack()[:-1])}), "
                "which swaps or resizes a tensor's storage; the recording cannot follow it (torch.nn.utils."
                "parametrize does this to register a parametrization). What to do: build under torch.device('meta'), "
                "where init_weights replays each module's reset_parameters() and sets the originals of a "
                "parametrization registered in a module's __init__ (weight_norm) from it; or build the tensor at "
                "its final size.")
        tape = self.tape
        writes: dict[int, bool] = {}
        reads = set()
        shape_only = func.overloadpacket in _SHAPE_ONLY
        args, kwargs = list(args), dict(kwargs)
        for i, a in enumerate(func._schema.arguments):
            positional = not a.kwarg_only and i < len(args)
            v = args[i] if positional else kwargs.get(a.name)
            if shape_only and i == 0:
                shape = _Shape(tuple(v.shape), tuple(v.stride()), v.dtype)
                if positional:
                    args[0] = shape
                else:
                    kwargs[a.name] = shape
                continue
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                if not isinstance(t, torch.Tensor):
                    continue
                key = tape.ref(t).storage
                if a.alias_info is not None and a.alias_info.is_write:
                    whole = i == 0 and func.overloadpacket in _KILL and _whole(t)
                    writes[key] = writes.get(key, True) and whole
                else:
                    reads.add(key)
        for k in writes:
            if k in reads:  # (copy_(w, w.t()): the whole is written from itself)
                writes[k] = False
        outs, made = [], False
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and tape.key_of(o) is None:
                outs.append(tape.ref(o, made_by=len(tape.ops)).storage)
                made = True
            else:
                outs.append(None)
        draws = torch.Tag.nondeterministic_seeded in func.tags
        if made or writes or draws:  # (a view needs no replay: arguments are named by storage and geometry)
            names = {a.name for a in func._schema.arguments}
            if "dtype" in names and "device" in names and kwargs.get("dtype") is None and isinstance(out, torch.Tensor):
                kwargs["dtype"] = out.dtype  # (a factory's dtype is the default one, which may differ later)
            kept = {k for k, whole in writes.items() if not whole}  # a partial write keeps the rest
            self.on_meta = any(t.is_meta for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor))
            try:
                tape.ops.append(_Op(func, tree_map(self._arg, tuple(args)), tree_map(self._arg, dict(kwargs)), outs,
                                    writes, frozenset(reads | kept), draws))
            finally:
                self.on_meta = True
            tape.keep.append(out)
        return out


def _python_calls() -> tuple[dict, dict]:
    """({code: (function, parameter names)} of the Python functions recorded whole: the torch.nn.init functions
    that return at once on the meta device (their draws depend on values: trunc_normal_ redraws what falls
    outside [a, b]) and torch.manual_seed; {code: (name, why)} of those refused: the global generator's state
    set from a saved state (what it holds depends on when the build ran) or the clock, or read."""
    fns = [getattr(nn.init, n) for n in ("trunc_normal_", "orthogonal_", "dirac_", "sparse_") if hasattr(nn.init, n)]
    fns.append(torch.random.manual_seed)
    recorded = {f.__code__: (f, tuple(inspect.signature(f).parameters)) for f in fns}
    refused = {f.__code__: (f"torch.{f.__name__}", _SETS) for f in (torch.random.set_rng_state, torch.random.seed)}
    refused |= {f.__code__: (f"torch.{f.__name__}", _READS) for f in (torch.random.get_rng_state,
                                                                        torch.random.initial_seed)}
    return recorded, refused


_PY_SEED = random.Random.seed.__code__
_SETS = "which sets the random generator from a saved state or the clock: a replay cannot know it"
_READS = ("which reads the global generator's state or seed: init_weights(seed) sets it anew, so the replay cannot "
          "know what the build read")

# torch.Generator (its `_cdata`) -> (the dispatcher's wrapper of it, which keeps it alive so that no other generator
# takes its address; the recording that drew from it on meta last, a weak reference; its state then): those draws
# moved it nowhere, so a later build drawing from it, still in that state, would draw the same numbers again
_META_DRAWN: dict[int, tuple[torch.Generator, "weakref.ref[InitTape]", torch.Tensor]] = {}
_DRAWN = ("which reads the state of a generator the build drew from: the meta device draws nothing, so the state "
          "read is not the one a build on values reads")


def _set_generator_state(g: torch.Generator, state: torch.Tensor) -> None:
    """The replay of a reseed of, or a state set on, a generator of the build's own (`_Calls._generator_call`)."""
    g.set_state(state)


class _Calls:
    """Records each call of a `_python_calls` function as one op of the tape, replayed by calling it (on the
    real tensor). A profile hook sees it however the model imported it (`nn.init.trunc_normal_`, or the
    name alone); the ops it runs inside are not recorded."""

    def __init__(self, recorder: "_Recorder"):
        self.recorder, self.inside, self.refused_call = recorder, None, None
        self.codes, self.refused = _python_calls()
        self.seeded_python = False  # (random.seed in the build: Python's draws are the same every build)

    def __enter__(self):
        self.before = sys.getprofile()
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self.before)

    def _refuse(self, name: str, frame, why: str = _SETS) -> None:
        """Noted, and raised once the build returns (`_recording`)."""
        if self.refused_call is None:
            self.refused_call = (name, _user_line(traceback.extract_stack(frame)), why)

    def _hook(self, frame, event, arg):
        if self.before is not None:
            self.before(frame, event, arg)
        if self.inside is not None:
            if event == "return" and frame is self.inside:
                self.inside = None
            return
        if event == "call":
            if frame.f_code is _PY_SEED:
                self.seeded_python = True
            if frame.f_code in self.refused:
                name, why = self.refused[frame.f_code]
                self._refuse(name, frame.f_back, why)
            if frame.f_code in self.codes:
                fn, params = self.codes[frame.f_code]
                values = [frame.f_locals[p] for p in params]
                if fn is torch.random.manual_seed or isinstance(values[0], torch.Tensor) and values[0].is_meta:
                    self.recorder.record_call(fn, values)
                    self.inside = frame
        elif event in ("c_call", "c_return") and isinstance(getattr(arg, "__self__", None), torch.Generator) \
                and frame.f_code.co_filename != __file__:  # (not the recording's own get_state)
            self._generator_call(event, arg.__self__, arg.__name__, frame)

    def _generator_call(self, event: str, g: torch.Generator, name: str, frame) -> None:
        """A method of a torch.Generator called while building. The global generator's seed and state depend on
        when the build ran (init_weights seeds it anew): setting them, or reading them (`torch.initial_seed()`,
        `g.set_state(torch.get_rng_state())`), is refused. A generator of the build's own follows from where it
        was first seen and what the build does to it: a reseed or a state set (`g.manual_seed(2)` between draws,
        a state it saved itself) is recorded as the state it leaves, and set again there in the replay; `seed()`
        (the clock) is refused. (Found by a probe: each of these came out 2.9-4.6 off, silently: the replay set a
        generator's state once, where it first drew.)"""
        if g is torch.default_generator:
            if event == "c_call" and name in ("manual_seed", "set_state", "seed"):
                self._refuse(f"torch.default_generator.{name}", frame)
            elif event == "c_call" and name in ("get_state", "initial_seed"):
                self._refuse(f"torch.default_generator.{name}", frame, _READS)
        elif g.device.type == "cpu":
            if event == "c_call" and name == "seed":
                self._refuse("torch.Generator.seed", frame)
            elif event == "c_call" and name in ("get_state", "clone_state", "__reduce_ex__", "__reduce__") \
                    and g._cdata in self.recorder.drawn:
                shown = "copy.deepcopy of a torch.Generator" if name.startswith("__") else f"torch.Generator.{name}"
                self._refuse(shown, frame, _DRAWN)
            elif event == "c_return" and name in ("manual_seed", "set_state", "graphsafe_set_state", "__setstate__"):
                self.recorder.setting = True
                try:
                    with torch._C._DisableTorchDispatch():  # (get_state's set_ is no op of the build)
                        self.recorder.record_call(functools.partial(_set_generator_state, state=g.get_state()), [g])
                finally:
                    self.recorder.setting = False
                self.recorder.drawn.pop(g._cdata, None)


class _Literals(TorchFunctionMode):
    """`torch.tensor([...])` under the meta device drops its data without an op the dispatch mode sees: make
    it on CPU and move it, so the tape holds the values (a constant) and the copy to meta."""
    _MAKERS = (torch.tensor, torch.as_tensor, torch.asarray)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._MAKERS and kwargs.get("device") in (None, "meta", torch.device("meta")) \
                and not (args and isinstance(args[0], torch.Tensor)):
            with torch._C.DisableTorchFunction():
                real = func(*args, **{**kwargs, "device": "cpu"})
            return real.to("meta")
        if getattr(func, "__self__", None) in (torch._C.TensorBase.is_meta, torch._C.TensorBase.device):
            _refuse_a_meta_branch(sys._getframe(1), func.__self__ is torch._C.TensorBase.device)
        if getattr(func, "__self__", None) is torch._C.TensorBase.data and len(args) == 2 \
                and isinstance(args[1], torch.Tensor) and args[0].is_meta and args[1].device.type == "cpu":
            # `p.data = torch.from_numpy(array)` (a CPU tensor no device context reaches), found by a probe to fail
            # with torch's "incompatible tensor type": moved as torch.tensor's values are, so the tape holds them
            return func(args[0], args[1].clone().to("meta"))
        return func(*args, **kwargs)


def _refuse_a_meta_branch(frame, device: bool) -> None:
    """A build of the user's asking whether a tensor is on meta (`if not w.is_meta: nn.init.normal_(w)`, or
    `w.device.type != "meta"`: a line reading a device and naming "meta") takes, recorded on meta, the branch one
    device's build does not: the recording would replay other values (a probe: 0.97 off, the generator
    elsewhere). torch's and transformers' own checks are theirs to make."""
    module = frame.f_globals.get("__name__", "") if frame is not None else ""
    if module.split(".")[0] in ("torch", "transformers", __name__.split(".")[0]):
        return
    if device and not re.search(r"""["']meta["']""", linecache.getline(frame.f_code.co_filename, frame.f_lineno)):
        return
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    what = 'its `.device` against "meta"' if device else "`.is_meta`"
    raise SpmdError(
        f"deferred_init: the model's construction asks whether a tensor is on the meta device "
        f"({what}, at {where}); "
        "recorded on meta, it takes the branch a build on one device does not, and its init would differ. What to "
        "do: build the model without that branch (its init in reset_parameters(), or in an init_fn given to "
        "init_weights), or build it for real on every rank (the pieces then come from rank 0's values).")


def _other_generators() -> dict[str, object]:
    """The states of Python's and numpy's global generators (numpy only if imported)."""
    states: dict[str, object] = {"random": random.getstate()}
    if "numpy" in sys.modules:
        state = sys.modules["numpy"].random.get_state()
        states["numpy.random"] = (state[0], state[1].tobytes(), *state[2:])
    return states


@contextlib.contextmanager
def _recording(tape: InitTape):
    recorder = _Recorder(tape)
    try:
        with torch.device("meta"), _Literals(), recorder, recorder.calls:
            yield recorder.calls
        for key, g in recorder.drawn.items():  # (drawn from since last set: where the build leaves them is wrong)
            _META_DRAWN[key] = (g, weakref.ref(tape), g.get_state())
        if len(_META_DRAWN) > 256:  # (each holds a generator alive: those of builds gone are let go, past a few)
            for key in [k for k, (_, ref, _) in _META_DRAWN.items() if ref() is None]:
                del _META_DRAWN[key]
        if recorder.calls.refused_call is not None:
            name, line, why = recorder.calls.refused_call
            raise SpmdError(
                f"deferred_init: the construction calls {name} ({line}), {why}. What to do: seed with "
                "torch.manual_seed(n) (recorded and replayed), or draw from a torch.Generator of your own seeded "
                "with a number (`torch.Generator().manual_seed(n)`).")
    except (RuntimeError, NotImplementedError) as e:
        if "meta" not in str(e):
            raise
        raise SpmdError(
            f"deferred_init: the construction read a tensor's values ({_user_line(traceback.extract_tb(e.__traceback__))}"
            f"), which the meta device does not hold: {type(e).__name__}: {e}. What to do: compute such numbers in "
            "Python (drop-path rates: `[rate * i / (depth - 1) for i in range(depth)]` for "
            "`torch.linspace(0, rate, depth).tolist()`), or build the model under torch.device('meta') yourself.") from e


# model -> (its recorded construction, its tensors at the end of it, their version counters then)
_TAPES: "weakref.WeakKeyDictionary[nn.Module, tuple[InitTape, dict, dict]]" = weakref.WeakKeyDictionary()


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for n, t in (*model.named_parameters(remove_duplicate=False),
                                 *model.named_buffers(remove_duplicate=False)) if t is not None]


def _final(model: nn.Module, tape: InitTape) -> dict[str, _Ref]:
    return {name: tape.ref(t) for name, t in _named_tensors(model)}


def deferred_init(build: Callable[..., nn.Module], *args, **kwargs) -> nn.Module:
    """`build(*args, **kwargs)` on the meta device (shapes only, no memory), with its construction recorded:
    `spmd.compile` plans it as any meta model, and `compiled.init_weights(seed)` gives each rank the pieces of
    what `torch.manual_seed(seed); build(*args, **kwargs)` holds on one CPU device, whatever `__init__` did
    (a nanoGPT-style `self.apply(self._init_weights)`, ties either way, parameters drawn with torch.randn).
    Conversions belong inside: `deferred_init(lambda: Model(cfg).to(torch.bfloat16))`. Python's `random` and
    numpy draws are taken as they fell while recording (seed them in the build for the same on every rank)."""
    tape = InitTape()
    before = _other_generators()
    with _recording(tape) as calls:
        model = build(*args, **kwargs)
    drew = [name for name, state in _other_generators().items() if state != before.get(name)
            and not (name == "random" and calls.seeded_python)]
    if drew:
        warnings.warn(
            f"deferred_init: the build drew numbers from {' and '.join(drew)}, which the recording cannot replay: the "
            "values they gave are kept as they fell here, so a fresh build gives others, and so may another rank. "
            "What to do: seed them inside the build (`random.seed(0)`, `numpy.random.seed(0)`), or draw with torch.",
            stacklevel=2)
    if not isinstance(model, nn.Module):
        raise SpmdError(f"deferred_init: {getattr(build, '__name__', build)!r} returned a {type(model).__name__}, "
                        "not an nn.Module")
    if is_transformers(model):
        raise SpmdError("deferred_init: the model holds a transformers model, whose own init (post_init) does not run "
                        "under the meta device, so the recording would miss it. What to do: build it under "
                        "torch.device('meta'): init_weights replays transformers' post_init itself.")
    _TAPES[model] = (tape, _final(model, tape), {name: t._version for name, t in _named_tensors(model)})
    return model


def tape_of(model: nn.Module) -> tuple[InitTape, dict[str, _Ref]] | None:
    """The recorded construction of `model` (or of a model it is part of), with `model`'s tensors at the end of
    it; None for a model not built by `deferred_init`. A tensor replaced since (a `.to()` after the build, a
    module swapped in) is refused: the tape cannot know its values."""
    for root, (tape, final, versions) in list(_TAPES.items()):
        if root is not model and not any(m is model for m in root.modules()):
            continue
        prefix = "" if root is model else next(n for n, m in root.named_modules() if m is model) + "."
        mine = {}
        for name, t in _named_tensors(model):
            ref = final.get(prefix + name)
            if ref is None or tape.key_of(t) != ref.storage or tuple(t.shape) != ref.size or t.dtype != ref.dtype:
                raise SpmdError(
                    f"init_weights: {name} is not the tensor spmd.deferred_init recorded (the model was changed after "
                    "it was built: a .to(), a module swapped in). What to do: make the change inside the build "
                    "function, `spmd.deferred_init(lambda: change(Model(cfg)))`, so it is recorded too.")
            if isinstance(t, nn.Parameter) and t._version != versions.get(prefix + name, t._version):
                # (parameters: a buffer the model's own forward writes, batch norm's count on a meta call for
                # the output's shape, is no init)
                # (found by a probe: `nn.init.normal_(m.mid.weight, std=3)` after deferred_init returned was
                # dropped, 11 off, silently: on meta it writes nothing, and the recording had ended)
                raise SpmdError(
                    f"init_weights: {name} was written after spmd.deferred_init returned (an nn.init call, a value set "
                    "in place on the meta model), which the recording did not see and the meta tensor does not "
                    "hold. What to do: make the change inside the build function, `spmd.deferred_init(lambda: "
                    "change(Model(cfg)))`, or pass it as `init_weights(init_fn=...)`, which is recorded too.")
            mine[name] = ref
        return tape, mine
    return None


def record_init_fn(model: nn.Module, tape: InitTape, init_fn: Callable) -> tuple[InitTape, dict[str, _Ref]]:
    """The tape with `model.apply(init_fn)` recorded after the build, and the model's tensors at its end (an
    init_fn may write in place, set `.data`, or put in new tensors). The model is left as it was."""
    tape = tape.copy()
    slots = [(table, name, t, t.detach()) for m in model.modules() for table in (m._parameters, m._buffers)
             for name, t in table.items() if t is not None]
    versions = [t._version for _, _, t, _ in slots]
    try:
        with _recording(tape), torch.no_grad():
            model.apply(init_fn)
        final = _final(model, tape)
    finally:
        for table, name, t, data in slots:
            table[name] = t
            if StorageWeakRef(t.untyped_storage()) != StorageWeakRef(data.untyped_storage()) or t.shape != data.shape:
                t.data = data  # (`.data = ...` in the init_fn)
        # (the init_fn's writes, recorded, are no change made to the model after its build: `tape_of`)
        torch._C._autograd._unsafe_set_version_counter(tuple(t for _, _, t, _ in slots), tuple(versions))
    return tape, final


# ---- replay ----------------------------------------------------------------------------------------

@dataclass
class _Schedule:
    order: list[int]                     # the needed ops, in the order they run
    allocate: dict[int, list[int]]       # op -> storages allocated empty just before it (killed there)
    scratch: dict[int, set[int]]         # op -> storages it writes whose values are dead: scratch instead
    last_use: dict[int, int]             # storage -> the position in `order` after which it is dropped (cut)


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
    lost = [s for s in need if tape.storages[s].constant is None]
    if lost:  # values no recorded op made
        names = [n for s in lost for n in finals.get(s, ())] or ["an intermediate value"]
        raise SpmdError(f"init_weights: the values of {', '.join(sorted(names)[:6])} come from tensors no op of the "
                        "recording made (made on the meta device before deferred_init's build ran). What to do: make "
                        "them inside the build function.")
    order = _run_order(tape, needed, scratch)
    last_use: dict[int, int] = {}
    for p, i in enumerate(order):
        op = tape.ops[i]
        dead = scratch.get(i, set())
        for s in (*op.writes, *op.reads, *(s for s in op.outs if s is not None)):
            if s not in dead:
                last_use[s] = p
    for s in need:  # (constants: held from the start)
        last_use.setdefault(s, -1)
    return _Schedule(order, allocate, scratch, last_use)


def _run_order(tape: InitTape, needed: list[bool], scratch: Mapping[int, set[int]]) -> list[int]:
    """The needed ops in the order they run: the random ones (and recorded calls) in the tape's order, so the
    generator draws the same numbers into the same tensors; each other op that reads something right after
    the last op it depends on (what wrote or made what it reads or writes, what read what it writes), so
    that a `.to()` or a `mul_` after the init frees its input as soon as that input is done, not at the end
    of the build; an op reading nothing (a factory) stays where it was, so as not to allocate early."""
    epoch = -1                                   # the random ops before, counted
    key: dict[int, tuple] = {}
    last_write: dict[int, int] = {}              # storage -> epoch of the last op writing or making it
    last_read: dict[int, int] = {}               # storage -> epoch of the last op reading it
    for i, op in enumerate(tape.ops):
        if not needed[i]:
            continue
        dead = scratch.get(i, set())
        writes = [s for s in op.writes if s not in dead] + [s for s in op.outs if s is not None]
        reads = [s for s in op.reads if s not in dead]
        if op.random:
            epoch += 1
            key[i] = (epoch, 0, i)
        elif reads:
            at = max([last_write.get(s, -1) for s in (*reads, *writes)] + [last_read.get(s, -1) for s in writes] + [-1])
            key[i] = (at, 1, i)
        else:
            key[i] = (epoch, 1, i)
        at = key[i][0]
        for s in writes:
            last_write[s] = max(last_write.get(s, -1), at)
        for s in reads:
            last_read[s] = max(last_read.get(s, -1), at)
    return sorted(key, key=key.get)


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
    _warn_unwritten(tape, sched, by_storage)
    real: dict[int, torch.Tensor] = {s: tape.storages[s].constant.clone() for s in sched.last_use
                                     if tape.storages[s].constant is not None}
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

    for s in [s for s, last in sched.last_use.items() if last == -1]:  # (constants nothing else touches)
        cut(s)
        del real[s]
    peak = 0
    if seed is not None:
        torch.manual_seed(seed)
    # (autocast off: the tape holds the ops as the build ran them, casts included; replayed under the caller's
    # autocast, a matmul came out in bf16 and its bytes were then read as float32, silently; found by a probe)
    with torch.no_grad(), autocast_off():
        for p, i in enumerate(sched.order):
            op = tape.ops[i]
            for s in sched.allocate.get(i, ()):
                st = tape.storages[s]
                real[s] = torch.empty(st.nbytes // st.dtype.itemsize, dtype=st.dtype)
            dead = sched.scratch.get(i, ())

            def resolve(x):
                if isinstance(x, _Ref):  # (scratch of the same geometry: the CPU generator's draws depend on it)
                    return torch.empty_strided(x.size, x.stride, dtype=x.dtype) if x.storage in dead else view(x)
                if isinstance(x, _Shape):
                    return torch.empty_strided(x.size, x.stride, dtype=x.dtype)
                if isinstance(x, _Gen):
                    return gens[x.index]
                return x

            with _default_dtype(op.default_dtype):
                out = op.func(*tree_map(resolve, op.args), **tree_map(resolve, op.kwargs))
            for s, o in zip(op.outs, tree_flatten(out)[0]):
                if s is not None:
                    if o.dtype != tape.storages[s].dtype:
                        raise SpmdInternalError(f"init replay: {op.func} made {o.dtype} where the build made "
                                                f"{tape.storages[s].dtype}")
                    real[s] = o
            peak = max(peak, sum(t.untyped_storage().nbytes() for t in real.values()))
            for s in {*op.writes, *op.reads, *(s for s in op.outs if s is not None)}:
                if sched.last_use.get(s) == p and s in real:
                    cut(s)
                    del real[s]
    if stats is not None:
        stats["peak_bytes"] = peak
    left = [n for n in final if n not in pieces]
    if left:
        raise SpmdInternalError(f"init replay: no piece cut for {left[:6]}")
    return pieces


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    was = torch.get_default_dtype()
    if dtype is was:
        yield
        return
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(was)


def _warn_unwritten(tape: InitTape, sched: _Schedule, by_storage: Mapping[int, list[str]]) -> None:
    """A tensor made by `torch.empty` that nothing writes holds whatever memory held, on one device too; here its
    pieces differ between ranks (a replicated one disagrees with itself)."""
    written = {s for i in sched.order for s in tape.ops[i].writes if s not in sched.scratch.get(i, ())}
    empty = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided}
    names = [n for s, ns in by_storage.items() if s not in written and tape.storages[s].made_by is not None
             and getattr(tape.ops[tape.storages[s].made_by].func, "overloadpacket", None) in empty for n in ns]
    if names:
        warnings.warn(f"init_weights: {', '.join(sorted(names)[:6])} {'is' if len(names) == 1 else 'are'} made by "
                      "torch.empty and never written: the values are whatever memory held, different on each rank. "
                      "What to do: initialize them in the build (or load them from a checkpoint).", stacklevel=3)
