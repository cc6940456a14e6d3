"""Initializing a sharded model without any rank holding it whole: each rank gets the local piece of
what `torch.manual_seed(seed); model = Model(cfg)` (and `model.apply(init_fn)`) gives on one CPU
device, while holding at most one *init group* (normally one module's tensors) in full.

    the dry run (runtime/init_replay.py)   events in construction order, what each touches, on meta
    groups                                 tensors touched by one event are joined (union-find): usually
                                           one module's own tensors; GPT-2's attention init also writes
                                           its child's c_proj.weight, so that group is the attention's
    the real pass                          on the global CPU generator, one event at a time, saving the
                                           generator state before each: an event that is not its group's
                                           last runs on scratch only to move the generator on (skipped
                                           when it draws nothing); at a group's last event its full CPU
                                           buffers are made, the earlier events whose results survive are
                                           replayed from their saved states, the last one runs, the
                                           local pieces are cut (cloned), the buffers dropped

Extra memory: the largest group plus one event's scratch, not the model. Every rank draws the whole
random stream (about one or two single-device inits of compute), with no communication. Tensors no
event writes (an RMSNorm's `torch.ones` made in `__init__`, a RoPE table) are named, with the way out.
transformers models: `hf_init_kwargs` replays their post_init (`_init_weights` over each PreTrainedModel's
subtree) and ties.
"""
from __future__ import annotations

import ast
import builtins
import functools
import inspect
import re
import sys
import textwrap
import types
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from spmd.core.errors import SpmdError
from spmd.runtime.distribute import local_slices
from spmd.runtime.init_replay import _default_reset_fns, _Event, _lookup, _Recorder, dry_run


def _malloc_trim():
    """Give freed heap pages back to the OS (glibc). Full buffers up to 32 MiB land on the heap once glibc's
    dynamic mmap threshold has grown, and freed ones between live local pieces stay in RSS otherwise."""
    global _libc
    if _libc is None:
        try:
            import ctypes
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc = None
_TRIM_EVERY = 64 << 20


# ---- the plan ----------------------------------------------------------------------------------

@dataclass(eq=False)
class _Group:
    keys: list[int]
    events: list[int]                    # every event touching the group, in order
    replay: list[int]                    # earlier events whose results survive to the end
    nbytes: int


class InitPlan:
    """What `init_local_shards` will run, from a dry run on meta. Reusable for every coordinate."""

    def __init__(self, model, infos, events, unknown, discard):
        self.model, self.infos, self.events, self.unknown_modules = model, infos, events, unknown
        self._discard = discard                 # event index -> set of (id(module), kind, attr) written to scratch
        self._analyze()

    # -- analysis
    def _analyze(self):
        parent = {k: k for k in self.infos}

        def find(k):
            while parent[k] != k:
                parent[k] = parent[parent[k]]
                k = parent[k]
            return k

        for ev in self.events:
            ks = list(ev.touched)
            for k in ks[1:]:
                parent[find(k)] = find(ks[0])
        members = defaultdict(list)
        for k in self.infos:
            members[find(k)].append(k)
        ev_of = defaultdict(list)
        for ev in self.events:
            if ev.touched:
                ev_of[find(next(iter(ev.touched)))].append(ev.index)
        self.groups: list[_Group] = []
        self.group_of_event: dict[int, _Group] = {}
        self.uncovered: list[str] = []             # nobody writes them
        self.read_before_write: list[str] = []     # their __init__ value is read, and it is lost on meta
        self.tainted: set[int] = set()             # keys of groups computed from such values
        written = set().union(*(ev.writes for ev in self.events)) if self.events else set()
        for root, keys in members.items():
            evs = ev_of.get(root, [])
            keys = sorted(keys, key=lambda k: self.infos[k].fqns[0])
            for k in keys:
                if k not in written:
                    self.uncovered.append(self.infos[k].fqns[0])
            if not evs:
                continue
            need = set(keys)
            needed = []
            for i in reversed(evs):
                ev = self.events[i]
                if ev.writes & need:
                    needed.append(i)
                    need = (need - ev.kills) | ev.uses
            for k in need:                       # the group's values depend on values lost on meta
                self.read_before_write.append(self.infos[k].fqns[0])
            if need:
                self.tainted.update(keys)
            needed.reverse()
            last = evs[-1]
            g = _Group(keys, evs, [i for i in needed if i != last],
                       sum(self.infos[k].nbytes for k in keys))
            self.groups.append(g)
            for i in evs:
                self.group_of_event[i] = g
        self.uncovered.sort()
        self.read_before_write.sort()

    @property
    def largest_group_bytes(self) -> int:
        return max((g.nbytes for g in self.groups), default=0)

    def report(self) -> str:
        lines = [f"{len(self.events)} events ({sum(e.kind == 'reset' for e in self.events)} reset, "
                 f"{sum(e.kind == 'init' for e in self.events)} init), {len(self.groups)} groups, "
                 f"largest group {self.largest_group_bytes / 2**20:.1f} MiB of "
                 f"{sum(i.nbytes for i in self.infos.values()) / 2**20:.1f} MiB"]
        big = max(self.groups, key=lambda g: g.nbytes, default=None)
        if big is not None:
            lines.append("  largest group: " + ", ".join(self.infos[k].fqns[0] for k in big.keys[:6]) +
                         (" ..." if len(big.keys) > 6 else ""))
        if self.uncovered:
            lines.append(f"  not initialized by any event: {', '.join(self.uncovered)}")
        if self.read_before_write:
            lines.append(f"  read before written: {', '.join(self.read_before_write)}")
        if self.unknown_modules:
            lines.append("  modules with their own tensors and no reset_parameters: " +
                         ", ".join(f"{c} ({len(v)})" for c, v in self.unknown_modules.items()))
        return "\n".join(lines)

    own_inits: list[str] = []                 # (set by plan_init)

    def check(self, strict: bool = True):
        problems = []
        if self.own_inits:
            said = (f"{len(self.own_inits)} class(es) of the model initialize values in __init__ beyond "
                    f"reset_parameters(), which a model built under torch.device('meta') does not keep and the "
                    f"replay cannot see: {'; '.join(self.own_inits[:4])}. What to do: build the model with "
                    "spmd.deferred_init(Model, ...), which records the whole construction and replays it; or, "
                    "if an init_fn or reset_fns already redo exactly that, pass strict=False.")
            if strict:
                raise SpmdError(said)
            warnings.warn(said, stacklevel=3)
        if self.uncovered:
            problems.append(
                f"{len(self.uncovered)} parameters/buffers are set by no reset_parameters() and no init_fn, so their "
                f"values (made in __init__, e.g. torch.ones / torch.zeros / a RoPE table) are lost on meta: "
                f"{', '.join(self.uncovered[:12])}{' ...' if len(self.uncovered) > 12 else ''}")
        if self.read_before_write:
            problems.append(
                f"{len(self.read_before_write)} parameters/buffers are read by their init before anything wrote "
                f"them (their __init__ value is lost on meta): {', '.join(self.read_before_write[:12])}")
        if self.unknown_modules:
            warnings.warn(
                "modules that own tensors but have no reset_parameters(): " +
                "; ".join(f"{c} at {', '.join(v[:3])}{' ...' if len(v) > 3 else ''}" for c, v in self.unknown_modules.items()) +
                ". If their __init__ draws random numbers (torch.randn, nn.init.*_), the replay cannot know and "
                "every later draw differs from a single-device build: declare reset_fns={Class: fn} that draws "
                "the same numbers, or reset_fns={Class: None} if __init__ draws none.", stacklevel=3)
        parametrized = sorted({n.split(".parametrizations.")[0] for n in self.uncovered if ".parametrizations." in n})
        if parametrized:  # (found by a probe: Wav2Vec2's positional conv under weight_norm, told only the above)
            problems.append(
                f"Among them, the tensors of a parametrization on {', '.join(parametrized[:3])}: one registered in a "
                "module's __init__ (weight_norm in Wav2Vec2's, spectral_norm, or either in a helper it calls) has its "
                "tensors set from the module's reset as registering it set them; not one registered on the built "
                "model (after its init, which a meta model cannot replay) or under a condition in __init__ (HuBERT's, "
                "under `if not conv_pos_batch_norm`: a meta model cannot tell it ran), nor one holding state of its "
                "own other than spectral_norm's. A checkpoint (load_safetensors), or a build with values on every rank (the "
                "pieces then come from rank 0's), needs none of this")
        if problems and strict:
            raise SpmdError(
                "\n".join(problems) + "\nWhat to do: give the module a reset_parameters() that sets them; or pass "
                "reset_fns={ModuleClass: fn} (fn(module) re-does what __init__ did, run at that module's place in "
                "construction order); or pass an init_fn that sets them (it runs as model.apply(init_fn)); or "
                "strict=False to leave them out of the result.")

    # -- execution helpers
    _init_dtype = None

    def _dtype(self, o: torch.Tensor) -> torch.dtype:
        """Full buffers are made in init_dtype (floating tensors only), pieces cast back to the meta dtype."""
        if self._init_dtype is not None and o.dtype.is_floating_point:
            return self._init_dtype
        return o.dtype

    def _placements_of(self, info, placements, mesh_shape, replicate_missing):
        found = [(f, placements[f]) for f in info.fqns if f in placements]
        if not found:
            if replicate_missing:
                return tuple(Replicate() for _ in mesh_shape)
            raise SpmdError(f"no placements for {info.fqns[0]!r}"
                                   + (f" (also named {info.fqns[1:]})" if len(info.fqns) > 1 else ""))
        ps = tuple(found[0][1])
        for f, other in found[1:]:
            if tuple(other) != ps:
                raise SpmdError(f"tied {found[0][0]!r} and {f!r} have different placements {ps} / {tuple(other)}")
        return ps

    def _run(self, ev: _Event, bufs: dict[int, torch.Tensor], rec: _Recorder):
        """Run one event with `bufs` installed in place of the meta tensors (scratch for discarded slots)."""
        discard = self._discard.get(ev.index, set())
        saved, installed = [], []
        try:
            for key, info in self.infos.items():
                buf = bufs.get(key)
                obj = None
                if buf is not None:
                    obj = nn.Parameter(buf, requires_grad=info.obj.requires_grad) if info.is_param else buf
                for (m, kind, attr, _) in info.holders:
                    table = m._parameters if kind == "p" else m._buffers
                    if (id(m), kind, attr) in discard:     # writes here are thrown away (scratch)
                        o = info.obj
                        s = torch.empty_strided(o.shape, o.stride(), dtype=self._dtype(o))
                        here = nn.Parameter(s, requires_grad=o.requires_grad) if info.is_param else s
                    elif obj is not None:
                        here = obj
                    else:
                        continue
                    saved.append((table, attr, table[attr]))
                    table[attr] = here
                    installed.append((table, attr, here, info.fqns[0]))
            rec.keys = {StorageWeakRef(b.untyped_storage()): k for k, b in bufs.items()}
            rec.event = _Event(ev.index, ev.kind, ev.module, ev.fqn, ev.fn)
            with torch.no_grad():
                ev.fn(ev.module)
            for table, attr, here, fqn in installed:
                if table[attr] is not here:
                    raise SpmdError(f"{ev.describe()} replaced {fqn!r} with a new tensor instead of writing "
                                           "into it; write in place (tensor.normal_(), nn.init.*_) instead")
        finally:
            rec.event = None
            for table, attr, old in reversed(saved):
                table[attr] = old

    def materialize(self, placements: Mapping[str, tuple], mesh_shape, coord, *, seed: int | None,
                    device="cpu", strict: bool = True, replicate_missing: bool = False,
                    init_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """See init_local_shards."""
        mesh_shape, coord = tuple(mesh_shape), tuple(coord)
        self._init_dtype = init_dtype
        self.check(strict)
        lookup = {k: self._placements_of(info, placements, mesh_shape, replicate_missing)
                  for k, info in self.infos.items() if info.fqns[0] not in self.uncovered}
        leave_out = self.tainted | {k for k, i in self.infos.items() if i.fqns[0] in self.uncovered}
        if seed is not None:
            torch.manual_seed(seed)
        rec = _Recorder()
        rec.forbidden = {StorageWeakRef(i.obj.untyped_storage()): i.fqns[0] for i in self.infos.values()}
        replay_needed = {j for g in self.groups for j in g.replay}
        states: dict[int, torch.Tensor] = {}
        marked = {ev.rng_from for ev in self.events if ev.rng_from is not None}
        marks: dict[int, torch.Tensor] = {}  # the generator as an original's event had it, for its copies
        local: dict[int, torch.Tensor] = {}

        def empty(k):
            o = self.infos[k].obj
            return torch.empty_strided(o.shape, o.stride(), dtype=self._dtype(o))

        freed = 0
        with rec:
            for ev in self.events:
                if freed >= _TRIM_EVERY:
                    _malloc_trim()
                    freed = 0
                state = torch.get_rng_state()
                if ev.index in marked:
                    marks[ev.index] = state
                run_state = state if ev.rng_from is None else marks[ev.rng_from]
                g = self.group_of_event.get(ev.index)
                if g is not None and g.events[-1] == ev.index:
                    bufs = {k: empty(k) for k in g.keys}
                    for j in g.replay:
                        torch.set_rng_state(states.pop(j))
                        self._run(self.events[j], bufs, rec)
                    torch.set_rng_state(run_state)
                    self._run(ev, bufs, rec)
                    if ev.rng_from is not None:  # (a copy draws nothing: the generator stays)
                        torch.set_rng_state(state)
                    for k in g.keys:
                        if k in leave_out:
                            continue
                        piece = bufs[k][local_slices(tuple(bufs[k].shape), lookup[k], mesh_shape, coord)].clone()
                        local[k] = piece.to(device=device, dtype=self.infos[k].obj.dtype)
                    del bufs
                    freed += g.nbytes
                else:
                    if ev.index in replay_needed:
                        states[ev.index] = run_state
                    if ev.rng_ops and ev.rng_from is None:  # only to move the RNG on as construction did
                        self._run(ev, {k: empty(k) for k in ev.touched}, rec)
                        freed += sum(self.infos[k].nbytes for k in ev.touched)
        _malloc_trim()
        out = {}
        for k, t in local.items():                 # strict=False leaves out what came from lost values
            for f in self.infos[k].fqns:
                out[f] = t
        return out

    def assemble_trace(self) -> list[tuple[str, tuple]]:
        """The RNG ops of the replay, in order (to compare with `rng_trace` of a real build)."""
        return [op for ev in self.events if ev.rng_from is None for op in ev.rng_ops]


def plan_init(meta_model: nn.Module, **kwargs) -> InitPlan:
    """The dry run on meta (runtime/init_replay.py), analysed: reusable for every coordinate."""
    plan = InitPlan(meta_model, *dry_run(meta_model, **kwargs))
    plan.own_inits = own_inits(meta_model, kwargs.get("reset_fns") or {}) + \
        built_apart(meta_model, kwargs.get("reset_fns") or {})
    return plan


def own_inits(model: nn.Module, reset_fns: Mapping[type, Any]) -> list[str]:
    """`Class.__init__ (file:line: code)` for each class of the model's own (not torch's, not transformers')
    whose `__init__` writes or draws values itself, beyond the reset_parameters() of its modules: a
    nanoGPT-style `self.apply(self._init_weights)`, a `normal_` on some weights, a `torch.randn`, a weight zeroed
    or scaled in place, a submodule's parameter replaced. On a model built under torch.device('meta') the replay
    cannot see what it did (found by a probe: nanoGPT's init came out 4.09 off on wte, about 0.2 on every
    Linear), unless reset_fns declares the class. Every `__init__` along the class's MRO is read (a subclass
    that inherits its base's), and the functions it calls: its own methods (`self._init()`) and plain functions
    of the user's (`my_init(self)`)."""
    found, seen = [], set()
    for m in model.modules():
        if any(c in reset_fns for c in type(m).__mro__):
            continue
        for cls in type(m).__mro__:
            if cls in seen or "__init__" not in cls.__dict__ or not _users(cls):
                continue
            seen.add(cls)
            hit = _writes_values(cls.__init__, type(m), instance=m) or _reset_twice(cls, type(m))
            if hit is not None:
                found.append(f"{cls.__qualname__}.__init__ ({hit})")
    return found


def built_apart(model: nn.Module, reset_fns: Mapping[type, Any]) -> list[str]:
    """`Class.__init__ (file:line: code: why)` for each class of the model's own whose `__init__` builds a module
    the replay does not walk as one device built it: a submodule a base class's `__init__` built and a subclass's
    `__init__` builds again (one device drew for the one thrown away: a probe found the init 0.63 off and every
    later draw shifted), or a deep copy of a built module (`copy.deepcopy(layer)`, torch's `_get_clones`, or a
    helper of the user's making them: one device copies the values, the replay would reset each copy). torch's
    TransformerEncoder / TransformerDecoder copies are replayed as copies (init_replay._clones)."""
    found, seen = [], set()
    for m in model.modules():
        cls = type(m)
        if cls in seen or any(c in reset_fns for c in cls.__mro__):
            continue
        seen.add(cls)
        built: dict[str, tuple[type, str]] = {}  # attribute -> (the class whose __init__ built it first, where)
        for c in reversed(cls.__mro__):
            if "__init__" not in c.__dict__ or not _users(c):
                continue
            for attr, value, top, where in _self_assignments(c.__init__):
                held = getattr(m, attr, None) if attr else None
                if not attr:
                    if top and _draws_when_built(value, c.__module__):
                        found.append(f"{c.__qualname__}.__init__ ({where}: builds a module no attribute keeps; one "
                                     "device drew for it)")
                elif isinstance(value, ast.Constant) and value.value is None:
                    if attr in built and (top or held is None):
                        found.append(f"{c.__qualname__}.__init__ ({where}: throws `{attr}` away, which "
                                     f"{built[attr][0].__qualname__}.__init__ built at {built[attr][1]}; one device "
                                     "drew for it)")
                elif isinstance(held, nn.Module) and _copies(value, c.__module__) and _draws(held):
                    found.append(f"{c.__qualname__}.__init__ ({where}: a copy of a built module, whose values "
                                 "one device copies and the replay would draw again)")
                elif _reads_self_attr(value, attr):  # (kept inside: `self.fc = weight_norm(self.fc)`, a wrapper)
                    continue
                elif top and attr in built and built[attr][1] != where and isinstance(held, nn.Module):
                    found.append(f"{c.__qualname__}.__init__ ({where}: builds `{attr}` again, which "
                                 f"{built[attr][0].__qualname__}.__init__ built at {built[attr][1]}; one device "
                                 "drew for the one thrown away)")
                elif top and _draws_when_built(value, c.__module__):
                    built.setdefault(attr, (c, where))
    return list(dict.fromkeys(found))


def _self_assignments(fn) -> list[tuple[str, ast.expr, bool, str]]:
    """(attribute, value, at the top level of `fn`, `file:line: code`) for each `self.<attr> = value` in `fn`, in
    source order (also `self.<attr>.append(value)` / `.extend(value)`; `del self.<attr>` as a value of None; a
    module built and kept by none, `nn.Linear(4, 4)` as a statement, under the attribute "")."""
    try:
        lines, start = inspect.getsourcelines(inspect.unwrap(fn))
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return []
    init = tree.body[0] if tree.body and isinstance(tree.body[0], ast.FunctionDef) else None
    if init is None or not init.args.args:
        return []
    me = init.args.args[0].arg
    top = {id(s) for s in init.body}
    out = []
    for node in ast.walk(init):
        pairs = []
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            pairs = [(t.attr, node.value) for t in targets if isinstance(t, ast.Attribute)
                     and isinstance(t.value, ast.Name) and t.value.id == me]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("append", "extend")
              and isinstance(node.func.value, ast.Attribute) and isinstance(node.func.value.value, ast.Name)
              and node.func.value.value.id == me and node.args):
            pairs = [(node.func.value.attr, node.args[0])]
        elif isinstance(node, ast.Delete):
            pairs = [(t.attr, ast.Constant(None)) for t in node.targets if isinstance(t, ast.Attribute)
                     and isinstance(t.value, ast.Name) and t.value.id == me]
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            pairs = [("", node.value)]
        for attr, value in pairs:
            where = f"{inspect.getsourcefile(fn) or '?'}:{start + node.lineno - 1}: {lines[node.lineno - 1].strip()}"
            out.append((node.lineno, node.col_offset, attr, value, id(node) in top, where))
    return [row[2:] for row in sorted(out, key=lambda row: row[:2])]


def _resolved(node: ast.expr, module: str):
    """What a dotted name in the source of `module` (a module's name) names: its globals', then builtins', or None."""
    parts = _dotted(node).split(".")
    if "?" in parts:
        return None
    scope = vars(sys.modules[module]) if module in sys.modules else {}
    value = scope.get(parts[0], getattr(builtins, parts[0], None))
    for part in parts[1:]:
        value = getattr(value, part, None)
    return value


def _copies(value: ast.expr, module: str) -> bool:
    """Whether `value` is a copy of a module, or a container of copies: `copy.deepcopy(layer)`, torch's
    `_get_clones(layer, n)`, `nn.ModuleList([copy.deepcopy(layer) for _ in range(n)])`, or a plain function of the
    user's returning such (the annotated transformer's `clones(layer, N)`); not a module built from a copied
    config (`Block(copy.deepcopy(cfg))`)."""
    if isinstance(value, ast.Starred):
        return _copies(value.value, module)
    if isinstance(value, (ast.List, ast.Tuple)):
        return any(_copies(e, module) for e in value.elts)
    if isinstance(value, (ast.ListComp, ast.GeneratorExp)):
        return _copies(value.elt, module)
    if not isinstance(value, ast.Call):
        return False
    name = _dotted(value.func).rsplit(".", 1)[-1]
    if name in ("deepcopy", "_get_clones"):
        return True
    if name in ("TransformerEncoder", "TransformerDecoder") and value.args and isinstance(value.args[0], ast.Attribute):
        return True  # (torch's stack copying a layer the module keeps too, `TransformerEncoder(self.layer, n)`)
    if name in ("ModuleList", "Sequential", "ModuleDict"):
        return any(_copies(a, module) for a in value.args)
    helper = _resolved(value.func, module)
    if isinstance(helper, types.FunctionType) and _users(helper):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(helper)))
        except (OSError, TypeError, SyntaxError):
            return False
        return any(isinstance(n, ast.Return) and n.value is not None and _copies(n.value, helper.__module__)
                   for n in ast.walk(tree))
    return False


def _draws(module: nn.Module) -> bool:
    """Whether building `module` draws random numbers, by what it holds: a module of torch's whose `__init__` or
    reset draws (Linear, Embedding, Conv; not LayerNorm, Dropout), or any other module with tensors of its own."""
    for x in module.modules():
        own = any(t is not None for t in (*x._parameters.values(), *x._buffers.values()))
        if not own:
            continue
        if (type(x).__module__ or "").split(".")[0] != "torch" or _class_draws(type(x), 0):
            return True
    return False


@functools.lru_cache(maxsize=None)
def _class_draws(made: type, depth: int) -> bool:
    """Whether building a module class draws: torch's by its `__init__` and reset (Linear, Embedding, Conv; not
    LayerNorm, Dropout) or a module its `__init__` builds that does (TransformerEncoderLayer's Linears); another's
    by its `__init__` (a parameter made, a draw, or a module built that draws); unsure (no source): it draws."""
    torchs = (made.__module__ or "").split(".")[0] == "torch"
    for c in made.__mro__:
        if c in (nn.Module, object):
            continue
        names = ("__init__", "reset_parameters", "_reset_parameters") if torchs else ("__init__",)
        for name in names:
            if name not in c.__dict__:
                continue
            fn = c.__dict__[name]
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                if not torchs:
                    return True
                continue
            if _RNG_WORDS.search(source) or (not torchs and re.search(r"\bParameter\(", source)):
                return True
            if name == "__init__" and depth < 4 and \
                    any(_draws_when_built(v, c.__module__, depth + 1) for _, v, _, _ in _self_assignments(fn)):
                return True
    return False


def _reads_self_attr(value: ast.expr, attr: str) -> bool:
    """Whether `value` reads `self.<attr>` (`weight_norm(self.fc)`, `Wrapper(self.fc)`): the module is kept."""
    return any(isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.value, ast.Name)
               for n in ast.walk(value))


def _draws_when_built(value: ast.expr, module: str, depth: int = 0) -> bool:
    """Whether `value` builds a module whose construction draws random numbers: any call in it (the arguments of
    a container, `nn.Sequential(nn.Linear(...))`, a list comprehension's element) of a module class that draws
    (`_class_draws`). Names are resolved in `module` (the source's module's name)."""
    for node in ast.walk(value):
        if isinstance(node, ast.Call):
            made = _resolved(node.func, module)
            if isinstance(made, type) and issubclass(made, nn.Module) and _class_draws(made, depth):
                return True
    return False


def _installed(cls: type) -> bool:
    """Whether a class comes from an installed package (site-packages), not the user's own code."""
    path = getattr(sys.modules.get(cls.__module__), "__file__", None) or ""
    return "site-packages" in path or "dist-packages" in path


def _users(obj) -> bool:
    """Whether a class or function is the user's: not torch's, not transformers'."""
    return (getattr(obj, "__module__", None) or "torch").split(".")[0] not in ("torch", "transformers", "builtins")


def _writes_values(fn, cls: type, seen: set | None = None, *, its_own: bool = False,
                   instance: nn.Module | None = None) -> str | None:
    """`file:line: code` of the first line of `fn`, or of a function of the user's it calls (its methods through
    `self`, plain functions by name), that draws or writes values (`_INIT_WORDS`), or None. `its_own`: only
    the lines `fn` runs when called, not those of the functions it defines (a builder whose result is kept, read
    without the init a factory makes and returns). `instance`: the module being built, whose children's methods a
    call may run (`self.block.init_weights()`, `layer.init_weights()` in a loop over `self.layers`), looked up on
    the child's own class where that is the user's code (not an installed library's, such as peft's).

    Also a hit (each found by a probe, silently other values before): an init of torch's called under another
    name (`from torch.nn.init import zeros_ as zero_init`, `winit = partial(nn.init.normal_, std=.02)`), an
    initializer object called (`Initializer()(self)`, its `__call__`), a `reset_parameters` called with arguments
    or on a child (the replay runs each module's once, with none), a reset run before a child that draws is
    built. (A function whose source cannot be read, defined at a prompt or by exec, is taken to write nothing.)"""
    seen = set() if seen is None else seen
    fn = inspect.unwrap(fn)
    if (fn, its_own) in seen or not isinstance(fn, types.FunctionType) or not _users(fn):
        return None
    seen.add((fn, its_own))
    try:
        lines, start = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None
    try:
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except SyntaxError:
        tree = None
    prose = _string_lines(tree)  # (a docstring's example, `>>> model = X.from_pretrained(...)`, writes nothing)
    if its_own:
        prose |= _nested_lines(tree)
    for k, line in enumerate(lines):
        code = line.split("#", 1)[0]
        if k not in prose and _INIT_WORDS.search(code):
            return f"{inspect.getsourcefile(fn) or '?'}:{start + k}: {code.strip()}"
    if (hit := _unseen_inits(fn, tree, prose, lines, start)) is not None:
        return hit
    for target, kept in _called(fn, tree, cls, instance):
        if (hit := _writes_values(target, cls, seen, its_own=kept, instance=instance)) is not None:
            return f"calls {target.__qualname__}: {hit}"
    for k, line in enumerate(lines):  # (a value written under no_grad in a way none of the words name: `w /= 2`)
        if k not in prose and _NO_GRAD.search(line.split("#", 1)[0]):
            return f"{inspect.getsourcefile(fn) or '?'}:{start + k}: {line.strip()}"
    return None


def init_local_shards(meta_model: nn.Module, placements: Mapping[str, tuple], mesh_shape, coord, *,
                      seed: int | None, init_fn: Callable | None = None,
                      reset_fns: Mapping[type, Callable | None] | None = None,
                      init_roots: Mapping[str, Callable] | None = None, discard_writes: Iterable[str] = (),
                      tied_reset_owner: str | None = None, device="cpu", strict: bool = True,
                      replicate_missing: bool = False, init_dtype: torch.dtype | None = None,
                      wrapped: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] | None = None
                      ) -> dict[str, torch.Tensor]:
    """{fqn: this rank's piece} of every parameter and buffer of `meta_model` (tied names share one tensor),
    equal to the pieces of `torch.manual_seed(seed); m = Model(cfg); m.apply(init_fn)` built on CPU.

    placements: {fqn: (Shard(d) | Replicate(), ...) one per mesh axis}; a tied tensor may be named under
        any of its names. replicate_missing: a tensor with no entry is Replicate on every axis.
    seed: torch.manual_seed(seed) first; None: go on from the current global RNG state. Afterwards the
        global RNG is where the single-device construction would have left it.
    init_fn: applied as model.apply(init_fn) after construction (children first).
    reset_fns: {ModuleClass: fn(module) | None} for modules whose __init__ initializes without a
        reset_parameters() (e.g. transformers' Conv1D, an RMSNorm made with torch.ones, a RoPE buffer);
        None declares "its __init__ draws no random numbers". Looked up along the class MRO.
    init_roots: {module fqn: fn}: that module's __init__ ends by applying fn to its subtree, each module
        once over all roots, the nearest root's fn (transformers' post_init; see hf_init_kwargs).
    discard_writes: names whose writes go to scratch in every event (a tie made after init: the tied
        target's own init draws numbers, but its values are replaced by the source's).
    tied_reset_owner: "first": in reset events only the first name of a tied tensor writes it (the
        module that created it, when ties are made as `later.weight = earlier.weight`); "all": every
        name's reset writes it in turn, the last one wins (`earlier.weight = later.weight`); None: a tie
        two modules' resets write (and no init_fn overwrites) is refused, since a meta model cannot tell
        which made it (spmd.deferred_init records it).
    strict: raise when a tensor is set by nothing (its __init__ value is lost on meta).
    init_dtype: draw floating tensors in this dtype and cast the pieces to the meta dtype: a meta model
        cast with .to(torch.bfloat16) equals `Model(cfg).to(torch.bfloat16)` with init_dtype=torch.float32
        (without it, it equals a model built in bfloat16, e.g. under torch.set_default_dtype).
    wrapped: {module fqn: (names of the children it wraps, names of those its wrapping builds)}, in the order
        they were wrapped: modules put in place of others after construction (peft's LoRA layers; see
        peft_init_kwargs), built after everything else; their other children are copies their reset makes.
    device: where the pieces go (the draws are always on the CPU generator, as a CPU build's).
    """
    plan = plan_init(meta_model, init_fn=init_fn, reset_fns=reset_fns, init_roots=init_roots,
                     discard_writes=discard_writes, tied_reset_owner=tied_reset_owner, wrapped=wrapped)
    return plan.materialize(placements, mesh_shape, coord, seed=seed, device=device, strict=strict,
                            replicate_missing=replicate_missing, init_dtype=init_dtype)


# ---- transformers ------------------------------------------------------------------------------

# what draws random numbers, or sets the generator: names, as the source spells them (`torch.normal` and the
# generator's setters only before a call, so prose in a docstring is not taken for them)
_NO_GRAD = re.compile(r"\bwith\s+torch\.no_grad\(\)")
_RNG_NAMES = ("randn", "rand", "randint", "randperm", "randn_like", "rand_like", "randint_like", "normal_", "uniform_",
              "trunc_normal_", "orthogonal_", "bernoulli", "bernoulli_", "multinomial", "random_", "sparse_",
              "exponential_", "geometric_", "cauchy_", "log_normal_", "poisson")
_RNG_CALLS = ("normal", "manual_seed", "fork_rng", "set_rng_state")
_RNG_WORDS = re.compile(rf"\b({'|'.join(_RNG_NAMES)}|xavier_\w+|kaiming_\w+)\b|\b({'|'.join(_RNG_CALLS)})(?=\()")
# an __init__ that draws, or writes values in place, or applies an init over its modules (`own_inits`)
_INIT_WORDS = re.compile(
    rf"\.apply\(|{_RNG_WORDS.pattern}|\b(dirac_|zeros_|ones_|constant_|fill_|copy_|eye_|bernoulli_|zero_|mul_|div_|"
    r"add_|sub_|clamp_|fill_diagonal_|masked_fill_|index_fill_|scatter_)\b"
    r"|\.data\s*=[^=]"                                       # a value set through .data
    r"|(\.data|\.weight|\.bias)\s*([*/+-]|\*\*)="             # ... or scaled in place (GPT-2's `p.data /= ...`)
    r"|(\.data|\.weight|\.bias)\[[^\]]*\]\s*=[^=]"            # ... or in part (`emb.weight[0] = 0`)
    r"|\bfrom_pretrained\(|\b_weight\s*="                       # an embedding given its table (no reset)
    r"|\bload_state_dict\(|\b(F|functional)\.\w*dropout\("     # values copied in (MoCo's key encoder); a draw
    r"|self(\.\w+)+\.\w+\s*=\s*(torch\.)?(nn\.)?Parameter\(")  # a submodule's parameter replaced
_REPLAYED = ("reset_parameters",)  # (what the replay runs itself for any module: init_replay.py)


def _string_lines(tree) -> set[int]:
    """The lines (0-based) of a parsed function that are a string standing as a statement (its docstring)."""
    found = set()
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found.update(range(node.lineno - 1, node.end_lineno))
    return found


def _nested_lines(tree) -> set[int]:
    """The lines (0-based) of a parsed function's body that belong to a function, lambda or class it defines."""
    outer, found = tree.body[0] if tree is not None and tree.body else None, set()
    for node in ast.walk(tree) if tree is not None else ():
        if node is not outer and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])
            found.update(range(first - 1, node.end_lineno))
    return found


def _reset_twice(cls: type, built: type) -> str | None:
    """`file:line: code` where a class of the user's derived from one of torch's (`class LoRALinear(nn.Linear)`)
    calls `self.reset_parameters()` in its `__init__`, which torch's `__init__` already called (the override, as
    loralib's): one device draws twice, the first time before the subclass's own tensors exist, which no replay
    can redo (found by a review)."""
    if not any((c.__module__ or "").split(".")[0] == "torch" and c is not nn.Module and "__init__" in c.__dict__
               and _calls_reset(c.__init__) for c in built.__mro__):
        return None
    try:
        lines, start = inspect.getsourcelines(cls.__init__)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    init = tree.body[0] if tree.body and isinstance(tree.body[0], ast.FunctionDef) else None
    for node in _own_calls(init, "reset_parameters"):
        return (f"{inspect.getsourcefile(cls.__init__) or '?'}:{start + node.lineno - 1}: "
                f"{lines[node.lineno - 1].strip()}: reset_parameters() runs twice, torch's __init__ calls it too")
    return None


def _own_calls(fn: ast.FunctionDef | None, name: str) -> list[ast.Call]:
    """The calls in a method's source of its own method `name`, through its first argument (`self.name(...)`)."""
    me = fn.args.args[0].arg if fn is not None and fn.args.args else None
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == name and isinstance(n.func.value, ast.Name) and n.func.value.id == me] if me else []


@functools.lru_cache(maxsize=None)
def _calls_reset(init) -> bool:
    try:
        return "reset_parameters()" in inspect.getsource(init)
    except (OSError, TypeError):
        return False


def _is_torch_init(obj) -> bool:
    """An init function of torch's (`torch.nn.init.normal_`), or a partial of one."""
    while isinstance(obj, functools.partial):
        obj = obj.func
    return callable(obj) and getattr(obj, "__module__", None) == "torch.nn.init" and \
        getattr(obj, "__name__", "").endswith("_")  # (an init in place; not `calculate_gain`, a fan's count)


def _unseen_inits(fn, tree, prose: set[int], lines: list[str], start: int) -> str | None:
    """`file:line: code` of a call in `fn` that no word names: one of torch's inits under another name, or a
    `reset_parameters` with arguments or on another module than `fn`'s own (see `_writes_values`)."""
    if tree is None or not tree.body or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    outer = tree.body[0]
    me = outer.args.args[0].arg if outer.args.args else None
    resets = [n.lineno for n in _own_calls(outer, "reset_parameters")]
    for node in ast.walk(outer):
        if not isinstance(node, ast.Call) or node.lineno - 1 in prose:
            continue
        f = node.func
        hit = isinstance(f, ast.Name) and _is_torch_init(fn.__globals__.get(f.id))
        if isinstance(f, ast.Attribute) and f.attr == "reset_parameters":
            own = isinstance(f.value, ast.Name) and f.value.id == me
            hit = hit or not own or bool(node.args or node.keywords)
        # (its own reset before a child is built: one device draws it first, the replay after the children)
        if resets and any(line < node.lineno for line in resets) and \
                _draws_when_built(node, fn.__module__):
            hit = True
        if hit:
            return f"{inspect.getsourcefile(fn) or '?'}:{start + node.lineno - 1}: {lines[node.lineno - 1].strip()}"
    return None


def _called(fn, tree, cls: type, instance: nn.Module | None = None) -> list[tuple[Any, bool]]:
    """The functions `fn` calls that may be the user's, each with whether its result is kept: a call standing as a
    statement wherever it stands (`if zero: self._init()`, after a `;`, `_ = self._init()`: a line-start pattern
    missed them and a helper's `zeros_` went unseen, 0.18 off; found by a probe), or assigned (`self.emb =
    build_emb(cfg)`, a builder that zero-fills a row: unseen before), to a method through `self` or `super()`, a plain
    function, or a function or static method through a module's or class's name (`initlib.init_model(self)`). A
    kept call is read without the functions it defines (`init = init_method_normal(0.02)` makes the init that
    reset_parameters applies, running nothing). Not one in a nested function or lambda (not run now), nor
    `reset_parameters` (the replay runs it), nor Python's own."""
    if tree is None:
        return []
    outer, found = tree.body[0] if tree.body else None, []

    class Statements(ast.NodeVisitor):
        def visit_FunctionDef(self, node):
            if node is outer:
                self.generic_visit(node)

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_Lambda(self, node):
            pass

        def visit_Expr(self, node):
            if isinstance(node.value, ast.Call):
                found.append((node.value.func, False))

        def visit_Assign(self, node):
            if isinstance(node.value, ast.Call):
                thrown = all(isinstance(t, ast.Name) and t.id == "_" for t in node.targets)
                found.append((node.value.func, not thrown))

        def visit_AnnAssign(self, node):
            if isinstance(node.value, ast.Call):
                found.append((node.value.func, True))

    Statements().visit(tree)
    me = outer.args.args[0].arg if isinstance(outer, ast.FunctionDef) and outer.args.args else "self"
    # a loop variable over a container of the module's (`for layer in self.layers:`): the container's attribute
    loops = {n.target.id: n.iter.attr for n in ast.walk(tree) if isinstance(n, ast.For) and isinstance(n.target, ast.Name)
             and isinstance(n.iter, ast.Attribute) and isinstance(n.iter.value, ast.Name) and n.iter.value.id == me}

    def children(receiver: ast.expr) -> list[nn.Module]:
        """The modules of `instance` a receiver names: `self.block`, or a loop variable over `self.layers`."""
        if instance is None:
            return []
        if isinstance(receiver, ast.Attribute) and isinstance(receiver.value, ast.Name) and receiver.value.id == me:
            child = getattr(instance, receiver.attr, None)
            return [child] if isinstance(child, nn.Module) else []
        if isinstance(receiver, ast.Name) and receiver.id in loops:
            held = getattr(instance, loops[receiver.id], None)
            return list(held.children()) if isinstance(held, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) else []
        return []

    targets = []
    for f, kept in found:
        target, more = None, []
        if isinstance(f, ast.Name):
            target = fn.__globals__.get(f.id)
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in (me, "self"):
            target = inspect.getattr_static(cls, f.attr, None)
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in fn.__globals__:
            owner = fn.__globals__.get(f.value.id)
            if isinstance(owner, types.ModuleType):
                target = getattr(owner, f.attr, None)
            elif isinstance(owner, type):
                target = inspect.getattr_static(owner, f.attr, None)
        elif isinstance(f, ast.Call) and isinstance(f.func, ast.Name):  # (an initializer object: `Init()(self)`)
            made = fn.__globals__.get(f.func.id)
            target = inspect.getattr_static(made, "__call__", None) if isinstance(made, type) else None
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Name):
            if f.value.func.id == "super":
                target = _after(cls, fn, f.attr)
            elif f.value.func.id == "type":  # (`type(self)._zero(self)`)
                target = inspect.getattr_static(cls, f.attr, None)
        elif isinstance(f, ast.Attribute):  # (a method of a child, `self.block.init_weights()`, of the user's code)
            more = [getattr(m, "__func__", m) for c in dict.fromkeys(type(x) for x in children(f.value))
                    if _users(c) and not _installed(c) and isinstance(
                        m := inspect.getattr_static(c, f.attr, None), (types.FunctionType, classmethod, staticmethod))]
        if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) in _REPLAYED:
            continue
        for target in [getattr(target, "__func__", target), *more]:
            if target is not None and (target, kept) not in targets and \
                    (getattr(target, "__module__", None) or "").split(".")[0] not in sys.stdlib_module_names:
                targets.append((target, kept))  # (not Python's own: `copy.deepcopy(...)`, `logging.getLogger(...)`)
    return targets


def _after(cls: type, fn, name: str):
    """What `super().<name>` finds in `fn`, a method of a class along `cls`'s MRO: `name` on the classes after it."""
    past = False
    for c in cls.__mro__:
        if past and name in c.__dict__:
            return c.__dict__[name]
        own = c.__dict__.get(fn.__name__)
        past = past or (own is not None and inspect.unwrap(getattr(own, "__func__", own)) is fn)
    return None


def is_transformers(model: nn.Module) -> bool:
    """A transformers `PreTrainedModel`, or a model holding one (checked without importing transformers when it
    is not loaded): its post_init is replayed (a plain module around GPT-2 got torch's default init, 11.8 off)."""
    import sys

    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return any(isinstance(m, PreTrainedModel) for m in model.modules())


def _flagged(init: Callable) -> Callable:
    """A PreTrainedModel's `_init_weights` as its post_init runs it on one module: post_init marks each module
    `_is_hf_initialized` after its init, children first, so by then every module below it is marked, and an
    `_init_weights` may read those marks (ViTMAE's embeddings skip their sin-cos table when their patch
    projection is marked, which it always is: the table stays zeros on one device, and the replay without the
    marks wrote it, 1.0 off). The marks are set on the subtree for the call and taken off after, so the meta
    model is left as it was and every run of the replay sees the same."""
    def init_module(module: nn.Module) -> None:
        marked = [m for m in module.modules() if m is not module and not getattr(m, "_is_hf_initialized", False)]
        for m in marked:
            m._is_hf_initialized = True
        try:
            init(module)
        finally:
            for m in marked:
                del m._is_hf_initialized
    return init_module


def hf_init_kwargs(model: nn.Module) -> dict:
    """Keyword arguments for init_local_shards / plan_init that replay a transformers model's construction:
    `Model(config)` runs torch's default init in every submodule's __init__, then each PreTrainedModel's
    post_init() runs `_init_weights` over its subtree (innermost models first, each module once, the
    nearest PreTrainedModel's `_init_weights`), then ties weights. On meta, post_init skips the init
    (`init_weights` checks for the meta device) but still ties.

    - init_roots: every PreTrainedModel in the tree -> its `_init_weights` (not `_initialize_weights`,
      which sets `_is_hf_initialized` flags on the meta model and would skip work on a second run).
    - reset_fns: transformers' Conv1D draws normal_(std=0.02) in __init__ with no reset_parameters.
      Other classes owning tensors without reset_parameters are declared None when their __init__
      source shows no random call (a heuristic; checked against real builds in the tests), and
      replayed from their source when it draws (`init_draws`: ViT's cls_token and position embeddings).
    - discard_writes: tied targets (lm_head.weight -> embed weight): ties are made after init, so the
      target's own inits draw random numbers that the tie then throws away.
    """
    from transformers import PreTrainedModel
    from transformers.pytorch_utils import Conv1D

    roots = {f: _flagged(m._init_weights) for f, m in model.named_modules() if isinstance(m, PreTrainedModel)}
    reset_fns: dict[type, Callable | None] = {Conv1D: lambda m: nn.init.normal_(m.weight, std=0.02)}
    torch_resets = _default_reset_fns()          # (nn.MultiheadAttention: its own reset, which the replay knows)
    for _, m in model.named_modules():
        cls = type(m)
        if cls in reset_fns or callable(getattr(m, "reset_parameters", None)) or _lookup(torch_resets, cls)[0]:
            continue
        if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)):
            made = init_draws(cls, m)
            if made is not _UNREAD:              # (no source: left to the replay's warning)
                reset_fns[cls] = made if not isinstance(made, _Draws) or made.draws or made.before_children else None
    discard = []
    for prefix, m in model.named_modules():  # (each model's ties, under its path: a peft model's base model's too)
        if not isinstance(m, PreTrainedModel):
            continue
        for target, source in (m.__dict__.get("all_tied_weights_keys") or getattr(type(m), "all_tied_weights_keys",
                                                                                  None) or {}).items():
            target, source = (_wrapped_name(model, f"{prefix}.{n}" if prefix else n) for n in (target, source))
            if target is not None and source is not None and target not in discard and \
                    model.get_parameter(target) is model.get_parameter(source):
                discard.append(target)
    return {"init_roots": roots, "reset_fns": reset_fns, "discard_writes": discard}


def _wrapped_name(model: nn.Module, name: str) -> str | None:
    """`name`, a parameter's path in a model as built, as the model holds it now: through the module peft put in
    place of its module (`lm_head.weight`: `lm_head.original_module.weight`, `q_proj.weight`:
    `q_proj.base_layer.weight`); None where there is no such parameter."""
    module, path = model, []
    for part in name.split("."):
        while part not in module._modules and part not in module._parameters:
            inner = next((n for n in ("base_layer", "original_module") if n in module._modules), None)
            if inner is None:
                return None
            module, path = module._modules[inner], path + [inner]
        module, path = (module._modules[part] if part in module._modules else module), path + [part]
    return ".".join(path) if isinstance(model.get_parameter(".".join(path)), nn.Parameter) else None


# ---- peft -----------------------------------------------------------------------------------------

_PEFT_INITS = (True, False, "gaussian")  # (init_lora_weights that draw or write nothing but A and B)


def has_peft_layers(model: nn.Module) -> bool:
    """A model with peft's adapter layers in it (checked without importing peft when it is not loaded)."""
    import sys

    if "peft" not in sys.modules:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


def peft_init_kwargs(model: nn.Module) -> dict:
    """Keyword arguments for init_local_shards that replay `get_peft_model(Model(cfg), config)`: the base model is
    built and initialized (transformers' post_init) with its Linear layers in place, then peft wraps each target
    in a LoRA layer, in the model's module order (`wrapped`), whose construction builds `lora_A` and `lora_B` as
    nn.Linear (each drawing its default init) and ends with `reset_lora_parameters` (A drawn again, B zeroed).
    The replay without it initialized the adapters with the base model's post_init (lora_B drawn, not zero:
    0.19 off one device after 3 steps, silently; found by a probe).

    A `modules_to_save` module is copied from the original's values. LoRA's own Linear layers only, with
    `init_lora_weights` True, False or "gaussian"; another init (PiSSA, OLoRA, LoftQ, EVA, DoRA's magnitudes,
    which read the base weights) and another kind of adapter layer are refused when replayed, unless `reset_fns`
    names the class."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    configs = {}
    for m in model.modules():
        found = getattr(m, "peft_config", None)
        if isinstance(found, dict):
            configs.update(found)
    adapters = list(configs) or ["default"]
    holders = {}  # id(parameter) -> (module, attribute) of its first name: a tie's source
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                holders.setdefault(id(p), (m, name))
    sources = {}  # id(ModulesToSaveWrapper) -> where each of its original's tensors is held first

    def copies_saved(wrapper: nn.Module) -> None:
        _copies_saved(wrapper, sources[id(wrapper)])

    def reset_lora(layer: nn.Module) -> None:
        way_out = (f"say how the layers start, `init_weights(seed=..., reset_fns={{{type(layer).__qualname__}: fn}})` "
                   "(fn(layer) writes each adapter's tensors: zeros will do where a checkpoint follows), then load ")
        if len(adapters) > 1:  # (peft builds each adapter over all layers in turn: the draws come in another order)
            raise SpmdError(
                f"init_weights: the model holds {len(adapters)} peft adapters ({', '.join(map(repr, adapters))}), "
                "whose layers peft built one adapter after another; the replay does not redo that order. What to "
                f"do: {way_out}each adapter's weights (`compiled.load_state_dict`, under the model's own names).")
        for adapter in layer.lora_A.keys():
            init = getattr(configs.get(adapter), "init_lora_weights", True)
            if type(layer) is not LoraLinear or init not in _PEFT_INITS or layer.use_dora.get(adapter) \
                    or adapter in getattr(layer, "lora_variant", {}):
                raise SpmdError(
                    f"init_weights: {type(layer).__module__}.{type(layer).__qualname__} (adapter {adapter!r}, "
                    f"init_lora_weights={init!r}{', DoRA' if layer.use_dora.get(adapter) else ''}) is initialized by "
                    f"peft in a way the replay does not redo. What to do: {way_out}the adapter's weights "
                    "(`compiled.load_safetensors(folder)`, the folder peft's save_pretrained wrote).")
            layer.reset_lora_parameters(adapter, init)

    wrapped, reset_fns = {}, {}
    for fqn, m in model.named_modules():
        if isinstance(m, ModulesToSaveWrapper) and "original_module" in m._modules:
            wrapped[fqn] = (("original_module",), ())  # (its copies: made by copying, nothing drawn)
            reset_fns[type(m)] = copies_saved
            # (each copied value read where its tensor was made: a tied head's weight from the embedding, whose
            # slot the replay writes; the head's own is scratch)
            sources[id(m)] = {name: holders[id(p)] for name, p in m.original_module.named_parameters()}
        elif isinstance(m, BaseTunerLayer) and "base_layer" in m._modules:
            wrapped[fqn] = (("base_layer",), tuple(n for n in m._modules if n != "base_layer"))
            reset_fns[type(m)] = reset_lora
    return {"wrapped": wrapped, "reset_fns": reset_fns}


def _copies_saved(wrapper: nn.Module, sources: dict) -> None:
    """peft's `ModulesToSaveWrapper`: each adapter's module starts as a copy of the original's values, each read
    from where its tensor is held first (`sources`: {name in the original: (module, attribute)})."""
    original = dict(wrapper.original_module.state_dict(keep_vars=True))
    for name, (module, attr) in sources.items():
        original[name] = getattr(module, attr)
    for copy in wrapper.modules_to_save.values():
        for name, tensor in copy.state_dict(keep_vars=True).items():
            if name in original:
                tensor.data.copy_(original[name].data)


# ---- transformers: tensors drawn in __init__ -----------------------------------------------------

# a tensor drawn by a factory, and the in-place draw that makes the same numbers from the same generator state
# (`torch.randn(shape)` is `torch.empty(shape).normal_()` in torch)
_FACTORY_DRAWS = {"randn": "normal_", "rand": "uniform_"}
_INPLACE_DRAWS = ("normal_", "uniform_")


def _drawn(value: ast.expr) -> tuple[str, tuple] | None:
    """(in-place write, its constant arguments) when `value` is exactly `nn.Parameter(<new>)` or `<new>`
    (optionally `... if cond else None`), <new> being `torch.randn(shape)` / `torch.rand(shape)`, a new
    tensor drawn in place with constant arguments (`torch.Tensor(n).uniform_()`), or a constant one
    (`torch.zeros(shape)`, `torch.ones(shape)`, `torch.full(shape, 0.5)`, `torch.tensor(2.5)` or
    `torch.tensor(self.config.logit_scale_init_value)`); else None."""
    if isinstance(value, ast.IfExp) and isinstance(value.orelse, ast.Constant) and value.orelse.value is None:
        value = value.body
    if isinstance(value, ast.Call) and _dotted(value.func) in ("nn.Parameter", "torch.nn.Parameter", "Parameter"):
        if len(value.args) != 1 or any(k.arg != "requires_grad" for k in value.keywords):
            return None
        value = value.args[0]
    if not isinstance(value, ast.Call):
        return None
    name = _dotted(value.func)
    plain = all(k.arg in ("dtype", "device", "requires_grad") for k in value.keywords)
    if name in ("torch.randn", "torch.rand") and plain:
        return _FACTORY_DRAWS[name.split(".")[1]], ()
    if name in ("torch.zeros", "torch.ones") and plain:
        return ("zero_", ()) if name == "torch.zeros" else ("fill_", (1.0,))
    if name == "torch.tensor" and plain and len(value.args) == 1:  # (CLIP's logit_scale from its config)
        chain = _self_chain(value.args[0])
        if chain is not None:
            return "fill_", (_SelfAttr(chain),)
        try:
            number = ast.literal_eval(value.args[0])
        except ValueError:
            return None
        return ("fill_", (number,)) if isinstance(number, (int, float)) and not isinstance(number, bool) else None
    if name == "torch.full" and plain and len(value.args) == 2:
        try:
            return "fill_", (ast.literal_eval(value.args[1]),)
        except ValueError:
            return None
    f = value.func
    if (isinstance(f, ast.Attribute) and f.attr in _INPLACE_DRAWS and isinstance(f.value, ast.Call)
            and _dotted(f.value.func) in ("torch.Tensor", "torch.empty") and not value.keywords):
        try:
            return f.attr, tuple(ast.literal_eval(a) for a in value.args)
        except ValueError:
            return None
    return None


def _self_chain(node: ast.expr) -> tuple[str, ...] | None:
    """("config", "logit_scale_init_value") for `self.config.logit_scale_init_value`, else None."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return tuple(reversed(names)) if names and isinstance(node, ast.Name) and node.id == "self" else None


@dataclass(frozen=True)
class _SelfAttr:
    """A value `__init__` read from the module itself (`self.config.logit_scale_init_value`), read again at the
    replay from the same module."""
    chain: tuple[str, ...]

    def of(self, module: nn.Module):
        value = module
        for name in self.chain:
            value = getattr(value, name)
        return value


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


class _Draws:
    """A reset fn redoing a transformers module's `__init__` draws into its own tensors, in source order, with
    `before_children` for those drawn before a child is built (init_replay's schedule runs them there)."""

    def __init__(self, draws: list[tuple[str, str, tuple]], before_children: dict[str, "_Draws"] | None = None):
        self.draws, self.before_children = draws, before_children or {}

    def __call__(self, module: nn.Module) -> None:
        for attr, op, args in self.draws:
            t = getattr(module, attr, None)
            if isinstance(t, torch.Tensor):     # (None when made under a branch not taken)
                getattr(t, op)(*(a.of(module) if isinstance(a, _SelfAttr) else a for a in args))


_UNREAD = object()  # (init_draws: a class whose source cannot be read)


def init_draws(cls: type, module: nn.Module) -> Callable:
    """The reset fn of a transformers class that owns tensors, has no reset_parameters, and draws in `__init__`
    (ViTEmbeddings: `self.cls_token = nn.Parameter(torch.randn(1, 1, h))`, then its patch embedding, then the
    position embeddings). On one device those draws move the generator before post_init overwrites the values;
    a replay without them shifted every later draw (ViT 0.12 off). Read from the source: each statement
    `self.x = nn.Parameter(torch.randn(shape))` (or `rand`, or `torch.Tensor(n).uniform_()`) is the same
    draw in place, placed among the children as the source builds them. Anything else that draws (a scaled
    `s * torch.randn(...)`, a loop, a helper) gives a reset fn that refuses, naming the line and the way out.
    `_UNREAD` where the source cannot be read."""
    qual = f"{cls.__module__}.{cls.__qualname__}"
    try:
        lines, first = inspect.getsourcelines(cls.__init__)
        src = textwrap.dedent("".join(lines))
        fn = ast.parse(src).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return _UNREAD
    children = set(module._modules)
    steps: list[tuple] = []   # (line, "draw", attr, (op, args)) | (line, "child", attr, None), in source order
    accepted: set[int] = set()
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        t = node.targets[0]
        if not (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"):
            continue
        draw = _drawn(node.value)
        if draw is not None:
            if any(k == "draw" and a == t.attr for _, k, a, _ in steps):  # (branches: which one ran is unknown)
                return _refusing(qual, f"it makes {t.attr} in more than one place")
            steps.append((node.lineno, "draw", t.attr, draw))
            accepted.update(id(n) for n in ast.walk(node.value))
        elif t.attr in children:
            steps.append((node.lineno, "child", t.attr, None))
    branched: set[int] = set()  # (the lines under an `if`, or in a conditional expression's branches)
    for b in ast.walk(fn):
        if isinstance(b, (ast.If, ast.IfExp)):
            parts = [b.body, b.orelse] if isinstance(b, ast.IfExp) else [*b.body, *b.orelse]
            branched.update(n.lineno for part in parts for n in ast.walk(part) if hasattr(n, "lineno"))

    def built_after(lineno: int) -> list[str]:
        """The children holding tensors `__init__` builds after an unconditional draw at `lineno` (a draw under an
        `if` may not run: Mamba's mixer draws only where its caller asks, and its block does not; a review)."""
        if lineno in branched:
            return []

        def draws(child: nn.Module) -> bool:  # (holds a parameter of a module other than a norm, which draws none)
            return any(any(True for _ in m.parameters(recurse=False)) and not type(m).__name__.endswith("Norm")
                       and not isinstance(m, (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm))
                       for m in child.modules())
        return sorted({a for n, k, a, _ in steps if k == "child" and n > lineno
                       and module._modules.get(a) is not None and draws(module._modules[a])})

    for node in ast.walk(fn):                    # any other draw: refuse
        word = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if word is not None and (_RNG_WORDS.fullmatch(word) or word in _RNG_CALLS) and id(node) not in accepted:
            line = src.splitlines()[node.lineno - 1].strip()
            return _refusing(qual, f"line {first + node.lineno - 1}: {line}", built_after(node.lineno),
                             node.lineno in branched)
    helper = _drawing_helper(cls, fn, src, first)
    if helper is not None:
        return _refusing(qual, helper[0], built_after(helper[1]), helper[1] in branched)
    steps.sort(key=lambda s: s[0])
    if any(isinstance(n, (ast.For, ast.While)) for n in ast.walk(fn)) and any(
            k == "draw" and d[0] in _INPLACE_DRAWS for _, k, _, d in steps):
        return _refusing(qual, "it draws and loops")
    seen = {a for _, k, a, _ in steps if k == "child"}
    before, pending = {}, []
    for _, kind, attr, draw in steps:
        if kind == "draw":
            pending.append((attr, *draw))
        elif pending:
            before[attr], pending = _Draws(pending), []
    if before and children - seen:               # a child built elsewhere (a helper): its place is unknown
        return _refusing(qual, f"it builds {', '.join(sorted(children - seen))} outside __init__'s own lines")
    return _Draws(pending, before)


def _drawing_helper(cls: type, fn: ast.FunctionDef, src: str, first: int) -> tuple[str, int] | None:
    """(`line N: code (calls M, which draws)`, the call's line in `src`) when `__init__` calls, for its effect, a
    method through self or a plain function whose source draws random numbers (ViTMAEDecoder's
    `self.initialize_weights(num_patches)`, whose normal_ moved the generator: 0.11 off on every later weight), or
    None. post_init is replayed itself."""
    lines = src.splitlines()
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
            continue
        f = node.value.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
            target = inspect.getattr_static(cls, f.attr, None)
        elif isinstance(f, ast.Name):
            target = inspect.unwrap(cls.__init__).__globals__.get(f.id)
        else:
            continue
        target = getattr(target, "__func__", target)
        if not isinstance(target, types.FunctionType) or target.__name__ in ("post_init", *_REPLAYED):
            continue
        try:
            body = inspect.getsource(target)
        except (OSError, TypeError):
            continue
        if _RNG_WORDS.search("\n".join(line.split("#", 1)[0] for line in body.splitlines())):
            return (f"line {first + node.lineno - 1}: {lines[node.lineno - 1].strip()}, and {target.__qualname__} "
                    "draws", node.lineno)
    return None


def _refusing(qual: str, why: str, built_after: list[str] = (), branched: bool = False) -> Callable:
    """A reset fn that refuses, saying why. `built_after`: the children holding tensors `__init__` builds after the
    draw, which no reset fn can stand in for (it runs at the module's own place, after its children), so its way out
    is a checkpoint alone; it is kept on the fn (`built_after`), so that one given in reset_fns is refused too.
    `branched`: the draw is under a condition, which may not hold in this build (found by a probe: Mamba's mixer,
    told to pass a fn that draws, was given one, where its block builds it not drawing: 14 tensors up to 4.2 off;
    `reset_fns={MambaMixer: None}` is its way out)."""
    name = qual.rpartition(".")[2]
    maybe = (f" It draws under a condition: if that does not hold in this build (an argument its caller passes), "
             f"reset_fns={{{name}: None}} says so.") if branched else ""

    def refuse(module: nn.Module) -> None:
        if built_after:
            raise SpmdError(
                f"init_weights: {qual}.__init__ draws random numbers that the replay on meta cannot redo ({why}), "
                f"before it builds {', '.join(built_after)}, whose own draws follow: no reset_fns entry can stand in "
                "for it (one runs at the module's own place, not between its children). What to do: load the "
                "weights from a checkpoint (load_safetensors), or build the model with values on every rank (the "
                "pieces then come from rank 0's).")
        raise SpmdError(
            f"init_weights: {qual}.__init__ draws random numbers that the replay on meta cannot redo ({why}); on "
            f"one device they move the generator for every later draw. What to do: pass reset_fns={{"
            f"{name}: fn}}, fn(module) drawing the same numbers in place (torch.randn(shape) is "
            "tensor.normal_()), or load the weights from a checkpoint (load_safetensors)." + maybe)
    refuse.built_after = tuple(built_after)
    return refuse


# ---- diagnostics -------------------------------------------------------------------------------

class _RngTrace(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded in func.tags:
            name = str(func.overloadpacket.__name__)
            if name in _FACTORY_DRAWS:          # torch.randn(shape) as the in-place draw a replay makes of it
                self.ops.append((_FACTORY_DRAWS[name], (tuple(out.shape),)))
            else:
                self.ops.append((name, tuple(tuple(t.shape) for t in args if isinstance(t, torch.Tensor))))
        return out


def rng_trace(fn: Callable[[], Any]) -> tuple[Any, list[tuple[str, tuple]]]:
    """(fn(), the RNG-drawing aten ops it ran, with argument shapes): compare a real build's trace with
    `plan.assemble_trace()` to find where a replay departs from construction."""
    t = _RngTrace()
    with t:
        out = fn()
    return out, t.ops
