"""Sharding specs: one DTensor placement per mesh axis, plus the global shape they split.

Semantics by equivalence (see docs/placements.md):
  Shard(d) on axis i    the tensor is the concatenation along dim d of the ranks' local tensors, in
                        rank order along axis i (axes sharding the same dim nest left to right);
  Replicate() on axis i every rank along axis i holds the same values;
  Partial(op) on axis i the tensor is the `op`-reduction (sum, avg, max, min) over axis i of the
                        ranks' local tensors.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

Placements = tuple[Placement, ...]


Value = tuple[str, int]  # a graph value: (producing node name, output index)


def placement_str(p: Placement) -> str:
    """The short form DTensor users read: S(0), R, P (a sum), P(max). The one formatter: dumps, plans,
    pictures and plan files all write placements this way."""
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    return str(p)


def placements_str(ps: Placements) -> str:
    return "[" + ", ".join(placement_str(p) for p in ps) + "]"


def placement_from_text(text: str) -> Placement:
    """The inverse of `placement_str`: "S(0)" -> Shard(0), "R" -> Replicate(), "P" or "P(sum)" -> Partial()."""
    text = text.strip()
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial("sum")
    m = re.fullmatch(r"([SP])\((\w+)\)", text)
    if m is None:
        raise ValueError(f"not a placement: {text!r} (expected S(<dim>), R, P or P(<op>))")
    return Shard(int(m.group(2))) if m.group(1) == "S" else Partial(m.group(2))


# The helpers the passes call millions of times test `type(p) is Shard`: torch's placements are opaque
# objects whose `isinstance` runs a Python `__instancecheck__` on a miss (176 ns a Replicate, against 12 ns),
# and Shard has no subclasses (tests/unit/test_planning_memos.py checks that it stays so).


def shard_factor(ps: Placements, mesh_shape: tuple[int, ...], dim: int) -> int:
    """How many pieces dim `dim` is cut into by `ps`."""
    return math.prod([n for p, n in zip(ps, mesh_shape) if type(p) is Shard and p.dim == dim])


def pieces(ps: Placements, mesh_shape: tuple[int, ...]) -> int:
    """Into how many pieces `ps` cuts a tensor (the product of the mesh axes that shard it)."""
    return math.prod([n for p, n in zip(ps, mesh_shape) if type(p) is Shard])


def piece_of(ps: Placements, mesh_shape: tuple[int, ...], coord: tuple[int, ...], dim: int) -> tuple[int, int]:
    """(which piece, of how many) of dim `dim` the rank at `coord` holds under `ps`. Axes that shard the
    same dim nest left to right: on a 2x2 mesh [S(0), S(0)] cuts dim 0 in four and rank (a, b) holds
    piece 2a + b."""
    index, pieces = 0, 1
    for axis, p in enumerate(ps):
        if type(p) is Shard and p.dim == dim:
            index, pieces = index * mesh_shape[axis] + coord[axis], pieces * mesh_shape[axis]
    return index, pieces


def piece_span(ps: Placements, dim: int, size: int, mesh_shape: tuple[int, ...],
               coord: tuple[int, ...]) -> tuple[int, int] | None:
    """(first index, length) of the rank at `coord`'s piece of `dim` (of global length `size`) under `ps`,
    or None where `ps` does not split `dim`."""
    index, pieces = piece_of(ps, mesh_shape, coord, dim)
    if pieces == 1:
        return None
    length = size // pieces
    return index * length, length


def local_shape(shape: tuple[int, ...], ps: Placements, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape each rank holds (specs here are always even: see `is_even`)."""
    return tuple(s // shard_factor(ps, mesh_shape, d) for d, s in enumerate(shape))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def is_even(shape: tuple[int, ...], ps: Placements, mesh_shape: tuple[int, ...]) -> bool:
    """Every sharded dim divides evenly (uneven shards are excluded from the strategy space)."""
    for d, s in enumerate(shape):
        f = shard_factor(ps, mesh_shape, d)
        if f > 1 and s % f:
            return False
    return all(type(p) is not Shard or p.dim < len(shape) for p in ps)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Global shape and dtype of one value in the graph."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def all_placements(ndim_tensor: int, mesh_ndim: int, partial: bool = False) -> list[Placements]:
    """Every combination of R / S(d) (and P(sum) if asked) over the mesh axes."""
    choices: list[Placement] = [Replicate()] + [Shard(d) for d in range(ndim_tensor)]
    if partial:
        choices.append(Partial())
    return [tuple(c) for c in itertools.product(choices, repeat=mesh_ndim)]


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run a node: the placements it needs on each tensor input and produces on each output.

    `inputs[j]` is for the j-th tensor argument (pytree order of args then kwargs); `outputs[k]` for the
    k-th output (None where that output is not a tensor).
    """

    outputs: tuple[Placements | None, ...]
    inputs: tuple[Placements, ...]

    def __str__(self) -> str:
        ins = ", ".join(placements_str(p) for p in self.inputs)
        outs = ", ".join(placements_str(p) if p is not None else "-" for p in self.outputs)
        return f"({ins}) -> {outs}"


@dataclass(frozen=True)
class Pins:
    """User constraints: placements for inputs (by argument name), parameters/buffers (by FQN), outputs
    (by flat output index); each a sequence of one placement per mesh axis (see passes/check_pins.py)."""

    inputs: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
