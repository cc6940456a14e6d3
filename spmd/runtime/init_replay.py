"""Replaying a model's construction-time init on the meta device, to learn what each step touches.

A model built under `with torch.device("meta")` has shapes and no values. To give each rank the values
`torch.manual_seed(s); model = Model(cfg)` has on one device (runtime/init_weights.py), construction is
replayed as a list of *events* in construction order:

    reset  M   M.reset_parameters() (or reset_fns[type(M)]), which nn modules call at the END of their
               __init__, after their children were built: a post-order walk of the module tree (children
               in registration order, then the module). It differs from named_modules()'s pre-order for a
               module that has its own reset and children: nn.MultiheadAttention's out_proj draws first.
               A reset fn with `before_children` ({child: fn}) also draws before building those children
               (transformers' ViTEmbeddings draws its cls_token, builds its patch embedding, then draws
               its position embeddings: `init_weights.init_draws`).
    init   M   init_fn(M), in exactly the order model.apply(init_fn) calls it (post-order, after every
               reset); or, for `init_roots` (transformers' post_init), at the root's post-order slot.

A module `wrapped` after construction (peft's LoRA layers, put in place of the Linear they wrap once the
model is built and initialized) stands in the walk as the modules it wraps: the modules its wrapping built and
its own reset come after the whole walk, in `wrapped`'s order; any other module of it is a copy, which its reset
makes (peft's `modules_to_save`).

`plan_init` runs every event once on the meta model (no random numbers drawn, no memory) under a
TorchDispatchMode that maps each aten op's arguments to the model's tensors by storage (so `.data`
writes are seen too, which do not bump a meta tensor's `_version`), and records per event which tensors
it writes, which it overwrites whole without reading first (normal_, uniform_, fill_, zero_, copy_, ...:
it *kills* them), which values it *uses*, and which random ops it runs.
"""
from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from spmd.core.errors import SpmdError
from spmd.core.shared_patch import SharedPatch

aten = torch.ops.aten


# ---- the model's tensors ------------------------------------------------------------------------

@dataclass(eq=False)
class _TensorInfo:
    key: int
    obj: torch.Tensor                    # the meta Parameter / buffer object
    fqns: list[str]                      # every name; fqns[0] is the one named_parameters() keeps
    holders: list[tuple[nn.Module, str, str, str]] = field(default_factory=list)  # (module, kind, attr, fqn)
    is_param: bool = True

    @property
    def nbytes(self) -> int:
        return self.obj.numel() * self.obj.element_size()


def _collect(model: nn.Module) -> dict[int, _TensorInfo]:
    infos: dict[int, _TensorInfo] = {}
    seen_holders = set()
    for prefix, m in model.named_modules(remove_duplicate=False):
        for kind, table in (("p", m._parameters), ("b", m._buffers)):
            for name, t in table.items():
                if t is None:
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                info = infos.get(id(t))
                if info is None:
                    info = infos[id(t)] = _TensorInfo(id(t), t, [], is_param=kind == "p")
                if fqn not in info.fqns:
                    info.fqns.append(fqn)
                h = (id(m), kind, name)
                if h not in seen_holders:
                    seen_holders.add(h)
                    info.holders.append((m, kind, name, fqn))
    storages: dict[Any, str] = {}
    for info in infos.values():
        ref = StorageWeakRef(info.obj.untyped_storage())
        if ref in storages:
            raise SpmdError(f"{info.fqns[0]} and {storages[ref]} share one storage but are different "
                            "tensors (views of one flat buffer, or a tie re-registered as a second tensor, as "
                            "accelerate's init_empty_weights does); init_weights needs one storage each. What to do: "
                            "tie them as one tensor before compiling (a transformers model: model.tie_weights(); or "
                            "build it under torch.device('meta')), or give each its own storage.")
        storages[ref] = info.fqns[0]
    return infos


# ---- events -----------------------------------------------------------------------------------

@dataclass(eq=False)
class _Event:
    index: int
    kind: str                            # "reset" | "init"
    module: nn.Module
    fqn: str
    fn: Callable[[nn.Module], Any]
    touched: set[int] = field(default_factory=set)
    writes: set[int] = field(default_factory=set)
    kills: set[int] = field(default_factory=set)
    uses: set[int] = field(default_factory=set)
    rng_ops: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    # a copy's event: it runs with the generator as event `rng_from` had it (the original's draws again, into the
    # copy's tensors), and leaves the generator where it was (a deep copy draws nothing)
    rng_from: int | None = None

    def describe(self) -> str:
        return f"{self.kind} {self.fqn or '<root>'} ({type(self.module).__name__})"


def _default_reset_fns() -> dict[type, Callable | None]:
    # torch modules whose __init__ ends with a private reset (after building their children)
    # (a parametrization's originals, and spectral_norm's draws, come with its module's reset:
    # `_through_parametrizations`)
    return {nn.MultiheadAttention: lambda m: m._reset_parameters(),
            nn.Transformer: lambda m: m._reset_parameters(),
            torch.nn.utils.parametrize.ParametrizationList: None,
            torch.nn.utils.parametrizations._SpectralNorm: None}


def _lookup(table: Mapping[type, Any], cls: type):
    for c in cls.__mro__:
        if c in table:
            return True, table[c]
    return False, None


@functools.lru_cache(maxsize=None)
def _construction_resets(cls: type) -> str:
    """Whether building `cls` calls its reset_parameters: "always", "never", or "maybe" (a module of the user's
    calling it under a condition, which a meta model cannot tell). An `__init__` along the MRO names it, or a
    method one calls through self does; torch's modules end their `__init__` with it. A module of the user's that
    defines it and does not call it (its tensors made with torch.zeros) was reset by the replay all the same, 2.12
    off, and every later draw shifted (found by a probe). Where a source cannot be read: "always", as before."""
    import ast
    import inspect
    import textwrap

    def names_reset(fn) -> bool:
        try:
            return "reset_parameters" in inspect.getsource(fn)
        except (OSError, TypeError):
            return False

    found = "never"
    for c in cls.__mro__:
        if c is nn.Module or c is object or "__init__" not in c.__dict__:
            continue
        if (c.__module__ or "").split(".")[0] == "torch":
            if names_reset(c.__init__):
                return "always"
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(c.__init__)))
        except (OSError, TypeError, SyntaxError):
            return "always"
        init = tree.body[0] if tree.body and isinstance(tree.body[0], ast.FunctionDef) else None
        if init is None or not init.args.args:
            return "always"
        me = init.args.args[0].arg                 # ("self", or whatever the first argument is called)
        top = {id(node.value) for node in init.body if isinstance(node, ast.Expr)}
        for node in ast.walk(init):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == me):
                continue
            helper = inspect.getattr_static(cls, node.func.attr, None)
            helper = getattr(helper, "__func__", helper)
            if node.func.attr == "reset_parameters" or (callable(helper) and names_reset(helper)):
                if id(node) in top:
                    return "always"
                found = "maybe"
    return found


_PARAMETRIZING = re.compile(r"^(weight_norm|spectral_norm|orthogonal|register_parametrization)$")
_KINDS = {"weight_norm": "_WeightNorm", "spectral_norm": "_SpectralNorm", "orthogonal": "_Orthogonal",
          "register_parametrization": "*"}  # (torch's function -> the class of the parametrization it registers)


def _registrations(fn, depth: int = 1) -> frozenset[tuple[str, str]]:
    """(parametrization class name, or "*" for any, `self` attribute it goes on) of each parametrization `fn`
    registers whatever its arguments: a call of torch's function by its name (`weight_norm(`,
    `nn.utils.parametrizations.weight_norm(`, Wav2Vec2's local `weight_norm = ...` then `weight_norm(...)`), under
    another (`wn = weight_norm` at module level), or a function or class of its module that makes one
    (`self.conv = WNConv1d(...)`), `depth` calls deep; the attribute is the assignment's (`self.conv = ...`,
    `self.convs = nn.ModuleList([...])`) or the call's first argument's (`weight_norm(self.conv)`), "" where neither.
    Only calls every run makes count: one under an `if` (both branches count where both make it), a conditional
    expression or `and`/`or` does not, nor a flag of that name (`weight_norm=False`; a review found both taken for
    registrations, and a parametrization registered after the build replayed at the wrong place, silently)."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    scope = getattr(fn, "__globals__", {})

    def self_attr(node) -> str:
        return node.attr if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
            node.value.id == "self" else ""

    def kinds(call: ast.Call) -> set[str]:
        name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        if _PARAMETRIZING.match(name) and not self_attr(call.func):
            return {_KINDS[name]}
        called = scope.get(call.func.id) if isinstance(call.func, ast.Name) else None
        if getattr(called, "__module__", "") in ("torch.nn.utils.parametrizations", "torch.nn.utils.parametrize") \
                and _PARAMETRIZING.match(getattr(called, "__name__", "")):
            return {_KINDS[called.__name__]}
        if isinstance(called, type) and (called.__module__ or "").split(".")[0] != "torch":
            called = called.__dict__.get("__init__")
        if depth and inspect.isfunction(called) and (called.__module__ or "").split(".")[0] != "torch":
            return {kind for kind, _ in _registrations(called, depth - 1)}
        return set()

    def unconditional_calls(node):
        if isinstance(node, (ast.IfExp, ast.BoolOp, ast.Lambda, ast.FunctionDef)):
            return
        if isinstance(node, ast.Call):
            yield node
        for child in ast.iter_child_nodes(node):
            yield from unconditional_calls(child)

    def visit(statements) -> set[tuple[str, str]]:
        found = set()
        for st in statements:
            if isinstance(st, ast.If):
                found |= visit(st.body) & visit(st.orelse)
            elif isinstance(st, (ast.With, ast.For, ast.While, ast.Try)):
                found |= visit(st.body)
            else:
                pairs = [(st, "")]
                if isinstance(st, ast.Assign) and len(st.targets) == 1:
                    target = st.targets[0]
                    pairs = list(zip(st.value.elts, target.elts)) if isinstance(target, ast.Tuple) and isinstance(
                        st.value, ast.Tuple) and len(target.elts) == len(st.value.elts) else [(st.value, target)]
                    pairs = [(value, self_attr(target)) for value, target in pairs]
                for part, target in pairs:  # (`self.a, self.b = wn(...), ...`: each value with its target)
                    for call in unconditional_calls(part):
                        attr = target or (self_attr(call.args[0]) if call.args else "")
                        found |= {(kind, attr) for kind in kinds(call)}
        return found

    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef) else tree.body
    return frozenset(visit(body))


@functools.lru_cache(maxsize=None)
def _registers_parametrizations(cls: type) -> frozenset[tuple[str, str]]:
    """What building `cls` registers on its children (`_registrations` of its `__init__`s along the MRO). Only for
    those did a child's reset run before the parametrization came, as Wav2Vec2's positional conv is drawn and then
    weight-normed; one registered on the built model came after any init of the model's too, which a meta model
    cannot replay."""
    return frozenset().union(*(_registrations(c.__init__) for c in cls.__mro__
                               if c is not nn.Module and c is not object and "__init__" in c.__dict__
                               and (c.__module__ or "").split(".")[0] != "torch"))


def _registered_when_built(model: nn.Module, m: nn.Module, fqn: str) -> bool:
    """Whether every parametrization of `m` (at `fqn`) was registered while the model was built: an ancestor's
    `__init__` registers one of its class on the attribute `m` is under (the parent's `self.conv`, or a
    grandparent's `self.convs` list of weight-normed convs, as HiFi-GAN builds them)."""
    parts = fqn.split(".") if fqn else []
    made = [(parts[k] if k < len(parts) else "", _registers_parametrizations(type(model.get_submodule(".".join(
        parts[:k]))))) for k in range(len(parts) - 1, -1, -1)]
    return all(any((kind, attr) in found or ("*", attr) in found for attr, found in made if attr)
               for kind in {type(chain[0]).__name__ for chain in m.parametrizations.values()})


def _through_parametrizations(fn: Callable[[nn.Module], Any], m: nn.Module) -> Callable[[nn.Module], Any]:
    """`fn` (a module's reset) run as construction ran it, before the parametrizations came: what it writes into
    a parametrized tensor (`self.weight`) goes to a plain tensor of that tensor's shape, from which the first
    parametrization is registered again, on the side (`_registered_again`), and its originals and state copied in:
    weight_norm's g and v from the drawn weight; spectral_norm's `_u` and `_v` drawn and iterated as its
    construction did. A tensor `fn` does not write, or whose parametrization holds state of another kind, keeps
    its originals (and is refused as set by nothing)."""
    parametrize = torch.nn.utils.parametrize
    with torch.no_grad():                        # (on the meta model, before any event records)
        shapes = {name: getattr(m, name).shape for name in m.parametrizations}

    @functools.wraps(fn)
    def run(m: nn.Module):
        plains = {}
        for name, shape in shapes.items():
            chain = m.parametrizations[name]
            first = chain.original if chain.is_tensor else chain.original0
            plains[name] = torch.empty(shape, dtype=first.dtype, device=first.device)
        keys = [(id(m), name) for name in plains]
        with parametrize.cached():
            parametrize._cache.update(zip(keys, plains.values()))
            try:
                result = fn(m)
            finally:
                for key in keys:
                    parametrize._cache.pop(key, None)
        with torch.no_grad():
            for name, plain in plains.items():
                if plain._version:
                    _registered_again(m.parametrizations[name], plain)
        return result

    return run


def _registered_again(chain, plain: torch.Tensor) -> None:
    """`chain`'s originals (and its first parametrization's buffers) as registering that parametrization on
    `plain` made them: torch's `ParametrizationList` built on the side (its right_inverse, then the consistency
    check's forward, which moves spectral_norm's power iteration on), the values copied into `chain`'s own."""
    parametrize = torch.nn.utils.parametrize
    first = chain[0]
    if isinstance(first, torch.nn.utils.parametrizations._SpectralNorm):  # (draws its u and v when made)
        again = type(first)(plain, getattr(first, "n_power_iterations", 1), first.dim, first.eps)
    elif next(iter(first.parameters()), None) is None and next(iter(first.buffers()), None) is None:
        again = first                            # (no state: weight_norm's, a user's symmetric map)
    else:
        return
    side = parametrize.ParametrizationList([again], plain, unsafe=chain.unsafe)
    if chain.is_tensor:
        chain.original.copy_(side.original)
    else:
        for i in range(chain.ntensors):
            getattr(chain, f"original{i}").copy_(getattr(side, f"original{i}"))
    if again is not first:
        for key, value in again.named_buffers():
            first.get_buffer(key).copy_(value)


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a else b


def _children(m: nn.Module):
    seen = set()
    for name, c in m._modules.items():
        if c is not None and id(c) not in seen:       # as Module.children(): once per parent
            seen.add(id(c))
            yield name, c


def _clones(m: nn.Module) -> dict[int, nn.Module]:
    """{id(copy): first copy} for the layers torch's TransformerEncoder / TransformerDecoder deep-copy from the
    one layer they are given (`_get_clones`): the given layer is built (drawing) before them and kept by none, so
    the first copy stands for it and the others draw its numbers again (`_as_copies`). Resetting each copy (the
    replay's walk) drew other values for every layer, and moved the generator on by as many layers (found by a
    probe: 0.60 off)."""
    layers = getattr(m, "layers", None)
    # (torch's own classes only: a subclass may build its layers itself, each drawing; a review)
    if type(m) not in (nn.TransformerEncoder, nn.TransformerDecoder) or not isinstance(layers, nn.ModuleList) \
            or len(layers) < 2:
        return {}
    first = layers[0]
    return {id(c): first for c in list(layers)[1:] if c is not first}


def _as_copies(originals: list[_Event], copies: list[_Event], copy: nn.Module, fqn: str) -> None:
    """Mark the events of a copy's walk (`copies`) to run as the original's did: each with the generator of its
    counterpart (the same draws into the copy's tensors, which are the copy's values without reading the
    original's: no group joins the layers), leaving the generator where it was. The walks must match, module
    type and tensor shapes, event for event; a layer changed since it was copied (another module put in, a peft
    adapter on some layers only) is refused: its values are no copy's."""
    def shape(ev: _Event):
        own = [*ev.module._parameters.items(), *ev.module._buffers.items()]
        return ev.kind, type(ev.module), tuple((n, tuple(t.shape), t.dtype) for n, t in own if t is not None)

    if [shape(e) for e in originals] != [shape(e) for e in copies]:
        raise SpmdError(
            f"{fqn} ({type(copy).__name__}) is a deep copy of the first layer of a TransformerEncoder/Decoder, made "
            "by its __init__, but it is no longer that copy (a module of it replaced or wrapped since), so a model "
            "built under torch.device('meta') cannot tell its values. What to do: build the model with "
            "spmd.deferred_init(Model, ...), which records the whole construction; or load its weights "
            "(load_safetensors).")
    for o, c in zip(originals, copies):
        c.rng_from = o.index if o.rng_from is None else o.rng_from


def _schedule(model, reset_fns, init_fn, init_roots, order="post", wrapped=None):
    events: list[_Event] = []
    wrapped = {id(model.get_submodule(f)): (f, kept, built) for f, (kept, built) in (wrapped or {}).items()}
    user = dict(reset_fns or {})
    defaults = _default_reset_fns()
    roots = {}
    for f, fn in (init_roots or {}).items():
        roots[id(model.get_submodule(f))] = fn
    constructed, initialized = set(), set()
    unknown = defaultdict(list)
    clones = {k: v for x in model.modules() for k, v in _clones(x).items()}
    spans: dict[int, tuple[int, int]] = {}  # id(module) -> the events its visit added (a clone's original's)

    def add(kind, m, fqn, fn):
        events.append(_Event(len(events), kind, m, fqn, fn))

    def reset_fn(m):
        found, fn = _lookup(user, type(m))
        if not found:
            found, fn = _lookup(defaults, type(m))
        if not found and callable(getattr(m, "reset_parameters", None)):
            called = _construction_resets(type(m))
            if called == "maybe":
                name = type(m).__name__
                raise SpmdError(
                    f"{name}.__init__ calls reset_parameters() only under a condition, and a model built under "
                    "torch.device('meta') cannot tell whether it ran. What to do: say it, reset_fns={"
                    f"{name}: {name}.reset_parameters}} if it ran, or reset_fns={{{name}: None}} if not (its "
                    "tensors then keep what __init__ made: give them an init_fn); or build the model with "
                    "spmd.deferred_init(Model, ...).")
            # (None where construction never calls it: its tensors keep what __init__ made, lost on meta)
            found, fn = True, type(m).reset_parameters if called == "always" else None
        return found, fn

    def reset_event(m, fqn):
        found, fn = reset_fn(m)
        if found and fn is not None:
            if torch.nn.utils.parametrize.is_parametrized(m) and _registered_when_built(model, m, fqn):
                fn = _through_parametrizations(fn, m)
            add("reset", m, fqn, fn)
        elif not found and (any(t is not None for t in m._parameters.values())
                            or any(t is not None for t in m._buffers.values())):
            unknown[type(m).__qualname__].append(fqn or "<root>")

    def early_events(m) -> tuple[dict[str, list], list]:
        """({child name: the draws `__init__` makes before building it}, draws left for the end), from a reset
        fn's `before_children` (its draws in source order, keyed by the child built next): a draw keyed by a
        child this module does not have (made under a branch not taken) goes with the next child it has, or
        before the reset fn itself."""
        early = getattr(reset_fn(m)[1], "before_children", None)
        if not early:
            return {}, []
        names = {n for n, _ in _children(m)}
        out, carry = {}, []
        for name, fn in early.items():
            carry.append(fn)
            if name in names:
                out[name], carry = carry, []
        return out, carry

    def as_built(m):
        """`m`'s children as construction saw them: a wrapper's, the modules it wraps."""
        kept = wrapped[id(m)][1] if id(m) in wrapped else None
        return [(n, c) for n, c in _children(m) if kept is None or n in kept]

    def visit(m, fqn, late=False):
        if id(m) in constructed:                 # a shared module is built once
            return
        if id(m) in wrapped and not late:        # (built later: what it wraps, now)
            for name, c in as_built(m):
                visit(c, _join(fqn, name))
            return
        constructed.add(id(m))
        if order == "pre":                       # for comparison only: named_modules() order
            reset_event(m, fqn)
        early, tail = early_events(m) if order == "post" else ({}, [])
        for name, c in _children(m):
            for fn in early.get(name, ()):
                add("reset", m, fqn, fn)
            if not late or name in wrapped[id(m)][2]:
                before = len(events)
                visit(c, _join(fqn, name))
                if id(c) in clones:              # a deep copy of a built module: the original's draws again
                    first = spans[id(clones[id(c)])]
                    _as_copies(events[first[0]:first[1]], events[before:], c, _join(fqn, name))
                spans[id(c)] = (before, len(events))
        for fn in tail:
            add("reset", m, fqn, fn)
        if order == "post":
            reset_event(m, fqn)
        if id(m) in roots:                       # transformers post_init: init the subtree once
            def walk(x, xfqn, fn_here):
                for n, c in as_built(x):
                    walk(c, _join(xfqn, n), roots.get(id(c), fn_here))
                if id(x) not in initialized and id(x) not in wrapped:
                    initialized.add(id(x))
                    add("init", x, xfqn, fn_here)
            walk(m, fqn, roots[id(m)])

    visit(model, "")
    for fqn, _, _ in list(wrapped.values()):
        visit(model.get_submodule(fqn), fqn, late=True)
    if init_fn is not None:                      # model.apply(init_fn), exactly its traversal
        def apply(x, xfqn):
            for n, c in _children(x):
                apply(c, _join(xfqn, n))
            add("init", x, xfqn, init_fn)
        apply(model, "")
    return events, dict(unknown)


# ---- the recorder -------------------------------------------------------------------------------

_KILL = {aten.normal_, aten.uniform_, aten.fill_, aten.zero_, aten.copy_, aten.random_, aten.exponential_,
         aten.bernoulli_, aten.geometric_, aten.cauchy_, aten.log_normal_}


def _schema_pairs(func, args, kwargs):
    schema = func._schema
    for i, a in enumerate(schema.arguments):
        if a.kwarg_only or i >= len(args):
            if a.name in kwargs:
                yield i, a, kwargs[a.name]
        else:
            yield i, a, args[i]


def _whole(t: torch.Tensor) -> bool:
    try:
        return (t.storage_offset() == 0 and t.is_contiguous()
                and t.numel() * t.element_size() == t.untyped_storage().nbytes())
    except Exception:
        return False


class _Recorder(TorchDispatchMode):
    """Maps every aten op argument to a model tensor (by storage) and classifies the touch."""

    def __init__(self):
        super().__init__()
        self.keys: dict[Any, int] = {}           # StorageWeakRef -> tensor key
        self.forbidden: dict[Any, str] = {}      # storages that must not be touched (meta originals)
        self.event: _Event | None = None
        self.skipped: str | None = None  # an nn.init function torch skips on meta, called by the event (its name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ev = self.event
        if ev is not None:
            pairs = list(_schema_pairs(func, args, kwargs))
            pairs.sort(key=lambda p: p[1].alias_info is not None and p[1].alias_info.is_write)  # reads first
            for i, a, v in pairs:
                for t in (v if isinstance(v, (list, tuple)) else (v,)):
                    if not isinstance(t, torch.Tensor):
                        continue
                    alias = a.alias_info
                    if alias is not None and not alias.is_write:
                        continue                 # a view reads nothing
                    ref = StorageWeakRef(t.untyped_storage())
                    if ref in self.forbidden:
                        raise SpmdError(
                            f"{ev.describe()} touched {self.forbidden[ref]!r}, which the meta dry run did not see "
                            f"it touch ({func}): its init depends on values (data-dependent control flow)")
                    key = self.keys.get(ref)
                    if key is None:
                        continue
                    first = key not in ev.touched
                    if alias is not None and alias.is_write:
                        ev.writes.add(key)
                        # (an `out=` argument is written whole, its old value unread where the op reads it not
                        # as an input too (`first`): `nn.init.eye_` writes through `aten.eye.out`, and its weight was
                        # refused as read before written; found by a probe)
                        if first and ((i == 0 and func.overloadpacket in _KILL) or a.is_out) and _whole(t):
                            ev.kills.add(key)
                        elif key not in ev.kills:
                            ev.uses.add(key)
                        ev.touched.add(key)
                    else:                        # a read of the value
                        if key not in ev.kills:
                            ev.uses.add(key)
                        ev.touched.add(key)
            if torch.Tag.nondeterministic_seeded in func.tags:
                shapes = tuple(tuple(t.shape) for t in args if isinstance(t, torch.Tensor))
                ev.rng_ops.append((str(func.overloadpacket.__name__), shapes))
        return func(*args, **kwargs)


# ---- the dry run ---------------------------------------------------------------------------------

def dry_run(meta_model: nn.Module, *, init_fn: Callable | None = None,
              reset_fns: Mapping[type, Callable | None] | None = None,
              init_roots: Mapping[str, Callable] | None = None,
              discard_writes: Iterable[str] = (), tied_reset_owner: str | None = None, order: str = "post",
              wrapped: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] | None = None):
    """Dry-run the replay on the meta model: (tensors, events with what each touched, classes of modules
    with tensors and no reset, which slots each event writes to scratch). See `init_weights.init_local_shards`
    for the arguments. order="pre" (resets in named_modules() pre-order) exists to show where it departs
    from construction."""
    infos = _collect(meta_model)
    for info in infos.values():
        if not info.obj.is_meta:
            path, _, leaf = info.fqns[0].rpartition(".")
            raise SpmdError(
                f"{info.fqns[0]} is on {info.obj.device}, not meta: its module made it there although the model was "
                "built under torch.device('meta') (the legacy constructor `torch.Tensor(n)`, as transformers' "
                "Wav2Vec2 uses, ignores it). What to do: build the model with spmd.deferred_init(Model, ...), which "
                "records its construction (not for a transformers model); for a transformers model, move it to meta "
                f"before compiling (`{f'model.get_submodule({path!r})' if path else 'model'}.{leaf} = "
                "nn.Parameter(t.to('meta'))`, the same for a buffer), and init_weights redoes what its __init__ did "
                "where it can read it; or load the weights from a checkpoint.")
    if order not in ("post", "pre"):
        raise SpmdError("order: 'post' or 'pre'")
    events, unknown = _schedule(meta_model, reset_fns, init_fn, init_roots, order, wrapped)
    # which (module, kind, attr) slots write to scratch in which events
    discard_fqns = set(discard_writes)
    slot_names = defaultdict(set)                  # slot -> every fqn naming it
    for prefix, m in meta_model.named_modules(remove_duplicate=False):
        for kind, table in (("p", m._parameters), ("b", m._buffers)):
            for name, t in table.items():
                if t is not None:
                    slot_names[(id(m), kind, name)].add(_join(prefix, name))
    unknown_discard = discard_fqns - set().union(*slot_names.values()) if slot_names else discard_fqns
    if unknown_discard:
        raise SpmdError(f"discard_writes names no parameter or buffer: {sorted(unknown_discard)}")
    always = {s for s, names in slot_names.items() if names & discard_fqns}
    reset_only = set()
    if tied_reset_owner in ("first", None):
        for info in infos.values():
            for (m, kind, attr, fqn) in info.holders[1:]:
                reset_only.add((id(m), kind, attr))
    elif tied_reset_owner != "all":
        raise SpmdError("tied_reset_owner: 'first', 'all' or None")
    discard = {ev.index: always | (reset_only if ev.kind == "reset" else set()) for ev in events}
    # dry run
    rec = _Recorder()
    rec.keys = {StorageWeakRef(i.obj.untyped_storage()): k for k, i in infos.items()}
    slots = [(m._parameters if kind == "p" else m._buffers, attr)
             for info in infos.values() for (m, kind, attr, _) in info.holders]
    rng_before = torch.get_rng_state()
    try:
        with rec, _skips_refused(rec):
            for ev in events:
                saved = []
                try:
                    for info in infos.values():
                        for (m, kind, attr, _) in info.holders:
                            if (id(m), kind, attr) in discard[ev.index]:
                                table = m._parameters if kind == "p" else m._buffers
                                o = info.obj
                                s = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device="meta")
                                saved.append((table, attr, table[attr]))
                                table[attr] = nn.Parameter(s, requires_grad=o.requires_grad) if kind == "p" else s
                    before = [(table, attr, table[attr]) for table, attr in slots]
                    rec.event, rec.skipped = ev, None
                    with torch.no_grad():
                        ev.fn(ev.module)
                    _refuse_skipped(rec)
                    for table, attr, obj in before:
                        if table[attr] is not obj:
                            table[attr] = obj
                            raise SpmdError(
                                f"{ev.describe()} replaced {attr!r} of a module with a new tensor instead of writing "
                                "into it; write in place (tensor.normal_(), nn.init.*_) instead")
                except SpmdError:
                    raise
                except Exception as e:
                    _refuse_skipped(rec)  # (what failed after a skipped init is its doing)
                    raise SpmdError(f"{ev.describe()} failed on the meta device: {type(e).__name__}: {e}. "
                                           "An init that needs real values (.item(), data-dependent branches) "
                                           "cannot be planned on meta.") from e
                finally:
                    rec.event = None
                    for table, attr, old in reversed(saved):
                        table[attr] = old
    finally:
        torch.set_rng_state(rng_before)
    if tied_reset_owner is None:
        _refuse_unknown_tie_makers(infos, events, always)
    return infos, events, unknown, discard


# nn.init functions torch returns from at once on a meta tensor, before drawing: the dry run would see them write
# and draw nothing, and the replay, on real values, would draw numbers the plan never counted (found by a probe: an
# init_fn with orthogonal_ came out 0.48-1.06 off, and every later draw shifted)
_SKIPPED_ON_META = ("orthogonal_", "sparse_", "dirac_")


def _trunc_normal_on_meta(original):
    """torch's `_no_grad_trunc_normal_`, which returns at once on a meta tensor, made to show the dry run what it
    does on values: it overwrites the whole tensor with random draws (a normal_ or uniform_, then redraws of the
    rejected values, as many as the values ask for: the real pass runs it on values and draws exactly those). Without
    this an event that only calls `trunc_normal_` (a timm-style init_fn, transformers' ViT post_init) was seen to
    touch nothing and was skipped, so the tensor kept its reset values and every later draw moved (0.28 off)."""
    @functools.wraps(original)
    def trunc_normal(tensor, mean, std, a, b, generator=None):
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            with torch.no_grad():
                return tensor.normal_(mean, std, generator=generator)
        return original(tensor, mean, std, a, b, generator=generator)
    return trunc_normal


_here = threading.local()  # .rec: this thread's dry run's recorder, while it replays


def _noted(name: str, original):
    """nn.init's `name` as the dry run calls it: a call on a meta tensor noted on this thread's recorder."""
    @functools.wraps(original)
    def init(tensor, *args, **kwargs):
        rec = getattr(_here, "rec", None)
        if rec is not None and rec.event is not None and rec.skipped is None and isinstance(tensor, torch.Tensor) \
                and tensor.is_meta:
            rec.skipped = name
        return original(tensor, *args, **kwargs)
    return init


def _init_patched() -> dict:
    originals = {name: getattr(nn.init, name) for name in (*_SKIPPED_ON_META, "_no_grad_trunc_normal_")}
    for name in _SKIPPED_ON_META:
        setattr(nn.init, name, _noted(name, originals[name]))
    nn.init._no_grad_trunc_normal_ = _trunc_normal_on_meta(originals["_no_grad_trunc_normal_"])
    return originals


def _init_restored(originals: dict) -> None:
    for name, original in originals.items():
        setattr(nn.init, name, original)


# (dry runs in two threads: the first to enter patches, the last to leave restores; a review found two overlapping
# ones leaving trunc_normal_ patched for good)
_INIT_PATCH = SharedPatch(_init_patched, _init_restored)


@contextlib.contextmanager
def _skips_refused(rec: "_Recorder"):
    """`nn.init.orthogonal_`, `sparse_` and `dirac_` refused on a meta tensor while the dry run replays an event;
    `trunc_normal_` shown as the draw it is (`_trunc_normal_on_meta`, through the module function every binding of
    `trunc_normal_` calls). For the refusals, two ways: the functions on `nn.init` are replaced while any thread's dry run
    replays (`_INIT_PATCH`; a call noted on this thread's recorder), and, where no profiler runs, a profile function notes a call of their code however it was
    bound (`from torch.nn.init import
    orthogonal_`; transformers' `initialization` keeps torch's own in a table). A profiler that runs (cProfile,
    torch.profiler with stacks: C-level, which a Python profile function cannot chain to) is left alone, and a
    function bound by name is not seen then (a review found the first version breaking both). The refusal is
    raised once the event's function returns (`_Recorder.skipped`, `_refuse_skipped`)."""
    import sys

    with _INIT_PATCH:
        originals = _INIT_PATCH.saved  # (torch's own, also while another thread's dry run has them patched)
        codes = {originals[name].__code__: name for name in _SKIPPED_ON_META}

        def profile(frame, event, arg):
            if event == "call" and frame.f_code in codes and rec.event is not None and rec.skipped is None:
                tensor = frame.f_locals.get("tensor")
                if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                    rec.skipped = codes[frame.f_code]

        outer, _here.rec = getattr(_here, "rec", None), rec
        watching = sys.getprofile() is None
        if watching:
            sys.setprofile(profile)
        try:
            yield
        finally:
            if watching:
                sys.setprofile(None)
            _here.rec = outer


def _refuse_skipped(rec: "_Recorder") -> None:
    if rec.skipped is not None:
        raise SpmdError(
            f"{rec.event.describe()} calls nn.init.{rec.skipped}, which torch skips on the meta device (it returns "
            "before drawing anything), so the replay cannot see what it writes or draws. What to do: build the model "
            "with spmd.deferred_init(Model, ...), which records the construction on real values and replays it; or "
            "initialize those weights with another nn.init function.")


def _holder(module: nn.Module, fqn: str) -> str:
    """"Embedding tok_emb": the class and path of the module holding `fqn`."""
    return f"{type(module).__name__} {fqn.rpartition('.')[0] or '<root>'}"


def _refuse_unknown_tie_makers(infos: dict[int, _TensorInfo], events: list[_Event], discarded: set) -> None:
    """A tied tensor two modules' resets write, and no init_fn overwrites after: its values are those of the
    module that made it, which a meta model cannot tell (`lm_head.weight = wte.weight` or the other way,
    nanoGPT's). Found by a probe: nanoGPT's tie came out with the embedding's init, 4.01 off."""
    resets = {id(ev.module) for ev in events if ev.kind == "reset"}
    overwritten = set().union(*(ev.kills for ev in events if ev.kind == "init")) if events else set()
    for info in infos.values():
        makers = [(m, fqn) for (m, kind, attr, fqn) in info.holders
                  if (id(m), kind, attr) not in discarded and id(m) in resets]
        if len(makers) < 2 or info.key in overwritten:
            continue
        (a, fa), (b, fb) = makers[:2]
        raise SpmdError(
            f"init_weights: {fa} and {fb} are one tensor, and the reset_parameters of both {_holder(a, fa)} and "
            f"{_holder(b, fb)} write it. On a model built under torch.device('meta') the tie does not say which "
            "module made the tensor, and that decides its values. What to do: build the model with "
            "spmd.deferred_init(Model, ...), which records its construction; or say which made it: "
            f"tied_reset_owner='first' (the tie was made as `{fb} = {fa}`) or 'all' (made as `{fa} = {fb}`, "
            "nanoGPT's way: the last reset wins).")
