"""Moving whole tensors to and from one rank's local shard.

`local_shard` cuts a full tensor (the same on every rank) into this rank's piece: no communication.
`gather_full` rebuilds the full tensor from local shards with the collectives of the one redistribute
planner (placements -> all Replicate), so it is exactly as correct as the compiled graphs.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.core.collectives import STEP_FUNCTIONS
from spmd.core.specs import Placements, TensorInfo, piece_of
from spmd.cost_model.comm import reshard_steps


def local_slices(shape: tuple[int, ...], placements: Placements, mesh_shape: tuple[int, ...],
                 coord: tuple[int, ...]) -> tuple[slice, ...]:
    """Which part of a tensor of `shape` this rank holds, one slice per dim (`specs.piece_of`; shards are
    even: see `specs.is_even`)."""
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError("a full tensor has no Partial layout; use Replicate")
    cuts = [piece_of(placements, mesh_shape, coord, d) for d in range(len(shape))]
    return tuple(slice(i * (n // k), (i + 1) * (n // k)) for (i, k), n in zip(cuts, shape))


def local_shard(full: torch.Tensor, placements: Placements, mesh_shape: tuple[int, ...],
                coord: tuple[int, ...]) -> torch.Tensor:
    """This rank's piece of `full` (a contiguous tensor; a view of `full` where that one already is)."""
    return full[local_slices(tuple(full.shape), placements, mesh_shape, coord)].contiguous()


def spread_values(t: torch.Tensor, n: int) -> torch.Tensor:
    """`n` values of `t` spread evenly over it, first and last included (all of a smaller one), flat: read where
    they lie, so a strided tensor is not copied whole. The indices are integers (float32's linspace rounded the
    last index of a 38.6M-value embedding past its end)."""
    t = t.detach()
    if t.numel() <= n:
        return t.reshape(-1)
    at = torch.arange(n, device=t.device) * (t.numel() - 1) // (n - 1)
    return t.reshape(-1)[at] if t.is_contiguous() else t[torch.unravel_index(at, t.shape)]


SAMPLED = 1 << 16  # values a sampled digest reads of a larger tensor


def values_digest(t: torch.Tensor, sampled: bool = False) -> int:
    """64 bits of the SHA-1 of `t`'s values (the same values: the same digest, whatever the strides or
    views); 0 for a tensor with no bytes to read (a subclass), on every rank alike. `sampled`: of `SAMPLED`
    values spread evenly over a larger tensor (the checks after a first call: a batch of another rank's
    differs there too; a 154 MB image batch's whole digest takes a few hundred ms)."""
    import hashlib

    try:
        t = spread_values(t, SAMPLED) if sampled else t.detach()
        raw = t.resolve_conj().resolve_neg().to("cpu").contiguous().flatten()
        raw = raw.to(torch.uint8) if raw.dtype == torch.bool else raw.view(torch.uint8)
        return int.from_bytes(hashlib.sha1(raw.numpy().tobytes()).digest()[:8], "little", signed=True)
    except (RuntimeError, TypeError):
        return 0


def same_piece(saved: tuple, mine: tuple, placements: Placements) -> bool:
    """Whether the piece saved at (coordinate, mesh shape) `saved` is the one this rank holds at `mine`, for a
    tensor laid out as `placements`: the same mesh, and coordinates that differ only along axes it is not split
    on (a checkpoint of rank 0's pieces loaded on rank 1 is another piece where it is split)."""
    (coord, shape), (my_coord, my_shape) = saved, mine
    return tuple(shape) == tuple(my_shape) and all(
        c == m or not isinstance(p, Shard) for c, m, p in zip(coord, my_coord, placements))


def shard_full(full: torch.Tensor, placements: Placements, mesh, coord: tuple[int, ...],
               group_names: tuple[str, ...]) -> torch.Tensor:
    """`local_shard`, differentiable as DTensor's redistribute from Replicate is: the full tensor (the same on
    every rank) gets the whole gradient, its pieces' gradients gathered. (Autograd's own gradient of the slice
    is zero outside this rank's piece: the gradient of an input the user asked for, `x.requires_grad_()`,
    came back with only this rank's rows.)"""
    if torch.is_grad_enabled() and full.requires_grad:
        return _ShardFull.apply(full, tuple(placements), mesh, tuple(coord), tuple(group_names))
    return local_shard(full, placements, mesh.shape, coord)


class _ShardFull(torch.autograd.Function):
    @staticmethod
    def forward(ctx, full, placements, mesh, coord, group_names):
        ctx.layout = (placements, mesh, group_names)
        ctx.set_materialize_grads(False)  # (a piece no used output reaches: None, as the whole's in eager)
        piece = local_shard(full, placements, mesh.shape, coord)
        return piece.clone() if piece._base is not None or piece is full else piece  # (never a view of the input)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None, None, None
        placements, mesh, group_names = ctx.layout
        return _gathered(grad.contiguous(), placements, mesh, group_names), None, None, None, None


def gather_full(local: torch.Tensor, placements: Placements, mesh, coord: tuple[int, ...],
                group_names: tuple[str, ...]) -> torch.Tensor:
    """The full tensor on every rank, from this rank's `local` piece laid out as `placements`. Differentiable
    as DTensor's `full_tensor()` is: every rank is taken to compute the same thing from the full tensor (a
    loss), so the gradient of this rank's piece is its own piece of the full gradient, moved nowhere (a
    reduce_scatter, the gather's autograd transpose, would sum the ranks' copies of one gradient: a loss of
    the gathered outputs got the gradients of a batch split over 2 ranks 2x one device's)."""
    if all(isinstance(p, Replicate) or mesh.shape[axis] == 1 for axis, p in enumerate(placements)):
        return local  # (the piece is the whole: through a Function, writing into it in place was refused)
    if torch.is_grad_enabled() and local.requires_grad:
        return _GatherFull.apply(local, tuple(placements), mesh, tuple(coord), tuple(group_names))
    return _gathered(local, placements, mesh, group_names)


def collective_device(device: torch.device | None) -> torch.device:
    """Where a rank on `device` moves tensors of its own collectives: `device` where the default process group
    moves CUDA tensors with NCCL, else the CPU (gloo given CUDA tensors crashed the process in its all_gather:
    SIGSEGV, seen on an H200 with two ranks sharing the GPU)."""
    import torch.distributed as dist

    if device is None or device.type != "cuda" or not dist.is_initialized():
        return torch.device("cpu")
    return device if "nccl" in str(dist.get_backend()).lower() else torch.device("cpu")


def gather_to_first(local: torch.Tensor, placements: Placements, full_shape: tuple[int, ...],
                    mesh_shape: tuple[int, ...], coord: tuple[int, ...], global_rank) -> torch.Tensor | None:
    """The full tensor on the mesh's first rank (coordinate 0 on every axis), in host memory; None on the others.
    Each part of it is sent once, point to point, by the rank at coordinate 0 along every axis it is not split
    on, and received in turn: no other rank holds more than its own piece, and the first holds the whole and one
    piece at a time (`gather_full` gives every rank the whole, and gloo's all_gather a second copy while it
    runs: 2x the tensor on every rank). `global_rank(coordinate)`: the process's rank there. Bytes travel, so
    any dtype does (gloo sends no bool)."""
    import itertools

    import torch.distributed as dist

    if any(isinstance(p, Partial) for p in placements):
        raise ValueError("gather_to_first: a Partial piece is not a part of the whole; use gather_full")
    senders = [c for c in itertools.product(*(range(n) for n in mesh_shape))
               if all(c[axis] == 0 for axis, p in enumerate(placements) if not isinstance(p, Shard))]
    first = global_rank((0,) * len(mesh_shape))
    via = collective_device(local.device)
    if any(coord):
        if tuple(coord) in senders and local.numel():
            dist.send(local.detach().to(via).contiguous().view(-1).view(torch.uint8), dst=first)
        return None
    full = torch.empty(full_shape, dtype=local.dtype)
    for c in senders:
        region = local_slices(tuple(full_shape), placements, mesh_shape, c)
        if not any(c):
            full[region] = local.detach().cpu()
            continue
        part = full[region]
        if part.numel():
            got = torch.empty(part.numel() * part.element_size(), dtype=torch.uint8, device=via)
            dist.recv(got, src=global_rank(c))
            part.copy_(got.cpu().view(local.dtype).view(part.shape))
    return full


class _GatherFull(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, placements, mesh, coord, group_names):
        # (a Partial axis sums pieces into the whole: each piece's gradient is the whole's, as a Replicate's is)
        ctx.layout = (tuple(p if isinstance(p, Shard) else Replicate() for p in placements), mesh.shape, coord)
        return _gathered(local, placements, mesh, group_names)

    @staticmethod
    def backward(ctx, grad):
        placements, shape, coord = ctx.layout
        return local_shard(grad, placements, shape, coord), None, None, None, None


def _gathered(local: torch.Tensor, placements: Placements, mesh, group_names: tuple[str, ...]) -> torch.Tensor:
    replicated = tuple(Replicate() for _ in placements)
    # (on an axis of size 1 the piece is the whole, and a Partial one its own sum: nothing to gather there. A
    # parameter the forward never reads may be planned Shard on it, and its gather called a group of one)
    placements = tuple(Replicate() if mesh.shape[axis] == 1 else p for axis, p in enumerate(placements))
    shape = list(local.shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            shape[p.dim] *= mesh.shape[axis]
    steps = reshard_steps(tuple(placements), replicated, TensorInfo(tuple(shape), local.dtype), mesh)
    t = local
    for step in steps:
        t = STEP_FUNCTIONS[step.kind](t, **step.call_kwargs(), group=group_names[step.axis], world=mesh.shape[step.axis])
    return t


def max_over_mesh(t: torch.Tensor, mesh_shape: tuple[int, ...], group_names: tuple[str, ...]) -> torch.Tensor:
    """The elementwise maximum of `t` over every rank of the mesh: an all_reduce along each axis in turn
    (the mesh's axes connect it). The first-call checks' flags and GradScaler's found-inf use it."""
    from torch.distributed import _functional_collectives as funcol

    for axis, size in enumerate(mesh_shape):
        if size > 1:
            t = funcol.all_reduce(t, "max", group_names[axis]).wait()
    return t


def extremes_over_mesh(t: torch.Tensor, mesh_shape: tuple[int, ...], group_names: tuple[str, ...]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The elementwise (maximum, minimum) of `t` over every rank of the mesh, in one all_reduce per axis: whether
    the ranks agree on a value (equal where they do)."""
    most, negated_least = max_over_mesh(torch.cat([t.reshape(-1), -t.reshape(-1)]), mesh_shape, group_names).chunk(2)
    return most.view(t.shape), -negated_least.view(t.shape)


def total_norm(tensors: list[tuple[torch.Tensor, Placements]], norm_type: float, mesh_shape: tuple[int, ...],
               group_names: tuple[str, ...]) -> torch.Tensor:
    """The `norm_type`-norm of all the full tensors together (as `torch.nn.utils.get_total_norm` of the
    full tensors), from this rank's local pieces: the same value on every rank.

    Each piece contributes sum |x|^p (max |x| for inf). A full tensor is the union of the pieces along
    the axes where it is Shard, so those axes are summed over; along Replicate axes every rank holds the
    same piece, and summing there would count it again. On a (dp=2, tp=2) mesh:

        [R, S(0)]: rows split over tp      dp=0: rows 0..k | rows k..n    -> all_reduce over tp only
                                           dp=1: the same  | the same
        [S(0), S(1)]: four distinct blocks                                -> over dp, then over tp
        [R, R]: every rank the whole                                      -> nothing

    Tensors are grouped by their set of sharded axes, and each mesh axis reduces once: one all_reduce
    per axis that shards anything, carrying one number per group that includes the axis.
    """
    inf = norm_type == float("inf")
    if not inf and not norm_type > 0:
        raise ValueError(f"total_norm: norm_type must be positive or inf, got {norm_type}")
    groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for t, placements in tensors:
        if any(isinstance(p, Partial) for p in placements):
            raise ValueError(f"total_norm: a Partial piece {placements} has no norm of its own")
        axes = tuple(a for a, p in enumerate(placements) if isinstance(p, Shard))
        local = t.detach()
        # (the piece's norm in its own dtype, as torch's is, then widened before the power: squared in float16, a
        # norm above 256 overflowed and a small one underflowed; found by a probe)
        part = (local.abs().max() if local.numel() else local.new_zeros(())).to(torch.float64) if inf else \
            torch.linalg.vector_norm(local, norm_type).to(torch.float64) ** norm_type
        groups.setdefault(axes, []).append(part)
    keys = sorted(groups)
    if not keys:
        return torch.zeros((), dtype=torch.float64)
    per_group = torch.stack([torch.stack(groups[k]).amax() if inf else torch.stack(groups[k]).sum() for k in keys])
    # a NaN travels as a flag beside each value: gloo's all_reduce(max) dropped one on rank 1 (found by a probe:
    # the inf-norm came back finite and error_if_nonfinite let the clip go on)
    n = len(keys)
    both = torch.cat([torch.where(per_group.isnan(), 0.0, per_group), per_group.isnan().to(torch.float64)])
    for axis in range(len(mesh_shape)):
        rows = [i for i, k in enumerate(keys) if axis in k]
        if rows:
            at = rows + [n + i for i in rows]
            both[at] = STEP_FUNCTIONS["all_reduce"](both[at], reduce_op="max" if inf else "sum",
                                                    group=group_names[axis], world=mesh_shape[axis])
    per_group, nan = both[:n], both[n:]
    norm = per_group.amax() if inf else per_group.sum() ** (1.0 / norm_type)
    return torch.where(nan.any(), torch.nan, norm)
