"""The budgeted price search's twin program (`solve_placements._Program`, `IlpBuilder.solve(twin=)`): the reads of
a value in one region priced as flows at 1/k of their cost. It must have the program's binary columns in the
same order, and for every plan cost no more than the program does (its bounds are then bounds), and the plan
the search returns is priced by the program itself."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import spmd
from spmd.core.mesh import MeshSpec
from spmd.core.profiles import device_profile_for, link_profile_for
from tests.models import GPT, GPTConfig
from tests.support import lm_loss


def _small_gpt():
    """A 2-layer GPT on (2, 2) with the built-in gloo and cpu profiles: its budgeted program's pooled reads are
    29% of its columns (the twin is used at `POOLED_SHARE`)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(sdpa=True, seq=16))
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g))
    return model, inputs, MeshSpec((2, 2), ("dp", "tp"), (link_profile_for("gloo"),) * 2, device_profile_for("cpu"))


def _least_cost(builder, x_binary: np.ndarray, droppable: tuple) -> float:
    """The least cost of `builder`'s program (shared costs exact, without its `droppable` rows: a plan over
    what is alive when backward ends is a plan) with its binary columns at `x_binary`."""
    from spmd.cost_model import solver

    binary = np.asarray(builder.integral, dtype=bool)
    costs, upper, lower = builder._priced(np.ones(len(builder._shared), dtype=bool))
    search = solver._Search(builder._model(costs, upper, lower), binary, builder._choice_groups(binary),
                            float("inf"), 1e-6)
    search.droppable = tuple(droppable)
    search._drop_rows()
    x = np.zeros(len(costs))
    x[np.flatnonzero(binary)] = x_binary
    settled = search.settled(x, costs)
    assert settled is not None, "a plan of the program is not a plan of its twin"
    return float(costs @ settled)


def test_twin_prices_every_plan_of_the_search_at_most_as_the_program(monkeypatch):
    from spmd.cost_model import solver
    from spmd.passes import solve_placements as sp

    monkeypatch.setattr(sp, "POOLED_SHARE", 0.0)  # (a small GPT: its pooled reads are fewer than the toy's)
    seen: dict = {}
    plans: list[np.ndarray] = []
    solve = solver.IlpBuilder.solve

    def spy_solve(self, *args, budget=None, twin=None, **kwargs):
        if budget is not None:
            seen.update(program=self, twin=twin)

            def extra(x, measure=budget.extra):  # every plan the search checks whole
                plans.append(np.asarray(x).copy())
                return measure(x)
            budget = dataclasses.replace(budget, extra=extra)
        return solve(self, *args, budget=budget, twin=twin, **kwargs)

    monkeypatch.setattr(solver.IlpBuilder, "solve", spy_solve)
    model, inputs, mesh = _small_gpt()
    free = spmd.plan(model, mesh, inputs, loss_fn=lm_loss)
    budget = 0.7 * free.predicted_peak_bytes
    plan = spmd.plan(model, mesh, inputs, loss_fn=lm_loss, memory_budget=budget)

    program, (twin, twin_budget) = seen["program"], seen["twin"]
    binary, twin_binary = (np.asarray(b.integral, dtype=bool) for b in (program, twin))
    assert binary.sum() == twin_binary.sum()
    assert len(twin.cost) < len(program.cost)
    assert twin_budget.limit == budget
    assert plan.predicted_peak_bytes <= budget
    assert plans, "the search checked no plan whole"
    exact = program._priced(np.ones(len(program._shared), dtype=bool))[0]
    # the search's plans, and plans of random costs (reshardings everywhere, reads of one value sharing some)
    rng = np.random.default_rng(0)
    groups = program._choice_groups(binary)
    search = solver._Search(program._model(exact, *program._priced(np.ones(len(program._shared), dtype=bool))[1:]),
                            binary, groups, float("inf"), 1e-6)
    for _ in range(3):
        x, _, _ = search.integral(np.where(binary, rng.uniform(0.0, 1e-3, len(exact)), 0.0) + exact, first_found=True)
        plans.append(x)
    equal = below = 0
    for x in plans:
        price = float(exact @ x)
        lower = _least_cost(twin, np.round(x[binary]), twin_budget.droppable)
        assert lower <= price * (1 + 1e-9) + 1e-12, (lower, price)
        equal += lower >= price * (1 - 1e-9)
        below += lower < price * (1 - 1e-6)
    assert equal, "the twin priced no plan exactly (where every read of a value needs one layout, it does)"
    assert below, "no plan had reads of one value needing different layouts: the case checks too little"
    # and the plan the search returns is one it checked, priced by the program itself
    assert any(plan.objective == pytest.approx(float(exact @ x), rel=1e-9) for x in plans)


def test_where_the_unbudgeted_optimum_fits_it_is_the_answer_with_a_twin(monkeypatch):
    """Price 0 is the program's own relaxation, not the twin's: the twin's optimum may be another plan, dearer
    in the program, and with the twin the search does no branch and bound that would find the better one."""
    from spmd.cost_model import solver
    from spmd.passes import solve_placements as sp

    monkeypatch.setattr(sp, "POOLED_SHARE", 0.0)
    solved: list = []  # the builder of each relaxation the budgeted search solved, and the twin it had
    solve, integral = solver.IlpBuilder.solve, solver._LazyShares.integral

    def spy_solve(self, *args, budget=None, twin=None, **kwargs):
        if budget is not None:
            solved.append(("twin", twin[0] if twin is not None else None))
        return solve(self, *args, budget=budget, twin=twin, **kwargs)

    def spy_integral(self, *args, **kwargs):
        solved.append(("relaxation", self.builder))
        return integral(self, *args, **kwargs)

    monkeypatch.setattr(solver.IlpBuilder, "solve", spy_solve)
    monkeypatch.setattr(solver._LazyShares, "integral", spy_integral)
    model, inputs, mesh = _small_gpt()
    free = spmd.plan(model, mesh, inputs, loss_fn=lm_loss)
    solved.clear()
    plan = spmd.plan(model, mesh, inputs, loss_fn=lm_loss, memory_budget=1.5 * free.predicted_peak_bytes)
    (_, twin), *relaxations = solved
    assert twin is not None and relaxations and all(builder is not twin for _, builder in relaxations)
    assert plan.objective == pytest.approx(free.objective, rel=1e-9)
    assert plan.stats["status"] == "Optimal (the unbudgeted optimum fits)", plan.stats["status"]
