"""Pointwise ops that are linear in some of their tensor arguments, where DTensor's pointwise rule
offers no Partial form: `where` (the select of masked_fill, padding masks, nll_loss's ignore_index) and
gelu_backward (kept whole in the joint graph); and `copy` and `lift_fresh_copy`, which DTensor has no rule for.

Along one mesh axis:
  * split: the output on any dim d, each input on its matching dim (right-aligned broadcasting) or
    whole where it broadcasts there (size 1 or missing);
  * `copy(self, src)` (a slice assignment's functional form, T5's `_shift_right`) is src broadcast into
    self's shape and dtype: split like any pointwise op (it had no rule, and a batch-split plan gathered
    the labels; a plan-quality probe); `lift_fresh_copy(x)`, a copy of a constant the model made with
    `torch.tensor(...)` (transformers' key/value cache), likewise, where it warned and ran replicated;
  * Partial: `where(c, x, y)` with c whole is linear in (x, y) together, so x and y Partial(sum) ->
    Partial(sum): sum_r where(c, x_r, y_r) = where(c, sum_r x_r, sum_r y_r). A constant branch (the 0 of
    masked_fill) reaches the Partial form locally: Replicate -> Partial(sum) keeps it on one rank and
    zeros elsewhere, no communication (for a zero, a no-op). `gelu_backward(g, x)` = g * gelu'(x) is
    linear in g: g Partial, x whole -> Partial.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.passes.rules.registry import RuleInput, rule

aten = torch.ops.aten


def broadcast_rows(out_shape: tuple[int, ...], in_shapes: list[tuple[int, ...]]) -> list[list]:
    """One row per output dim: the output split on it, each input on its matching dim or whole."""
    rows = []
    for d, size in enumerate(out_shape):
        if size == 1:
            continue
        row = [Shard(d)]
        for shape in in_shapes:
            k = d - (len(out_shape) - len(shape))
            row.append(Shard(k) if k >= 0 and shape[k] == size else Replicate())
        rows.append(row)
    return rows


@rule(aten.where.self)
def where(inp: RuleInput) -> list[list]:
    cond, x, y = (t.shape for t in inp.inputs)
    rows = broadcast_rows(inp.outputs[0].shape, [cond, x, y])
    if inp.outputs[0].dtype.is_floating_point:  # a sum of booleans or integers is not their select
        rows.append([Partial(), Replicate(), Partial(), Partial()])
    return rows


@rule(aten.gelu_backward.default)
def gelu_backward(inp: RuleInput) -> list[list]:
    g, x = (t.shape for t in inp.inputs)
    rows = broadcast_rows(inp.outputs[0].shape, [g, x])
    rows.append([Partial(), Partial(), Replicate()])
    return rows


@rule(aten.copy.default)
def copy(inp: RuleInput) -> list[list]:
    destination, source = (t.shape for t in inp.inputs)
    return broadcast_rows(inp.outputs[0].shape, [destination, source])


@rule(aten.lift_fresh_copy.default)
def lift_fresh_copy(inp: RuleInput) -> list[list]:
    rows = broadcast_rows(inp.outputs[0].shape, [inp.inputs[0].shape])
    if inp.outputs[0].dtype.is_floating_point:
        rows.append([Partial(), Partial()])
    return rows
