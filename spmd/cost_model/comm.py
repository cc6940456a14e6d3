"""Communication cost: the alpha-beta model per mesh axis, with ring factors.

For a collective over the n ranks of one mesh axis whose link has latency a and bus bandwidth b (per
collective kind where the backend differs, `LinkProfile.alpha_beta`), with B the bytes each rank holds
*before* the step:

    all_reduce      a + 2 (n-1)/n * B / b
    reduce_scatter  a +   (n-1)/n * B / b
    all_gather      a +   (n-1)   * B / b      (each rank receives the n-1 other shards)
    all_to_all      a +   (n-1)/n * B / b
    local slice     copy of the kept 1/n into a contiguous buffer
    partial_local   ranks other than index 0 write zeros (sum): one pass over the local bytes

Gathers and scatters on a dim other than 0 also pay a local copy (collectives work on dim 0). Local
copies go through the device's memory hierarchy (`compute.copy_seconds`: the bandwidth of the level the
bytes fit in, and the page faults of a fresh output on a CPU); a collective's own buffers are in its
link's measured bandwidth.

Gradient buckets: the runtime packs a rank's gradient all_reduces on one mesh axis into buckets of
`bucket_bytes` (passes/bucket_gradients.py) and launches one collective per bucket. A gradient pays its
bandwidth plus its share of a bucket's latency, `bucket_share` = min(1, B / bucket_bytes) (a gradient
larger than a bucket fills one of its own); together the gradients on an axis pay
`latency * max(1, sum of shares)`, at least one launch: `bucketed_latency`. The solver, the symbolic
costs and the plan's explanations all price buckets with these two functions. Each bucketed gradient
also pays its packing (`bucket_packing`): copied into the bucket's flat buffer, which is reduced in place
and read back through views (where a piece flows on to another collective instead of leaving the graph,
the runtime copies it out: a chain over two mesh axes, which this leaves unpriced).
"""
from __future__ import annotations

import functools
from typing import Iterable

from spmd.core.redistribute import Step, pick, shortest_redistributions
from spmd.core.specs import Placements, TensorInfo
from spmd.cost_model.compute import copy_seconds

WIRE_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
               "all_gather": lambda n: float(n - 1), "all_to_all": lambda n: (n - 1) / n}


def wire_bytes(kind: str, n: int, nbytes: float) -> float:
    """Bytes one rank moves for collective `kind` over `n` ranks that each hold `nbytes` before it."""
    return WIRE_FACTOR[kind](n) * nbytes


def bucket_share(nbytes, bucket_bytes: float):
    """The part of one bucket's launch a gradient of `nbytes` pays (works on sympy expressions too)."""
    share = nbytes / bucket_bytes
    return min(1.0, share) if isinstance(share, (int, float)) else _sympy_min(1, share)


def bucket_packing(device, nbytes):
    """What packing a gradient of `nbytes` into its bucket costs: `bucket_start` copies it into the flat
    buffer; the reduced piece comes back as a view of it (runtime: core/collectives.py)."""
    return copy_seconds(device, nbytes)


def bucketed_latency(latency: float, shares: list):
    """What the gradient all_reduces on one axis pay in latency together: at least one launch."""
    total = sum(shares)
    return latency * (max(1.0, total) if isinstance(total, (int, float)) else _sympy_max(1, total))


def _sympy_min(a, b):
    import sympy

    return sympy.Min(a, b)


def _sympy_max(a, b):
    import sympy

    return sympy.Max(a, b)


def all_reduce_seconds(mesh, axis: int, nbytes: float) -> float:
    """Seconds one all_reduce of `nbytes` per rank takes on mesh axis `axis` (a bucket's, or a lone one's)."""
    n, link = mesh.shape[axis], mesh.links[axis]
    return link.alpha_beta("all_reduce")[0] + link.transfer_seconds("all_reduce", wire_bytes("all_reduce", n, nbytes))


def step_cost(step: Step, mesh, bucket_bytes: float | None = None) -> float:
    """Seconds for one step. `bucket_bytes`: the step is a gradient all_reduce that the runtime packs
    with others into buckets of that size, so it pays its share of one latency, not a whole one."""
    n = mesh.shape[step.axis]
    latency = mesh.links[step.axis].alpha_beta(step.kind)[0]
    B = step.in_bytes
    device = mesh.device
    copy = 0.0
    if bucket_bytes and step.kind == "all_reduce":
        latency *= bucket_share(B, bucket_bytes)
        copy = bucket_packing(device, B)
    if step.kind == "shard_local":
        return copy_seconds(device, B / n)
    if step.kind == "partial_local":
        return copy_seconds(device, B, read=False) if step.reduce_op == "sum" else 0.0  # zeros_like
    if step.kind not in WIRE_FACTOR:
        return 0.0
    moved_dim = step.src_dim if step.kind == "all_gather" else step.dst_dim
    if step.kind in ("all_gather", "reduce_scatter", "all_to_all") and moved_dim not in (0, None):
        copy = copy_seconds(device, B * n if step.kind == "all_gather" else B)  # the larger side
    return latency + mesh.links[step.axis].transfer_seconds(step.kind, wire_bytes(step.kind, n, B)) + copy


def steps_cost(steps: Iterable[Step], mesh, bucket_bytes: float | None = None) -> float:
    return sum(step_cost(s, mesh, bucket_bytes) for s in steps)


@functools.lru_cache(maxsize=65536)
def reshard_paths(src: Placements, tensor: TensorInfo, mesh, bucket_bytes: float | None = None) -> dict:
    """layout -> (seconds, steps) for every layout reachable from `src`: the one redistribute planner
    (core/redistribute.py) priced by `step_cost`. `bucket_bytes`: all_reduces are gradient reductions
    packed into buckets of that size."""
    return shortest_redistributions(tuple(src), tensor, mesh, lambda step: step_cost(step, mesh, bucket_bytes))


def reshard_steps(src: Placements, dst: Placements, tensor: TensorInfo, mesh,
                  bucket_bytes: float | None = None) -> tuple[Step, ...]:
    """The cheapest legal sequence of per-axis steps turning layout `src` into `dst` on `mesh`."""
    if tuple(src) == tuple(dst):
        return ()
    return pick(reshard_paths(tuple(src), tensor, mesh, bucket_bytes), src, dst, tensor, mesh)
