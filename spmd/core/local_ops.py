"""Rank-dependent local ops the generated graphs call where a sharded dim is indexed (vocab parallelism),
and random ops on a piece of a tensor (`dropout_piece`).

A table split by rows over ranks (an embedding's vocabulary, the logits' classes) is indexed by values
that name global rows. Each rank holds rows [start, start + rows): it looks up the indices that fall
there, shifted to its own numbering, and contributes zeros for the others, so the sum over the ranks
holding the slices is the full result (a Partial(sum) value; DTensor's `_MaskPartial`). emit_rank_graph
rewrites the op to one of these with this rank's `start` (passes/rules/vocab_parallel.py).
"""
from __future__ import annotations

import itertools

import torch

aten = torch.ops.aten


def _local_indices(indices: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices shifted to this rank's rows, with 0 where outside; the mask of those outside)."""
    outside = (indices < start) | (indices >= start + rows)
    return (indices - start).masked_fill(outside, 0), outside


def in_range(indices: torch.Tensor, size: int, what: str) -> None:
    """Raise as one device's lookup does where an index names no row of the whole table (`size` rows): the
    masked lookups below would take it for another rank's row, and every rank would add zeros for it (an id past
    the vocabulary read a zero embedding, a target past the classes a loss, silently; found by a probe). On CUDA,
    and under torch.compile, a device-side assert, as eager's kernels have: no wait for the device."""
    if indices.is_cuda or torch.compiler.is_compiling():
        torch._assert_async(((indices >= 0) & (indices < size)).all(), f"{what}: index out of range")
    elif indices.numel() and ((bounds := torch.aminmax(indices)).min < 0 or bounds.max >= size):
        bad = indices[(indices < 0) | (indices >= size)][0]
        raise IndexError(f"{what}: index {int(bad)} is out of bounds for size {size} (the dim is split over the "
                         "ranks; one device raises here too)")


def masked_embedding(weight: torch.Tensor, indices: torch.Tensor, start: int, total: int) -> torch.Tensor:
    """`aten.embedding` over rows [start, start + len(weight)) of a table of `total` rows: zeros where an index
    falls outside them."""
    in_range(indices, total, "embedding")
    local, outside = _local_indices(indices, start, weight.shape[0])
    return aten.embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0)


def masked_embedding_backward(grad: torch.Tensor, indices: torch.Tensor, rows: int, padding_idx: int,
                              start: int) -> torch.Tensor:
    """The gradient of this rank's rows [start, start + rows) of the table (`embedding_dense_backward`
    restricted to them); `padding_idx` is global (-1: none)."""
    local, outside = _local_indices(indices, start, rows)
    pad = padding_idx - start if start <= padding_idx < start + rows else -1
    return aten.embedding_dense_backward(grad.masked_fill(outside.unsqueeze(-1), 0), local, rows, pad, False)


def masked_gather(x: torch.Tensor, dim: int, index: torch.Tensor, start: int, total: int) -> torch.Tensor:
    """`aten.gather(x, dim, index)` where `x` holds entries [start, start + x.shape[dim]) of `dim`, `total` in
    all: zeros where an index falls outside them (the loss's pick of each target's log-probability)."""
    in_range(index, total, "gather")
    local, outside = _local_indices(index, start, x.shape[dim])
    return aten.gather(x, dim, local).masked_fill(outside, 0)


def masked_nll_loss_backward(grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor, weight, reduction: int,
                             ignore_index: int, total_weight: torch.Tensor, start: int) -> torch.Tensor:
    """`nll_loss_backward` for the classes [start, start + x.shape[1]) this rank holds: targets outside
    them are ignored here (their gradient lives on another rank); `total_weight` is the global one."""
    classes = x.shape[1] if x.dim() > 1 else x.shape[0]
    outside = (target < start) | (target >= start + classes) | (target == ignore_index)
    # -1 is never one of this rank's classes, whatever the user's ignore_index is
    local = (target - start).masked_fill(outside, -1)
    w = weight[start:start + classes] if weight is not None else None
    return aten.nll_loss_backward(grad, x, local, w, reduction, -1, total_weight)


def in_traced_layout(x: torch.Tensor, contiguous: bool) -> torch.Tensor:
    """`x` contiguous, or not, as the traced value was. torch's determinant and solve factor a contiguous matrix's
    transpose, and the backward traced with them solves with the factors of whichever they saw (its `adjoint` is a
    constant of the graph): a piece all-gathered contiguous where the trace saw a transposed view got a gradient
    46.9 off (found by a probe)."""
    if x.is_contiguous() == contiguous or x.dim() < 2 or x.shape[-1] < 2 or x.shape[-2] < 2:
        return x
    return x.contiguous() if contiguous else x.mT.contiguous().mT


def owns_its_storage(x: torch.Tensor) -> bool:
    """Whether `x` is contiguous over the whole of its storage, from its start (no view of another tensor)."""
    return x.is_contiguous() and x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.numel() * x.element_size()


def owning_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` contiguous from the start of a storage of its own, as the traced input of an `as_strided` was (it reads
    the storage, not the tensor: a piece gathered or viewed in another layout is read elsewhere). Under
    torch.compile always a copy (the storage's size is a graph break; a review)."""
    return x if not torch.compiler.is_compiling() and owns_its_storage(x) else x.clone(
        memory_format=torch.contiguous_format)


def drawn_in_layout(name: str, stride: tuple[int, ...], x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The random op `aten.<name>` (`rand_like.default`, `bernoulli.p`) on `x` laid out with `stride`, as one
    device's input was: the kernel fills memory in order, so another layout draws other numbers where they land."""
    packet, overload = name.split(".")
    if tuple(x.stride()) != tuple(stride):  # (laid out as traced already: drawn on it)
        x = torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device).copy_(x)
    if name == "bernoulli.default" and torch.compiler.is_compiling() and not args and \
            all(v is None for v in kwargs.values()):
        return BERNOULLI_AS_EAGER(x, next(_DRAWS))
    return getattr(getattr(aten, packet), overload)(x, *args, **kwargs)


_DRAWS = itertools.count()  # (each call site of `bernoulli_as_eager` its own number: see there)


@torch.library.custom_op("spmd::bernoulli_as_eager", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def bernoulli_as_eager(p: torch.Tensor, draw: int) -> torch.Tensor:
    """`torch.bernoulli(p)`, which torch.compile cannot take apart: inductor decomposes `aten.bernoulli.default`
    into `rand_like(p, dtype=float32) < p` even with `fallback_random`, which draws other numbers than eager's
    kernel for float64 (a probe: a loss 0.0049 off one device at the first step under `compile_graphs=True`, and
    the generator left elsewhere). Called in the rank graphs handed to torch.compile (runtime/compiled.py
    `_runner`). `draw`: a number of its own per call site, which the op ignores: a common-subexpression pass
    merges two calls with the same arguments (AOTAutograd's skips a fixed list of torch's random ops, not this
    tag; a review), and two draws of one `p` are two draws."""
    return torch.bernoulli(p)


@bernoulli_as_eager.register_fake
def _bernoulli_as_eager_fake(p: torch.Tensor, draw: int) -> torch.Tensor:
    return torch.empty_like(p)


def _bernoulli_as_eager_backward(ctx, grad: torch.Tensor):
    return torch.zeros_like(grad), None  # (as torch's own bernoulli: no gradient reaches the probabilities)


bernoulli_as_eager.register_autograd(_bernoulli_as_eager_backward)
BERNOULLI_AS_EAGER = torch.ops.spmd.bernoulli_as_eager.default  # (the op as a graph node calls it)


def dropout_piece(x: torch.Tensor, p: float, train: bool | None, shape: tuple[int, ...],
                  pieces: tuple[tuple[int, int, int], ...], stride: tuple[int, ...] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`native_dropout` on this rank's piece `x` of a tensor of global `shape`, equal to that piece of one
    device's result: the mask is drawn whole by the same kernel from the same generator state (so the
    generator also moves on as on one device), on an empty tensor laid out as one device's input was
    (`stride`; None: contiguous), and cut to the piece; only the piece is kept (and saved for backward).
    `pieces`: (dim, start, length) of each dim the piece is cut on (rules/random.py)."""
    if train is False or p == 0.0:  # no draw: the op is the identity (and its mask all ones)
        return aten.native_dropout(x, p, train)
    whole = torch.empty(shape, dtype=x.dtype, device=x.device) if stride is None else \
        torch.empty_strided(shape, stride, dtype=x.dtype, device=x.device)
    _, mask = aten.native_dropout(whole, p, train)
    for dim, start, length in pieces:
        mask = mask.narrow(dim, start, length)
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    return x.mul(mask).mul_(scale), mask.contiguous()
