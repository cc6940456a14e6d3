"""Meshes of three axes: the layout graph's distances are the redistribute planner's, an edge priced as
a flow over its arcs costs what its layout pairs cost, and the axis search returns a plan that trains
as on one device, no worse than its start and close to the exact optimum."""
import heapq
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd.passes.solve_placements as solve_module
from spmd.core.specs import TensorInfo
from spmd.core.redistribute import after_step
from spmd.cost_model.comm import reshard_paths, step_cost
from spmd.cost_model.layout_graph import LayoutGraph, cheapest_paths
from spmd.runtime.simulate import simulate
from tests.support import check_simulated_training, compile_graph, spec

MESHES = [spec((2, 2), ("dp", "tp")), spec((2, 2, 2), ("dp", "fsdp", "tp")), spec((4, 2, 2), ("dp", "fsdp", "tp"))]


@pytest.mark.parametrize("shape", [(8,), (4, 6), (2, 4, 8)])
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m.shape)))
def test_layout_graph_distances_are_the_planners(shape, mesh):
    info = TensorInfo(shape, torch.float32)
    graph = LayoutGraph(info, mesh)
    for a in graph.layouts:
        paths = reshard_paths(a, info, mesh)
        assert set(paths) == {b for b in graph.layouts if math.isfinite(graph.dist[graph.index[a], graph.index[b]])}
        for b, (seconds, _) in paths.items():
            assert graph.dist[graph.index[a], graph.index[b]] == pytest.approx(seconds, rel=1e-9, abs=1e-18)


@pytest.mark.parametrize("bucket", [None, 1e6])
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m.shape)))
def test_cheapest_paths_from_the_graph_are_the_planners(mesh, bucket):
    """What the cost table asks: from every layout, the same layouts and seconds as Dijkstra, by steps
    that really lead there and cost that much; the pair table agrees with the paths."""
    info = TensorInfo((4, 8, 6), torch.float32)
    graph = LayoutGraph(info, mesh, bucket)
    for a in graph.layouts[::3]:
        want, got = reshard_paths(a, info, mesh, bucket), cheapest_paths(a, info, mesh, bucket)
        assert set(got) == set(want)
        seconds, collective = graph.pair_table([a], list(got))
        for k, b in enumerate(got):
            cost, steps = got[b]
            assert cost == pytest.approx(want[b][0], rel=1e-9, abs=1e-18) == pytest.approx(seconds[0, k])
            at = a
            for step in steps:
                at = at[:step.axis] + (after_step(step),) + at[step.axis + 1:]
            assert at == b
            assert sum(step_cost(step, mesh, bucket) for step in steps) == pytest.approx(cost, rel=1e-9, abs=1e-18)
            assert collective[0, k] == any(step.is_collective for step in steps)


def _cheapest(arcs, a, b) -> float:
    best, heap = {a: 0.0}, [(0.0, 0, a)]
    out: dict = {}
    for k, arc in enumerate(arcs):
        out.setdefault(arc.src, []).append(arc)
    n = 1
    while heap:
        d, _, u = heapq.heappop(heap)
        if u == b:
            return d
        for arc in out.get(u, ()):
            if d + arc.seconds < best.get(arc.dst, math.inf):
                best[arc.dst] = d + arc.seconds
                heapq.heappush(heap, (best[arc.dst], n, arc.dst))
                n += 1
    return math.inf


@pytest.mark.parametrize("mesh", MESHES[1:], ids=lambda m: "x".join(map(str, m.shape)))
def test_arcs_between_keep_every_cheapest_path(mesh):
    info = TensorInfo((4, 8, 6), torch.float32)
    graph = LayoutGraph(info, mesh)
    sources, targets = graph.layouts[::7], graph.layouts[3::5]
    arcs = graph.between(sources, targets)
    assert 0 < len(arcs) < len(graph.arcs)
    for a in sources:
        for b in targets:
            want = graph.dist[graph.index[a], graph.index[b]]
            got = _cheapest(arcs, a, b)
            assert got == pytest.approx(want, rel=1e-9, abs=1e-18) if math.isfinite(want) else math.isinf(got)


MESH3 = spec((2, 2, 2), ("dp", "fsdp", "tp"))


@pytest.fixture
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


class Residual(nn.Module):
    def __init__(self, dim: int = 8, layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                                                  nn.Linear(2 * dim, dim)) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def _mse(out, target):
    return F.mse_loss(out, target)


def _residual():
    torch.manual_seed(0)
    return Residual(), torch.randn(4, 8, 8), torch.randn(4, 8, 8)  # (in the default dtype)


def test_flow_edges_cost_what_pair_edges_cost(monkeypatch):
    model, x, target = _residual()
    plans = {}
    for name, threshold in (("pairs", 10**12), ("flows", 0)):
        monkeypatch.setattr(solve_module, "FLOW_MIN_PAIRS", threshold)
        plans[name] = compile_graph(model, (x, target), MESH3, loss_fn=_mse, axis_search=False).plan
    assert plans["flows"].objective == pytest.approx(plans["pairs"].objective, rel=1e-6)
    assert plans["flows"].stats["continuous"] < plans["pairs"].stats["continuous"] / 2


def test_axis_search_nears_the_exact_plan():
    model, x, target = _residual()
    exact = compile_graph(model, (x, target), MESH3, loss_fn=_mse, axis_search=False).plan
    searched = compile_graph(model, (x, target), MESH3, loss_fn=_mse, axis_search=True).plan
    steps = searched.stats["axis_search"]["steps"]
    assert steps[0].startswith("outer axes equal") and len(steps) >= 4  # a start, then each pair of axes
    assert math.isnan(searched.gap) and "unproven" in str(searched)
    # (in float64 the exact solve stops at its time limit 8.7% above its bound; the search lands 0.03% above)
    assert exact.lower_bound * (1 - 1e-9) <= searched.objective <= 1.05 * exact.lower_bound


def test_an_axis_searched_plan_trains_like_one_device(float64):
    model, x, target = _residual()
    c = compile_graph(model, (x, target), MESH3, loss_fn=_mse, axis_search=True)
    outs = simulate(c, (x, target, torch.tensor(1.0)))
    loss = _mse(model(x), target)
    loss.backward()
    assert check_simulated_training(c, outs, loss, model) == 1 + len(list(model.parameters()))


def test_pins_the_outer_axes_cannot_hold_equal_fall_back_to_the_exact_solve():
    from torch.distributed.tensor import Replicate, Shard

    model, x, target = _residual()
    pins = {"blocks.0.1.weight": [Replicate(), Shard(1), Shard(0)]}  # dp and fsdp differ: not on the diagonal
    plan = compile_graph(model, (x, target), MESH3, loss_fn=_mse, axis_search=True, param_placements=pins).plan
    assert "axis_search" not in plan.stats and not math.isnan(plan.gap)
