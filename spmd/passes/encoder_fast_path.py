"""`nn.TransformerEncoder`'s nested-tensor fast path, traced as eager evaluates it.

In evaluation under `torch.no_grad()`, an `nn.TransformerEncoder` built with `enable_nested_tensor=True` (the
default) and called with a `src_key_padding_mask` runs its layers on a nested tensor of the unpadded tokens and
pads the result with zeros: its outputs at padded positions are 0 (or its final norm of 0). A trace never takes
that path (torch.export and torch.compile skip it), so the compiled graph computed the padded positions as the
layers' standard path does, and a mean over the sequence was 0.99 off one device without a word (found by a
probe). `encoder_fast_path_as_eager` makes the trace give eager's values: while open, each such encoder's layers'
output gets zeros at the padded positions before the encoder's final norm, where eager would have taken the fast
path for these inputs. Whether it would is decided at trace time from the module and the inputs' kinds
(eval mode, the mask given alone, batched input, no autocast), except eager's own check that each row's padding
is at its end (`mask_check`), which depends on the values and is computed in the graph.

Inference traces only: with gradients on and parameters that require them, eager takes the standard path too, as
it does in training; an inference graph is the one evaluated under `torch.no_grad()`, and a call of it with grad on
and such parameters warns once (`CompiledModule`), its padded positions being eager's under no_grad.
"""
from __future__ import annotations

import contextlib
import inspect
import weakref

import torch
import torch.nn.functional as F


def _takes_fast_path(encoder: torch.nn.TransformerEncoder, src, mask, padding) -> bool:
    """Whether eager, under `torch.no_grad()`, runs `encoder` on a nested tensor for these inputs (torch's
    `TransformerEncoder.forward` conditions, the data-dependent alignment check aside)."""
    layers = getattr(encoder, "layers", None)
    if not layers or not isinstance(layers[0], torch.nn.TransformerEncoderLayer):
        return False
    return (torch.backends.mha.get_fastpath_enabled() and getattr(encoder, "use_nested_tensor", False)
            and layers[0].self_attn.batch_first and not layers[0].training
            and isinstance(src, torch.Tensor) and src.dim() == 3 and not src.is_nested
            and padding is not None and mask is None and not torch.is_autocast_enabled())


def _padded(padding: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """The (batch, sequence) positions the fast path leaves out: True in a boolean mask, non-zero in a float one
    (torch's canonical mask: -inf where padded)."""
    padding = F._canonical_mask(mask=padding, mask_name="src_key_padding_mask", other_type=None,
                                other_name="", target_type=src.dtype)
    return padding != 0


def _arguments(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, bound to the forward's signature (a compiled root's view takes keywords as
    positions of its own: `(src, src_key_padding_mask)`)."""
    try:
        return dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return dict(zip(("src", "mask", "src_key_padding_mask"), args)) | kwargs


# the layers of the encoders a trace gave eager's zeros: a call of such a graph with grad on, where eager takes the
# standard path, is told (`CompiledModule`)
emulated: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


@contextlib.contextmanager
def encoder_fast_path_as_eager(model: torch.nn.Module):
    """While open, each `nn.TransformerEncoder` in `model` that eager would run on its fast path zeroes its layers'
    output at the padded positions: as the input of its final norm, as after eager's `to_padded_tensor(0)`, or as
    its output where it has none. (Hooked after the layers, not on the last one: a stack of layers is traced cut
    short and stamped to its depth.)"""
    handles = []
    for encoder in model.modules():
        if not isinstance(encoder, torch.nn.TransformerEncoder) or not len(encoder.layers):
            continue
        state: dict = {}

        def before(module, args, kwargs, state=state):
            given = _arguments(module, args, kwargs)
            src, mask, padding = (given.get(name) for name in ("src", "mask", "src_key_padding_mask"))
            state["padded"] = (_padded(padding, src) if _takes_fast_path(module, src, mask, padding) else None)
            state["check"] = getattr(module, "mask_check", True)
            state["layers"] = module.layers  # (shared by a compiled root's view and the model)

        def zeroed(out, state=state):
            padded, state["padded"] = state.get("padded"), None
            if padded is None or not isinstance(out, torch.Tensor) or out.dim() != 3:
                return out
            emulated.add(state["layers"])
            kept_out = out.masked_fill(padded.unsqueeze(-1), 0)
            if not state["check"]:
                return kept_out
            kept = ~padded  # (eager's mask check: each row's kept tokens first, its padding at its end)
            aligned = ~(kept[:, 1:] & ~kept[:, :-1]).any()
            return torch.where(aligned, kept_out, out)

        handles.append(encoder.register_forward_pre_hook(before, with_kwargs=True))
        if isinstance(encoder.norm, torch.nn.Module):
            handles.append(encoder.norm.register_forward_pre_hook(
                lambda module, args, zeroed=zeroed: (zeroed(args[0]), *args[1:])))
        else:
            handles.append(encoder.register_forward_hook(lambda module, args, out, zeroed=zeroed: zeroed(out)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
