"""The one redistribute planner: spec A -> spec B on an N-D mesh as a list of per-axis steps.

Both the edge costs the solver sees and the collectives code generation inserts come from this search,
so the cost the solver minimizes is exactly what runs. The search is priced by whoever asks (the cost
model's `comm.step_cost`: `cost_model.comm.reshard_paths` is the cached entry point).

Per-axis steps (n = ranks on that axis):

    P -> R     all_reduce       P -> S(d)  reduce_scatter     S(d) -> R   all_gather
    R -> S(d)  local slice      S(d)->S(e) all_to_all         R -> P      keep on index 0 (sum)

Axes that shard the same tensor dim nest left to right: on a 2x2 mesh [S(0), S(0)] cuts dim 0 in four
and rank (a, b) holds piece 2a + b. A step may only touch the innermost sharding of a dim (no axis to
its right shards that dim), so un-sharding runs right to left and sharding left to right. The planner
searches layouts (Dijkstra over single legal steps) and keeps the cheapest sequence.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Iterator

from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.core.errors import SpmdInternalError
from spmd.core.specs import Placements, TensorInfo, local_shape, placements_str


@dataclass(frozen=True, slots=True)
class Step:
    """One collective (or local op) on one mesh axis.

    kind: all_reduce | reduce_scatter | all_gather | all_to_all | shard_local | partial_local
    src_dim / dst_dim: tensor dims involved (gather/scatter dims), reduce_op: for reductions.
    `local_in_shape` is the per-rank shape entering the step.
    """

    kind: str
    axis: int
    src_dim: int | None
    dst_dim: int | None
    reduce_op: str | None
    local_in_shape: tuple[int, ...]
    itemsize: int

    @property
    def is_collective(self) -> bool:
        return self.kind not in ("shard_local", "partial_local")

    @property
    def in_bytes(self) -> int:
        n = 1
        for s in self.local_in_shape:
            n *= s
        return n * self.itemsize

    def call_kwargs(self) -> dict:
        """Keyword arguments of this step's function in `spmd.core.collectives` (minus group/rank)."""
        return {
            "all_reduce": lambda: {"reduce_op": self.reduce_op},
            "all_gather": lambda: {"dim": self.src_dim},
            "reduce_scatter": lambda: {"dim": self.dst_dim, "reduce_op": self.reduce_op},
            "all_to_all": lambda: {"src_dim": self.src_dim, "dst_dim": self.dst_dim},
            "shard_local": lambda: {"dim": self.dst_dim},
            "partial_local": lambda: {"reduce_op": self.reduce_op},
        }[self.kind]()

    def __str__(self) -> str:
        detail = []
        if self.reduce_op:
            detail.append(self.reduce_op)
        if self.src_dim is not None:
            detail.append(f"from dim {self.src_dim}")
        if self.dst_dim is not None:
            detail.append(f"to dim {self.dst_dim}")
        return f"{self.kind}(axis {self.axis}{', ' + ', '.join(detail) if detail else ''})"


def _direct(src, dst) -> tuple[str, int | None, int | None, str | None] | None:
    """The single-step transition src -> dst on one axis, or None if it needs an intermediate R.
    (Shard and Replicate by type, as `specs.shard_factor` does: they have no subclasses; Partial does.)"""
    kind = type(src)
    if kind is Shard:
        if type(dst) is Replicate:
            return ("all_gather", src.dim, None, None)
        if type(dst) is Shard:
            return ("all_to_all", src.dim, dst.dim, None)
        return None
    if kind is not Replicate and isinstance(src, Partial):
        if type(dst) is Replicate:
            return ("all_reduce", None, None, src.reduce_op)
        if type(dst) is Shard:
            return ("reduce_scatter", None, dst.dim, src.reduce_op)
        return None
    if type(dst) is Shard:
        return ("shard_local", None, dst.dim, None)
    if isinstance(dst, Partial):
        return ("partial_local", None, None, dst.reduce_op)
    return None


def _legal(cur, axis: int, dims) -> bool:
    """A step on `axis` may touch dim d only if no axis to its right shards d."""
    return not any(type(p) is Shard and p.dim in dims for p in cur[axis + 1:])


def single_steps(cur: Placements, tensor: TensorInfo, mesh, partials, skip=()) -> Iterator[tuple[Placements, Step]]:
    """Every layout one legal per-axis step turns `cur` into, with that step (in a fixed order: equal on
    every rank). `partials`: the Partial placements a Replicate axis may turn into; `skip`: layouts not
    wanted (a search's finished ones), left out before their step is built."""
    shape = local_shape(tensor.shape, cur, mesh.shape)
    options = [Replicate()] + [Shard(d) for d in range(len(tensor.shape))]
    for axis in range(len(cur)):
        for target in options if isinstance(cur[axis], Partial) else options + list(partials):
            if target == cur[axis]:
                continue
            move = _direct(cur[axis], target)
            if move is None or not _legal(cur, axis, move[1:3]):
                continue
            nxt = cur[:axis] + (target,) + cur[axis + 1:]
            if nxt in skip or isinstance(target, Shard) and shape[target.dim] % mesh.shape[axis]:
                continue  # (uneven: it would cut the local dim unevenly)
            yield nxt, Step(move[0], axis, move[1], move[2], move[3], shape, tensor.dtype.itemsize)


def shortest_redistributions(src: Placements, tensor: TensorInfo, mesh, price: Callable[[Step], float]) -> dict:
    """Dijkstra over layouts from `src`: every reachable layout -> (cost, steps), each step priced by
    `price`. Edges are `single_steps` between even layouts. Partial layouts appear only where `src` has
    them, or as Partial(sum) (the only one a consumer asks for from a Replicate input)."""
    src = tuple(src)
    # a list, not a set: Partial's hash includes a string, and string hashes differ between processes,
    # so set order would break ties differently on different ranks (and hang their collectives)
    partials = list(dict.fromkeys([Partial("sum")] + [p for p in src if isinstance(p, Partial)]))
    best: dict = {src: (0.0, ())}
    heap = [(0.0, 0, src)]
    counter = itertools.count(1)
    done = set()
    while heap:
        cost, _, cur = heapq.heappop(heap)
        if cur in done:
            continue
        done.add(cur)
        for nxt, step in single_steps(cur, tensor, mesh, partials, done):
            c = cost + price(step)
            if nxt not in best or c < best[nxt][0] - 1e-15:
                best[nxt] = (c, best[cur][1] + (step,))
                heapq.heappush(heap, (c, next(counter), nxt))
    return best


def pick(paths: dict, src: Placements, dst: Placements, tensor: TensorInfo, mesh) -> tuple[Step, ...]:
    """The steps to `dst` out of `shortest_redistributions`' answer (an internal error when none reach it)."""
    if tuple(src) == tuple(dst):
        return ()
    if tuple(dst) not in paths:
        raise SpmdInternalError(f"no redistribution {placements_str(src)} -> {placements_str(dst)} "
                                f"for shape {tensor.shape} on mesh {mesh}")
    return paths[tuple(dst)][1]


def after_step(step: Step):
    """The placement an axis holds after `step` ran on it."""
    if step.kind in ("all_reduce", "all_gather"):
        return Replicate()
    if step.kind in ("reduce_scatter", "all_to_all", "shard_local"):
        return Shard(step.dst_dim)
    return Partial(step.reduce_op)
