"""The budgeted solve (cost_model/solver.py): a price per byte searched instead of a budget row, then
branch and bound. Whatever it returns fits (row and extra), costs no less than the true optimum, and
its bound is no more than it; small programs are checked against every plan."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spmd.cost_model.solver import Budget, IlpBuilder
from tests.support import choice_program as _program

Group = list[tuple[float, float]]  # (cost, bytes) per option


def _brute_force(groups: list[Group], limit: float, extra=lambda picks: 0.0) -> float:
    best = float("inf")
    for picks in itertools.product(*(range(len(g)) for g in groups)):
        cost = sum(g[i][0] for g, i in zip(groups, picks))
        need = sum(g[i][1] for g, i in zip(groups, picks)) + extra(picks)
        if need <= limit * (1 + 1e-9):
            best = min(best, cost)
    return best


def _picks(x, cols) -> tuple[int, ...]:
    return tuple(int(np.argmax([x[c] for c in g])) for g in cols)


groups_st = st.lists(st.lists(st.tuples(st.integers(1, 50).map(float), st.integers(1, 40).map(float)),
                              min_size=2, max_size=3), min_size=2, max_size=6)


@settings(max_examples=40, deadline=None)
@given(groups_st, st.floats(0.3, 1.1))
def test_fits_and_brackets_the_optimum(groups, tightness):
    ilp, cols, weights = _program(groups)
    leanest = sum(min(b for _, b in g) for g in groups)
    roomiest = sum(max(b for _, b in g) for g in groups)
    limit = leanest + tightness * (roomiest - leanest)
    best = _brute_force(groups, limit)
    r = ilp.solve(budget=Budget(weights, limit))
    if best == float("inf"):
        assert r.objective == float("inf")
        return
    picks = _picks(r.values, cols)
    assert sum(g[i][1] for g, i in zip(groups, picks)) <= limit + 1e-6
    assert r.objective >= best - 1e-6 and r.lower_bound <= best + 1e-6
    assert r.objective <= best * (1 + 1e-2) + 1e-6  # the gap asked for (branch and bound closes it here)


def test_extra_bytes_are_checked_whole():
    # temporaries grow with the layout, as a schedule's do: the first choice's option also needs three
    # times its bytes at its worst point. The row alone would pick cost 9 (row 15, whole 15 + 15 = 30);
    # whole, the best plan that fits costs 10 (row 10 + 15).
    groups = [[(10.0, 10.0), (5.0, 5.0), (9.0, 1.0)], [(5.0, 5.0), (4.0, 10.0)]]
    ilp, cols, weights = _program(groups)

    def extra_of(picks):
        return 3.0 * groups[0][picks[0]][1]

    r = ilp.solve(budget=Budget(weights, 25.0, extra=lambda x: extra_of(_picks(x, cols))))
    picks = _picks(r.values, cols)
    assert sum(g[i][1] for g, i in zip(groups, picks)) + extra_of(picks) <= 25.0
    assert abs(r.objective - _brute_force(groups, 25.0, extra_of)) < 1e-9
    assert r.lower_bound <= r.objective


def test_the_unbudgeted_optimum_that_fits_is_proven():
    groups = [[(1.0, 1.0), (2.0, 9.0)], [(3.0, 1.0), (1.0, 2.0)]]
    ilp, _, weights = _program(groups)
    r = ilp.solve(budget=Budget(weights, 100.0))
    assert r.objective == 2.0 and r.gap == 0.0 and r.status.startswith("Optimal")


def test_progress_reports_a_fitting_plan_and_a_bound():
    groups = [[(float(c), float(b)) for c, b in zip(range(1, 4), (9, 5, 1))] for _ in range(5)]
    ilp, _, weights = _program(groups)
    seen = []
    r = ilp.solve(budget=Budget(weights, 20.0), on_progress=lambda *a: seen.append(a))
    assert seen and all(obj >= bound - 1e-9 for obj, bound, _ in seen)
    assert seen[-1][0] == r.objective


def test_branch_and_bound_reports_its_progress_without_a_budget():
    # a fractional relaxation (odd cycle of "not both" pairs): branch and bound runs, and reports
    ilp = IlpBuilder()
    cols = [ilp.add_var(-1.0, binary=True) for _ in range(5)]
    for i in range(5):
        ilp.add_le([(cols[i], 1.0), (cols[(i + 1) % 5], 1.0)], 1.0)
    seen = []
    r = ilp.solve(on_progress=lambda *a: seen.append(a))
    assert r.objective == -2.0 and r.gap == 0.0
    assert seen and seen[-1][0] == -2.0


pair_costs_st = st.integers(0, 20).map(float)


@settings(max_examples=30, deadline=None)
@given(st.integers(3, 5), st.integers(2, 3), st.data())
def test_cycles_of_pairwise_choices_solve_to_the_brute_force_optimum(n, k, data):
    """Nodes on a cycle, k options each, a cost per option and per (option, option) of neighbours, in
    solve_placements' marginal form: on cycles the relaxation can be fractional, so the rounding and
    branch and bound paths run. The result is the optimum, and the bound is no more than it."""
    node_cost = [[data.draw(pair_costs_st) for _ in range(k)] for _ in range(n)]
    edge_cost = [[[data.draw(pair_costs_st) for _ in range(k)] for _ in range(k)] for _ in range(n)]
    ilp = IlpBuilder()
    cols = []
    for i in range(n):
        mine = [ilp.add_var(c, binary=True) for c in node_cost[i]]
        ilp.add_eq([(c, 1.0) for c in mine], 1.0)
        cols.append(mine)
    for i in range(n):  # edge i -> i+1: e[a, r] with row sums x[i, a] and column sums x[i+1, r]
        j = (i + 1) % n
        first = ilp.add_vars(k * k)
        for a in range(k):
            for r in range(k):
                ilp.add_cost(first + a * k + r, edge_cost[i][a][r])
            ilp.add_eq([(first + a * k + r, 1.0) for r in range(k)] + [(cols[i][a], -1.0)], 0.0)
        for r in range(k):
            ilp.add_eq([(first + a * k + r, 1.0) for a in range(k)] + [(cols[j][r], -1.0)], 0.0)
    best = min(sum(node_cost[i][p[i]] + edge_cost[i][p[i]][p[(i + 1) % n]] for i in range(n))
               for p in itertools.product(range(k), repeat=n))
    r = ilp.solve()
    assert r.objective == pytest.approx(best, abs=1e-6)
    assert r.lower_bound <= best + 1e-6
    picks = _picks(r.values, cols)
    assert sum(node_cost[i][picks[i]] + edge_cost[i][picks[i]][picks[(i + 1) % n]] for i in range(n)) \
        == pytest.approx(best, abs=1e-6)


def test_a_fractional_relaxation_is_rounded_then_branched_to_the_optimum(monkeypatch):
    # three nodes on a triangle, two options each, an edge costs 1 when both ends pick the same option:
    # the relaxation halves every choice (cost 0), the rounded plan costs 2, the optimum is 1
    from spmd.cost_model import solver

    rounded = []
    original = solver._Search.rounded

    def recording(self, x, costs):
        rounded.append(original(self, x, costs))
        return rounded[-1]

    monkeypatch.setattr(solver._Search, "rounded", recording)
    ilp, cols = IlpBuilder(), []
    for _ in range(3):
        mine = [ilp.add_var(0.0, binary=True) for _ in range(2)]
        ilp.add_eq([(c, 1.0) for c in mine], 1.0)
        cols.append(mine)
    for i in range(3):
        j, first = (i + 1) % 3, ilp.add_vars(4)
        for a in range(2):
            for r in range(2):
                ilp.add_cost(first + 2 * a + r, 1.0 if a == r else 0.0)
            ilp.add_eq([(first + 2 * a + r, 1.0) for r in range(2)] + [(cols[i][a], -1.0)], 0.0)
        for r in range(2):
            ilp.add_eq([(first + 2 * a + r, 1.0) for a in range(2)] + [(cols[j][r], -1.0)], 0.0)
    r = ilp.solve()
    assert rounded and rounded[0] is not None  # the relaxation was fractional and rounded
    assert r.objective == pytest.approx(1.0) and r.gap == pytest.approx(0.0, abs=1e-6)


def test_when_nothing_fits_whole_the_leanest_plan_comes_back_marked():
    # every plan fits the row, none fits with its extra: the plan needing least comes back, said to be over
    groups = [[(1.0, 5.0), (3.0, 2.0)], [(1.0, 5.0), (2.0, 4.0)]]
    ilp, cols, weights = _program(groups)
    r = ilp.solve(budget=Budget(weights, 10.0, extra=lambda x: 100.0 - float(sum(x[c] for c in weights))))
    assert r.objective < float("inf") and r.status.startswith("Over the budget")
    assert _picks(r.values, cols) == (1, 1)  # row 6 + extra 98: the least any plan needs


@pytest.mark.parametrize("beside", [False, True])
def test_a_relaxation_the_simplex_does_not_finish_goes_to_interior_point(monkeypatch, beside):
    """With no iterations for the simplex, interior point and crossover solve the relaxation and hand the simplex
    their basis: the same optimum, still integral, and the budget search warm-starts from there. `beside`:
    the first relaxation's interior point was started with the simplex, on a thread of its own
    (`BESIDE_MIN_COLUMNS`), and is the one that hands over its basis."""
    import spmd.cost_model.solver as solver

    groups = [[(1.0, 4.0), (2.0, 1.0), (3.0, 0.5)], [(0.5, 3.0), (1.5, 1.0)], [(2.0, 2.0), (1.0, 5.0)]]
    want = {None: _brute_force(groups, float("inf")), 4.0: _brute_force(groups, 4.0)}
    calls = []
    monkeypatch.setattr(solver, "SIMPLEX_ITERATIONS_MIN", 0)
    monkeypatch.setattr(solver, "SIMPLEX_ITERATIONS_PER_COLUMN", 0.0)
    monkeypatch.setattr(solver, "BESIDE_MIN_COLUMNS", 0 if beside else 10**9)
    monkeypatch.setattr(solver, "BESIDE_AFTER", 0.0)  # (at once: these relaxations take milliseconds)
    run = solver._Search._interior_point

    def spy(self, costs, until, ipm=None):
        calls.append(ipm is not None)
        return run(self, costs, until, ipm)

    monkeypatch.setattr(solver._Search, "_interior_point", spy)
    for limit in (None, 4.0):
        ilp, cols, weights = _program(groups)
        result = ilp.solve(budget=None if limit is None else Budget(weights, limit))
        assert result.objective == pytest.approx(want[limit])
    assert calls
    # the first relaxation of each program had its interior point ready (one solved while the simplex ran)
    assert calls[0] == beside and (not beside or calls.count(True) == 2), calls


@settings(max_examples=40, deadline=None)
@given(groups_st, st.data())
def test_with_cuts_a_plan_that_fits_whole_is_found_or_none_exists(groups, data):
    """The last resort when no plan of the price search fits with its extra: branch and bound with a cut
    per point where a plan was over (the bytes there as a row, `Budget.cuts`). A schedule of a few
    points, each holding per option some bytes, one of them a copy that is alive only when the first
    group picks option 0 and the second does not (a helper column). Whenever some plan fits whole the
    result fits whole; when none does, the search says so, proven."""
    from spmd.cost_model.solver import Cut

    ilp, cols, weights = _program(groups)
    points = [([[data.draw(st.integers(0, 60).map(float)) for _ in g] for g in groups],
               data.draw(st.integers(0, 30).map(float))) for _ in range(data.draw(st.integers(1, 3)))]

    def at_point(picks, k) -> float:
        live, copy = points[k]
        alive = picks[0] == 0 and picks[1] != 0
        return sum(b[i] for b, i in zip(live, picks)) + (copy if alive else 0.0)

    def extra_of(picks) -> float:
        return max(at_point(picks, k) for k in range(len(points)))

    def cut(k) -> Cut:
        live, copy = points[k]
        terms = dict(weights)
        for g, b in zip(cols, live):
            for c, v in zip(g, b):
                terms[c] += v
        # z >= [first picks 0] - [second picks 0], its first column in two halves (two readers of tied
        # layers share their columns: a row HiGHS refuses unless they are summed)
        made = ((cols[0][0], 0.5), (cols[1][0], -1.0), (cols[0][0], 0.5))
        return Cut(tuple(terms.items()), ((copy, ((made, 0.0),)),))

    def cuts(x) -> tuple[Cut, ...]:  # every point where x is over, the worst first
        picks = _picks(x, cols)
        over = [k for k in range(len(points)) if sum(g[i][1] for g, i in zip(groups, picks)) + at_point(picks, k) > limit]
        return tuple(cut(k) for k in sorted(over, key=lambda k: -at_point(picks, k)))

    leanest = sum(min(b for _, b in g) for g in groups)
    roomiest = sum(max(b for _, b in g) for g in groups) + 60.0 * len(groups) + 30.0
    limit = leanest + data.draw(st.floats(0.1, 1.0)) * (roomiest - leanest)
    best = _brute_force(groups, limit, extra_of)
    r = ilp.solve(budget=Budget(weights, limit, extra=lambda x: extra_of(_picks(x, cols)), cuts=cuts))
    if best == float("inf"):
        assert r.objective == float("inf") or "(proven)" in r.status, r.status
        return
    picks = _picks(r.values, cols)
    assert sum(g[i][1] for g, i in zip(groups, picks)) + extra_of(picks) <= limit * (1 + 1e-9), r.status
    assert r.objective >= best - 1e-6 and r.lower_bound <= best + 1e-6


def test_a_re_solved_instance_gets_its_seconds_on_top_of_what_it_ran_before():
    """HiGHS checks `time_limit` against an instance's run time summed over all its runs. The search
    re-solves one instance per price of memory; given only the seconds left, a price stopped with "Time
    limit reached" after 0.04 s on a relaxation whose first solve had taken 10 s. `_time_limit` adds them."""
    import highspy

    from spmd.cost_model.solver import _time_limit

    ilp, _, _ = _program([[(1.0, 1.0), (2.0, 0.5)]] * 30)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.passModel(ilp._model(np.asarray(ilp.cost, dtype=float)))
    h.run()
    ran = h.getRunTime()
    assert ran > 0
    _time_limit(h, 5.0)
    assert h.getOptionValue("time_limit")[1] == pytest.approx(ran + 5.0)
    h.run()
    assert h.getModelStatus() == highspy.HighsModelStatus.kOptimal


def test_branch_and_bound_is_not_repeated_when_it_ran_out_of_time_with_nothing_to_cut(monkeypatch):
    """After the price search (here 16.7% from its bound), branch and bound runs from the best plan. When it
    runs out of time with nothing better, and no plan was over by its extra alone (no cut to add), the cut
    loop would run the same search from the same plan with a little more room: it is skipped (a 2-layer
    transformers Llama on (2, 2) spent 10 s on each, neither past its root)."""
    from spmd.cost_model import solver

    runs = []

    def out_of_time(self, costs, weight, limit, start, rel_gap, on_progress, seconds, cuts=()):
        runs.append(len(cuts))
        return start, -float("inf"), False  # its start back, no bound: the time ran out

    monkeypatch.setattr(solver._Search, "branch_and_bound", out_of_time)
    ilp, _, weights = _program([[(0.0, 10.0), (3.0, 7.0), (7.0, 1.0)]] * 4)
    r = ilp.solve(budget=Budget(weights, 25.0, extra=lambda x: 0.0, cuts=lambda x: ()))
    assert r.gap > 0.01  # (so branch and bound ran at all)
    assert runs == [0]


def test_weights_first_gives_a_fitting_plan_when_the_prices_run_out_of_time(monkeypatch):
    """`Budget.weights_only`: when the cheapest plan does not fit, those columns are re-chosen under the row
    with every other choice fixed, before any price. Here every relaxation after the first runs out of
    time (as the transformers Llama's did at the price where its plan changes). Re-laying out the
    "weights" (groups 0 and 1) gives a plan of cost 4 that fits, from which branch and bound may improve;
    without those columns the search ends with no plan."""
    from spmd.cost_model import solver

    integral, calls = solver._Search.integral, []

    def slow(self, costs, **options):
        calls.append(1)
        if len(calls) > 1:
            return None, float("nan"), "Time limit reached"
        return integral(self, costs, **options)

    monkeypatch.setattr(solver._Search, "integral", slow)
    groups = [[(0.0, 10.0), (2.0, 5.0)], [(0.0, 10.0), (2.0, 5.0)], [(0.0, 10.0), (1.0, 4.0)]]
    for weights_only in (True, False):
        calls.clear()
        ilp, cols, weights = _program(groups)
        free = tuple(c for g in cols[:2] for c in g) if weights_only else ()
        r = ilp.solve(budget=Budget(weights, 20.0, extra=lambda x: 0.0, weights_only=free))
        if weights_only:
            picks = _picks(r.values, cols)
            assert sum(g[i][1] for g, i in zip(groups, picks)) <= 20.0 and r.objective <= 4.0 + 1e-9, r.status
        else:
            assert r.objective == float("inf") and r.status.startswith("Out of time"), r.status


@pytest.mark.parametrize("relaxation_solved", [True, False])
def test_branch_and_bound_is_skipped_where_a_price_relaxation_ran_out_of_time(monkeypatch, relaxation_solved):
    """Branch and bound from the best plan starts from the relaxation with the budget row. Where a price's
    relaxation (the same program at another price) ran out of its time, that root is no easier: the search
    keeps its best plan instead of spending branch and bound's time on it (the 2-layer transformers Llama at
    0.8 of its peak: 10 s, its root never solved). Where the relaxation was solved and only the price's own
    branch and bound found no plan in its time, branch and bound from the best plan still runs."""
    from spmd.cost_model import solver

    integral, calls, runs = solver._Search.integral, [], []

    def slow(self, costs, **options):
        calls.append(1)
        if len(calls) > 1:  # every price after the first: nothing in time
            return None, (0.0 if relaxation_solved else float("nan")), "Time limit reached"
        return integral(self, costs, **options)

    def branch_and_bound(self, costs, weight, limit, start, rel_gap, on_progress, seconds, cuts=(), fits=None):
        runs.append(1)
        return start, -float("inf"), False

    monkeypatch.setattr(solver._Search, "integral", slow)
    monkeypatch.setattr(solver._Search, "branch_and_bound", branch_and_bound)
    groups = [[(0.0, 10.0), (2.0, 5.0)], [(0.0, 10.0), (2.0, 5.0)], [(0.0, 10.0), (1.0, 4.0)]]
    ilp, cols, weights = _program(groups)
    r = ilp.solve(budget=Budget(weights, 20.0, extra=lambda x: 0.0,
                                weights_only=tuple(c for g in cols[:2] for c in g)))
    picks = _picks(r.values, cols)  # the weights-first plan, in hand before the prices
    assert sum(g[i][1] for g, i in zip(groups, picks)) <= 20.0 and r.objective <= 4.0 + 1e-9, r.status
    assert r.gap > 0.01  # (so branch and bound had a gap to close)
    assert runs == ([1] if relaxation_solved else [])


@pytest.mark.parametrize("dropped", [False, True])
def test_a_row_the_relaxation_drops_still_holds_for_the_plan(monkeypatch, dropped):
    """`Budget.droppable`: a second knapsack row of the program (what is alive when backward ends) that the
    price search's relaxation leaves out once its simplex passes `DROPPABLE_ITERATIONS`. Branch and bound
    keeps it, so the plan that comes back satisfies it either way. Here each option also holds some bytes
    at the end (`end`); the cheapest picks (cost 2) hold 20 there, over the limit of 12, and the best plan
    that fits costs 4. The walk (`extra`) sees the end's bytes beyond the row, and its cut is the row."""
    import spmd.cost_model.solver as solver
    from spmd.cost_model.solver import Cut

    groups = [[(1.0, 1.0), (3.0, 1.0)], [(1.0, 1.0), (2.0, 1.0)]]
    end = [[10.0, 2.0], [10.0, 3.0]]
    ilp, cols, weights = _program(groups)
    ending = [(c, b) for g, bs in zip(cols, end) for c, b in zip(g, bs)]
    row = ilp.add_le(ending, 12.0)
    drops = []
    monkeypatch.setattr(solver, "DROPPABLE_ITERATIONS", 0 if dropped else solver.DROPPABLE_ITERATIONS)
    def drop(self, run=solver._Search._drop_rows):
        before = self.relaxed.getNumRow()
        run(self)
        drops.append((before - self.relaxed.getNumRow(), self.droppable))  # (the row left the relaxation)

    monkeypatch.setattr(solver._Search, "_drop_rows", drop)

    def at_end(x) -> float:
        return sum(b * x[c] for c, b in ending)

    def extra(x) -> float:  # what the walk holds beyond the row: the end's bytes, where more
        return max(0.0, at_end(x) - sum(b * x[c] for c, b in weights.items()))

    r = ilp.solve(budget=Budget(weights, 12.0, extra=extra, droppable=(row,),
                                cuts=lambda x: (Cut(tuple(ending)),) if at_end(x) > 12.0 else ()))
    assert drops == ([(1, ())] if dropped else [])
    assert at_end(r.values) <= 12.0 + 1e-9, r.status
    assert r.objective == pytest.approx(4.0)


def test_cuts_are_added_to_branch_and_bound_in_one_call_as_their_rows_say(monkeypatch):
    """`_add_cuts` puts every cut and helper row into the instance in one addRows (HiGHS's addRow costs
    about a millisecond a call on a large program: 53k rows one by one took a minute on LLaMA3-8B), with
    the same matrix the rows say: a helper column per helper after the program's, z - sum(row) >= const,
    a column named twice in one row summed, and each cut's row <= the limit."""
    import highspy

    from spmd.cost_model.solver import Cut, _add_cuts

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    for _ in range(3):
        h.addVar(0.0, 1.0)
    calls = []
    monkeypatch.setattr(h, "addRow", lambda *a: calls.append(a), raising=False)
    cuts = (Cut(((0, 2.0), (1, 3.0)), ((5.0, ((((0, 0.5), (2, -1.0), (0, 0.5)), 0.0), (((1, 1.0),), -1.0))),)),
            Cut(((2, 4.0),), ((7.0, ((((2, 1.0),), 0.0),)), (1.0, ((((0, 1.0),), 0.5),)))))
    _add_cuts(h, cuts, 10.0)
    assert not calls
    lp = h.getLp()
    assert lp.num_col_ == 3 + 3  # a helper column each
    dense = np.zeros((lp.num_row_, lp.num_col_))
    m = lp.a_matrix_
    if m.format_ == highspy.MatrixFormat.kColwise:
        for c in range(lp.num_col_):
            for k in range(m.start_[c], m.start_[c + 1]):
                dense[m.index_[k], c] = m.value_[k]
    else:
        for r in range(lp.num_row_):
            for k in range(m.start_[r], m.start_[r + 1]):
                dense[r, m.index_[k]] = m.value_[k]
    inf = highspy.kHighsInf
    want = [  # (row, lower, upper)
        ([-1.0, 0, 1.0, 1.0, 0, 0], 0.0, inf),   # z3 >= x0 - x2 (x0 named twice: summed)
        ([0, -1.0, 0, 1.0, 0, 0], -1.0, inf),    # z3 >= x1 - 1
        ([2.0, 3.0, 0, 5.0, 0, 0], -inf, 10.0),  # the first cut
        ([0, 0, -1.0, 0, 1.0, 0], 0.0, inf),     # z4 >= x2
        ([-1.0, 0, 0, 0, 0, 1.0], 0.5, inf),     # z5 >= x0 + 0.5
        ([0, 0, 4.0, 0, 7.0, 1.0], -inf, 10.0),  # the second cut
    ]
    assert dense.tolist() == [r for r, _, _ in want]
    assert list(lp.row_lower_) == [lo for _, lo, _ in want] and list(lp.row_upper_) == [hi for _, _, hi in want]
    assert list(lp.col_upper_[3:]) == [1.0] * 3 and list(lp.col_lower_[3:]) == [0.0] * 3


def test_with_no_plan_fitting_the_polish_of_a_plan_over_finds_one():
    """The price search can only take options on the lower hull of (bytes, cost): here the middle one,
    the only one that fits whole, is above it, so every price lands on a plan over by its extra. The last
    step re-chooses the polish columns from those plans under the row with room for their extra, and finds
    it (with no plan in hand, the gap is not "closed": an early stop there returned no plan)."""
    ilp = IlpBuilder()
    options = [(0.0, 10.0, 8.0), (6.0, 1.0, 8.0), (10.0, -10.0, 25.0)]  # (cost, row bytes, extra bytes)
    cols = [ilp.add_var(cost, binary=True) for cost, _, _ in options]
    ilp.add_eq([(c, 1.0) for c in cols], 1.0)

    def extra(x) -> float:
        return options[int(np.argmax([x[c] for c in cols]))][2]

    r = ilp.solve(budget=Budget({c: b for c, (_, b, _) in zip(cols, options)}, 10.0, extra=extra,
                                polish=tuple(cols)))
    assert r.objective == pytest.approx(6.0), r.status
    assert r.values[cols[1]] == pytest.approx(1.0)


def test_polishes_side_by_side_give_what_each_gives_alone(monkeypatch):
    """`_Search.polish_each` runs two or more polishes at once, each on a thread of its own with a fresh
    instance: every result is the one `polish` gives alone, in the order of the starts."""
    import threading
    import time

    from spmd.cost_model.solver import _Search

    groups = [[(5.0, 9.0), (7.0, 4.0), (9.0, 1.0)], [(2.0, 8.0), (6.0, 2.0)], [(1.0, 7.0), (4.0, 3.0), (8.0, 1.0)],
              [(3.0, 6.0), (5.0, 1.0)]]
    ilp, cols, weights = _program(groups)
    costs, upper, lower = ilp._priced(np.zeros(0, dtype=bool))
    binary = np.asarray(ilp.integral, dtype=bool)
    search = _Search(ilp._model(costs, upper, lower), binary, ilp._choice_groups(binary), time.perf_counter() + 60,
                     1e-6)
    weight = np.zeros(len(costs))
    for c, b in weights.items():
        weight[c] = b

    def plan(picks) -> np.ndarray:
        x = np.zeros(len(costs))
        x[[g[i] for g, i in zip(cols, picks)]] = 1.0
        return x

    free = np.asarray(cols[0] + cols[2])  # groups 1 and 3 stay as each start has them
    starts = [(14.0, plan((0, 0, 0, 0))), (14.0, plan((0, 1, 0, 1))), (9.0, plan((2, 0, 2, 0))),
              (21.0, plan((0, 0, 0, 0)))]
    names = []
    alone = _Search.polish

    def polish(self, *args, **kwargs):
        names.append(threading.current_thread().name)
        return alone(self, *args, **kwargs)

    monkeypatch.setattr(_Search, "polish", polish)
    together = search.polish_each(costs, weight, starts, free)
    assert len(names) == 4 and all(n.startswith("spmd-polish") for n in names)
    want = [alone(search, costs, weight, limit, x, free) for limit, x in starts]
    assert [None if x is None else _picks(x, cols) for x in together] == \
        [None if x is None else _picks(x, cols) for x in want]

    def brute_force(limit, x):  # groups 1 and 3 as the start has them, 0 and 2 re-chosen under the row
        fixed = _picks(x, cols)
        fits = [p for p in itertools.product(*(range(len(g)) for g in groups))
                if p[1] == fixed[1] and p[3] == fixed[3] and sum(g[i][1] for g, i in zip(groups, p)) <= limit]
        return min(fits, key=lambda p: sum(g[i][0] for g, i in zip(groups, p)), default=None)

    assert [None if x is None else _picks(x, cols) for x in want] == [brute_force(*s) for s in starts] == \
        [None, (1, 1, 0, 1), None, (1, 0, 1, 0)]


def test_the_weights_first_polish_runs_beside_the_prices_and_finds_what_it_finds_in_turn(monkeypatch):
    """With a second core the weights-first polish (`Budget.weights_only`) runs on a thread of its own
    while the prices are searched, and its plan is taken once they end: the same answer as on one core,
    where it runs first."""
    import threading

    from spmd.cost_model import solver

    names, polish = [], solver._Search.polish

    def recorded(self, *args, **kwargs):
        names.append(threading.current_thread().name)
        return polish(self, *args, **kwargs)

    monkeypatch.setattr(solver._Search, "polish", recorded)
    groups = [[(0.0, 10.0), (2.0, 5.0)], [(0.0, 10.0), (2.0, 5.0)], [(0.0, 10.0), (1.0, 4.0)], [(0.0, 3.0), (5.0, 1.0)]]
    found = {}
    for cores in (2, 1):
        monkeypatch.setattr(solver.os, "cpu_count", lambda: cores)
        names.clear()
        ilp, cols, weights = _program(groups)
        free = tuple(c for g in cols[:2] for c in g)
        r = ilp.solve(budget=Budget(weights, 20.0, extra=lambda x: 0.0, weights_only=free))
        found[cores] = (r.objective, _picks(r.values, cols), names[0])
    assert found[2][:2] == found[1][:2] and found[1][0] == _brute_force(groups, 20.0)
    assert found[2][2].startswith("spmd-polish") and found[1][2] == threading.main_thread().name


def test_a_price_cut_short_for_a_weights_first_plan_that_does_not_come_goes_on(monkeypatch):
    """While the weights-first polish runs, a price's relaxation gets branch and bound's time, as with a plan
    in hand. Where it runs out of that time and the polish brings no plan, the relaxation goes on for the
    rest of the limit, as it would have with no plan in hand: here every price relaxation "runs out" of a
    time cut short, and without going on the search would end with no plan."""
    from spmd.cost_model import solver

    seconds_asked, integral = [], solver._Search.integral

    def cut_short(self, costs, seconds=None, **options):
        seconds_asked.append(seconds)
        if seconds is not None:
            return None, float("nan"), "Time limit reached"
        return integral(self, costs, seconds=seconds, **options)

    monkeypatch.setattr(solver._Search, "integral", cut_short)
    monkeypatch.setattr(solver._Search, "polish", lambda self, *args, **kwargs: None)  # no weights-first plan
    groups = [[(0.0, 10.0), (2.0, 5.0)], [(0.0, 10.0), (2.0, 5.0)], [(0.0, 10.0), (1.0, 4.0)]]
    ilp, cols, weights = _program(groups)
    free = tuple(c for g in cols[:2] for c in g)
    r = ilp.solve(budget=Budget(weights, 20.0, extra=lambda x: 0.0, weights_only=free))
    picks = _picks(r.values, cols)
    assert sum(g[i][1] for g, i in zip(groups, picks)) <= 20.0 and r.objective >= _brute_force(groups, 20.0), r.status
    # a price asked with branch and bound's time, then again with the rest of the limit (None)
    assert any(a is not None and b is None for a, b in zip(seconds_asked, seconds_asked[1:]))


def test_the_plan_nearest_to_fitting_is_repaired_by_its_weights():
    """A knapsack the prices cannot split. Price 0's plan (a0, b0, w0) needs 28 bytes of 21, and 27 with its
    weights re-chosen (the weights-first polish finds nothing). Between prices 1/3 and 10/12 per byte the
    plan is (a0, b1, w0), 22 bytes; above, (a1, b1, w0) fits at cost 12. The optimum, (a0, b1, w1) at cost
    3, is no price's plan. With a twin there is no branch and bound to find it (here the program is its own
    twin), so the repair does: the nearest plan over, (a0, b1, w0), its weights re-chosen under the row."""
    groups = [[(0.0, 12.0), (10.0, 0.0)], [(0.0, 6.0), (2.0, 0.0)], [(0.0, 10.0), (1.0, 9.0)]]
    ilp, cols, weights = _program(groups)
    assert _brute_force(groups, 21.0) == pytest.approx(3.0)
    budget = Budget(weights, 21.0, weights_only=tuple(cols[2]))
    r = ilp.solve(budget=budget, twin=(ilp, budget))
    assert _picks(r.values, cols) == (0, 1, 1) and r.objective == pytest.approx(3.0)
    # without the weights to re-choose, the prices' plan stays
    r = ilp.solve(budget=Budget(weights, 21.0), twin=(ilp, Budget(weights, 21.0)))
    assert _picks(r.values, cols) == (1, 1, 0) and r.objective == pytest.approx(12.0)
