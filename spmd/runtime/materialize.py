"""Where a rank's parameter shards come from, without any rank holding more than it must.

    model built on meta     each rank allocates its local shards, empty, on its own device; the
                            weights come from `init_weights` (the model's own init, one module at a
                            time, runtime/init_weights.py) or a checkpoint (runtime/checkpoint.py)
    model built for real    one rank's values are the truth (`src_data_rank`, rank 0 by default, as
                            DTensor's `distribute_tensor`): it sends every rank its piece, so ranks that
                            built the model with different seeds still train one model
    src_data_rank=None      every rank cuts its piece of its own copy (all loaded the same checkpoint)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate

from spmd.core.specs import Placements, local_shape
from spmd.runtime.distribute import local_shard


def is_placeholder_value(t: torch.Tensor) -> bool:
    """A tensor with a shape and no data: meta, or a fake tensor planning made from meta."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.is_meta or isinstance(t, FakeTensor)


def local_piece(full: torch.Tensor, placements: Placements, mesh, rank: int, device, src_data_rank: int | None,
                ) -> torch.Tensor:
    """This rank's piece of one parameter or buffer (a new tensor on `device`; every rank calls this for
    the same tensors in the same order when `src_data_rank` is set: it is a collective then)."""
    shape = local_shape(tuple(full.shape), placements, mesh.shape)
    device = device or torch.device("cpu")
    if is_placeholder_value(full):
        return torch.empty(shape, dtype=full.dtype, device=device)
    if src_data_rank is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return local_shard(full.detach(), placements, mesh.shape, mesh.coordinate(rank)).to(device).clone()
    out = torch.empty(shape, dtype=full.dtype, device=device)
    if all(isinstance(p, Replicate) for p in placements):
        if rank == src_data_rank:
            out.copy_(full.detach())
        dist.broadcast(out, src=src_data_rank)
        return out
    pieces = None
    if rank == src_data_rank:
        pieces = [local_shard(full.detach(), placements, mesh.shape, mesh.coordinate(r)).to(device).contiguous()
                  for r in range(mesh.size)]
    dist.scatter(out, pieces, src=src_data_rank)
    return out
