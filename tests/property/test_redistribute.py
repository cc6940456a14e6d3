"""Unit and property tests of the one redistribute planner (core/redistribute.py, priced by comm.reshard_steps).

The oracle simulates every rank in one process: a layout is the list of per-rank local tensors (rank r at
row-major coordinate `MeshSpec.coordinate(r)`), and each Step acts on the ranks that share all coordinates
but the one on `step.axis`:

    mesh (2, 2)        all_gather on axis 1 runs in the rows {0, 1} and {2, 3};
      [ 0 , 1 ]        all_gather on axis 0 in the columns {0, 2} and {1, 3}.
      [ 2 , 3 ]

Whatever the plan, every rank must end up holding `local_shard(full, dst, ...)`.
"""
from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.cost_model.comm import step_cost, steps_cost
from spmd.core.errors import SpmdInternalError
from spmd.core.mesh import MeshSpec
from spmd.core.redistribute import Step
from spmd.cost_model.comm import reshard_steps as plan_redistribute
from spmd.core.collectives import STEP_FUNCTIONS
from spmd.runtime.distribute import local_shard
from spmd.core.specs import TensorInfo, all_placements, is_even, local_shape, placements_str, shard_factor

F64 = torch.float64
MESHES = ((2,), (3,), (2, 2), (2, 3), (2, 2, 2))
TOL = dict(rtol=1e-10, atol=1e-10)
_REDUCE = {"sum": lambda ts: ts.sum(0), "avg": lambda ts: ts.mean(0),
           "max": lambda ts: ts.amax(0), "min": lambda ts: ts.amin(0)}


def mesh_of(shape: tuple[int, ...]) -> MeshSpec:
    return MeshSpec(shape, tuple(f"a{i}" for i in range(len(shape))))


# ---------------------------------------------------------------------------------------------------
# Simulated ranks.

def _partial_parts(t: torch.Tensor, n: int, op: str, gen: torch.Generator) -> list[torch.Tensor]:
    """n rank-specific random tensors whose `op`-reduction is `t`."""
    noise = torch.randn((n, *t.shape), generator=gen, dtype=t.dtype)
    if op == "sum":
        return [*noise[:-1], t - noise[:-1].sum(0)]
    if op == "avg":
        return list(t + noise - noise.mean(0))
    winner = torch.randint(0, n, t.shape, generator=gen)  # max/min: one rank per element holds t itself
    sign = -1.0 if op == "max" else 1.0
    return [torch.where(winner == i, t, t + sign * noise[i].abs()) for i in range(n)]


def distribute(full: torch.Tensor, placements, mesh: MeshSpec, gen) -> list[torch.Tensor]:
    """Per-rank locals of `full` laid out as `placements` (Partial parts random), outer axes split first."""
    layout = {(): full}
    for axis, p in enumerate(placements):
        n, nxt = mesh.shape[axis], {}
        for coord, t in layout.items():
            parts = (t.chunk(n, p.dim) if isinstance(p, Shard) else
                     _partial_parts(t, n, p.reduce_op, gen) if isinstance(p, Partial) else [t] * n)
            for i in range(n):
                nxt[coord + (i,)] = parts[i].contiguous()
        layout = nxt
    return [layout[mesh.coordinate(r)] for r in range(mesh.size)]


def _apply(step: Step, xs: list[torch.Tensor], i: int, n: int) -> torch.Tensor:
    """What member i of a group of n ranks holding `xs` (in axis order) has after `step`."""
    if step.kind == "all_reduce":
        return _REDUCE[step.reduce_op](torch.stack(xs))
    if step.kind == "reduce_scatter":
        return _REDUCE[step.reduce_op](torch.stack(xs)).chunk(n, step.dst_dim)[i]
    if step.kind == "all_gather":
        return torch.cat(xs, step.src_dim)
    if step.kind == "all_to_all":  # rank j sends its j-th block along dst_dim to rank i = j's peer
        return torch.cat([x.chunk(n, step.dst_dim)[i] for x in xs], step.src_dim)
    if step.kind == "shard_local":
        return xs[i].chunk(n, step.dst_dim)[i]
    if step.kind == "partial_local":
        return torch.zeros_like(xs[i]) if step.reduce_op == "sum" and i else xs[i]
    raise AssertionError(f"unknown step kind {step.kind}")


def _after(step: Step, before):
    """The placement `step` leaves on its axis, checking it starts from the one it claims to."""
    p = before[step.axis]
    expect_src = {
        "all_reduce": lambda: isinstance(p, Partial) and p.reduce_op == step.reduce_op,
        "reduce_scatter": lambda: isinstance(p, Partial) and p.reduce_op == step.reduce_op,
        "all_gather": lambda: p == Shard(step.src_dim),
        "all_to_all": lambda: p == Shard(step.src_dim),
        "shard_local": lambda: isinstance(p, Replicate),
        "partial_local": lambda: isinstance(p, Replicate),
    }[step.kind]()
    assert expect_src, f"{step} applied to {placements_str(before)}"
    if step.kind in ("all_reduce", "all_gather"):
        new = Replicate()
    elif step.kind == "partial_local":
        new = Partial(step.reduce_op)
    else:
        new = Shard(step.dst_dim)
    return before[:step.axis] + (new,) + before[step.axis + 1:]


def simulate(steps, layout: list[torch.Tensor], src, shape, mesh: MeshSpec) -> list[torch.Tensor]:
    """Run `steps` on every rank's local tensor; check each step's recorded local shape on the way."""
    cur = tuple(src)
    for step in steps:
        n = mesh.shape[step.axis]
        groups: dict[tuple, list[tuple[int, int]]] = {}
        for rank in range(mesh.size):
            c = mesh.coordinate(rank)
            groups.setdefault(c[:step.axis] + c[step.axis + 1:], []).append((c[step.axis], rank))
        new = [None] * mesh.size
        for members in groups.values():
            ranks = [r for _, r in sorted(members)]
            xs = [layout[r] for r in ranks]
            for i, r in enumerate(ranks):
                assert tuple(xs[i].shape) == step.local_in_shape, f"{step}: rank {r} holds {tuple(xs[i].shape)}"
                new[r] = _apply(step, xs, i, n)
        layout = new
        cur = _after(step, cur)
        assert is_even(shape, cur, mesh.shape), f"{step} leads to uneven {placements_str(cur)}"
    return layout, cur


# ---------------------------------------------------------------------------------------------------
# (a) Property: any plan, simulated on all ranks, lands every rank on its piece of the target layout.

@st.composite
def problems(draw):
    mesh_shape = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(1, 3))
    # reductions that commute with each other, so nested Partial axes mean the same in any order
    family = draw(st.sampled_from((("sum", "avg"), ("max",), ("min",))))
    shard_or_rep = [Replicate()] + [Shard(d) for d in range(ndim)]
    src = tuple(draw(st.sampled_from(shard_or_rep + [Partial(op) for op in family])) for _ in mesh_shape)
    dst = tuple(draw(st.sampled_from(shard_or_rep)) for _ in mesh_shape)
    # each dim a multiple of what src and dst cut it into: both layouts even, some intermediates not
    shape = tuple(math.lcm(shard_factor(src, mesh_shape, d), shard_factor(dst, mesh_shape, d))
                  * draw(st.integers(1, 3)) for d in range(ndim))
    return mesh_shape, shape, src, dst


@settings(max_examples=250, deadline=None, database=None)
@given(problem=problems(), seed=st.integers(0, 2**32 - 1))
def test_plan_moves_every_rank_to_its_target_piece(problem, seed):
    mesh_shape, shape, src, dst = problem
    mesh = mesh_of(mesh_shape)
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, generator=gen, dtype=F64)
    steps = plan_redistribute(src, dst, TensorInfo(shape, F64), mesh)
    what = f"{placements_str(src)} -> {placements_str(dst)} of {shape} on {mesh_shape}: {[str(s) for s in steps]}"

    layout, cur = simulate(steps, distribute(full, src, mesh, gen), src, shape, mesh)
    assert cur == dst, what
    for rank, got in enumerate(layout):
        want = local_shard(full, dst, mesh.shape, mesh.coordinate(rank))
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}, rank {rank}:\n{m}")


@settings(max_examples=100, deadline=None, database=None)
@given(problem=problems(), mid=st.data())
def test_plan_is_no_dearer_than_going_through_any_other_layout(problem, mid):
    """Dijkstra's answer: src -> dst never costs more than src -> mid -> dst."""
    mesh_shape, shape, src, dst = problem
    mesh, t = mesh_of(mesh_shape), TensorInfo(shape, F64)
    evens = [ps for ps in all_placements(len(shape), len(mesh_shape)) if is_even(shape, ps, mesh_shape)]
    m = mid.draw(st.sampled_from(evens), label="mid")
    direct = steps_cost(plan_redistribute(src, dst, t, mesh), mesh)
    via = steps_cost(plan_redistribute(src, m, t, mesh), mesh) + steps_cost(plan_redistribute(m, dst, t, mesh), mesh)
    assert direct <= via * (1 + 1e-9) + 1e-15


# ---------------------------------------------------------------------------------------------------
# (b) Structure: which collectives, on which axes, in which order.

def kinds(steps) -> list[tuple[str, int]]:
    return [(s.kind, s.axis) for s in steps]


def plan(src, dst, shape=(8, 8), mesh_shape=(4,)):
    return plan_redistribute(tuple(src), tuple(dst), TensorInfo(shape, torch.float32), mesh_of(mesh_shape))


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_partial_to_replicate_is_one_all_reduce(op):
    (step,) = plan([Partial(op)], [Replicate()])
    assert (step.kind, step.axis, step.reduce_op) == ("all_reduce", 0, op)
    assert step.local_in_shape == (8, 8) and step.in_bytes == 8 * 8 * 4


@pytest.mark.parametrize("dim", [0, 1])
def test_shard_to_replicate_is_one_all_gather(dim):
    (step,) = plan([Shard(dim)], [Replicate()])
    assert (step.kind, step.src_dim) == ("all_gather", dim)
    assert step.local_in_shape == local_shape((8, 8), (Shard(dim),), (4,))


def test_partial_to_shard_is_one_reduce_scatter():
    (step,) = plan([Partial()], [Shard(1)])
    assert (step.kind, step.dst_dim, step.reduce_op) == ("reduce_scatter", 1, "sum")


def test_shard_to_other_shard_is_one_all_to_all():
    (step,) = plan([Shard(0)], [Shard(1)])
    assert (step.kind, step.src_dim, step.dst_dim) == ("all_to_all", 0, 1)
    assert step.local_in_shape == (2, 8)


@pytest.mark.parametrize("mesh_shape, dst", [((4,), (Shard(1),)), ((2, 2), (Shard(0), Shard(1))),
                                             ((2, 2), (Shard(0), Shard(0)))])
def test_replicate_to_shard_is_free_of_collectives(mesh_shape, dst):
    steps = plan([Replicate()] * len(mesh_shape), dst, mesh_shape=mesh_shape)
    assert steps and all(s.kind == "shard_local" and not s.is_collective for s in steps)
    assert steps_cost(steps, mesh_of(mesh_shape)) < step_cost(plan([Shard(0)], [Replicate()])[0], mesh_of((4,)))


def test_nested_shards_gather_the_inner_axis_first():
    """[S(0), S(0)] cuts dim 0 in four (rank (a, b) holds piece 2a + b): axis 1 must be undone first."""
    steps = plan([Shard(0), Shard(0)], [Replicate(), Replicate()], mesh_shape=(2, 2))
    assert kinds(steps) == [("all_gather", 1), ("all_gather", 0)]
    assert [s.local_in_shape for s in steps] == [(2, 8), (4, 8)]


def test_one_axis_partial_touches_only_that_axis():
    steps = plan([Partial(), Shard(1)], [Replicate(), Shard(1)], mesh_shape=(2, 2))
    assert kinds(steps) == [("all_reduce", 0)]


def test_same_layout_is_the_empty_plan():
    for ps in all_placements(2, 2, partial=True):
        assert plan(ps, ps, mesh_shape=(2, 2)) == ()


def test_costs_are_non_negative_and_sum_over_steps():
    mesh = mesh_of((2, 2))
    layouts = all_placements(2, 2, partial=True)
    for src in layouts:
        for dst in layouts:
            if any(isinstance(p, Partial) for p in dst):
                continue
            steps = plan(src, dst, mesh_shape=(2, 2))
            costs = [step_cost(s, mesh) for s in steps]
            assert all(c >= 0 for c in costs), (src, dst, steps)
            assert steps_cost(steps, mesh) == pytest.approx(sum(costs))
            assert (not steps) == (src == dst)


def test_uneven_target_has_no_plan():
    with pytest.raises(SpmdInternalError, match="no redistribution"):
        plan([Replicate()], [Shard(0)], shape=(3, 8), mesh_shape=(2,))


def test_every_step_binds_to_its_runtime_function():
    """`call_kwargs` plus what emit_rank_graph adds (group/world, or index/world) fit the runtime signature."""
    extra = {"all_reduce": ("group", "world"), "all_gather": ("group", "world"), "reduce_scatter": ("group", "world"),
             "all_to_all": ("group", "world"), "shard_local": ("index", "world"), "partial_local": ("index",)}
    cases = [([Partial()], [Replicate()]), ([Shard(0)], [Replicate()]), ([Partial("max")], [Shard(1)]),
             ([Shard(0)], [Shard(1)]), ([Replicate()], [Shard(0)]), ([Replicate()], [Partial("sum")])]
    seen = set()
    for src, dst in cases:
        for step in plan(src, dst):
            sig = inspect.signature(STEP_FUNCTIONS[step.kind])
            sig.bind(torch.zeros(1), **step.call_kwargs(), **{k: 0 for k in extra[step.kind]})
            seen.add(step.kind)
    assert seen == set(STEP_FUNCTIONS)
