"""How the user calls the model, as the one positional call the passes trace.

Hugging Face models take keyword arguments (`input_ids=`, `attention_mask=`, `labels=`) and return a
`ModelOutput`; the passes trace `forward(*tensors)`. `positional_call` gives the model a view whose
forward takes the positional inputs, then the keyword ones, in one flat list of named parameters:

    model(input_ids, labels=labels)   ->   view(input_ids, labels)   signature (input_ids, labels)

The view shares every parameter, buffer and submodule with the model (a shallow copy whose class is a
subclass with that forward): parameter names do not change, and the pytree of the output (a
`ModelOutput`, a dict, a tuple) is what the trace records, so `compiled(...)` returns the same
structure. When the model computes its own loss (`labels=`) and there is no `loss_fn`, training
differentiates `output.loss` only: the view detaches every other output.
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves, tree_map

from spmd.core.errors import SpmdError
from spmd.passes.trace_joint import argument_names


@dataclass(frozen=True)
class Call:
    """The names of the flat inputs: `positional` first, then `keywords`, in the order given. `constants`:
    keyword arguments that hold no tensor (CLIP's `return_loss=True`), fixed when traced: the graph takes
    no input for them, and a call must pass the same values."""

    positional: tuple[str, ...]
    keywords: tuple[str, ...]
    constants: tuple[tuple[str, object], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return self.positional + self.keywords

    def flatten(self, args: tuple, kwargs: dict, what: str = "compiled") -> tuple:
        """`args` and `kwargs` of a call as the flat tuple the graph takes."""
        if self.constants:
            kwargs = dict(kwargs)
            for name, value in self.constants:
                given = kwargs.pop(name, _MISSING)
                if given is _MISSING or not _same(given, value):
                    raise SpmdError(
                        f"{what}(...): the model was compiled with {name}={value!r}, which holds no tensor, so the "
                        f"graph was traced for that value; got {'no ' + name if given is _MISSING else repr(given)}. "
                        f"What to do: pass {name}={value!r}, or compile again with the other value.")
        if not self.keywords and not kwargs:
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
                f"keyword ({', '.join(self.keywords) or 'none'}) inputs; got {len(args)} positional"
                + (f", unknown keywords {unknown}" if unknown else "") + (f", missing {missing}" if missing else "")
                + ". What to do: pass the same inputs, by the same names, as the example inputs of spmd.compile "
                "(or compile again for the new ones)"
                + (f"; a keyword that holds no tensor ({', '.join(f'{k}={kwargs[k]!r}' for k in fixed)}) is fixed "
                   "when traced, so give it to spmd.compile too (example_kwargs) and pass the same value at each "
                   "call" if fixed else "") + ".")
        return tuple(args) + tuple(kwargs[k] for k in self.keywords)

    def unflatten(self, flat: tuple) -> tuple[tuple, dict]:
        n = len(self.positional)
        return tuple(flat[:n]), {**dict(zip(self.keywords, flat[n:])), **dict(self.constants)}


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
                    ) -> tuple[torch.nn.Module, tuple, Call]:
    """(the view to trace, the flat example inputs, the names). With no keywords and `loss_only` False,
    the model itself."""
    kwargs = dict(kwargs or {})
    constants = tuple((k, copy.deepcopy(v)) for k, v in kwargs.items() if _plain(v))
    fixed = dict(constants)
    call = Call(tuple(argument_names(model, len(args))), tuple(k for k in kwargs if k not in fixed), constants)
    # (the graph takes tensors; a value given by keyword is fixed as a constant of the call instead)
    plain = [(name, a) for name, a in zip(call.positional, args)
             if any(not isinstance(leaf, torch.Tensor) for leaf in tree_leaves(a))]
    if plain:
        name, value = plain[0]
        what = "holds no tensor" if _plain(value) else "holds values that are not tensors"
        raise SpmdError(
            f"example input {name}={value!r} {what}, and positional inputs are the graph's inputs (tensors). What "
            f"to do: pass such a value by keyword (example_kwargs={{{name!r}: ...}}, and `compiled(..., "
            f"{name}=...)`): a value that holds no tensor is fixed when traced, and a call with another one is "
            "refused.")
    clash = set(call.positional) & set(call.keywords)
    if clash:
        raise SpmdError(f"example_kwargs {sorted(clash)} are also given positionally. What to do: pass each input "
                        "once.")
    flat = call.flatten(tuple(args), kwargs, "spmd.compile")
    if not kwargs and not loss_only:
        return model, flat, call
    base = type(model)

    def forward(self, *inputs):
        a, kw = call.unflatten(inputs)
        out = base.forward(self, *a, **kw)
        return _loss_only(out) if loss_only else out

    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = inspect.Signature(
        [self_param] + [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in call.names])
    view_class = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                               "__qualname__": base.__qualname__})
    view = copy.copy(model)  # shares _parameters, _buffers and _modules with the model
    view.__class__ = view_class
    return view, flat, call
