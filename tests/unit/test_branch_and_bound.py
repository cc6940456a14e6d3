"""Branch and bound without a budget (`_Search.integral`): where the relaxation is fractional, branch and
bound over its fractional choices first, a plan within `PLAN_GAP` of the bound is the answer, and every
plan branch and bound returns is settled (its continuous columns at their least cost)."""
import itertools

import pytest

from spmd.cost_model import solver
from spmd.cost_model.solver import IlpBuilder


def _odd_cycle(base: float):
    """Three choices of A (0) or B (1), no two A's together, and a fourth choice of one option costing
    `base`: the relaxation takes every A by half (base + 1.5), every plan costs base + 2 at least."""
    ilp = IlpBuilder()
    picks = []
    for _ in range(3):
        a, b = ilp.add_var(0.0, binary=True), ilp.add_var(1.0, binary=True)
        ilp.add_eq([(a, 1.0), (b, 1.0)], 1.0)
        picks.append((a, b))
    for (a1, _), (a2, _) in itertools.combinations(picks, 2):
        ilp.add_le([(a1, 1.0), (a2, 1.0)], 1.0)
    fixed = ilp.add_var(base, binary=True)
    ilp.add_eq([(fixed, 1.0)], 1.0)
    return ilp, picks


def test_a_plan_over_the_fractional_choices_within_the_gap_is_the_answer():
    # bound 1001.5, optimum 1002: 0.05%, within PLAN_GAP; the whole program's branch and bound never runs
    ilp, picks = _odd_cycle(1000.0)
    r = ilp.solve()
    assert r.objective == pytest.approx(1002.0) and r.lower_bound == pytest.approx(1001.5)
    assert r.status == "Optimal (within the gap of the relaxation's bound)"
    assert sum(round(r.values[a]) for a, _ in picks) == 1


def test_outside_the_gap_branch_and_bound_proves_the_optimum():
    # bound 1.5, optimum 2 (25%): the fractional choices' plan only starts the whole branch and bound
    ilp, picks = _odd_cycle(0.0)
    r = ilp.solve()
    assert r.objective == pytest.approx(2.0) and r.lower_bound == pytest.approx(2.0)
    assert r.status == "Optimal"
    assert sum(round(r.values[a]) for a, _ in picks) == 1


def test_a_plan_branch_and_bound_returns_carries_no_slack(monkeypatch):
    # a continuous column z >= (the A's taken) / 3 costs 3 per unit: a plan that hands it back at 1 (slack)
    # is settled to 1/3 of it, its least, and priced so
    ilp, picks = _odd_cycle(0.0)
    z = ilp.add_var(3.0, binary=False)
    ilp.add_ge([(z, 3.0)] + [(a, -1.0) for a, _ in picks], 0.0)
    near = solver._Search.near

    def slack(self, x, costs, until):
        plan = near(self, x, costs, until)
        loose = plan.copy()
        loose[z] = 1.0
        assert self.settled(loose, costs)[z] == pytest.approx(1.0 / 3.0)
        return plan

    monkeypatch.setattr(solver._Search, "near", slack)
    r = ilp.solve()
    assert r.objective == pytest.approx(3.0) and r.values[z] == pytest.approx(1.0 / 3.0)
