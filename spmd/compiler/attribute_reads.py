"""The plain attributes of the model's modules that their forward reads, and a guard on their values.

A trace turns what the forward reads from its modules into constants of the graph: a temperature
(`self.temperature`, annealed by the training loop through `model.set_gumbel_temperature(t)`), a dropout
probability (`nn.Dropout.p`), a flag (`self.gradient_checkpointing`), a layer-drop rate. Set on the model
after compiling, the new value reaches nothing: the compiled module goes on with the old one, silently
(torch.compile guards on them and recompiles; spmd compiles once).

`forward_reads(cls)` reads the bytecode of a module class's `forward` (through its decorators, each class of
its MRO, and the methods it calls on `self`, transitively) for the attributes it reads through `self`, less
those it writes (a counter the forward keeps is state, not a constant), and one object further
(`self.config.temperature`, an attribute of a configuration object the module holds). Reading the code instead of watching
the trace leaves the model's classes alone (a recording subclass changed what `type(self.act) is Act` said
while tracing) and covers every layer, stamped or traced. It over-approximates where a branch the trace did
not take reads an attribute, and misses reads through `getattr(self, name)` or an alias of `self`.
`AttributeGuard` holds the plain values (None, bools, numbers, strings, dtypes, devices, tuples of them;
`training` aside: `CompiledModule` checks the mode itself) of those attributes on the user's model when
compiled, and names any that changed when the compiled module is called. A plain tensor attribute (not a
parameter or buffer: `self.scale = torch.tensor(2.0)`) is a constant of the graph too; it is watched by
identity and version counter, so one set in place (`model.scale.fill_(3.0)`) or replaced is named, unless it
holds the same values. So is a dict, list or tuple of such values and tensors (a LoRA layer's `self.scaling =
{"default": 2.0}`, a table of tensors), up to `_LEAVES` leaves, unless the module's forward changes any
container in place (stores an item, calls `append` or `update` on anything: its containers may be state it
keeps, and bytecode does not say which). A property the forward reads is read through: what its getter reads
is watched (`self.disable_adapters` returning `self._disabled`).
"""
from __future__ import annotations

import dis
import functools
import inspect
import sysconfig
import types
import warnings
from copy import deepcopy

import torch

from spmd.compiler.call import PLAIN_TYPES
from spmd.core.errors import SpmdError, user_stacklevel

_SELF_LOADS = ("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE")
_ATTR_LOADS = ("LOAD_ATTR", "LOAD_METHOD")
# what changes a dict, list or set in place: an item stored, or a method of theirs that changes them
_ITEM_STORES = ("STORE_SUBSCR", "DELETE_SUBSCR", "STORE_SLICE", "DELETE_SLICE")
_REBINDS = ("STORE_FAST", "STORE_DEREF", "DELETE_FAST", "DELETE_DEREF")
_MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "popitem",
                       "add", "discard", "sort", "reverse", "__setitem__", "__delitem__"})
CHANGES_CONTAINERS = "[]"  # (among a scan's writes: the code changes some container in place)


def plain(value) -> bool:
    """A value a trace fixes as a constant: `call.PLAIN_TYPES`, or a tuple of them (immutable: a list changed in
    place would be the same object, compared with itself)."""
    return isinstance(value, PLAIN_TYPES) or (isinstance(value, tuple) and all(plain(v) for v in value))


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _scan(fn, me: str | None = None) -> tuple[set[str], set[str]]:
    """(attributes read through `self`, attributes stored anywhere) in `fn` and the functions nested in it. A
    read further (`self.config.pad_token_id`, `self.cfg.attn.scale`) is each of its prefixes: "config.pad_token_id"
    as well as "config", `_CHAIN` attributes deep."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None or not (me or code.co_varnames):
        return set(), set()
    me = me or code.co_varnames[0]  # (the method's self, by whatever name)
    reads, writes = set(), set()
    codes = list(_codes(code))
    packed = {n for c in codes for n in _packed(c)}
    rebound = {ins.argval for c in codes for ins in dis.get_instructions(c) if ins.opname in _REBINDS}
    for c in codes:
        fresh = ({*_packed(c)} | ({*c.co_freevars} & packed)) - rebound  # (this call's own; `kwargs = self.d` not)
        before = previous = None
        chain = None  # (the attributes read one after another from `self` just before: ["sched", "inner"])
        for ins in dis.get_instructions(c):
            if ins.opname in _ATTR_LOADS and previous is not None and previous.opname in _SELF_LOADS \
                    and previous.argval == me:
                reads.add(ins.argval)
                chain = [ins.argval] if ins.opname == "LOAD_ATTR" else None
            elif ins.opname == "LOAD_ATTR" and chain is not None and previous.opname == "LOAD_ATTR" \
                    and len(chain) < _CHAIN:
                chain.append(ins.argval)
                reads.add(".".join(chain))
            else:
                chain = None
            if ins.opname in ("STORE_ATTR", "DELETE_ATTR"):
                writes.add(ins.argval)
            if ins.opname in _ATTR_LOADS and ins.argval in _MUTATORS and previous is not None:
                if previous.opname in _SELF_LOADS and previous.argval in fresh:
                    pass  # (the call's own `*args`/`**kwargs`)
                elif previous.opname == "LOAD_ATTR" and before is not None and before.opname in _SELF_LOADS \
                        and before.argval == me:
                    writes.add(previous.argval)  # (`self.merged_adapters.pop()`: that container is state)
                else:
                    writes.add(CHANGES_CONTAINERS)  # (on what, bytecode does not say: an alias, a key computed)
            elif ins.opname in _ITEM_STORES:
                writes.add(CHANGES_CONTAINERS)
            before, previous = previous, ins
    return reads, writes


_CHAIN = 4  # (attributes read one after another through `self`: `self.cfg.model.attn.scale`)


def _packed(code: types.CodeType) -> tuple[str, ...]:
    """The names of `code`'s `*args` and `**kwargs`: containers each call makes anew, so a method that changes
    them (peft's LoRA layers: `kwargs.pop("adapter_names", None)`) changes nothing the module keeps (found by a
    probe: that pop left a LoRA layer's `scaling` unwatched, and `set_scale` after compiling went unseen)."""
    at = code.co_argcount + code.co_kwonlyargcount
    names = []
    for flag in (inspect.CO_VARARGS, inspect.CO_VARKEYWORDS):
        if code.co_flags & flag:
            names.append(code.co_varnames[at])
            at += 1
    return tuple(names)


@functools.cache
def forward_reads(cls: type) -> frozenset[str]:
    """The attributes `cls`'s forward reads through `self` and never writes, over its MRO (a `super()` call
    reaches the base's forward) and the methods it calls on `self`."""
    return frozenset(_constants(*_reads_and_writes(cls)))


def _constants(reads, writes) -> set[str]:
    """The reads the code never writes: constants of the graph (the mode is checked on its own). A read through
    an object, `self.config.problem_type`, whose last part the code also writes, is state too."""
    return {r for r in set(reads) - set(writes) - {"training"} if r.rpartition(".")[2] not in writes}


@functools.cache
def changes_containers(cls: type) -> bool:
    """Whether `cls`'s forward (or what it calls on `self`) stores an item, or calls a method such as `append`
    or `update`, on anything: then a dict or list it reads may be state it keeps (`self.counts["n"] += 1`,
    through an alias, under a computed key), and none of its containers is watched."""
    return CHANGES_CONTAINERS in _reads_and_writes(cls)[1]


@functools.cache
def reads_training(cls: type) -> bool:
    """Whether `cls`'s forward reads its module's mode (`self.training`: dropout, batch norm, an attention's
    dropout rate), so that the module's mode, as traced, is in the graph."""
    return "training" in _reads_and_writes(cls)[0]


GRAD_MODE_READS = frozenset({"is_grad_enabled", "is_inference_mode_enabled"})
GRAD_FLAG_READS = frozenset({"requires_grad"})


def grad_mode_reader(root: torch.nn.Module) -> str | None:
    """The first module of `root` (its path, or its class's name) whose forward, the methods it calls on `self`,
    the plain functions those call by name, or a forward hook on it, asks torch whether grad is on
    (`torch.is_grad_enabled()`, `torch.is_inference_mode_enabled()`); None where none does. The code of torch's
    own modules is not looked at (their fast paths under no_grad compute the same values); a hook on one is."""
    return _first_reader(root, GRAD_MODE_READS)


def grad_flag_reader(root: torch.nn.Module) -> str | None:
    """As `grad_mode_reader`, for code that reads a tensor's `requires_grad` (`if x.requires_grad:`): a forward
    that may branch on whether an input requires grad, which the graph fixed as the example input's."""
    return _first_reader(root, GRAD_FLAG_READS)


def _first_reader(root: torch.nn.Module, names: frozenset[str]) -> str | None:
    for path, module in root.named_modules():
        own = (module.__dict__.get("forward"), *module._forward_pre_hooks.values(), *module._forward_hooks.values())
        if _class_reads(type(module), names) or any(_reads_names(h, names) for h in own if h is not None):
            return path or type(module).__name__
    return None


@functools.cache
def _class_reads(cls: type, names: frozenset[str]) -> bool:
    return any(_reads_names(fn, names) for fn in _walk(cls)[2]
               if not (getattr(fn, "__module__", None) or "").startswith("torch."))


def _reads_names(fn, names: frozenset[str], depth: int = 2) -> bool:
    """Whether `fn`, or a plain function it calls by name (`depth` deep, torch's aside), reads one of `names` as
    a global or an attribute (found by a review: a helper's `torch.is_grad_enabled()` went unseen)."""
    return any(ins.argval in names for f in _called(getattr(fn, "__func__", fn), depth) for c in _codes(f.__code__)
               for ins in dis.get_instructions(c)
               if ins.opname in _ATTR_LOADS or ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"))


def _called(fn, depth: int, torch_too: bool = False) -> list:
    """`fn` (unwrapped) and the plain functions it calls by name (a global holding a Python function), and those
    they call, `depth` deep, each once, nearest first; torch's own (and those of no module) left out unless
    `torch_too`. The one walk behind every scan here that follows helpers."""
    found, todo, seen = [], [(inspect.unwrap(fn), 0)], set()
    while todo:
        f, level = todo.pop(0)
        if f in seen or not isinstance(getattr(f, "__code__", None), types.CodeType):
            continue
        seen.add(f)
        found.append(f)
        if level == depth:
            continue
        for c in _codes(f.__code__):
            for ins in dis.get_instructions(c):
                callee = getattr(f, "__globals__", {}).get(ins.argval) if ins.opname == "LOAD_GLOBAL" else None
                if isinstance(callee, types.FunctionType) and \
                        (torch_too or not (getattr(callee, "__module__", None) or "torch").startswith("torch")):
                    todo.append((inspect.unwrap(callee), level + 1))
    return found


def hooks_read_training(module: torch.nn.Module) -> bool:
    """Whether a forward hook or pre-hook on `module` (a function: it reads through its first argument, the module)
    reads the module's mode (`out * 1.5 if m.training else out`): traced into the graph, as its forward's reads
    are (found by a probe)."""
    return any("training" in _scan(hook)[0] for hook in (*module._forward_pre_hooks.values(),
                                                         *module._forward_hooks.values())
               if isinstance(hook, types.FunctionType))


@functools.cache
def _reads_and_writes(cls: type, start: str = "forward") -> tuple[frozenset[str], frozenset[str]]:
    reads, writes, _ = _walk(cls, start)
    return reads, writes


@functools.cache
def _walk(cls: type, start: str = "forward") -> tuple[frozenset[str], frozenset[str], tuple]:
    """(attributes read through `self`, attributes stored, the functions read) from `cls`'s `start` method,
    over its MRO and the methods it calls on `self`."""
    reads, writes, todo, done, fns = set(), set(), [start], set(), []
    while todo:
        name = todo.pop()
        if name in done:
            continue
        done.add(name)
        for klass in cls.__mro__:
            if klass in (torch.nn.Module, object):
                continue
            fn = klass.__dict__.get(name)
            if isinstance(fn, (staticmethod, classmethod)):
                fn = fn.__func__
            elif isinstance(fn, property):  # (its getter reads what the forward reads through it)
                fn = fn.fget
            if not callable(fn):
                continue
            r, w = _scan(fn)
            fns.append(fn)
            reads |= r
            writes |= w
            todo.extend(n for n in r if _code_behind(inspect.getattr_static(cls, n, None)) and n not in done)
    return frozenset(reads), frozenset(writes), tuple(fns)


@functools.cache
def _outside_reads(fn, depth: int = 2) -> list[tuple[object, str, tuple]]:
    """The names `fn` (and the code nested in it) reads from outside itself and never writes: (its module's
    globals, name, ()) for each global (`AUX_WEIGHT` in a loss function, annealed by the training loop), (the
    cell, name, ()) for each variable of an enclosing function it reads (a closure's `weight`); and those of the
    plain functions it calls by name, `depth` deep (a helper reading a global: found by a review), torch's aside.
    A global or variable that holds an object, a dict or a list comes with the path read through it, attribute
    by attribute or by a constant key (`args.aux_weight`: ("args", (("attr", "aux_weight"),)); `CFG["lam"]`;
    a config module's `cfg.lam`; found by a probe: those went unwatched, 0.14 off after 3 steps). A trace
    fixes what they held as constants of the graph. What a helper writes through a global (`_globals_written`)
    is state, not read."""
    kept = _globals_written(inspect.unwrap(fn), depth + 3)  # (each reader's own callees, 3 deep; a review)
    return [(where, name, path) for f in _called(fn, depth) for where, name, path in _own_outside_reads(f)
            if not isinstance(where, dict) or not _kept(path, kept.get(name, ()))]


def _own_outside_reads(fn) -> list[tuple[object, str, tuple]]:
    """`_outside_reads` of `fn`'s own code, functions it calls aside (they are read on their own)."""
    code = fn.__code__
    loads, stores, paths, through = set(), set(), {}, {}  # through: key -> the first steps written through it
    for c in _codes(code):
        instructions = list(dis.get_instructions(c))
        for at, ins in enumerate(instructions):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                key = ("global", ins.argval)
            elif ins.opname in ("LOAD_DEREF", "LOAD_CLASSDEREF") and c is code:
                key = ("cell", ins.argval)
            else:
                if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                    stores.add(("global", ins.argval))
                elif ins.opname in ("STORE_DEREF", "DELETE_DEREF"):
                    stores.add(("cell", ins.argval))
                continue
            loads.add(key)
            if (step := _written_through(instructions, at + 1)) is not None:  # (`STATS.calls += 1`: state)
                through.setdefault(key, set()).add(step)
            paths.setdefault(key, set()).add(_path_read(instructions, at + 1))
    cells = dict(zip(code.co_freevars, getattr(fn, "__closure__", None) or ()))
    found = []
    for kind, name in sorted(loads - stores):
        constant = sorted((p for p in paths[kind, name] if not _kept(p, through.get((kind, name), ()))), key=repr)
        if kind == "global":
            value = getattr(fn, "__globals__", {}).get(name, _NONE)
            if value is not _NONE and not isinstance(value, types.FunctionType):
                found += [(fn.__globals__, name, p) for p in constant]
        elif name in cells:
            found += [(cells[name], name, p) for p in constant]
    return found


def _kept(path: tuple, steps) -> bool:
    """Whether `path`, read through a global or variable, leads to state its readers' code keeps there: `steps`
    holds the first steps written through it (`("attr", "calls")` for `STATS.calls += 1`), `ALL` for the whole of
    it (a global assigned, an item under a key not known)."""
    return ALL in steps or (bool(path) and path[0] in steps)


ALL = ("all",)


def _path_read(instructions: list, at: int) -> tuple:
    """The attributes and constant keys read one after another from `instructions[at]` on (after the load of a
    global or a variable): `(("attr", "aux_weight"),)`, `(("item", "lam"),)`; () for none."""
    path = []
    while at < len(instructions):
        ins = instructions[at]
        if ins.opname == "LOAD_ATTR":
            path.append(("attr", ins.argval))
            at += 1
        elif ins.opname == "LOAD_CONST" and at + 1 < len(instructions) and \
                instructions[at + 1].opname == "BINARY_SUBSCR" and plain(ins.argval):
            path.append(("item", ins.argval))
            at += 2
        else:
            break
    return tuple(path)


def _written_through(instructions: list, at: int) -> tuple | None:
    """The first step (`("attr", "calls")`, `("item", "n")`, `ALL`) through which the value loaded just before
    `instructions[at]` (a global's or a variable's) is written by the instructions that follow, before anything
    is called or loaded by name: an attribute or an item set on it or on what is read from it (`STATS.calls += 1`,
    `CFG["n"] = v`, `STATS.hist[0] = x`); None where it is not, or a value read from it is stored into another
    object (`h[:, 0] = CFG["w"]`). The stack is followed where those instructions move it."""
    # each entry: None (another value), ("const", v), ROOT (the value itself), or the first step read from it
    ROOT, stack = ("root",), [("root",)]

    def first(entry, step):
        return step if entry == ROOT else entry

    for ins in instructions[at:]:
        op, arg = ins.opname, ins.arg
        if op in ("STORE_ATTR", "DELETE_ATTR"):
            obj = stack[-1] if stack else None
            return first(obj, ("attr", ins.argval)) if obj is not None and obj[0] != "const" else None
        if op in ("STORE_SUBSCR", "DELETE_SUBSCR"):
            key, obj = (stack[-1], stack[-2]) if len(stack) >= 2 else (None, None)
            if obj is None or obj[0] == "const":
                return None
            return first(obj, ("item", key[1]) if key is not None and key[0] == "const" else ALL)
        if op == "LOAD_ATTR" and stack:
            top = stack[-1]
            stack[-1] = first(top, ("attr", ins.argval)) if top is not None and top[0] != "const" else None
        elif op == "BINARY_SUBSCR" and len(stack) >= 2:
            key, obj = stack.pop(), stack.pop()
            stack.append(first(obj, ("item", key[1]) if key is not None and key[0] == "const" else ALL)
                         if obj is not None and obj[0] != "const" else None)
        elif op == "LOAD_CONST":
            stack.append(("const", ins.argval))
        elif op == "LOAD_FAST":
            stack.append(None)
        elif op in ("BINARY_OP", "COMPARE_OP") and len(stack) >= 2:
            stack[-2:] = [None]
        elif op == "COPY" and len(stack) >= arg:
            stack.append(stack[-arg])
        elif op == "SWAP" and len(stack) >= arg:
            stack[-1], stack[-arg] = stack[-arg], stack[-1]
        else:
            return None
    return None


@functools.cache
def _globals_written(fn, depth: int = 3, own: bool = False) -> dict[str, frozenset]:
    """name -> the first steps written through it (`_written_through`; `ALL` for a global assigned) of the globals
    the plain functions `fn` calls by name (and those they call, `depth` deep) write, and with `own` those `fn`
    itself writes: state the forward keeps through them (found by a review: `_LOGGED`, set by a log-once helper
    the forward calls, was watched, and an eager call of the model made the compiled one refuse; a counter
    `STATS.calls` bumped by a helper). A training loop that sets a global is no function the forward calls:
    what it sets stays watched."""
    written = {}
    for k, f in enumerate(_called(fn, depth, torch_too=True)):
        if k == 0 and not own:
            continue
        for c in _codes(f.__code__):
            instructions = list(dis.get_instructions(c))
            for at, ins in enumerate(instructions):
                if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                    written.setdefault(ins.argval, set()).add(ALL)
                elif ins.opname == "LOAD_GLOBAL" and (step := _written_through(instructions, at + 1)):
                    written.setdefault(ins.argval, set()).add(step)
    return {name: frozenset(steps) for name, steps in written.items()}


def _function_of(callable_) -> object | None:
    """The Python function a loss_fn that is not a module runs: itself, a partial's, a bound method's, or a
    callable object's `__call__`."""
    while isinstance(callable_, functools.partial):
        callable_ = callable_.func
    if isinstance(callable_, types.MethodType):
        return callable_.__func__
    if isinstance(callable_, types.FunctionType):
        return callable_
    call = getattr(type(callable_), "__call__", None)
    return call if isinstance(call, types.FunctionType) else None


def _outside_value(where, name: str, path: tuple = ()):
    """What a global or a cell holds now, or what is read through it along `path`, where plain, else a marker."""
    value = _outside_object(where, name, path)
    return value if value is not _NONE and plain(value) else _NONE


def _outside_object(where, name: str, path: tuple = ()):
    """What a global or a cell holds now, or what is read through it along `path`, else a marker. Read through
    an installed package's module or the standard library's (`torch.float32`, `math.pi`): a marker (not the
    user's to change)."""
    if isinstance(where, dict):
        value = where.get(name, _NONE)
    else:
        try:
            value = where.cell_contents
        except ValueError:  # (a cell not filled yet)
            return _NONE
    if path and isinstance(value, types.ModuleType) and not _users_module(value):
        return _NONE
    for kind, key in path:
        try:
            value = getattr(value, key) if kind == "attr" else value[key]
        except Exception:  # (a read the forward guards, an entry gone: nothing to compare)
            return _NONE
    return value


def _users_module(module: types.ModuleType) -> bool:
    """A module of the user's own code (a config module), not an installed package's or the standard library's."""
    path = getattr(module, "__file__", None) or ""
    return bool(path) and not any(part in path for part in ("site-packages", "dist-packages")) and \
        not path.startswith(_STDLIB)


_STDLIB = sysconfig.get_paths()["stdlib"]


def _shown_path(name: str, path: tuple) -> str:
    return name + "".join(f".{key}" if kind == "attr" else f"[{key!r}]" for kind, key in path)


def _code_behind(attribute) -> bool:
    """Whether reading `attribute` on an instance runs the class's code: a method, or a property's getter."""
    return callable(attribute) or isinstance(attribute, property)


_NONE = object()


def _holder(module, name: str):
    """(the object holding the attribute `name` reads, its last part): `module` itself, or for "config.x" the
    plain object `module.config` (a model's configuration: not a module or tensor, which are watched apart,
    nor a plain value), for "cfg.attn.x" `module.cfg.attn` (each a plain object), or None."""
    first, _, last = name.rpartition(".")
    if not first:
        return module, name
    sub = getattr(module, "_modules", {}).get(first) if "." not in first else None
    if sub is not None:  # (a submodule's attribute, `self.fc1.alpha`: unless private, the mode, or its own state)
        if last.startswith("_") or last == "training" or last in _reads_and_writes(type(sub))[1]:
            return None, last
        return sub, last
    holder = module
    for part in first.split("."):  # (`self.cfg.attn.scale`: through each plain object, as stored)
        inner = inspect.getattr_static(holder, part, _NONE)
        if inner is _NONE or part not in getattr(holder, "__dict__", {}) or plain(inner) or callable(inner) or \
                isinstance(inner, (torch.nn.Module, torch.Tensor, type, types.ModuleType, dict, list, set)):
            return None, last
        holder = inner
    if last.startswith("_"):  # (private: `_attn_implementation` picks a kernel, not a result)
        return None, last
    return holder, last


def _value(module, name):
    """The plain value `module.name` reads now (instance or class), or a marker where it is none."""
    static = inspect.getattr_static(module, name, _NONE)
    if static is _NONE or (name not in module.__dict__ and hasattr(static, "__get__")):
        return _NONE  # (absent, or a property or method: not a stored value)
    return static if plain(static) else _NONE


_SNAPSHOT = 1 << 16  # elements: a tensor attribute up to this size is copied, so one set to equal values is let be


def _stored(holder, name: str):
    """What `holder` stores under `name` in its own `__dict__` (None where nothing)."""
    return holder.__dict__.get(name) if hasattr(holder, "__dict__") else None


def _tensor(holder, name: str):
    """The plain tensor `holder` stores under `name` (not a parameter or buffer, which nn.Module keeps in its
    own tables and the compiled module holds copies of), or None."""
    t = _stored(holder, name)
    return t if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) else None


def _same_values(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    if b is None or a.shape != b.shape or a.dtype != b.dtype or a.is_meta or b.is_meta:
        return False
    return torch.equal(a.detach().to(b.device), b)


def _both_nan(a, b) -> bool:
    return isinstance(a, float) and isinstance(b, float) and a != a and b != b


_LEAVES = 256  # a dict, list or tuple attribute with more leaves (or deeper than 3) is not watched


def _leaves(container, path: tuple = (), out: list | None = None) -> list | None:
    """[(key path, leaf)] of a dict, list or tuple whose leaves are plain values or plain tensors (nested at most
    3 deep), or None where it holds anything else (a module, an object, a fake or inference tensor: not a
    constant the trace took whole)."""
    out = [] if out is None else out
    items = container.items() if isinstance(container, dict) else enumerate(container)
    for key, v in items:
        if len(out) >= _LEAVES or not plain(key):
            return None
        if isinstance(v, (dict, list, tuple)) and not plain(v):
            if len(path) == 2 or _leaves(v, (*path, key), out) is None:
                return None
            continue
        if not (plain(v) or (type(v) is torch.Tensor and not v.is_inference())):
            return None
        out.append(((*path, key), v))
    return out


class _Held:
    """What one watched container held when compiled. Plain values only: a copy, compared with `==` (as a plain
    attribute is: 2 and 2.0 are the same). With tensors: its key paths, plain values, and each tensor by
    identity and version (with a copy of the small ones, so one set to equal values is let be, and taken as
    the one held from then on)."""

    def __init__(self, container, leaves: list):
        self.tensors = any(isinstance(v, torch.Tensor) for _, v in leaves)
        if not self.tensors:
            self.copy = deepcopy(container)  # (plain values: the nested containers copied)
            return
        self.paths = [path for path, _ in leaves]
        self.values = [[v, None, None] if not isinstance(v, torch.Tensor) else
                       [v, v._version, v.detach().clone() if v.numel() <= _SNAPSHOT and not v.is_meta else None]
                       for _, v in leaves]

    def same(self, container) -> bool:
        if not self.tensors:
            return type(container) is type(self.copy) and container == self.copy
        leaves = _leaves(container) if isinstance(container, (dict, list, tuple)) else None
        if leaves is None or [path for path, _ in leaves] != self.paths:
            return False
        for (_, now), held in zip(leaves, self.values):
            old, version, copy = held
            if isinstance(old, torch.Tensor):
                if not isinstance(now, torch.Tensor):
                    return False
                if now is old and now._version == version:
                    continue
                if not _same_values(now, copy):
                    return False
                held[0], held[1] = now, now._version  # (set to what it held: the one held from now on)
            elif now is not old and now != old and not _both_nan(now, old):
                return False
        return True


def _readers(root: torch.nn.Module):
    """(module path, module, the object read through, attributes it reads, whether its code changes containers
    in place) for each module of `root`, and for each forward hook on it (run into the graph when traced): a
    hook function reads through its first argument, the module; a hook object (old-style `spectral_norm`'s)
    through itself, in its `__call__`."""
    for path, module in root.named_modules():
        names, writes = set(forward_reads(type(module))), set(_reads_and_writes(type(module))[1])
        own = module.__dict__.get("forward")  # (a forward set on the instance: PEFT, accelerate)
        if own is not None and callable(own):
            r, w = _scan(getattr(own, "__func__", own))
            names |= r - {"training"}
            writes |= w
        yield path, module, module, names, CHANGES_CONTAINERS in writes
        for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values()):
            if getattr(hook, "spmd_guard", False):  # (spmd's own: runtime/source_guard.py)
                continue
            if isinstance(hook, types.FunctionType):  # (and the modules it reads from its closure: the model)
                for var, cell in zip(hook.__code__.co_freevars, hook.__closure__ or ()):
                    try:
                        held = cell.cell_contents
                    except ValueError:  # (a cell not filled yet)
                        continue
                    if isinstance(held, torch.nn.Module):
                        r, w = _scan(hook, me=var)
                        yield path, module, held, _constants(r, w), CHANGES_CONTAINERS in w
            if isinstance(hook, (types.FunctionType, types.MethodType)):
                reader = hook.__self__ if isinstance(hook, types.MethodType) else module
                r, w = _scan(getattr(hook, "__func__", hook))
            elif callable(hook) and not isinstance(hook, functools.partial):
                reader, (r, w) = hook, _reads_and_writes(type(hook), "__call__")
            else:
                continue
            yield path, module, reader, _constants(r, w), CHANGES_CONTAINERS in w


def _object_reader(loss_fn) -> list:
    """A loss_fn that is a callable object but no module (`FocalLoss(alpha=0.25)` with a `__call__`): the attributes
    its `__call__` reads through `self`, as `_readers` gives a module's (found by a review: `loss.alpha` annealed
    by the loop stayed in the graph as compiled)."""
    if loss_fn is None or isinstance(loss_fn, (types.FunctionType, types.MethodType, functools.partial)) \
            or not isinstance(getattr(type(loss_fn), "__call__", None), types.FunctionType):
        return []
    r, w = _reads_and_writes(type(loss_fn), "__call__")
    return [("", loss_fn, loss_fn, _constants(r, w), CHANGES_CONTAINERS in w)]


def _set_by_hooks(module) -> set[str]:
    """The attributes a hook object of `module` sets before each forward (old-style `spectral_norm`,
    `weight_norm` and `prune` compute `module.weight` from parameters of their own, by the name they hold):
    the forward's input, not a constant."""
    hooks = (*getattr(module, "_forward_pre_hooks", {}).values(), *getattr(module, "_forward_hooks", {}).values())
    return {v for h in hooks if not isinstance(h, (types.FunctionType, types.MethodType))
            and not getattr(h, "spmd_guard", False)
            for v in getattr(h, "__dict__", {}).values() if isinstance(v, str)}


# what a transformers configuration carries that no forward reads: names, labels for display, versions, the dtype
# it was loaded in (a model cast after compiling moves it)
_CONFIG_METADATA = frozenset({"_name_or_path", "architectures", "id2label", "label2id", "finetuning_task",
                              "transformers_version", "_commit_hash", "tokenizer_class", "prefix",
                              "task_specific_params", "dtype", "torch_dtype",
                              "use_cache"})  # (no graph holds a cache: `use_cache=False` is asked of every compile)


def _configurations(root: torch.nn.Module) -> list[tuple[object, str]]:
    """(configuration, the path it is held at) of each transformers configuration `root`'s modules hold, and of
    the configurations inside them (a multimodal model's `text_config`), each once."""
    found, seen = [], set()

    def visit(config, shown):
        if id(config) in seen or not any(k.__name__.lower() == "pretrainedconfig" for k in type(config).__mro__):
            return
        seen.add(id(config))
        found.append((config, shown))
        for key, value in list(vars(config).items()):
            visit(value, f"{shown}.{key}")

    for path, module in root.named_modules():
        if "config" in module.__dict__:
            visit(module.__dict__["config"], f"{path}.config" if path else "config")
    return found


class AttributeGuard:
    """The plain attributes each module of `roots` (label -> module) reads in its forward, with their values
    now; `check()` raises, naming each that changed since. A transformers configuration the modules hold is
    watched whole (its metadata aside): its models read it through calls the bytecode scan does not follow
    (`self.config.get_text_config().pad_token_id`, a loss function handed `config=self.config`) and write
    some of its entries themselves (BERT's `problem_type`), so a value set after compiling (the tokenizer's
    `pad_token_id`, another `problem_type`) went unseen: found by a probe, 0.14 and 0.20 off, silently. Which
    entries the graph depends on is not known (a causal LM's loss never reads `pad_token_id`; an eager call with
    labels sets `problem_type` for a graph that took none: a review found refusals there wrong), so a change
    warns once, naming the entry, where an attribute the scan saw read raises."""

    def __init__(self, roots: dict[str, torch.nn.Module]):
        self._configs = []  # [configuration, path, its entries when compiled]: `_configurations`
        self._entries = []  # (the object holding it, attribute, module path, name read, value)
        self._tensors = []  # [the object holding it, attribute, module path, name read, tensor, its version, a copy]
        self._containers = []  # (the object holding it, attribute, module path, name read, what it held: _Held)
        self._outside = []  # (a module's globals or a cell, name, path read, who reads it, its value): `_outside_reads`
        self._outside_tensors = []  # [the same, a plain tensor read there, its version, a copy of a small one]
        seen = set()  # (id(holder), attribute): a configuration every layer holds is watched once
        for label, root in roots.items():
            if not isinstance(root, torch.nn.Module):
                fn = _function_of(root) if root is not None else None
                if fn is not None:
                    self._watch_outside(fn, label, seen)
                readers = _object_reader(root)
            else:
                for path, module in root.named_modules():
                    shown = ".".join(p for p in (label, path) if p) or type(module).__name__
                    fns = [getattr(fn, "__func__", fn) for fn in (*_walk(type(module))[2], module.__dict__.get("forward"))
                           if fn is not None]
                    # (what one method writes, another reads as state: `self._tick()` counting in `STATS.calls`)
                    kept = {}
                    for fn in fns:
                        for name, steps in _globals_written(inspect.unwrap(fn), own=True).items():
                            kept[name] = kept.get(name, frozenset()) | steps
                    for fn in fns:
                        self._watch_outside(fn, shown, seen, kept)
                    # (and its forward hooks', traced into the graph: a probe's `o * scale`, `scale` reassigned
                    # through `nonlocal` after compiling, went on with the old value)
                    for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values()):
                        if isinstance(hook, (types.FunctionType, types.MethodType)) and \
                                not getattr(hook, "spmd_guard", False):
                            self._watch_outside(getattr(hook, "__func__", hook), f"a forward hook on {shown}", seen)
                readers = _readers(root)
            for path, module, reader, names, keeps in readers:
                for name in sorted(names):
                    holder, attr = _holder(reader, name)
                    if holder is None or (id(holder), attr) in seen:
                        continue
                    value, shown = _value(holder, attr), ".".join(p for p in (label, path) if p)
                    if reader is not module:
                        shown = f"{shown}.<{type(reader).__name__}>" if shown else f"<{type(reader).__name__}>"
                    if value is not _NONE:
                        seen.add((id(holder), attr))
                        self._entries.append((holder, attr, shown, name, value))
                    elif (t := _tensor(holder, attr)) is not None and attr not in _set_by_hooks(holder):
                        seen.add((id(holder), attr))
                        copy = t.detach().clone() if t.numel() <= _SNAPSHOT and not t.is_meta else None
                        self._tensors.append([holder, attr, shown, name, t, t._version, copy])
                    elif isinstance(c := _stored(holder, attr), (dict, list, tuple)) and \
                            not keeps and (leaves := _leaves(c)) is not None:
                        seen.add((id(holder), attr))
                        self._containers.append((holder, attr, shown, name, _Held(c, leaves)))
            if isinstance(root, torch.nn.Module):
                self._configs += [[config, ".".join(p for p in (label, path) if p), dict(vars(config))]
                                  for config, path in _configurations(root)]

    def _watch_outside(self, fn, reader: str, seen: set, kept: dict | None = None) -> None:
        """Watch what `fn` reads from outside itself (`_outside_reads`), state the reader's code writes aside
        (`kept`: `_globals_written`'s)."""
        if (getattr(fn, "__module__", None) or "").startswith("torch."):
            return  # (torch's own state: parametrize's `_cache_enabled`, read by every parametrized weight)
        for where, name, path in _outside_reads(fn):
            if isinstance(where, dict) and _kept(path, (kept or {}).get(name, ())):
                continue
            value = _outside_object(where, name, path)
            tensor = type(value) is torch.Tensor and not value.is_inference()
            if (tensor or plain(value)) and (id(where), name, path) not in seen:
                seen.add((id(where), name, path))
                read = _shown_path(name, path)
                shown = f"global `{read}` of {where.get('__name__', fn.__module__)}" if isinstance(where, dict) else \
                    f"variable `{read}` around {fn.__qualname__}"
                if tensor:  # (a module-level mask or table: a constant of the graph, as a plain tensor attribute)
                    copy = value.detach().clone() if value.numel() <= _SNAPSHOT and not value.is_meta else None
                    self._outside_tensors.append([where, name, path, f"{shown} read by {reader}", value,
                                                  value._version, copy])
                else:
                    self._outside.append((where, name, path, f"{shown} read by {reader}", value))

    def __len__(self) -> int:
        return len(self._entries) + len(self._tensors) + len(self._containers) + len(self._outside) + \
            len(self._outside_tensors) + len(self._configs)

    def _config_changes(self) -> list[tuple[str, str]]:
        """(path of the entry, how) of each configuration entry set since the last call (metadata aside, and
        entries `_entries` watches and names itself)."""
        changed, watched = [], None
        for held in self._configs:
            config, path, then = held
            now = vars(config)
            try:
                if now == then:  # (the usual case: every entry the very object it was)
                    continue
            except Exception:  # (an entry without a plain ==: compared one by one below)
                pass
            watched = watched if watched is not None else {(id(e[0]), e[1]) for e in self._entries}
            for key in sorted(set(now) | set(then)):
                old, new = then.get(key, _NONE), now.get(key, _NONE)
                if key in _CONFIG_METADATA or (id(config), key) in watched or new is old or _both_nan(new, old):
                    continue
                try:
                    same = bool(new == old)
                except Exception:  # (values without a plain ==: told apart by identity)
                    same = False
                if not same:
                    changed.append((f"{path}.{key}", f"{old!r} -> {new!r}" if plain(old) and plain(new)
                                    else "set anew"))
            held[2] = dict(now)  # (each change told once: the next calls take the fast path again)
        return changed

    def watched(self) -> set[tuple[str, str]]:
        """The (module path, attribute) pairs checked ("config.pad_token_id" for an attribute of an object the
        module holds)."""
        return {(e[2], e[3]) for e in (*self._entries, *self._tensors, *self._containers)}

    def check(self) -> None:
        changed = []
        for e in self._tensors:
            holder, attr, path, name, old, version, copy = e
            now = holder.__dict__.get(attr, _NONE)
            if now is old and old._version == version:
                continue
            if isinstance(now, torch.Tensor) and _same_values(now, copy):
                e[4], e[5] = now, now._version  # (set to what it held: nothing the graph holds differs)
                continue
            how = "a tensor set in place" if now is old else "a tensor replaced"
            changed.append((f"{path}.{name}" if path else name, how))
        for holder, attr, path, name, held in self._containers:
            if not held.same(holder.__dict__.get(attr, _NONE)):
                changed.append((f"{path}.{name}" if path else name, "an entry or tensor in it changed"))
        if self._configs and (entries := self._config_changes()):
            listed = ", ".join(f"`{shown}` ({how})" for shown, how in entries[:4]) + (", ..." if len(entries) > 4 else "")
            warnings.warn(
                f"the model's {listed} changed after compiling. A transformers model may read such an entry in its "
                "forward (the pad token a sequence classifier pools at, the problem_type its loss takes), and the "
                "compiled graph holds the value it traced; spmd cannot tell whether this one does. What to do: if "
                "the forward reads it, compile again after the change (set such entries before compiling); if it "
                "does not, nothing (filter this warning).", stacklevel=user_stacklevel())
        for holder, attr, path, name, old in self._entries:
            if holder.__dict__.get(attr, _NONE) is old:  # (the usual case: the very object compiled with)
                continue
            new = _value(holder, attr)
            if new is not old and new != old and not _both_nan(new, old):
                changed.append((f"{path}.{name}" if path else name,
                                f"{old!r} -> {'not a plain value' if new is _NONE else repr(new)}"))
        outside = []
        for where, name, path, shown, old in self._outside:
            now = _outside_value(where, name, path)
            if now is not old and now != old and not _both_nan(now, old):
                outside.append(f"the {shown} ({old!r} -> {'not a plain value' if now is _NONE else repr(now)})")
        for e in self._outside_tensors:
            where, name, path, shown, old, version, copy = e
            now = _outside_object(where, name, path)
            if now is old and old._version == version:
                continue
            if isinstance(now, torch.Tensor) and _same_values(now, copy):
                e[4], e[5] = now, now._version
                continue
            outside.append(f"the {shown} ({'set in place' if now is old else 'replaced'})")
        if outside and not changed:
            raise SpmdError(
                f"{', '.join(outside[:4])}{', ...' if len(outside) > 4 else ''} changed after compiling. The trace "
                "read the value, and the compiled graph holds it: this call would run with the old one (Python "
                "values outside the model are not inputs of the graph). What to do: compile again after the "
                "change; for a value that changes during training (a loss weight, a temperature), keep it in a "
                "buffer of a module (of the model, or of a loss_fn module: `self.register_buffer('w', "
                "torch.tensor(1.0))`), read that, and set it on the compiled module "
                "(`compiled.get_buffer('loss_fn.w').fill_(new)`), which holds its own copy.")
        if changed:
            listed = ", ".join(f"`{shown}` ({how})" for shown, how in changed[:4]) + (", ..." if len(changed) > 4 else "")
            raise SpmdError(
                f"the model's {listed} changed after compiling. The forward read the value when it was traced, "
                "and the compiled graph holds that value: this call would run with the old one. What to do: "
                "compile again after the change; for a value that changes during training (a temperature, a "
                "rate), keep it in a buffer (`self.register_buffer('t', torch.tensor(1.0))`), read that in the "
                "forward, and set it on the compiled module (`compiled.get_buffer('t').fill_(new)`), which holds "
                "its own copy.")
