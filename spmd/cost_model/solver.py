"""A small 0-1 program builder over scipy's HiGHS `milp`.

Columns are either binary choice variables or continuous edge variables in [0, 1]; rows are equalities.
The placement problem uses the Alpa-style marginal form: for an edge u -> v the edge variables
e[a, r] (producer spec a, consumer spec r) have row sums equal to u's choice of a and column sums equal
to v's choice of r, so with binary choices exactly one e[a, r] is 1 and its cost is the resharding.
That form's LP relaxation is tight enough that HiGHS proves optimality in well under a second on
transformer graphs (see bench/), where the textbook product linearization takes minutes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_array


@dataclass(frozen=True)
class IlpResult:
    values: np.ndarray
    objective: float
    lower_bound: float
    gap: float
    seconds: float
    status: str
    n_binary: int
    n_continuous: int
    n_rows: int


class IlpBuilder:
    def __init__(self):
        self.cost: list[float] = []
        self.integral: list[int] = []
        self._rows: list[int] = []
        self._cols: list[int] = []
        self._vals: list[float] = []
        self._rhs: list[float] = []
        self._lower: list[float] = []
        self.upper: list[float] = []

    def add_var(self, cost: float, binary: bool, upper: float = 1.0) -> int:
        """A column in [0, upper] (binary ones in {0, 1})."""
        self.cost.append(float(cost))
        self.integral.append(1 if binary else 0)
        self.upper.append(1.0 if binary else float(upper))
        return len(self.cost) - 1

    def add_vars(self, n: int) -> int:
        """`n` continuous columns in [0, 1] costing nothing (edge variables); returns the first."""
        first = len(self.cost)
        self.cost += [0.0] * n
        self.integral += [0] * n
        self.upper += [1.0] * n
        return first

    def forbid(self, col: int) -> None:
        """Fix a column at 0 (a choice that cannot be made)."""
        self.upper[col] = 0.0

    def add_cost(self, col: int, cost: float) -> None:
        self.cost[col] += float(cost)

    def add_eq(self, terms: list[tuple[int, float]], rhs: float) -> None:
        self._add_row(terms, rhs, rhs)

    def add_le(self, terms: list[tuple[int, float]], rhs: float) -> None:
        self._add_row(terms, -np.inf, rhs)

    def add_ge(self, terms: list[tuple[int, float]], rhs: float) -> None:
        self._add_row(terms, rhs, np.inf)

    def _add_row(self, terms, lower: float, upper: float) -> None:
        row = len(self._rhs)
        for col, coef in terms:
            self._rows.append(row)
            self._cols.append(col)
            self._vals.append(coef)
        self._lower.append(float(lower))
        self._rhs.append(float(upper))

    def solve(self, time_limit: float = 60.0, mip_rel_gap: float = 1e-6) -> IlpResult:
        """The optimum. The LP relaxation goes first: on placement programs it is usually integral
        already (the marginal form is tight), and then its optimum is the program's, proven (the
        relaxation's bound is the objective itself), at about half the cost of branch and bound."""
        n = len(self.cost)
        t0 = time.perf_counter()
        a = csr_array((self._vals, (self._rows, self._cols)), shape=(len(self._rhs), n))
        # HiGHS's optimality tolerances are absolute (1e-7): in seconds, a small op's cost (1e-6) sits
        # near them and a vertex 0.1% off the optimum passes as optimal. Scaled so the largest cost is
        # 1000, every cost that matters to 1e-10 of the largest is seen.
        costs = np.asarray(self.cost)
        largest = float(np.abs(costs).max()) if n else 0.0
        scale = 1e3 / max(largest, 1e-9)  # (a nanosecond at most: 1e12)
        problem = dict(c=costs * scale, bounds=Bounds(0, np.asarray(self.upper)),
                       constraints=LinearConstraint(a, np.asarray(self._lower), np.asarray(self._rhs)))
        binary = np.asarray(self.integral, dtype=bool)
        n_binary, n_rows = int(binary.sum()), len(self._rhs)
        lp = milp(**problem, options={"time_limit": time_limit, "presolve": False})
        if lp.x is not None and lp.status == 0 and np.all(np.abs(lp.x[binary] - np.round(lp.x[binary])) <= 1e-7):
            x = lp.x.copy()
            x[binary] = np.round(x[binary])
            objective = float(lp.fun) / scale
            return IlpResult(x, objective, objective, 0.0, time.perf_counter() - t0,
                             "Optimal (the LP relaxation's optimum is integral)", n_binary, n - n_binary, n_rows)
        remaining = max(1.0, time_limit - (time.perf_counter() - t0))
        res = milp(**problem, integrality=binary.astype(int),
                   options={"time_limit": remaining, "mip_rel_gap": mip_rel_gap, "presolve": True})
        seconds = time.perf_counter() - t0
        if res.x is None:
            return IlpResult(np.zeros(n), float("inf"), float("nan"), float("inf"), seconds, res.message,
                             n_binary, n - n_binary, n_rows)
        bound = float(getattr(res, "mip_dual_bound", res.fun) or res.fun)
        gap = 0.0 if res.fun <= 0 else max(0.0, (res.fun - bound) / abs(res.fun))
        return IlpResult(res.x, float(res.fun) / scale, bound / scale, gap, seconds, res.message,
                         n_binary, n - n_binary, n_rows)
