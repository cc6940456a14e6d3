"""The per-axis redistribute steps as functions the generated per-rank graphs call.

Each wraps torch's functional collectives (`torch.ops._c10d_functional`, which run on NCCL and gloo)
on the process group of one mesh axis, named by `group`; `world` is that axis's size and `index` this
rank's coordinate on it. Collectives work on dim 0, so other dims are moved there and back.

`where` (set by emit_rank_graph: the value, the mesh axis, the user's source line) is what a failure
says: a collective that fails or times out (a peer died, or stopped answering) raises
`SpmdCollectiveError` naming the collective, the mesh axis and its ranks, and the line that needed it.
"""
from __future__ import annotations

import functools
import math

import torch

from spmd.core.errors import SpmdCollectiveError, SpmdError

_c10d = torch.ops._c10d_functional


def _group_ranks(group: str | None) -> str:
    """The group in words: `ranks [0, 1]`, or its name where it cannot be resolved (gone with the failure)."""
    if group is None:
        return "ranks ?"
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        return f"ranks {dist.get_process_group_ranks(_resolve_process_group(group))}"
    except Exception:  # the group is gone with the failure, or this torch names groups otherwise
        return f"process group {group!r}"


def speaking(fn):
    """`fn` (a step of the generated graph, taking `where=`) whose failures say what ran and where."""
    @functools.wraps(fn)
    def run(*args, where: str = "", **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpmdError:
            raise
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            # (a collective that refuses its input is no dead peer: a probe's complex all_to_all, "Invalid scalar
            # type", was reported as one)
            refused = any(w in str(e) for w in ("Invalid scalar type", "Unsupported data type", "unsupported dtype",
                                                "not supported for", "does not support"))
            # (a group destroyed on this rank, `dist.destroy_process_group()` then a call: no peer died; a probe)
            gone = "Could not resolve the process group" in str(e) or "has not been initialized" in str(e)
            raise SpmdCollectiveError(
                f"{fn.__name__} over {_group_ranks(kwargs.get('group'))} failed"
                + (f" ({where})" if where else "") + f": {type(e).__name__}: {first}\n" + (
                    "The collective refused its input on this backend (no rank died): this is spmd's to fix; please "
                    "report it with this message. What to do meanwhile: pin the value's producer so that it is not "
                    "resharded here (param_placements / in_placements), or keep it in a dtype the backend takes."
                    if refused else
                    "The process groups this module was compiled over are gone on this rank (no rank died): "
                    "`dist.destroy_process_group()` ran since, or the processes started again. What to do: call the "
                    "module before destroying the groups; after a new init_process_group, build the mesh again "
                    "(spmd.init_mesh) and compile the model again on it."
                    if gone else
                    "What to do: a rank of that group died or stopped answering; its own log says why. When a step "
                    "legitimately takes longer than the process group's timeout, raise it: "
                    "spmd.init_mesh(..., timeout=datetime.timedelta(minutes=...)).")) from e
    return run


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _c10d.wait_tensor(t)


def _in_place(x: torch.Tensor, asked: bool) -> bool:
    """Whether to reduce `x` in its own buffer, as `asked`: never under torch.compile, nor where autograd
    records the graph (an inference module called with grad enabled), since autograd may have saved `x`
    for a backward and the in-place collective does not bump its version (the reduced value would be used
    silently)."""
    return asked and not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and x.requires_grad)


def _real(x: torch.Tensor) -> torch.Tensor:
    """A complex tensor as real pairs (a last dim of 2), as torch.distributed's own API sends one: NCCL has no
    complex types, and gloo's all_to_all refuses them (a probe: an FNO's spectral weight pinned on its modes
    failed its first step with "Invalid scalar type"). A bool tensor as bytes: inductor's all_gather of a bool
    gave int64 back (a probe, `compile_graphs=True`: a gathered mask negated, `~mask`, was -1 and -2, and the
    loss 2.21 where eager gave 1.20). Anything else as it is. A conjugate view (`z.conj()`, and what complex
    gradients are made of) is made plain first: `view_as_real` refuses one, and `verify` or `gather_outputs` of
    one failed, said to be a dead peer (a probe)."""
    if x.is_complex():
        return torch.view_as_real(x.resolve_conj().contiguous())
    return x.view(torch.uint8) if x.dtype == torch.bool else x


def _like(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`y`, a collective's result of `_real(x)`, as complex (or bool) again where `x` is."""
    if x.is_complex():
        return torch.view_as_complex(y)
    return y.ne(0) if x.dtype == torch.bool else y  # (not `.view(torch.bool)`: inductor's CPU code for it fails)


def _launch(x: torch.Tensor, reduce_op: str, group: str, inplace: bool) -> torch.Tensor:
    """The all_reduce of `x` launched, not waited for: in `x`'s own buffer where `inplace` (`_in_place`). A complex
    `x` is reduced as real pairs and waited for here (its result a view, which no later wait would find)."""
    op = "sum" if reduce_op == "avg" else reduce_op  # not every backend has AVG: sum, then scale
    x = x.contiguous()  # (x itself where it is contiguous)
    if x.is_complex():
        return _like(_wait(_launch(_real(x), reduce_op, group, inplace)), x)
    return _c10d.all_reduce_(x, op, group) if inplace else _c10d.all_reduce(x, op, group)


@speaking
def all_reduce(x: torch.Tensor, reduce_op: str, group: str, world: int, inplace: bool = False) -> torch.Tensor:
    """Out of place by default: the Partial value may have other readers in the graph, which reducing it
    in place would hand the reduced value (and the functional all_reduce clones its input for that).
    `inplace`: `x` is read by nothing else and aliases nothing that is (passes/reduce_in_place.py), so
    its buffer is reduced where it is: no clone, no fresh allocation. The functional form all the same
    under torch.compile (its functionalization takes no in-place collective; inductor places buffers
    itself) and where autograd records the call (`_in_place`)."""
    inplace = _in_place(x, inplace)
    y = _wait(_launch(x, reduce_op, group, inplace))
    if reduce_op != "avg":
        return y
    return y.div_(world) if inplace else y / world


@speaking
def all_reduce_start(x: torch.Tensor, reduce_op: str, group: str, world: int, inplace: bool = False) -> torch.Tensor:
    """`all_reduce` launched, not waited for: read the result only through `all_reduce_wait`, and launch
    nothing else on `group` in between (gloo pairs up two collectives in flight on one group wrongly).
    passes/overlap_collectives.py places the two around work that does not need the result."""
    return _launch(x, reduce_op, group, _in_place(x, inplace))


@speaking
def all_reduce_wait(pending: torch.Tensor, reduce_op: str, world: int, group: str | None = None) -> torch.Tensor:
    """The result of `all_reduce_start`'s all_reduce, once it has arrived."""
    y = _wait(pending)
    return y / world if reduce_op == "avg" else y


@speaking
def all_gather(x: torch.Tensor, dim: int, group: str, world: int) -> torch.Tensor:
    y = _like(_wait(_c10d.all_gather_into_tensor(_real(x.contiguous()), world, group)), x)
    return y if dim == 0 else torch.cat(y.chunk(world, 0), dim)


@speaking
def reduce_scatter(x: torch.Tensor, dim: int, reduce_op: str, group: str, world: int) -> torch.Tensor:
    if dim != 0:
        x = torch.cat(x.chunk(world, dim), 0)
    op = "sum" if reduce_op == "avg" else reduce_op
    y = _like(_wait(_c10d.reduce_scatter_tensor(_real(x.contiguous()), op, world, group)), x)
    return y / world if reduce_op == "avg" else y


@speaking
def all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, group: str, world: int) -> torch.Tensor:
    """Sharded on `src_dim` -> sharded on `dst_dim`: block j (chunk j along dst_dim) goes to rank j."""
    blocks = torch.cat(x.chunk(world, dst_dim), 0).contiguous()
    rows = [blocks.shape[0] // world] * world
    y = _like(_wait(_c10d.all_to_all_single(_real(blocks), rows, rows, group)), x)
    del blocks  # (sent: not held beside the result's own copy below; a memory probe, 1.12x on a (2, 2, 2) mesh)
    return y if src_dim == 0 else torch.cat(y.chunk(world, 0), src_dim)


def shard_local(x: torch.Tensor, dim: int, index: int, world: int) -> torch.Tensor:
    """Replicate -> Shard(dim): keep this rank's piece (no communication)."""
    # A copy even where the piece is already contiguous: a view would keep the whole tensor alive (a
    # sharded gradient would pin the full one). The cost model prices this copy.
    if x.layout == torch.sparse_coo:  # nn.Embedding(sparse=True)'s gradient, made whole: its rows, as chunk cuts
        size = -(-x.shape[dim] // world)
        start = min(index * size, x.shape[dim])
        return x.narrow_copy(dim, start, min(size, x.shape[dim] - start))
    pieces = x.chunk(world, dim)
    if index >= len(pieces):  # (a probe: a bare IndexError)
        raise SpmdError(
            f"a value of shape {tuple(x.shape)} has no piece {index} of {world} on dim {dim}: it is smaller than the "
            "traced value this rank's piece was planned from. An op returned another shape than the trace said; "
            "for an op of your own (`torch.library`), its fake implementation must state the shape its kernel "
            "returns. `compiled.verify(...)` compares each value with one device's.")
    return pieces[index].clone(memory_format=torch.contiguous_format)


def partial_local(x: torch.Tensor, reduce_op: str, index: int) -> torch.Tensor:
    """Replicate -> Partial: for sum, index 0 keeps the value and the others hold zeros."""
    if reduce_op == "sum" and index != 0:
        return torch.zeros_like(x)
    return x


@speaking
def bucket_start(tensors: list[torch.Tensor], reduce_op: str, group: str, world: int) -> torch.Tensor:
    """One all_reduce for many tensors: flatten them into one buffer and launch it."""
    # in place (see all_reduce): the buffer is new, and read by bucket_wait alone
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return _launch(flat, reduce_op, group, _in_place(flat, True))


@speaking
def bucket_wait(flat: torch.Tensor, shapes: list[tuple[int, ...]], reduce_op: str, world: int,
                group: str | None = None, views: bool = False) -> list[torch.Tensor]:
    """Wait for a bucket and cut it back into tensors of `shapes` (the gradients' own shapes: not the
    gradients, which `bucket_start` copied into the bucket, so that they die at its launch and not here, a
    second copy of them held through the collective; a memory probe, 1.10x the predicted peak). `views`: the
    pieces are views of the bucket, which is right where every piece lives as long as the others (all are the
    graph's outputs, gradients held until the optimizer's step); else copies, since a view would keep the
    whole bucket alive for as long as any one piece lives, which the memory plan does not count."""
    flat = _wait(flat)
    if reduce_op == "avg":
        flat = flat.div_(world)
    pieces = flat.split([math.prod(shape) for shape in shapes])
    if views:
        return [p.view(shape) for p, shape in zip(pieces, shapes)]
    return [p.view(shape).clone() for p, shape in zip(pieces, shapes)]


STEP_FUNCTIONS = {
    "all_reduce": all_reduce,
    "all_gather": all_gather,
    "reduce_scatter": reduce_scatter,
    "all_to_all": all_to_all,
    "shard_local": shard_local,
    "partial_local": partial_local,
}
