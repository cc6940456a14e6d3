"""The budgeted search's cuts (`solve_placements._cut`, `IlpBuilder._cut_loop`) on a real program: a cut is
the bytes alive at one point of the schedule for every plan, not only for the plan that was over there, so
a later plan is never over again at a point already cut, and the copies a cut counts are those alive there
under every plan."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import Shard

import spmd
from spmd.core.mesh import MeshSpec
from spmd.cost_model.memory import Schedule, value_bytes
from spmd.core.profiles import device_profile_for, link_profile_for
from tests.models import GPT, GPTConfig
from tests.support import lm_loss


def test_no_plan_is_over_again_where_the_search_already_cut(monkeypatch):
    """The e2e budget case (tests/e2e/test_training.py: a 2-layer GPT on four gloo ranks, data parallel
    pinned, 0.6 of the free plan's peak). The price search's plans fit the row but not their temporaries.
    Each cut round's plan must be over at a new point or fit. When a cut counted only the copies of the plan
    it came from, the next plan was over at the same point with other copies: four rounds of 5-10 s, where
    one now does."""
    from spmd.cost_model import solver
    from spmd.passes import solve_placements as sp

    events: list[tuple] = []  # ("cuts", worst point, every point cut) and ("round",), in order
    made: list[tuple] = []  # (point, its cut)
    plans: list[tuple] = []  # (solution, its plan, the schedule) of every plan the search checked whole
    cut, temporaries = sp._cut, Schedule.temporaries

    def spy_cut(point, *args, **kwargs):
        events[-1][2].append((point.index, point.made))
        made.append((point, cut(point, *args, **kwargs)))
        return made[-1][1]

    def spy_temporaries(self, plan, rebuilt=(), packing=False):
        got = temporaries(self, plan, rebuilt, packing)
        if packing:  # (the plan's prediction after the search: not one of the search's plans)
            return got
        # (what the plan needs whole: the row's kinds, all but the gradients, and what the walk holds beyond)
        plans.append((None, plan, self, sum(b for k, b in plan.memory.items() if k not in ("gradients", "optimizer step")) + got[0]))
        return got

    solve = solver.IlpBuilder.solve

    def spy_solve(self, *args, budget=None, **kwargs):
        if budget is not None and budget.cuts is not None:
            def cuts(x, make=budget.cuts):
                events.append(("cuts", None, []))
                return make(x)

            def extra(x, measure=budget.extra):
                got = measure(x)
                if plans and plans[-1][0] is None:
                    plans[-1] = (x, *plans[-1][1:])
                return got
            budget = dataclasses.replace(budget, cuts=cuts, extra=extra)
        return solve(self, *args, budget=budget, **kwargs)

    rounds = solver._Search.branch_and_bound

    stops: list[tuple] = []  # per round of the cut loop: (the plan it returned, whether it fits, the first over)

    def spy_round(self, costs, weight, limit, start, rel_gap, on_progress, seconds, cuts=(), fits=None):
        if not cuts:
            return rounds(self, costs, weight, limit, start, rel_gap, on_progress, seconds, cuts, fits)
        # (the rounds that meet a plan over the budget stop there, in 2-5 s unloaded; on a loaded machine the
        # first ran out of its 10 s before it met it, and of 20 s at a load of 4 per core, and returned its
        # start, a path this test is not about: they get the time to meet it. The last round, which runs out of
        # its time proving its plan, keeps its 10 s)
        if sum(e[0] == "round" for e in events) < 2:
            seconds = max(seconds, 120.0)
        events.append(("round",))  # a round of the cut loop: it stops at its first incumbent that is over
        over = []

        def asked(x):
            ok = fits(x)
            if not ok and not over:
                over.append(x.copy())
            return ok
        made = []
        mip = self._mip
        self._mip = lambda *args: made.append(mip(*args)) or made[-1]
        try:
            got = rounds(self, costs, weight, limit, start, rel_gap, on_progress, seconds, cuts, asked)
        finally:
            del self._mip
        if got[0] is not None:
            status = made[-1].getModelStatus()
            stops.append((float(costs @ got[0]), float(costs @ over[0]) if over else None, status))
        return got

    monkeypatch.setattr(sp, "_cut", spy_cut)
    monkeypatch.setattr(Schedule, "temporaries", spy_temporaries)
    monkeypatch.setattr(solver.IlpBuilder, "solve", spy_solve)
    monkeypatch.setattr(solver._Search, "branch_and_bound", spy_round)

    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        model = GPT(GPTConfig(sdpa=True, seq=32))
        g = torch.Generator().manual_seed(1)
        inputs = (torch.randint(0, 128, (8, 32), generator=g), torch.randint(0, 128, (8, 32), generator=g))
        # (the case as it was built: the optimizer's step unpriced, which this test is not about)
        device = dataclasses.replace(device_profile_for("cpu"), optimizer_bandwidth=1e18,
                                     optimizer_cached_bandwidth=1e18, optimizer_tensor_overhead_s=0.0)
        mesh = MeshSpec((4,), ("dp",), (link_profile_for("gloo-oversubscribed"),), device.scaled(0.5).in_lockstep(4))
        pins = {"tokens": [Shard(0)]}
        free = spmd.plan(model, mesh, inputs, loss_fn=lm_loss, in_placements=pins)
        budget = 0.6 * (free.predicted_peak_bytes - free.stats["bucket_packing"])  # (the case as it was built)
        plan = spmd.plan(model, mesh, inputs, loss_fn=lm_loss, in_placements=pins, memory_budget=budget)
    finally:
        torch.set_default_dtype(torch.float32)

    # (the search does not weigh a gradient bucket's flat copy, alive beside its gradients at its launch: the
    # prediction counts it, and the budget's warning names it)
    assert plan.predicted_peak_bytes - plan.stats["bucket_packing"] <= budget
    assert any(e[0] == "round" for e in events), "the case no longer reaches the cut loop: pick a tighter budget"
    cut_before: set = set()  # points cut before the last round
    pending: set = set()
    for e in events:
        if e[0] == "round":
            cut_before |= pending
        elif e[2]:
            assert e[2][0] not in cut_before, (e[2][0], sorted(cut_before))
            pending |= set(e[2])
    assert sum(e[0] == "round" for e in events) <= 3
    # a round that met a plan over the budget stopped soon after it (it proved nothing more of it), with an
    # incumbent no dearer than that plan; some round did
    import highspy

    assert any(first is not None for _, first, _ in stops)
    for cost, first, status in stops:
        if first is not None:
            assert status in (highspy.HighsModelStatus.kInterrupt, highspy.HighsModelStatus.kOptimal), status
            assert cost <= first * (1 + 1e-9) + 1e-9
    assert any(status == highspy.HighsModelStatus.kInterrupt for _, _, status in stops)

    # every cut counts, at every plan the search checked, exactly the resharded copies the schedule walk
    # holds at its point under that plan (helper columns at their least), not only its own plan's copies
    checked = [(x, plan, schedule) for x, plan, schedule, _ in plans if x is not None]
    assert made and len(checked) >= 2
    # and no cut asks more of a plan than the plan needs whole (so no plan that fits is cut off), with a
    # layer recomputed (a rebuilt layer's bytes added back while its copy is alive)
    assert any(plan.recompute or plan.recompute_selective for _, plan, _ in checked)
    for point, c in made:
        for x, plan, schedule, need in (p for p in plans if p[0] is not None):
            value = sum(v * x[col] for col, v in c.terms) + sum(
                size * max(0.0, *(sum(v * x[col] for col, v in row) + const for row, const in lower))
                for size, lower in c.helpers)
            assert value <= need * (1 + 1e-9), (point.at, value, need, plan.recompute)
    for point, c in made:
        for x, plan, schedule in checked:
            copies = sum(size * max(0.0, *(sum(v * x[col] for col, v in row) + const for row, const in lower))
                         for size, lower in c.helpers)
            live = next(b for b, i, m in schedule.walk(plan.choices, mesh.shape, plan.edges)
                        if (i, m) == (point.index, point.made))
            values = sum(value_bytes(schedule.tensor_info.get(name), plan.choices[name].outputs, mesh.shape)
                         for name in point.values if name in plan.choices)
            values += schedule.gradient_bytes(point, plan.choices, mesh.shape)  # made by then, held
            assert copies == pytest.approx(live - values, abs=1e-6 * max(live, 1.0)), (point.at, copies, live, values)
