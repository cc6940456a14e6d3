"""Run every rank's generated graph in ONE process, in lockstep: a numerical oracle for whole plans.

The rank graphs of a plan have the same nodes in the same order (they differ in baked coordinates), so
we step through them together; ordinary nodes run per rank, and each collective step is computed from
all its group's inputs (the ranks that share every coordinate but the step's axis). No process group is
needed, so tests can check many plans (random pins included) quickly.
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx

from spmd.core import collectives as C
from spmd.passes.emit_rank_graph import emit_rank_graph
from spmd.passes.insert_collectives import insert_collectives
from spmd.runtime.distribute import local_shard

_REDUCE = {"sum": lambda ts: sum(ts[1:], ts[0]), "avg": lambda ts: sum(ts[1:], ts[0]) / len(ts),
           "max": lambda ts: torch.stack(ts).amax(0), "min": lambda ts: torch.stack(ts).amin(0),
           "product": lambda ts: torch.stack(ts).prod(0)}  # (Partial(product): a prod's pieces, found by a probe)


def _groups(mesh, axis: int) -> list[list[int]]:
    """Ranks along `axis`, ordered by their coordinate on it; one list per fixed other coordinates."""
    by_rest: dict[tuple, list[tuple[int, int]]] = {}
    for rank in range(mesh.size):
        coord = mesh.coordinate(rank)
        by_rest.setdefault(coord[:axis] + coord[axis + 1:], []).append((coord[axis], rank))
    return [[r for _, r in sorted(members)] for members in by_rest.values()]


def _collective(fn, values: list, kwargs: dict, mesh, axis: int) -> list:
    out = [None] * len(values)
    for group in _groups(mesh, axis):
        xs = [values[r] for r in group]
        n = len(group)
        for i, r in enumerate(group):
            if fn is C.all_reduce:
                out[r] = _REDUCE[kwargs["reduce_op"]](xs)
            elif fn is C.all_gather:
                out[r] = torch.cat(xs, kwargs["dim"])
            elif fn is C.reduce_scatter:
                out[r] = _REDUCE[kwargs["reduce_op"]](xs).chunk(n, kwargs["dim"])[i]
            elif fn is C.all_to_all:
                out[r] = torch.cat([x.chunk(n, kwargs["dst_dim"])[i] for x in xs], kwargs["src_dim"])
            else:
                raise NotImplementedError(fn)
    return out


def simulate(compilation, full_inputs: tuple) -> list:
    """Each rank's flat outputs for full `inputs` (then full tangents, for a joint graph), computed by
    stepping all rank graphs together.

    `compilation` is a `spmd.compiler.pipeline.Compilation` (its global graph is made here when the
    pipeline ran for no rank).
    """
    c = compilation
    mesh = c.mesh
    names = tuple(f"sim-axis{i}" for i in range(mesh.ndim))
    global_gm = c.global_gm if c.global_gm is not None else insert_collectives(c.traced, c.plan)
    graphs = [emit_rank_graph(global_gm, mesh, r, names) for r in range(mesh.size)]
    by_placeholder = c.traced.input_by_placeholder()
    user = iter(full_inputs)
    envs: list[dict[str, object]] = [{} for _ in graphs]

    def lookup(env):
        return lambda a: env[a.name] if isinstance(a, fx.Node) else a

    for nodes in zip(*(list(g.graph.nodes) for g in graphs)):  # rank graphs align node by node
        node = nodes[0]
        if node.op == "placeholder":
            gi = by_placeholder[node.name]
            full = next(user) if gi.kind in ("input", "tangent") else c.traced.state[gi.name]
            ps = c.plan.choices[node.name].outputs[0]
            for r, env in enumerate(envs):
                env[node.name] = local_shard(full.detach(), ps, mesh.shape, mesh.coordinate(r))
            continue
        if node.op == "output":
            return [fx.node.map_aggregate(n.args[0], lookup(env)) for n, env in zip(nodes, envs)]
        if node.op == "get_attr":  # (a higher-order op's subgraph: torch.cond's branches)
            for n, g, env in zip(nodes, graphs, envs):
                env[n.name] = functools.reduce(getattr, n.target.split("."), g)
            continue
        args = [fx.node.map_aggregate(n.args, lookup(env)) for n, env in zip(nodes, envs)]
        kwargs = [fx.node.map_aggregate(dict(n.kwargs), lookup(env)) for n, env in zip(nodes, envs)]
        if node.target in (C.all_reduce, C.all_gather, C.reduce_scatter, C.all_to_all):
            kw = dict(kwargs[0])
            axis = names.index(kw.pop("group"))
            kw.pop("world")
            kw.pop("where", None)
            results = _collective(node.target, [a[0] for a in args], kw, mesh, axis)
        else:  # each rank draws from the same generator state, as ranks seeded alike do
            state = torch.get_rng_state()
            results = []
            for a, kw in zip(args, kwargs):
                torch.set_rng_state(state)
                results.append(node.target(*a, **kw))
        for env, value in zip(envs, results):
            env[node.name] = value
    raise AssertionError("graph without output")
