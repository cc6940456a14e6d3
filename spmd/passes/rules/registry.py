"""The rule registry: `@rule(aten.op)` and the single-mesh-axis format our rules are written in.

A rule here is written for ONE mesh axis, in DTensor's single-dim format: it returns a list of
`[out_0, ..., in_0, ...]` placement lists, each a valid way to run the op along one axis. The expander
takes every combination over the mesh axes (as DTensor does) and drops uneven ones.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.tensor import Replicate

from spmd.core.specs import Strategy, TensorInfo

class TracedShape(tuple):
    """A traced tensor's global shape (a tuple), with its strides as traced where it was not contiguous
    (`.stride`; else None): a local rewrite that draws random numbers lays them out as one device's kernel did
    (rules/random.py)."""

    stride: tuple[int, ...] | None = None

    @classmethod
    def of(cls, val) -> "TracedShape | None":
        if not isinstance(val, torch.Tensor):
            return None
        shape = cls(val.shape)
        # (only a layout that holds each element once, as the tensors eager's kernels draw into: an expanded
        # input's is not, and a draw written into it failed; found by a review)
        if val.layout == torch.strided and not val.is_contiguous() and _dense(tuple(val.shape), tuple(val.stride())):
            shape.stride = tuple(val.stride())
        return shape


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a layout holds every element once, with no gaps: a permutation of a contiguous one."""
    expected = 1
    for size, step in sorted(((n, s) for n, s in zip(shape, stride) if n != 1), key=lambda p: p[1]):
        if step != expected:
            return False
        expected *= size
    return True


SingleDimRule = Callable[["RuleInput"], list[list]]
RULES: dict[Any, SingleDimRule] = {}
# op -> (the node's args, its Strategy, the global shape of each arg (a TracedShape; None: not a tensor), the mesh shape,
# this rank's coordinate) -> (local op, args, kwargs or None: the node's), or None to keep the op: what a rank runs where the
# op on its piece is not the op itself (emit_rank_graph; the vocab-parallel and random forms)
LocalRewrite = Callable[..., "tuple | None"]
LOCAL_REWRITES: dict[Any, LocalRewrite] = {}


@dataclass(frozen=True)
class RuleInput:
    """What a rule sees: args with each tensor replaced by its `TensorInfo`, and the outputs' infos."""

    op: Any
    args: tuple
    kwargs: dict
    inputs: tuple[TensorInfo, ...]  # tensor args in pytree order
    outputs: tuple[TensorInfo | None, ...]


def _registrar(table: dict, ops):
    def register(fn):
        for op in ops:
            table[op] = fn
        return fn

    return register


def rule(*ops) -> Callable[[SingleDimRule], SingleDimRule]:
    """Register a single-mesh-axis rule for each ATen overload in `ops`, or for an op of another library by its
    name (`"transformers.grouped_mm_fallback.default"`: it exists only once that library is imported)."""
    return _registrar(RULES, ops)


def rule_for(op) -> SingleDimRule | None:
    """The rule registered for `op`, itself or by its name (`rule`)."""
    found = RULES.get(op)
    return found if found is not None or not isinstance(op, torch._ops.OpOverload) else RULES.get(str(op))


def local_rewrite(*ops) -> Callable[[LocalRewrite], LocalRewrite]:
    """Register what a rank runs for each ATen overload in `ops` (see `LOCAL_REWRITES`)."""
    return _registrar(LOCAL_REWRITES, ops)


def expand_single_dim(single: list[list], n_out: int, mesh_ndim: int) -> list[Strategy]:
    """Combine single-axis rules over all mesh axes: one Strategy per element of the product."""
    rows = list(dict.fromkeys(tuple(r) for r in single))  # (a repeated row repeats only strategies)
    all_rep = next((r for r in rows if all(isinstance(p, Replicate) or p is None for p in r)), None)
    if all_rep is None and rows:
        rows.insert(0, tuple(Replicate() for _ in rows[0]))
    # Distinct rows give distinct strategies (each axis's row can be read back from the strategy) unless
    # a None (no tensor) in some output hides which row it came from: only then are duplicates looked for.
    hidden = any(p is None for r in rows for p in r[:n_out])
    seen, out = set(), []
    for combo in itertools.product(rows, repeat=mesh_ndim):
        n = len(combo[0])
        cols = [tuple(combo[a][k] for a in range(mesh_ndim)) for k in range(n)]
        outs = tuple(None if any(p is None for p in c) else c for c in cols[:n_out])
        s = Strategy(outs, tuple(cols[n_out:]))
        if hidden:
            if s in seen:
                continue
            seen.add(s)
        out.append(s)
    return out
