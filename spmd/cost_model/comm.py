"""Communication cost: the alpha-beta model per mesh axis, with ring factors.

For a collective over the n ranks of one mesh axis whose link has latency a and bus bandwidth b (per
collective kind where the backend differs, `LinkProfile.alpha_beta`), with B the bytes each rank holds
*before* the step:

    all_reduce      a + 2 (n-1)/n * B / b
    reduce_scatter  a +   (n-1)/n * B / b
    all_gather      a +   (n-1)   * B / b      (each rank receives the n-1 other shards)
    all_to_all      a +   (n-1)/n * B / b
    local slice     copy of the kept 1/n into a contiguous buffer, at the device's memory bandwidth
    partial_local   ranks other than index 0 write zeros (sum): one pass over the local bytes

Gathers and scatters on a dim other than 0 also pay a local copy (collectives work on dim 0), priced at
the device's memory bandwidth.
"""
from __future__ import annotations

from typing import Iterable


def step_cost(step, mesh, bucket_bytes: float | None = None) -> float:
    """Seconds for one step. `bucket_bytes`: the step is a gradient all_reduce that the runtime packs
    with others into buckets of that size, so it pays its share of one latency, not a whole one."""
    n = mesh.shape[step.axis]
    latency, bandwidth = mesh.links[step.axis].alpha_beta(step.kind)
    B = step.in_bytes
    if bucket_bytes and step.kind == "all_reduce":
        latency *= min(1.0, B / bucket_bytes)
    if step.kind == "all_reduce":
        wire = 2 * (n - 1) / n * B
    elif step.kind == "reduce_scatter":
        wire = (n - 1) / n * B
    elif step.kind == "all_gather":
        wire = (n - 1) * B
    elif step.kind == "all_to_all":
        wire = (n - 1) / n * B
    elif step.kind == "shard_local":
        return B / n / mesh.device.memory_bandwidth
    elif step.kind == "partial_local":
        return B / mesh.device.memory_bandwidth if step.reduce_op == "sum" else 0.0
    else:
        return 0.0
    copy = 0.0
    moved_dim = step.src_dim if step.kind == "all_gather" else step.dst_dim
    if step.kind in ("all_gather", "reduce_scatter", "all_to_all") and moved_dim not in (0, None):
        copy = 2 * (B * n if step.kind == "all_gather" else B) / mesh.device.memory_bandwidth  # the larger side
    return latency + wire / bandwidth + copy


def steps_cost(steps: Iterable, mesh, bucket_bytes: float | None = None) -> float:
    return sum(step_cost(s, mesh, bucket_bytes) for s in steps)
