"""The polishes' restricted program (cost_model/restrict.py): bounds implied by fixed columns, only the
components a free binary column reaches, and a polish over it equal to the best plan with those choices
re-made (checked against every option on small marginal-form programs: a chain of choices, an edge
column per pair of options between neighbours, a budget row on the options)."""
from __future__ import annotations

import itertools
import time

import highspy
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from spmd.cost_model.restrict import Entries, restrict
from spmd.cost_model.solver import IlpBuilder, _Search
from tests.support import choice_program


def _chain(nodes: list[list[tuple[float, float]]], edge_costs: list[np.ndarray]):
    """Choices (cost, bytes) per node; edges between neighbours in the marginal form (e[a, b] sums to
    a's choice over b and to b's over a), each pair at its cost. Returns the builder, the choices'
    columns per node and the budget row's weights."""
    ilp, cols, weight = choice_program(nodes)
    for (u, v), costs in zip(itertools.pairwise(cols), edge_costs):
        e = {(a, b): ilp.add_var(float(costs[a, b]), binary=False) for a in range(len(u)) for b in range(len(v))}
        for a, ca in enumerate(u):
            ilp.add_eq([(e[a, b], 1.0) for b in range(len(v))] + [(ca, -1.0)], 0.0)
        for b, cb in enumerate(v):
            ilp.add_eq([(e[a, b], 1.0) for a in range(len(u))] + [(cb, -1.0)], 0.0)
    return ilp, cols, weight


def _search(ilp: IlpBuilder) -> tuple[_Search, np.ndarray]:
    costs = np.asarray(ilp.cost, dtype=float)
    binary = np.asarray(ilp.integral, dtype=bool)
    return _Search(ilp._model(costs), binary, ilp._choice_groups(binary), time.perf_counter() + 60, 1e-9), costs


def _price(nodes, edge_costs, picks) -> tuple[float, float]:
    cost = sum(nodes[i][p][0] for i, p in enumerate(picks)) + sum(
        float(c[a, b]) for c, (a, b) in zip(edge_costs, itertools.pairwise(picks)))
    return cost, sum(nodes[i][p][1] for i, p in enumerate(picks))


def _plan(search: _Search, costs, cols, picks) -> np.ndarray:
    x = np.zeros(len(costs))
    for g, p in zip(cols, picks):
        x[g[p]] = 1.0
    return search.settled(x, costs)


option = st.tuples(st.integers(1, 30).map(float), st.integers(1, 30).map(float))


@st.composite
def chains(draw):
    nodes = draw(st.lists(st.lists(option, min_size=2, max_size=3), min_size=3, max_size=6))
    edge_costs = [np.asarray(draw(st.lists(st.lists(st.integers(0, 20), min_size=len(v), max_size=len(v)),
                                           min_size=len(u), max_size=len(u))), dtype=float)
                  for u, v in itertools.pairwise(nodes)]
    picks = tuple(draw(st.integers(0, len(o) - 1)) for o in nodes)
    free = draw(st.lists(st.integers(0, len(nodes) - 1), min_size=1, max_size=2, unique=True))
    return nodes, edge_costs, picks, sorted(free), draw(st.floats(0.0, 1.0))


@settings(max_examples=40, deadline=None)
@given(chains())
def test_polish_is_the_best_plan_re_choosing_the_free_nodes(case):
    nodes, edge_costs, picks, free, tightness = case
    ilp, cols, weight = _chain(nodes, edge_costs)
    search, costs = _search(ilp)
    row = np.zeros(len(costs))
    for c, b in weight.items():
        row[c] = b
    options = [[picks[i]] if i not in free else range(len(nodes[i])) for i in range(len(nodes))]
    priced = [(_price(nodes, edge_costs, p), p) for p in itertools.product(*options)]
    needs = sorted(need for (_, need), _ in priced)
    limit = needs[0] + tightness * (needs[-1] - needs[0])
    best = min((cost for (cost, need), _ in priced if need <= limit), default=None)

    x = _plan(search, costs, cols, picks)
    got = search.polish(costs, row, limit, x, np.asarray([c for i in free for c in cols[i]]))
    if best is None:
        assert got is None
        return
    assert got is not None and abs(float(costs @ got) - best) < 1e-6
    assert float(row @ got) <= limit + 1e-6
    # a plan of the whole program: its other choices kept, every row met
    chosen = [int(np.argmax(got[g])) for g in cols]
    assert all(chosen[i] == picks[i] for i in range(len(nodes)) if i not in free)
    assert abs(float(costs @ got) - _price(nodes, edge_costs, chosen)[0]) < 1e-6


def _rows_met(lp: "highspy.HighsLp", x: np.ndarray) -> bool:
    e = Entries.of(lp)
    activity = np.bincount(e.rows, weights=e.values * x[e.cols], minlength=e.num_rows)
    return bool(np.all(activity >= np.asarray(lp.row_lower_) - 1e-9) and
                np.all(activity <= np.asarray(lp.row_upper_) + 1e-9))


def test_fixed_choices_fix_their_edges_and_only_the_free_nodes_part_stays():
    # a chain of four nodes, two options each; only the last node's choice is free. Of its edge to the
    # third node, the two pair columns from the third's chosen option stay (the others are bounded to 0
    # by the third's choice); the first two edges are fixed by the choices at their ends and leave
    nodes = [[(1.0, 1.0), (2.0, 2.0)]] * 4
    edge_costs = [np.asarray([[0.0, 5.0], [5.0, 0.0]])] * 3
    ilp, cols, _ = _chain(nodes, edge_costs)
    search, costs = _search(ilp)
    x = _plan(search, costs, cols, (0, 1, 1, 0))
    binary = np.asarray(ilp.integral, dtype=bool)
    fixed = np.setdiff1d(np.flatnonzero(binary), cols[3])
    part = restrict(search.lp, Entries.of(search.lp), x, fixed, binary)
    kept = set(part.cols.tolist())
    assert set(cols[3]) <= kept and not kept & set(itertools.chain(*cols[:3]))
    assert len(kept) == 2 + 2  # the free node's options and two of the last edge's pair columns
    # the plan's own values back where the restricted program keeps them: a solution of the whole
    assert _rows_met(search.lp, part.whole(x[part.cols]))
    assert np.array_equal(part.whole(x[part.cols]), x)
