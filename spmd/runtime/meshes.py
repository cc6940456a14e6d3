"""One DeviceMesh per (shape, axis names, device type) in a process: asking again returns the same one.

torch's `init_device_mesh` makes new process groups on every call and keeps them until the process
group is destroyed: on a (2, 2) gloo mesh each call adds 2 groups per rank, each with 3 threads and 5
sockets (tests/e2e/test_repeated_compiles.py measured it). A script that calls `spmd.init_mesh` before
each `spmd.compile` (a sweep, a notebook cell run again, every e2e test on the shared rank pool) would
pile them up. The meshes made here are remembered per default process group: after
`destroy_process_group()` and a new `init_process_group`, the next call makes a new one, and the old
ones are let go.

Process-wide on purpose (like torch's own registry of process groups), and not per compilation: a mesh
is a handle on live groups, not compilation state.

The cache lets its meshes go at interpreter exit (`_release`, an atexit hook), not at finalization. A
DeviceMesh holds its process groups, so a cached mesh would keep them alive past
`destroy_process_group()`; a gloo worker thread that drops its last finished collective while the
interpreter is finalizing needs the GIL to free the tensors, cannot have it, and aborts the process
("terminate called without an active exception", 1 run in ~9 of the demo on 4 ranks). Dropping the
groups while Python still runs lets their destructors (which release the GIL) join those threads.
"""
from __future__ import annotations

import atexit
import gc
from typing import Sequence

_MESHES: dict[tuple, tuple[object, object]] = {}  # (shape, names, device type) -> (default group, DeviceMesh)


@atexit.register
def _release() -> None:
    """Drop the cached meshes and collect the cycles (compiled modules) that still hold them, so their
    process groups are destroyed, their worker threads joined, before the interpreter finalizes."""
    _MESHES.clear()
    gc.collect()


def _alive(mesh) -> bool:
    """Every group of `mesh` is still registered (none was destroyed by hand)."""
    from torch.distributed.distributed_c10d import _world

    try:
        return all(mesh.get_group(i) in _world.pg_map for i in range(mesh.ndim))
    except Exception:  # a group torch no longer knows
        return False


def cached_meshes() -> list:
    """The meshes `device_mesh` made over the live default process group."""
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    return [mesh for group, mesh in _MESHES.values() if group is default and _alive(mesh)]


def device_mesh(shape: Sequence[int], axis_names: Sequence[str], device_type: str):
    """`init_device_mesh(device_type, shape, mesh_dim_names=axis_names)`, made once per default process
    group. The default group must exist."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.distributed_c10d import _get_default_group

    default = _get_default_group()
    key = (tuple(shape), tuple(axis_names), device_type)
    hit = _MESHES.get(key)
    if hit is not None and hit[0] is default and _alive(hit[1]):
        return hit[1]
    for k in [k for k, (group, _) in _MESHES.items() if group is not default]:
        del _MESHES[k]  # meshes of a destroyed default group
    override = _timeout_override(default, tuple(shape), device_type)
    if override:
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(axis_names), backend_override=override)
    else:
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(axis_names))
    _MESHES[key] = (default, mesh)
    return mesh


def _timeout_override(default, shape: tuple, device_type: str) -> dict:
    """The default group's timeout for each mesh axis that gets a process group of its own (one smaller than the
    world). torch's init_device_mesh makes them with torch's default timeouts (30 minutes for gloo, 10 for NCCL),
    not the default group's: on a (2, 2) mesh `spmd.init_mesh(timeout=...)` (5 minutes unless told) held for
    nothing, a rank that stopped taking part left the others waiting 30 minutes, and nodes that built other
    meshes waited in the groups' creation as long (found by a probe). {} where nothing can be said."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    axes = [i for i, n in enumerate(shape) if 1 < n < world]
    if not axes:
        return {}
    try:
        device = torch.device(device_type)
        timeout = default._get_backend(device).options._timeout
        backend = dist.get_backend(default)
        if "gloo" in backend and device_type == "cpu" or backend == "gloo":
            name, options = "gloo", dist.ProcessGroupGloo._Options()
        elif "nccl" in backend and hasattr(dist, "ProcessGroupNCCL"):
            name, options = "nccl", dist.ProcessGroupNCCL.Options()
        else:
            return {}
        options._timeout = timeout
    except Exception:  # noqa: BLE001 - a backend whose options are not known here: torch's defaults, as before
        return {}
    return {i: (name, options) for i in axes}
