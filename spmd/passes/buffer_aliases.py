"""Buffers a forward reaches through a plain object that holds them (transformers' static key/value cache).

`TorchExportableModuleWithStaticCache` (transformers' recipe for exporting a decoder with its cache) registers
each cache layer's `keys`, `values` and `cumulative_length` as buffers of the wrapper, while the forward reads
and writes them through the cache object (`static_cache.layers[i].keys.index_copy_(...)`). torch.export's
non-strict trace swaps a module's buffers for its own tensors, but the cache object still holds the real ones:
the trace took them as constants, and the decomposition failed on their writes ("expected compiled_fn to be
GraphModule"; found by a probe). The user's way out was to rebind the cache's tensors to the buffers at the top of
the forward; `buffers_through_aliases` does that for the trace: each tensor attribute of a plain object that a
module holds (three levels deep: objects, lists, tuples' items left alone, dicts) and that is one of the model's
buffers is read from the module at the forward's start, and put back as it was after the trace. The buffers
then trace as the model's own, written in place (a cache split on heads over tp, as any buffer).
"""
from __future__ import annotations

import contextlib
import types

import torch

_LEAVES = (torch.Tensor, torch.nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType, str, bytes,
           int, float, bool, complex, type(None))


def buffer_aliases(model: torch.nn.Module, depth: int = 3) -> list[tuple[object, object, torch.nn.Module, str]]:
    """(holder, key, module, buffer name) for each place a plain object reached from a module's attributes holds
    one of the model's buffers: `holder` an object (`key` its attribute), a list or a dict (`key` the index)."""
    owners = {id(b): (m, name) for m in model.modules() for name, b in m._buffers.items() if b is not None}
    found: list = []
    seen: set[int] = set()

    def visit(obj, left: int) -> None:
        if left < 0 or isinstance(obj, _LEAVES) or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, (list, dict)):
            items = enumerate(obj) if isinstance(obj, list) else list(obj.items())
        elif isinstance(obj, tuple):
            items = ()
            for v in obj:
                visit(v, left - 1)
        else:
            items = list(vars(obj).items()) if hasattr(obj, "__dict__") else ()
        for key, value in items:
            if isinstance(value, torch.Tensor):
                if id(value) in owners and _settable(obj, key, value):
                    found.append((obj, key, *owners[id(value)]))
            else:
                visit(value, left - 1)

    for m in model.modules():
        for name, value in vars(m).items():
            if name not in ("_parameters", "_buffers", "_modules") and not isinstance(value, _LEAVES):
                visit(value, depth)
    return found


def _settable(holder, key, value) -> bool:
    """Whether `holder[key]` / `holder.key` takes a value (set to the one it holds: nothing changes). A frozen
    dataclass holding a rotary cache beside its buffers refuses, and its model traced as before this module (a
    review found it refused with a misleading trace error)."""
    try:
        _set(holder, key, value)
        return True
    except Exception:  # noqa: BLE001 - any refusal of the holder's own (frozen, slots, a property)
        return False


def _set(holder, key, value) -> None:
    if isinstance(holder, (list, dict)):
        holder[key] = value
    else:
        setattr(holder, key, value)


@contextlib.contextmanager
def buffers_through_aliases(model: torch.nn.Module):
    """Within: the forward of `model` reads each buffer a plain object holds from its module (as the trace swapped
    it), through a forward pre-hook; after: the objects hold their tensors as before."""
    aliases = buffer_aliases(model)
    if not aliases:
        yield
        return
    originals = [owner._buffers[name] for _, _, owner, name in aliases]  # (what each holder holds: `buffer_aliases`)

    def rebind(module, args):
        for holder, key, owner, name in aliases:
            _set(holder, key, owner._buffers[name])

    handle = model.register_forward_pre_hook(rebind, prepend=True)
    try:
        yield
    finally:
        handle.remove()
        for (holder, key, _, _), value in zip(aliases, originals):
            _set(holder, key, value)
