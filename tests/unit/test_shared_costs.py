"""Shared costs (`IlpBuilder.add_shared`): priced at even shares first, exactly where a solution takes
one partly. The answer must be the optimum of the program priced exactly, at its true cost."""
import itertools

import numpy as np
import pytest

from spmd.cost_model import solver
from spmd.cost_model.solver import IlpBuilder


def _choice(ilp: IlpBuilder, costs) -> list[int]:
    cols = [ilp.add_var(c, binary=True) for c in costs]
    ilp.add_eq([(c, 1.0) for c in cols], 1.0)
    return cols


def test_a_resharding_one_consumer_takes_alone_is_paid_whole():
    # c1 takes layout A (0) or B (12); c2 takes A (3) or B (1); A needs a resharding of 10 that both share.
    # At shares (5 each) c1 takes A and c2 B: 6, but that plan costs 11 (c1 pays the resharding alone).
    ilp = IlpBuilder()
    a1, b1 = _choice(ilp, [0.0, 12.0])
    a2, b2 = _choice(ilp, [3.0, 1.0])
    ilp.add_shared(10.0, [[a1], [a2]])
    r = ilp.solve()
    assert r.objective == pytest.approx(11.0)
    assert r.lower_bound == pytest.approx(11.0) and r.gap == pytest.approx(0.0)
    assert np.round(r.values[[a1, b1, a2, b2]]).tolist() == [1, 0, 0, 1]


def test_a_resharding_every_consumer_takes_is_paid_once():
    ilp = IlpBuilder()
    a1, _ = _choice(ilp, [0.0, 12.0])
    a2, _ = _choice(ilp, [3.0, 9.0])
    ilp.add_shared(10.0, [[a1], [a2]])
    r = ilp.solve()
    assert r.objective == pytest.approx(13.0)  # both A: 0 + 3 + 10 once


def _random_program(rng, consumers: int, groups: int, families: bool = False):
    """Choices of `consumers` consumers (4 options each) and `groups` shared costs over random options
    (`families`: in two families of two parts each, made exact together as `add_shared` says)."""
    ilp = IlpBuilder()
    choices = [_choice(ilp, rng.uniform(0, 10, size=4)) for _ in range(consumers)]
    shared = []
    for _ in range(groups):
        who = rng.choice(consumers, size=rng.integers(2, consumers + 1), replace=False)
        uses = [[int(c) for c in rng.choice(choices[w], size=rng.integers(1, 3), replace=False)] for w in who]
        seconds = float(rng.uniform(0, 20))
        if families:
            ilp.add_shared(seconds, uses, family=int(rng.integers(2)), part=int(rng.integers(2)))
        else:
            ilp.add_shared(seconds, uses)
        shared.append((seconds, uses))
    return ilp, choices, shared


def _true_cost(ilp: IlpBuilder, choices, shared, picked) -> float:
    x = np.zeros(len(ilp.cost))
    x[list(picked)] = 1.0
    own = sum(ilp.cost[c] for c in picked)
    return own + sum(seconds for seconds, uses in shared if any(x[u].sum() > 0.5 for u in uses))


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("beside", [False, True])
@pytest.mark.parametrize("rounds", ["one by one", "whole families", "parts"])
def test_the_answer_is_the_exact_optimum_at_its_true_cost(seed, beside, rounds, monkeypatch):
    # rounds of rows from the last basis until no shared cost is taken partly (beside: the first
    # relaxation with interior point beside it on a second thread, as on large programs), each round
    # making exact what was taken partly, with its family or, where families are too large, its part
    monkeypatch.setattr(solver, "BESIDE_MIN_COLUMNS", 0 if beside else 1 << 40)
    monkeypatch.setattr(solver, "BESIDE_AFTER", 0.0)  # (at once: these relaxations take milliseconds)
    monkeypatch.setattr(solver, "WHOLE_FAMILIES_MAX", 0.0 if rounds == "parts" else 1e9)
    rng = np.random.default_rng(seed)
    ilp, choices, shared = _random_program(rng, consumers=4, groups=6, families=rounds != "one by one")
    best = min(_true_cost(ilp, choices, shared, picked) for picked in itertools.product(*choices))
    r = ilp.solve()
    picked = [c for cols in choices for c in cols if r.values[c] > 0.5]
    assert r.objective == pytest.approx(best, rel=1e-6, abs=1e-6)
    assert _true_cost(ilp, choices, shared, picked) == pytest.approx(r.objective, rel=1e-6, abs=1e-6)
    assert r.lower_bound <= r.objective + 1e-9


def test_under_a_budget_a_plan_is_priced_at_its_true_cost(monkeypatch):
    # the unbudgeted optimum fits: at shares the price search's first relaxation takes A, B (6), which takes
    # the resharding partly; a round with it priced exactly finds A, B at 11 (a round of rows)
    rounds = []
    reprice = solver._Search.reprice
    monkeypatch.setattr(solver._Search, "reprice", lambda self, *a: (rounds.append(1), reprice(self, *a)))
    ilp = IlpBuilder()
    a1, b1 = _choice(ilp, [0.0, 12.0])
    a2, b2 = _choice(ilp, [3.0, 1.0])
    ilp.add_shared(10.0, [[a1], [a2]])
    r = ilp.solve(budget=solver.Budget(bytes={a1: 1.0, b1: 2.0, a2: 1.0, b2: 1.0}, limit=10.0))
    assert r.objective == pytest.approx(11.0) and r.lower_bound == pytest.approx(11.0)
    assert np.round(r.values[[a1, b1, a2, b2]]).tolist() == [1, 0, 0, 1]
    assert rounds == [1]


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("rounds", ["one by one", "parts"])
def test_under_a_budget_the_answer_is_the_exact_budgeted_optimum(seed, rounds, monkeypatch):
    # the price search's relaxations price shared costs lazily (rounds of rows); the plans it hands on,
    # branch and bound's and the answer are priced exactly
    monkeypatch.setattr(solver, "WHOLE_FAMILIES_MAX", 0.0)
    rng = np.random.default_rng(100 + seed)
    ilp, choices, shared = _random_program(rng, consumers=4, groups=6, families=rounds == "parts")
    size = {c: float(rng.integers(1, 10)) for cols in choices for c in cols}
    plans = list(itertools.product(*choices))
    need = [sum(size[c] for c in picked) for picked in plans]
    limit = float(np.quantile(need, 0.3))  # about a third of the plans fit
    best = min(_true_cost(ilp, choices, shared, p) for p, n in zip(plans, need) if n <= limit)
    r = ilp.solve(budget=solver.Budget(bytes=size, limit=limit, gap=0.0))
    picked = [c for cols in choices for c in cols if r.values[c] > 0.5]
    assert sum(size[c] for c in picked) <= limit
    assert r.objective == pytest.approx(best, rel=1e-6, abs=1e-6)
    assert _true_cost(ilp, choices, shared, picked) == pytest.approx(r.objective, rel=1e-6, abs=1e-6)
    assert r.lower_bound <= r.objective + 1e-9


@pytest.mark.parametrize("later", ["worse", "none"])
def test_a_later_round_never_makes_the_plan_worse(later, monkeypatch):
    # At shares the first round takes A, B (6; true cost 11). The shared cost is then priced exactly and
    # the next round's branch and bound runs out of time, with a dearer plan (B, A: 25) or none. The answer
    # is the first round's plan at its true cost, and the next round was handed it to start from.
    ilp = IlpBuilder()
    a1, b1 = _choice(ilp, [0.0, 12.0])
    a2, b2 = _choice(ilp, [3.0, 1.0])
    ilp.add_shared(10.0, [[a1], [a2]])
    y = len(ilp.cost) - 1  # (add_shared's column)
    integral, starts = solver._Search.integral, []

    def out_of_time_later(self, costs, **options):
        if not starts:
            starts.append(None)
            return integral(self, costs, **options)
        starts.append(options.get("start"))
        if later == "none":
            return None, float("nan"), "Time limit reached"
        x = np.zeros(len(costs))
        x[[b1, a2, y]] = 1.0
        return x, 0.0, "Time limit reached"

    monkeypatch.setattr(solver._Search, "integral", out_of_time_later)
    r = ilp.solve()
    assert r.objective == pytest.approx(11.0)
    assert np.round(r.values[[a1, b1, a2, b2]]).tolist() == [1, 0, 0, 1]
    assert r.lower_bound <= r.objective + 1e-9
    assert len(starts) == 2 and np.round(starts[1][[a1, b1, a2, b2, y]]).tolist() == [1, 0, 0, 1, 1]


def test_a_fractional_relaxation_taking_a_shared_cost_partly_is_tightened_before_branching(monkeypatch):
    # The first relaxation (faked) is fractional and takes the resharding for c1 by half and not for c2:
    # before any branch and bound, that shared cost is priced exactly and the relaxation solved again
    # (here integral: the optimum, 11, with no branch and bound at all).
    ilp = IlpBuilder()
    a1, b1 = _choice(ilp, [0.0, 12.0])
    a2, b2 = _choice(ilp, [3.0, 1.0])
    ilp.add_shared(10.0, [[a1], [a2]])
    integral, calls = solver._Search.integral, []

    def fractional_first(self, costs, **options):
        calls.append(options.get("branch", True))
        if len(calls) == 1:
            x = np.zeros(len(costs))
            x[[a1, b1, b2]] = [0.5, 0.5, 1.0]
            return x, 4.0, solver.FRACTIONAL
        return integral(self, costs, **options)

    monkeypatch.setattr(solver._Search, "integral", fractional_first)
    r = ilp.solve()
    assert calls == [False, False]
    assert r.objective == pytest.approx(11.0) and r.lower_bound == pytest.approx(11.0)


def _layouts_program(parts_per_family: int):
    """Two consumers of a value made in one of 3 layouts, each needing one of 2: per consumer a choice of
    (made, needed) pair, and a resharding per pair that the consumers taking it share, all of one family,
    a part per made layout."""
    ilp = IlpBuilder()
    c1, c2 = _choice(ilp, np.arange(6.0)), _choice(ilp, np.arange(6.0)[::-1])
    for pair in range(6):
        ilp.add_shared(3.0, [[c1[pair]], [c2[pair]]], family="value", part=(pair // 2) % parts_per_family)
    return ilp, c1, c2


@pytest.mark.parametrize("most", [1e9, 0.0])
def test_a_round_takes_whole_families_unless_they_are_too_many_rows(most, monkeypatch):
    # c1 takes the pair (made 0, needed 0), c2 (made 0, needed 1): each resharding is taken by one of its
    # two consumers. With room, the whole family (the value's six reshardings) is made exact; without,
    # only the part made in layout 0
    monkeypatch.setattr(solver, "WHOLE_FAMILIES_MAX", most)
    ilp, c1, c2 = _layouts_program(parts_per_family=3)
    x = np.zeros(len(ilp.cost))
    x[[c1[0], c2[1]]] = 1.0
    extra, mask, by_parts = ilp._partly_taken(x, np.zeros(6, dtype=bool))
    assert extra == pytest.approx(2 * (3.0 - 3.0 / 2))  # (each paid whole, priced at its share)
    assert mask.tolist() == ([True] * 6 if most > 1 else [True, True, False, False, False, False])
    assert by_parts == (most < 1)
    assert not ilp._partly_taken(x, mask)[1].any()  # (priced exactly now: nothing more to make exact)
    # once by parts, by parts: a later round does not go back to whole families
    monkeypatch.setattr(solver, "WHOLE_FAMILIES_MAX", 1e9)
    _, mask, by_parts = ilp._partly_taken(x, np.zeros(6, dtype=bool), by_parts=True)
    assert mask.tolist() == [True, True, False, False, False, False] and by_parts


def test_a_reprice_changes_the_rows_it_names_around_the_dropped_ones():
    # a round changes only the new exact costs' y columns and their rows, in the relaxation and in the
    # instance that completes rounded plans, at the relaxation's own row indices (rows it dropped skipped)
    ilp, c1, c2 = _layouts_program(parts_per_family=3)
    exact = np.zeros(6, dtype=bool)
    costs, upper, lower = ilp._priced(exact)
    binary = np.asarray(ilp.integral, dtype=bool)
    search = solver._Search(ilp._model(costs, upper, lower), binary, ilp._choice_groups(binary), 1e9, 1e-6)
    search.droppable = (0,)  # (c1's "exactly one of": any row but the shared costs' own)
    search._drop_rows()
    assert search.rounded(np.where(binary, 0.5, 0.0), costs) is not None  # (the completing instance, made)
    lazy = solver._LazyShares(ilp, 1.0, exact, search)
    lazy._more_exact(np.array([False, True, False, False, True, False]))
    want = ilp._priced(lazy.exact)
    kept = list(range(1, len(ilp._rhs)))
    for h in (search.relaxed, search.fixed):
        lp = h.getLp()
        assert np.asarray(lp.col_upper_)[~binary].tolist() == want[1][~binary].tolist()
        assert np.asarray(lp.row_lower_).tolist() == want[2][kept].tolist()
        assert np.asarray(lp.row_upper_).tolist() == np.asarray(ilp._rhs)[kept].tolist()
    assert np.asarray(search.lp.row_lower_).tolist() == want[2].tolist()  # (the program, made when asked)
