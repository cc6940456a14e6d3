"""Moving whole tensors to and from one rank's local shard.

`local_shard` cuts a full tensor (the same on every rank) into this rank's piece: no communication.
`gather_full` rebuilds the full tensor from local shards with the collectives of the one redistribute
planner (placements -> all Replicate), so it is exactly as correct as the compiled graphs.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.redistribute import plan_redistribute
from spmd.runtime.collectives import STEP_FUNCTIONS
from spmd.specs import Placements, TensorInfo


def local_shard(full: torch.Tensor, placements: Placements, mesh_shape: tuple[int, ...],
                coord: tuple[int, ...]) -> torch.Tensor:
    """This rank's piece of `full`. Axes that shard the same dim nest left to right."""
    t = full
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            t = t.chunk(mesh_shape[axis], p.dim)[coord[axis]]
        elif isinstance(p, Partial):
            raise ValueError("local_shard: a full tensor has no Partial layout; use Replicate")
    return t.contiguous()


def gather_full(local: torch.Tensor, placements: Placements, mesh, coord: tuple[int, ...],
                group_names: tuple[str, ...]) -> torch.Tensor:
    """The full tensor on every rank, from this rank's `local` piece laid out as `placements`."""
    replicated = tuple(Replicate() for _ in placements)
    shape = list(local.shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            shape[p.dim] *= mesh.shape[axis]
    steps = plan_redistribute(tuple(placements), replicated, TensorInfo(tuple(shape), local.dtype), mesh)
    t = local
    for step in steps:
        t = STEP_FUNCTIONS[step.kind](t, **step.call_kwargs(), group=group_names[step.axis], world=mesh.shape[step.axis])
    return t
