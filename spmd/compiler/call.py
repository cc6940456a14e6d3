"""How the user calls the model, as the one positional call the passes trace.

Hugging Face models take keyword arguments (`input_ids=`, `attention_mask=`, `labels=`) and return a
`ModelOutput`; the passes trace `forward(*tensors)`. `positional_call` gives the model a view whose
forward takes the positional inputs, then the keyword ones, in one flat list of named parameters:

    model(input_ids, labels=labels)   ->   view(input_ids, labels)   signature (input_ids, labels)
    model((a, b), mask=m)             ->   view(pair_0, pair_1, m)    an argument that is a structure of
                                                                      tensors (a tuple, a dict): one input each

The loss function's targets (training with a `loss_fn`) come last, after the keyword inputs: the trace
appends them to the view's inputs (`trace_joint.WithLoss`), so `compiled(x, y, mask=m)` runs `(x, m, y)`.
The view shares every parameter, buffer and submodule with the model (a shallow copy whose class is a
subclass with that forward): parameter names do not change, and the pytree of the output (a
`ModelOutput`, a dict, a tuple) is what the trace records, so `compiled(...)` returns the same
structure. When the model computes its own loss (`labels=`) and there is no `loss_fn`, training
differentiates `output.loss` only: the view detaches every other output.
"""
from __future__ import annotations

import copy
import inspect
import re
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import (TreeSpec, tree_flatten, tree_flatten_with_path, tree_is_leaf, tree_leaves, tree_map,
                                 tree_unflatten)

from spmd.core.errors import SpmdError
from spmd.passes.trace_joint import argument_names, loss_targets, target_names


@dataclass(frozen=True)
class Call:
    """How a call's arguments become the graph's flat inputs. `positional`: the model's positional arguments'
    names, then the loss's targets' (the last `targets` of them); `keywords`: its keyword inputs', in the
    order given. `constants`: keyword arguments that hold no tensor (CLIP's `return_loss=True`), fixed when
    traced: the graph takes no input for them, and a call must pass the same values. `tree`: where an
    argument is a structure of tensors (a tuple, a list, a dict; None where no tensor is given), the pytree
    of the model's arguments (positional, then keyword) and which of its leaves are tensors (`slots`): the
    graph takes each tensor as an input, named by its path (`leaves`: `pair_0`, `batch_mask`), and a call
    must pass the same structure."""

    positional: tuple[str, ...]
    keywords: tuple[str, ...]
    constants: tuple[tuple[str, object], ...] = ()
    targets: int = 0
    tree: TreeSpec | None = None
    slots: tuple[bool, ...] = ()
    leaves: tuple[str, ...] = ()
    defaulted: tuple[str, ...] = ()  # constants whose value is the forward's default: a call may leave them out
    # the forward's keywords the compile left out, with their plain defaults: a call may pass them at those values
    # (`attention_mask=None`, found by a probe: refused as an unknown keyword)
    unset: tuple[tuple[str, object], ...] = field(default=(), compare=False)

    @property
    def names(self) -> tuple[str, ...]:
        """The graph's inputs in order: the model's (each tensor of a structure by its path), then the targets."""
        cut = len(self.positional) - self.targets
        own = self.leaves if self.tree is not None else self.positional[:cut] + self.keywords
        return own + self.positional[cut:]

    def flatten(self, args: tuple, kwargs: dict, what: str = "compiled") -> tuple:
        """`args` and `kwargs` of a call as the flat tuple the graph takes."""
        if self.constants:
            kwargs = dict(kwargs)
            for name, value in self.constants:
                given = kwargs.pop(name, _MISSING)
                extra = len(args) - len(self.positional)  # (the value passed positionally: found by a probe)
                if given is _MISSING and name in self.defaulted and extra <= 0:  # (the forward's default: traced)
                    continue
                if given is _MISSING or not _same(given, value):
                    raise SpmdError(
                        f"{what}(...): the model was compiled with {name}={value!r}, which holds no tensor, so the "
                        f"graph was traced for that value; got {'no ' + name if given is _MISSING else repr(given)}"
                        + (f" by keyword, and {extra} positional argument{'s' if extra > 1 else ''} more than the "
                           f"{len(self.positional)} compiled ({', '.join(self.positional) or 'none'})"
                           if given is _MISSING and extra > 0 else "") +
                        f". What to do: pass {name}={value!r} by keyword, as spmd.compile was given it, or compile "
                        "again with the other value.")
        if self.unset and kwargs:
            unset = dict(self.unset)
            kwargs = {k: v for k, v in kwargs.items() if not (k in unset and _same(v, unset[k]))}
        if not self.keywords and not kwargs and self.tree is None:  # (the targets last already)
            return tuple(args)
        if kwargs and len(args) < len(self.positional):  # (positional inputs given by name: `compiled(x=x)`)
            kwargs, args = dict(kwargs), list(args)
            for name in self.positional[len(args):]:
                if name not in kwargs:
                    break
                args.append(kwargs.pop(name))
        unknown = sorted(set(kwargs) - set(self.keywords))
        missing = [k for k in self.keywords if k not in kwargs]
        if len(args) != len(self.positional) or unknown or missing:
            fixed = [k for k in unknown if _plain(kwargs[k])]
            raise SpmdError(
                f"{what}(...): the model was compiled for positional ({', '.join(self.positional) or 'none'}) and "
                f"keyword ({', '.join(self.keywords) or 'none'}) inputs"
                + (f" (and the values {', '.join(f'{k}={v!r}' for k, v in self.constants)}, fixed when traced)"
                   if self.constants else "") + f"; got {len(args)} positional"
                + (f", unknown keywords {unknown}" if unknown else "") + (f", missing {missing}" if missing else "")
                + ". What to do: pass the same inputs, by the same names, as the example inputs of spmd.compile "
                "(or compile again for the new ones)"
                + (f"; a keyword that holds no tensor ({', '.join(f'{k}={kwargs[k]!r}' for k in fixed)}) is fixed "
                   "when traced, so give it to spmd.compile too (example_kwargs) and pass the same value at each "
                   "call" if fixed else "") + ".")
        cut = len(args) - self.targets
        own = tuple(args[:cut]) + tuple(kwargs[k] for k in self.keywords)
        if self.tree is not None:
            given, tree = tree_flatten(own)
            if tree != self.tree:  # (a dict in another key order, a list where a tuple was: a loader's batch)
                given, tree = tree_flatten(_conform(own, tree_unflatten([None] * self.tree.num_leaves, self.tree)))
            slots = tuple(isinstance(t, torch.Tensor) for t in given)
            if tree != self.tree or slots != self.slots:
                raise SpmdError(
                    f"{what}(...): the model was compiled for inputs laid out as {_layout(self.tree, self.slots)}; "
                    f"got {_layout(tree, slots)}. What to do: pass the same "
                    "structures (tuples, lists, dicts of tensors, with None where the example had None) as the "
                    "example inputs of spmd.compile, or compile again for the new ones.")
            own = tuple(t for t in given if isinstance(t, torch.Tensor))
        return own + tuple(args[cut:])

    def unflatten(self, flat: tuple) -> tuple[tuple, dict]:
        """The flat tuple as a call's (args, kwargs): the structures rebuilt, the constants added back."""
        flat = tuple(flat)
        cut = len(flat) - self.targets
        args, kwargs = self.bind(flat[:cut])
        return args + flat[cut:], kwargs

    def bind(self, own: tuple) -> tuple[tuple, dict]:
        """The model's own call (args, kwargs) from its flat inputs (the targets' left out)."""
        own = tuple(own)
        if self.tree is not None:
            tensors = iter(own)
            own = tuple(tree_unflatten([next(tensors) if slot else None for slot in self.slots], self.tree))
        n = len(self.positional) - self.targets
        return own[:n], {**dict(zip(self.keywords, own[n:])), **dict(self.constants)}

    def as_given(self, flat: tuple):
        """What `shard_inputs` returns for the flat pieces: `(args, kwargs)` where the model takes keywords, else
        the positional arguments (structures rebuilt)."""
        if self.keywords or self.constants:
            return self.unflatten(flat)
        return self.unflatten(flat)[0] if self.tree is not None else tuple(flat)


def _conform(value, template):
    """`value` in `template`'s containers where it holds the same things otherwise: a dict with the same keys in
    another order, a list where the template has a tuple (torch's `default_collate` makes lists of a dataset's
    tuples) or the reverse, a plain tuple for a namedtuple. Anything else as it is (then refused, naming both)."""
    if isinstance(template, dict) and isinstance(value, dict) and set(value) == set(template):
        return type(template)((k, _conform(value[k], template[k])) for k in template)
    if isinstance(template, (list, tuple)) and isinstance(value, (list, tuple)) and len(value) == len(template):
        items = [_conform(v, t) for v, t in zip(value, template)]
        return type(template)(*items) if hasattr(template, "_fields") else type(template)(items)
    return value


def _layout(tree: TreeSpec, slots) -> str:
    """A structure of inputs in words: `(tensor, (tensor, tensor))`, `{'a': tensor, 'b': None}`."""
    marks = iter(slots)
    return repr(tree_unflatten([_Mark("tensor" if next(marks) else "None") for _ in range(tree.num_leaves)], tree))


class _Mark(str):
    def __repr__(self) -> str:
        return str(self)


_MISSING = object()


PLAIN_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)  # (values a trace fixes as constants)


def _plain(value) -> bool:
    """A keyword argument made only of plain values (None, bool, numbers, strings, dtypes, devices, in lists,
    tuples and dicts): fixed when traced. Anything else (tensors, an object that may hold some) is an input
    or is refused by the trace."""
    return all(isinstance(leaf, PLAIN_TYPES) for leaf in tree_leaves(value))


def _same(a, b) -> bool:
    """Whether a constant keyword argument is the one traced (`b`, a copy made then): the same type and
    equal (not the same object: a list changed in place since is another value)."""
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # (a comparison that is not a truth value)
        return False


def _loss_only(out):
    """`out` with every tensor but `out.loss` detached: training differentiates the loss alone. An
    output without a loss is left as it is (every output gets a gradient, as before)."""
    loss = getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        return out
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) and t is not loss else t, out)


def positional_call(model: torch.nn.Module, args: tuple, kwargs: dict | None, loss_only: bool = False,
                    loss_fn=None) -> tuple[torch.nn.Module, tuple, Call]:
    """(the view to trace, the flat example inputs, the names). `loss_fn`: training's loss, whose targets are
    the last of `args`. With no keywords, no structures and `loss_only` False, the model itself."""
    kwargs = dict(kwargs or {})
    constants = tuple((k, copy.deepcopy(v)) for k, v in kwargs.items() if _plain(v))
    fixed = dict(constants)
    keywords = tuple(k for k in kwargs if k not in fixed)
    n_targets = min(len(args), loss_targets(loss_fn)) if loss_fn is not None else 0
    cut = len(args) - n_targets
    names = tuple(argument_names(model, cut))
    # (the graph takes tensors; a value given by keyword is fixed as a constant of the call instead)
    plain = [(name, a) for name, a in zip(names, args)  # (None in a structure is kept: `(x, None)`)
             if any(not isinstance(leaf, torch.Tensor) and (leaf is not None or tree_is_leaf(a))
                    for leaf in tree_leaves(a))]
    if plain:
        name, value = plain[0]
        what = "holds no tensor" if _plain(value) else "holds values that are not tensors"
        raise SpmdError(
            f"example input {name}={value!r} {what}, and positional inputs are the graph's inputs (tensors). What "
            f"to do: pass such a value by keyword (example_kwargs={{{name!r}: ...}}, and `compiled(..., "
            f"{name}=...)`): a value that holds no tensor is fixed when traced, and a call with another one is "
            "refused.")
    own = tuple(args[:cut]) + tuple(kwargs[k] for k in keywords)
    structured = any(not tree_is_leaf(a) for a in own)  # (a tuple, a dict of tensors)
    odd = [(name, a) for name, a in zip(names + keywords, own) if structured
           and any(not isinstance(leaf, torch.Tensor) and leaf is not None for leaf in tree_leaves(a))]
    if odd:  # (structures are rebuilt from their tensors, with their Nones: nothing else can be given to the graph)
        name, value = odd[0]
        holds = "holds tensors and other values" if any(isinstance(t, torch.Tensor) for t in tree_leaves(value)) else \
            (f"is a {type(value).__name__}, neither a tensor nor a plain value (None, a number, a string, a dtype; "
             "or tuples, lists and dicts of them)")
        raise SpmdError(
            f"example_kwargs {name}={_short(value)} {holds}; a graph takes tensors, and a keyword that holds no "
            "tensor is fixed when traced. What to do: pass the tensors it holds as keywords of their own (or in a "
            "tuple, list or dict of tensors), and each other value as a keyword of its own.")
    clash = set(names) & set(keywords)
    if clash:
        raise SpmdError(f"example_kwargs {sorted(clash)} are also given positionally. What to do: pass each input "
                        "once.")
    targets = [(name, t) for name, t in zip(target_names(loss_fn, n_targets, ()), args[cut:])
               if not isinstance(t, torch.Tensor)]
    if targets:
        name, value = targets[0]
        raise SpmdError(
            f"the loss's target {name} is a {type(value).__name__}, and a loss function's targets are the graph's "
            "inputs one tensor each. What to do: give the loss function one parameter per tensor "
            "(`def loss_fn(out, a, b)`, called as `compiled(x, a, b)`), or compute the loss from the output after "
            "the call.")
    tree, slots, leaves = None, (), ()
    if structured:
        paths, tree = tree_flatten_with_path(own)
        slots = tuple(isinstance(t, torch.Tensor) for _, t in paths)
        leaves = _leaf_names(names + keywords, [path for path, t in paths if isinstance(t, torch.Tensor)])
    taken = leaves if tree is not None else names + keywords
    try:
        defaults = {p.name: p.default for p in inspect.signature(model.forward).parameters.values()
                    if p.default is not inspect.Parameter.empty}
    except (TypeError, ValueError):
        defaults = {}
    defaulted = tuple(k for k, v in constants if k in defaults and _plain(defaults[k]) and _same(defaults[k], v))
    given = set(names) | set(keywords) | {k for k, _ in constants}
    unset = tuple((k, v) for k, v in defaults.items() if k not in given and isinstance(v, PLAIN_TYPES))
    call = Call(names + tuple(target_names(loss_fn, n_targets, taken)), keywords, constants, n_targets, tree, slots,
                leaves, defaulted, unset)
    flat = call.flatten(tuple(args), kwargs, "spmd.compile")
    if not kwargs and not loss_only and tree is None:
        return model, flat, call
    base = type(model)

    def forward(self, *inputs):
        a, kw = call.bind(inputs)
        out = base.forward(self, *a, **kw)
        return _loss_only(out) if loss_only else out

    forward.__wrapped__ = base.forward  # (what the user's forward reads, for the messages that quote its lines)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = inspect.Signature(
        [self_param] + [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in taken])
    view_class = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                               "__qualname__": base.__qualname__})
    view = copy.copy(model)  # shares _parameters, _buffers and _modules with the model
    view.__class__ = view_class
    return view, flat, call


def _leaf_names(names: tuple, paths: list) -> tuple[str, ...]:
    """Each tensor of the arguments named by its argument and path, as torch.export names them (`x`: x;
    `pair=(a, b)`: pair_0, pair_1; `batch={"ids": ..}`: batch_ids): identifiers, each once."""
    out: list[str] = []
    for path in paths:
        keys = [str(getattr(k, "idx", getattr(k, "key", getattr(k, "name", k)))) for k in path[1:]]
        name = base = re.sub(r"\W", "_", "_".join([names[path[0].idx], *keys]))
        k = 1
        while keys and (name in out or name in names):  # (an argument's own name is its own)
            name, k = f"{base}_{k}", k + 1
        out.append(name)
    return tuple(out)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
