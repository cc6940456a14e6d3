"""torch's GradScaler over a compiled module's shards: every rank skips or takes a step together.

Mixed precision with `torch.amp.GradScaler` unscales the gradients the optimizer holds and looks for
non-finite values in them; where it finds one it skips `optimizer.step()` and lowers the scale. On a rank
that holds pieces of sharded parameters, it sees only those pieces: an overflow in rank 0's piece makes
rank 0 skip the step and lower its scale while rank 1 steps, and the replicas drift apart, without a word
(FSDP ships a ShardedGradScaler for this reason).

`watch(parameters, ...)` remembers (weakly) the pieces of sharded parameters a rank holds, with the mesh
they were cut on; from the first one on, GradScaler's unscaling (`GradScaler._unscale_grads_`, which
`unscale_` and `step` both use) reduces its "found a non-finite value" flag to the maximum over each
watched mesh (one small all_reduce per mesh axis), so every rank of it decides alike. An optimizer over
no such piece unscales as before, with no collective.
"""
from __future__ import annotations

import threading

import torch
from torch.amp import grad_scaler
from torch.utils.weak import WeakIdKeyDictionary

from spmd.runtime.distribute import max_over_mesh

_lock = threading.Lock()
# id(parameter piece) -> (ref, the mesh: (shape, process group names per axis, device of its collectives))
_watched = WeakIdKeyDictionary()
_torch_unscale = None  # GradScaler's own _unscale_grads_, once ours stands in its place


def watch(parameters: list[torch.Tensor], mesh_shape: tuple[int, ...], group_names: tuple[str, ...],
          device: torch.device) -> None:
    """This rank's pieces of sharded parameters, cut on a mesh of `mesh_shape` whose axes' collectives run on
    `group_names` (with tensors on `device`: CUDA for NCCL, the CPU for gloo)."""
    global _torch_unscale
    mesh = (tuple(mesh_shape), tuple(group_names), device)
    with _lock:
        for p in parameters:
            _watched[p] = mesh
        if _torch_unscale is None and _watched:
            _torch_unscale = grad_scaler.GradScaler._unscale_grads_
            grad_scaler.GradScaler._unscale_grads_ = _unscale_grads_


def _meshes(optimizer) -> list[tuple]:
    found = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in _watched:
                found[_watched[p]] = None
    return list(found)


def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
    """GradScaler's unscaling, its per-device flags then agreed over every mesh whose pieces the optimizer
    holds (the maximum: a non-finite value on any rank is one on every rank)."""
    per_device = _torch_unscale(self, optimizer, inv_scale, found_inf, allow_fp16)
    for shape, groups, device in _meshes(optimizer):
        flag = torch.zeros((), dtype=torch.float32, device=device)
        for t in per_device.values():
            flag = torch.maximum(flag, t.to(device))
        flag = max_over_mesh(flag, shape, groups)
        for t in per_device.values():
            t.copy_(flag)
        if not per_device:  # (no gradient here: what the others found still decides this rank's step)
            per_device[found_inf.device] = flag.to(found_inf.device)
    return per_device
