"""A small 0-1 program builder over HiGHS (`highspy`).

Columns are either binary choice variables or continuous edge variables in [0, 1]; rows are equalities
or inequalities. The placement problem uses the Alpa-style marginal form: for an edge u -> v the edge
variables e[a, r] (producer spec a, consumer spec r) have row sums equal to u's choice of a and column
sums equal to v's choice of r, so with binary choices exactly one e[a, r] is 1 and its cost is the
resharding. That form's LP relaxation is tight enough that HiGHS proves optimality in well under a
second on transformer graphs (see bench/), where the textbook product linearization takes minutes.

HiGHS is driven directly (not through scipy's `milp`) for two things `milp` cannot do: report the
incumbent, bound and gap while branch and bound runs (`on_progress`), and start from a known solution.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import highspy
import numpy as np

from spmd.core.errors import SpmdInternalError
from spmd.core.graph_facts import format_bytes
from spmd.cost_model.restrict import Entries, restrict


BRANCH_SECONDS = 10.0  # branch and bound's time from a plan in hand (see `_Search.integral`, `Budget`)
FRACTIONAL = "Fractional"  # `_Search.integral(branch=False)`'s status for a relaxation it did not branch on
# Where branch and bound stops without a budget: once its plan is proven within this of the optimum, as a
# budgeted search stops (`Budget.gap`). The costs it compares are predictions, good to ~25% (the predicted /
# measured rows of bench/results_predict.md), and proving the last fraction of a percent is what made it run
# its whole time: a 2-layer GPT on (2, 2, 2) held a plan 0.46% over its bound after a second and spent 10 s
# (twice) not closing it; the plan then also depended on how far the search got in that time.
PLAN_GAP = 1e-2
# The dual simplex's iterations on a relaxation before interior point (with crossover, so still a vertex)
# takes over: a few degenerate programs of 3-D meshes stall the simplex (the 1.1B search's hardest: 36,500
# iterations for 68k columns, 0.53 per column, 15 s, where interior point takes 5 s). The others need 0.1-0.24
# per column (the 1.1B search's other programs: 8,300-17,400 for 72-91k; LLaMA3-8B on (8, 8): 10,000 for
# 62k; the 2-layer transformers Llama on (2, 2) with the built-in cpu profile: 25,800 for 126k, which a cap
# of 0.2 cut off 600 iterations short, sending it to 14 s of interior point: its plan took 20.6 s, now 7.2).
# Counted in iterations, not seconds, so that the path, and with it which of several optimal vertices comes
# back, does not depend on the machine's load: four ranks solving at once on two cores once took Llama's
# relaxation (2 s alone) past a 4 s switch to interior point, which needs 45 s on that program.
SIMPLEX_ITERATIONS_PER_COLUMN = 0.3
SIMPLEX_ITERATIONS_MIN = 20_000
# A program's first relaxation, solved cold, with at least this many columns: interior point starts beside
# the simplex (on a second core: HiGHS lets go of the GIL), so that where the simplex reaches its cap the
# interior point's basis is ready sooner. It is the same solve as after the cap (same model and options), so
# the plan does not depend on which finished first; where the simplex finishes, interior point is stopped.
# The 1.1B Llama's axis search on (4, 4, 4): its degenerate program reached the cap after ~5 s and interior
# point then took 4.9 s more.
BESIDE_MIN_COLUMNS = 50_000
# Interior point waits this long before it starts: most relaxations are solved by then (LLaMA3-8B's first in
# 0.16 s, the 70B-shaped search's in 0.12-0.3 s, against 3 s and more to the cap), and an instance started at
# once cost each of them ~0.08 s (LLaMA3-8B's HiGHS 0.61-0.65 s without it, 0.70-0.72 with).
BESIDE_AFTER = 0.5
# The relaxation's iterations while it holds rows it may drop (`Budget.droppable`). The row of what is alive
# when backward ends tightens the price search's bound (the 2-layer GPT of the e2e budget test at 0.8 of its
# peak: a gap of 0.97% with it, 17.8% without), but on the 2-layer transformers Llama at 0.6 it made the first
# relaxation take 44 s (56k iterations to the cap, then 9 s without it) where 9 s does without it.
DROPPABLE_ITERATIONS = 20_000
# A round of the lazy pricing (`_LazyShares`) makes the shared costs a solution took partly exact with their
# whole families, unless those families hold more shared costs than this share of the program's row count (each
# adds a column and a row per consumer): then only the parts of them (`add_shared`) that were taken partly, in
# that round and every later one of the solve. Rows added in bulk make the warm simplex go on nearly as long as
# a cold solve: the 1.1B Llama's axis search on (4, 4, 4) took 11 shared costs partly in 10 families of 300-800
# each, and their 5,339 shared costs (13% of its 41k rows in number) took the next relaxation 15.7k iterations
# (3.2 s) where a few rounds of their parts (250 shared costs or fewer each) took 1.9 s; a later round's whole
# families there (7.9%) cost 0.4 s more than its parts. Below it: LLaMA3-8B's rounds (at most 4% of its row
# count; by parts its 80 GB plan took 6.7 s, not 5.5), the 70B-shaped search's (5.5-6.2%: by parts 0.3-0.5 s
# slower) and ViT-60B's at 80 GB (6.5-7.3%: by parts a plan 0.2% dearer).
WHOLE_FAMILIES_MAX = 0.08
# The price search stops after this many prices in a row improved neither its best plan nor its bound: near
# the dual optimum the interval keeps halving over plans that differ by a layer's layout (LLaMA3-8B at
# 80 GB: 14 such prices after the 5th, ~6 s). Raising the price stops as soon after this many plans whose
# row fit but were over by their temporaries, no leaner than before (ViT-120B at batch 512: 14, ~10 s).
POLISH_OVER = 3  # plans over by their temporaries alone that `polish` also tries, the cheapest first
POLISH_AT_ONCE = 2  # polishes side by side, at most (and at most one per core)
STALLED_PROBES = 3
CUT_ROUNDS = 12  # branch and bound runs of the last resort (`IlpBuilder._cut_loop`), more cuts each
# The bit of HiGHS's `presolve_rule_off` that stops its presolve probing binary columns (its log names it:
# "Rule 15 (set bit 15 = 32768): Probing"), off in the polishes: their free binary columns are one or a few
# "exactly one of" choices, where probing each column finds nothing. ViT-60B's recomputation polish (2,701
# pairs, 5.6k columns once restricted): presolve 3.0 of its 3.2 s with probing, 0.65 s in all without.
NO_PROBING = 1 << 15


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


@dataclass(frozen=True)
class Cut:
    """A row every solution that fits satisfies: sum(coef * x[col] for terms) + sum(bytes * z for helpers)
    <= the budget's limit. Each helper z is a new column in [0, 1] with rows z >= sum(coef * x[col]) + const,
    one per (terms, const) it is given: at an integral solution the smallest z is 1 exactly when what
    it stands for holds (a resharded copy that is alive)."""

    terms: tuple[tuple[int, float], ...]
    helpers: tuple[tuple[float, tuple[tuple[tuple[tuple[int, float], ...], float], ...]], ...] = ()


@dataclass(frozen=True)
class Budget:
    """One knapsack row, sum(bytes[col] * x[col]) <= limit, kept out of the program and relaxed (see
    `IlpBuilder.solve`). `extra(x)`: what a solution needs beyond the row that the row cannot see
    (the schedule's temporaries); a solution fits when its row plus its extra is within the limit."""

    bytes: dict[int, float]
    limit: float
    extra: Callable[[np.ndarray], float] | None = None
    gap: float = 1e-2  # stop searching once the certified gap is this small
    seconds: float = BRANCH_SECONDS  # branch and bound's time after the price search, when the gap is still larger
    # binary columns a last step re-chooses exactly under the row with every other binary column fixed at
    # the best plan's: choices the price search can only take all or nothing of (how many identical
    # layers to recompute: at any price, recomputing one pays exactly when recomputing all does)
    polish: tuple[int, ...] = ()
    # binary columns of the layouts of the values whose bytes do not depend on the schedule (parameters,
    # their gradients and optimizer state): re-chosen under the row with every other choice fixed, they turn
    # a plan that does not fit into one that shards its weights (`IlpBuilder._within_budget`)
    weights_only: tuple[int, ...] = ()
    # `cuts(x)`: for a solution whose row fits but whose extra does not, rows (`Cut`) that every fitting
    # solution satisfies and x violates (the bytes alive at the points of the schedule where x is over, as
    # linear functions of the choices), the worst point first. With them, when no plan the price search
    # meets fits whole, branch and bound with the row and these cuts either finds one that fits or proves
    # that none does.
    cuts: Callable[[np.ndarray], "tuple[Cut, ...]"] | None = None
    # rows of the program every fitting solution satisfies that the price search's relaxation may leave out
    # (what is alive when backward ends, a second knapsack row): they tighten its bound, but where they
    # make it too hard for the dual simplex (its iteration cap reached), the relaxation drops them and
    # every branch and bound and polish keeps them (the 2-layer transformers Llama at 0.6 of its peak: the
    # first price's relaxation ran past the 60 s limit with its row, 9 s without). A plan that breaks one
    # is over by its extra (the walk holds the same bytes; the optimizer's step's, where its temporaries are
    # counted, solve_placements folds into the extra and gives as a cut).
    droppable: tuple[int, ...] = ()

    def row(self, n: int) -> np.ndarray:
        """The row's bytes per column of a program of `n` columns."""
        weight = np.zeros(n)
        for col, b in self.bytes.items():
            weight[col] += b
        return weight


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
        # costs paid once if any of several consumers takes them (`add_shared`): (seconds, columns per
        # consumer, column y)
        self._shared: list[tuple[float, tuple[tuple[int, ...], ...], int]] = []
        self._family: list[object] = []  # per shared cost, what it is made exact with (`add_shared`)
        self._part: list[object] = []  # per shared cost, (family, part): what it is made exact with in a large round
        self._flat_lists: dict[str, list[int]] = {k: [] for k in ("row", "row_group", "use_start", "use_group", "col")}
        self._flat = None  # the same as arrays (`_shared_arrays`)
        self._matrix = None  # (entries, rows, columns) -> the column-wise matrix (`_model`)

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

    def add_shared(self, seconds: float, uses: list[list[int]], family: object = None, part: object = None) -> None:
        """`seconds` paid once if any consumer in `uses` takes it (each consumer's columns, at most one
        of them 1 in any solution): a resharding several consumers of one value share.

        Priced exactly, it is a column y >= each consumer's sum, costing `seconds`: one row per consumer.
        On small models those rows are most of the program and make its relaxation 25x slower (the 2-layer
        transformers Llama on (2, 2): 43k of 58k rows, 23 s against 0.9 s). So, without a budget, `solve`
        first leaves y and its rows out (y fixed at 0, the rows free) and has each consumer's columns carry
        an even share, seconds / len(uses): no plan pays less than that (m of k consumers taking it pay
        m / k of it, and it costs all of it), so that optimum is a lower bound, and it is the program's
        wherever no shared cost is taken by some consumers but not all. Where some are, they are priced
        exactly and the program solved again. Shared costs of one `family` (the reshardings of one value)
        are made exact together: a plan that takes one of them partly has its reasons to take the others
        so. Where a round's families would add too many rows at once (`WHOLE_FAMILIES_MAX`), only the
        shared costs of the same `part` of a family are (the reshardings from one made layout). y and its
        rows are in the program from the start, in order, so that priced exactly everywhere it is the same
        program, column for column, as without the lazy pricing.
        """
        uses = [tuple(u) for u in uses]
        if len(uses) == 1:
            for col in uses[0]:
                self.add_cost(col, seconds)
            return
        y = self.add_var(0.0, binary=False)
        g = len(self._shared)
        flat = self._flat_lists
        for u in uses:
            flat["row"].append(self._add_entries([y, *u], [1.0] + [-1.0] * len(u), 0.0, np.inf))
            flat["row_group"].append(g)
            flat["use_start"].append(len(flat["col"]))
            flat["use_group"].append(g)
            flat["col"].extend(u)
        self._shared.append((float(seconds), uses, y))
        self._family.append(g if family is None else family)
        self._part.append((self._family[-1], part))
        self._flat = None

    def _shared_arrays(self) -> dict[str, np.ndarray]:
        """`_shared` as arrays: per shared cost its seconds, y and number of consumers; per consumer its
        shared cost and first entry in `col`; per entry its column; per row of a y its shared cost."""
        if self._flat is None:
            flat = {k: np.asarray(v, dtype=np.int64) for k, v in self._flat_lists.items()}
            flat["seconds"] = np.asarray([sec for sec, _, _ in self._shared], dtype=float)
            flat["y"] = np.asarray([y for _, _, y in self._shared], dtype=np.int64)
            flat["k"] = np.bincount(flat["use_group"], minlength=len(self._shared))
            lengths = np.diff(np.append(flat["use_start"], len(flat["col"])))
            flat["col_group"] = np.repeat(flat["use_group"], lengths)  # per entry, its shared cost
            self._flat = flat
        return self._flat

    def _priced(self, exact: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(costs, column upper bounds, row lower bounds) with the shared costs `exact` (a mask) priced
        exactly and the others at their shares (`add_shared`)."""
        costs, upper = np.asarray(self.cost, dtype=float), np.asarray(self.upper, dtype=float)
        row_lower = np.asarray(self._lower, dtype=float)
        if not self._shared:
            return costs, upper, row_lower
        f = self._shared_arrays()
        costs[f["y"]] += np.where(exact, f["seconds"], 0.0)
        upper[f["y"][~exact]] = 0.0
        row_lower[f["row"][~exact[f["row_group"]]]] = -np.inf
        share = np.where(exact, 0.0, f["seconds"] / f["k"])[f["col_group"]]
        costs += np.bincount(f["col"], weights=share, minlength=len(costs))
        return costs, upper, row_lower

    def _partly_taken(self, x: np.ndarray, exact: np.ndarray, by_parts: bool = False) -> tuple[float, np.ndarray, bool]:
        """What `x` costs beyond the program's price of it (shared costs not in `exact` that some but not
        all consumers take, priced at their shares), a mask of those shared costs' families, whole, and
        False; or, with `by_parts` or where the families hold more shared costs than `WHOLE_FAMILIES_MAX`
        of the program's row count, a mask of their parts, and True."""
        if not self._shared:
            return 0.0, np.zeros(0, dtype=bool), by_parts
        f = self._shared_arrays()
        seconds, use_group = f["seconds"], f["use_group"]
        taken = np.add.reduceat(x[f["col"]], f["use_start"])
        most = np.full(len(seconds), -np.inf)
        np.maximum.at(most, use_group, taken)
        over = np.where(exact, 0.0, most - np.bincount(use_group, weights=taken, minlength=len(seconds)) / f["k"])
        missed = over > 1e-6
        extra, partly = float(seconds[missed] @ over[missed]), np.flatnonzero(missed).tolist()
        if not by_parts:
            families = {self._family[g] for g in partly}
            mask = ~exact & np.fromiter((f in families for f in self._family), dtype=bool, count=len(self._family))
            if mask.sum() <= WHOLE_FAMILIES_MAX * len(self._rhs):
                return extra, mask, False
        parts = {self._part[g] for g in partly}
        return extra, ~exact & np.fromiter((p in parts for p in self._part), dtype=bool, count=len(self._part)), True

    def _completed(self, x: np.ndarray) -> np.ndarray:
        """`x` with each shared cost's y at least what its consumers take (a solution of a program that
        priced some at their shares, made a solution of the exact one, at its true cost)."""
        if not self._shared:
            return x
        f = self._shared_arrays()
        most = np.zeros(len(f["seconds"]))
        np.maximum.at(most, f["use_group"], np.add.reduceat(x[f["col"]], f["use_start"]))
        x = x.copy()
        x[f["y"]] = np.maximum(x[f["y"]], np.minimum(most, 1.0))
        return x

    def _at_shares(self, x: np.ndarray, exact: np.ndarray) -> np.ndarray:
        """A completed solution `x` as a solution of the program with only `exact` priced exactly (the
        other shared costs' y at 0, their rows free)."""
        if not self._shared:
            return x
        x = x.copy()
        x[self._shared_arrays()["y"][~exact]] = 0.0
        return x

    def add_eq(self, terms: list[tuple[int, float]], rhs: float) -> int:
        return self._add_row(terms, rhs, rhs)

    def add_le(self, terms: list[tuple[int, float]], rhs: float) -> int:
        return self._add_row(terms, -np.inf, rhs)

    def add_ge(self, terms: list[tuple[int, float]], rhs: float) -> int:
        return self._add_row(terms, rhs, np.inf)

    def _add_row(self, terms, lower: float, upper: float) -> int:
        """Adds the row; returns its index."""
        terms = list(terms)
        return self._add_entries([col for col, _ in terms], [coef for _, coef in terms], lower, upper)

    def _add_entries(self, cols: list[int], coefs: list[float], lower: float, upper: float) -> int:
        """Adds the row `coefs . x[cols]` in [lower, upper] (a row per consumer of every shared cost: the
        program's most numerous rows, added in bulk); returns its index."""
        row = len(self._rhs)
        self._rows.extend([row] * len(cols))
        self._cols.extend(cols)
        self._vals.extend(coefs)
        self._lower.append(float(lower))
        self._rhs.append(float(upper))
        return row

    def solve(self, time_limit: float = 60.0, mip_rel_gap: float | None = None,
              on_progress: Callable[[float, float, float], None] | None = None,
              budget: Budget | None = None, twin: "tuple[IlpBuilder, Budget] | None" = None) -> IlpResult:
        """The optimum, or with a `budget` the best solution found within `budget.gap` of a proven bound.

        Without a budget the LP relaxation goes first: on placement programs it is usually integral
        already (the marginal form is tight), and then its optimum is the program's, proven (the
        relaxation's bound is the objective itself), at about half the cost of branch and bound.

        A budget row would make that relaxation fractional and leave the work to branch and bound
        (minutes on a two-layer model). It is relaxed instead (Lagrange): for a price `lam` per byte,
        the program without the row, costs `c + lam * bytes`, keeps its integral relaxation; its optimum
        less `lam * limit` bounds the budgeted optimum from below, and where its solution fits (row plus
        `budget.extra`) it is a budgeted plan. The search (`_within_budget`) finds the cheapest price
        that fits; branch and bound runs (from that plan) only if the certified gap is still above
        `budget.gap`.

        `mip_rel_gap`: where branch and bound stops without a budget (default `PLAN_GAP`; with a budget
        it is the polishes', default 1e-6, and `budget.gap` says where the search stops). `on_progress(objective, bound,
        gap)`, in the builder's units, is called as the incumbent or bound improve.

        Shared costs (`add_shared`) start at their shares: where the relaxation's solution takes one
        partly, those are priced exactly (their columns and rows join the relaxation, which goes on from
        its basis) and it is solved again, until no shared cost is taken partly. Each solve is a lower
        bound; the last one prices its solution at its true cost, so its optimum is the program's. With a
        budget the price search's relaxations do the same (`_LazyShares`: the rows made exact at one price
        stay for the next), and branch and bound and the polishes work on the exact program.

        `twin`: with a budget, a smaller program the price search's relaxations solve instead, and its
        budget row: the same binary columns in the same order, and for every plan a cost and a row no
        larger than this program's (solve_placements' pooled reads). Each of its bounds is then a bound
        here, and each plan it gives is this program's plan with those binary columns (its continuous
        columns at their least cost), priced here."""
        t0 = time.perf_counter()
        if mip_rel_gap is None:
            mip_rel_gap = PLAN_GAP if budget is None else 1e-6
        n = len(self.cost)
        exact = np.zeros(len(self._shared), dtype=bool)
        costs, upper, row_lower = self._priced(exact)
        # HiGHS's optimality tolerances are absolute (1e-7): in seconds, a small op's cost (1e-6) sits
        # near them and a vertex 0.1% off the optimum passes as optimal. Scaled so the largest cost is
        # 1000, every cost that matters to 1e-10 of the largest is seen. (The shares of shared costs are
        # never larger than their whole: the scale is the exact program's.)
        whole = self._priced(np.ones(len(self._shared), dtype=bool))  # (the exact program)
        largest = float(np.abs(whole[0]).max()) if n else 0.0
        scale = 1e3 / max(largest, 1e-9)  # (a nanosecond at most: 1e12)
        binary = np.asarray(self.integral, dtype=bool)
        sizes = (int(binary.sum()), n - int(binary.sum()), len(self._rhs) + (budget is not None))
        groups = self._choice_groups(binary)
        whole_costs, whole_upper, whole_lower = whole
        search = _Search(self._model(costs * scale, upper, row_lower), binary, groups, t0 + time_limit, mip_rel_gap)
        report = None if on_progress is None else (lambda o, b, g: on_progress(o / scale, b / scale, g))

        if budget is None:
            x, bound, status = _LazyShares(self, scale, exact, search).integral(on_progress=report)
            if x is None:
                return IlpResult(np.zeros(n), float("inf"), float("nan"), float("inf"), time.perf_counter() - t0,
                                 status, *sizes)
            # (x completed: its true cost, also where time ran out with shared costs taken partly)
            objective = float(whole_costs @ x)
            bound = bound / scale
            gap = 0.0 if objective <= 0 else max(0.0, (objective - bound) / abs(objective))
            return IlpResult(x, objective, min(bound, objective), gap, time.perf_counter() - t0, status, *sizes)

        # The price search's relaxations price shared costs lazily too (`_LazyShares`); branch and bound,
        # the polishes and every plan's price use the exact program
        exact_search = search if not self._shared else _Search(
            self._model(whole_costs * scale, whole_upper, whole_lower), binary, groups, search.deadline, mip_rel_gap)
        if twin is None or not exact_search.roundable:
            probes = _LazyShares(self, scale, exact, search)
            return self._within_budget(exact_search, probes, whole_costs * scale, scale, budget, report, t0, sizes)
        other, other_budget = twin
        other_binary = np.asarray(other.integral, dtype=bool)
        other_groups = other._choice_groups(other_binary)
        if [len(g) for g in other_groups] != [len(g) for g in groups]:
            raise SpmdInternalError(f"IlpBuilder.solve: a twin whose choices ({len(other_groups)}, "
                                    f"{int(other_binary.sum())} binary columns) are not the program's ({len(groups)}, "
                                    f"{int(binary.sum())})")
        other_exact = np.zeros(len(other._shared), dtype=bool)
        other_costs, other_upper, other_lower = other._priced(other_exact)
        other_search = _Search(other._model(other_costs * scale, other_upper, other_lower), other_binary,
                               other_groups, search.deadline, mip_rel_gap)
        # Price 0 here, and each twin's plan made a plan here (its binary columns, the rest at their least cost:
        # `settled`), without the droppable rows: a plan over what is alive when backward ends is over by its
        # extra, and still a plan. (The exact program's relaxation is not solved with a twin; its rows go too.)
        for s in dict.fromkeys([search, exact_search]):
            s.droppable = tuple(budget.droppable)
            s._drop_rows()
        at, other_at = np.flatnonzero(binary), np.flatnonzero(other_binary)

        def lift(x: np.ndarray) -> np.ndarray | None:
            plan = np.zeros(n)
            plan[at] = np.round(x[other_at])
            return exact_search.settled(plan, whole_costs * scale)

        probes = _LazyShares(other, scale, other_exact, other_search)
        return self._within_budget(exact_search, probes, whole_costs * scale, scale, budget, report, t0, sizes,
                                   (other_budget.row(len(other.cost)), other_budget.droppable, lift,
                                    _LazyShares(self, scale, exact, search)))

    def _within_budget(self, search: "_Search", probes: "_LazyShares", costs: np.ndarray, scale: float,
                       budget: Budget, report, t0: float, sizes: tuple, twin: tuple | None = None) -> IlpResult:
        """The Lagrangian search of `solve`. Each price `lam` gives a solution x and a line,
        c.x + mu * (w.x - limit), that lies above the dual function; the next price is where the lines
        of the dearest price that does not fit and the cheapest that does cross (Newton's step for a
        one-row dual), so the search ends in a few solves, at the dual optimum or when the gap closes.
        `report(objective, bound, gap)`: progress in the scaled `costs`' units. `search` is the exact
        program's (branch and bound, polishes), `probes` the prices' relaxations (shared costs lazily: each
        bound is a bound, and each plan it gives is priced here at its true cost, `costs`). `twin`: where
        `probes` solve the twin of `solve` instead, its (budget row, droppable rows, plan here of its plan, and
        this program's relaxation at shares without its droppable rows, for price 0)."""
        weight = budget.row(len(costs))
        limit = float(budget.limit)
        probe_weight, droppable, lift, unbudgeted = (weight, budget.droppable, None, None) if twin is None else twin
        probes.droppable(droppable)
        state = {"x": None, "objective": float("inf"), "bound": -float("inf"), "probes": 0,
                 "leanest": None, "leanest_need": float("inf"),  # the plan needing least, fitting or not
                 "nearest": None, "nearest_need": float("inf"),  # and of those that do not fit
                 "over": [], "proven": False,  # plans whose row fits but not their extra; none fits, proven
                 "polished": set(),  # ids of the plans of "over" that `polish(over=True)` started from
                 "repaired": None,  # the nearest plan `repair` last started from (nearer ones replace it)
                 "weights_first": None,  # the weights-first polish's plan (a future) until the prices end
                 # no branch and bound from the best plan where the prices solved a twin: its root is this
                 # program's relaxation with the row, which the twin is there to avoid (the 2-layer transformers
                 # Llama at 0.8 of its peak: 10 s, and no better plan)
                 "hard": twin is not None}

        def gap() -> float:
            best = state["objective"]
            if state["x"] is None:  # (no plan: (inf - bound) / inf is nan, which max() would make 0)
                return float("inf")
            return 0.0 if best <= 0 else max(0.0, (best - state["bound"]) / abs(best))

        def needs(x) -> float:
            return float(weight @ x) + (budget.extra(x) if budget.extra is not None else 0.0)

        def room(x) -> float:
            """What the row may hold beside `x`'s extra (its temporaries)."""
            return limit - (needs(x) - float(weight @ x))

        def improve(x, bound: float, need: float | None = None) -> None:
            state["bound"] = max(state["bound"], bound)
            if x is not None and float(costs @ x) < state["objective"]:
                need = needs(x) if need is None else need
                if need <= limit * (1 + 1e-9):
                    state["x"], state["objective"] = x, float(costs @ x)
            if report is not None and state["x"] is not None:
                report(state["objective"], state["bound"], gap())

        def probe(lam: float, here: "_LazyShares | None" = None):
            """(fits, c.x, what x needs) at price `lam` per byte of the row, or None when there is no
            solution. The bound is the row's alone (`extra` is not linear; every fitting plan satisfies the
            row); the search steers by what plans need whole. `here`: this program's relaxation, where
            `probes` solve a twin."""
            state["probes"] += 1
            relaxation, row, to_here = (probes, probe_weight, lift) if here is None else (here, weight, None)
            # with a plan that fits in hand (or on its way: the weights-first polish), a relaxation gets a
            # branch and bound's time, not the rest of the limit (a 2-layer transformers Llama on (2, 2): 79 s
            # for the price where its plan changes)
            on_its_way = state["x"] is None and state["weights_first"] is not None
            x, value, status = relaxation.integral(lam * row, first_found=True,
                                                   seconds=budget.seconds if state["x"] is not None or on_its_way
                                                   else None)
            if x is None and on_its_way and "time limit" in status.lower() and \
                    state["weights_first"].result() is None:
                # the plan on its way did not come: as with none in hand, the relaxation goes on (from where it
                # stopped) for the rest of the limit
                x, value, status = relaxation.integral(lam * row, first_found=True)
            if x is not None and to_here is not None:
                x = to_here(x)  # (None only out of time, or from a twin that is not one: no plan, the bound kept)
            if x is None:
                state["out_of_time"] = search.out_of_time() or "time limit" in status.lower()
                state["proven"] |= status.lower() == "infeasible"  # (the relaxation has no solution)
                if np.isfinite(value):  # (no plan in time, but the relaxation's optimum is a bound all the same)
                    improve(None, value - lam * limit)
                elif "time limit" in status.lower():  # the relaxation itself ran out of its time (see `branch`)
                    state["hard"] = True
                return None
            need = needs(x)  # (the temporaries walk the schedule: once per plan)
            state["row"] = float(weight @ x)
            improve(x, value - lam * limit, need)
            met(x, need)
            return need <= limit * (1 + 1e-9), float(costs @ x), need

        def met(x, need: float) -> None:
            """Keep the leanest plan, the leanest of those over (for `repair`), and each plan over by its extra
            alone (a cut for `_cut_loop`)."""
            if need < state["leanest_need"]:
                state["leanest"], state["leanest_need"] = x, need
            if limit * (1 + 1e-9) < need < state["nearest_need"]:
                state["nearest"], state["nearest_need"] = x, need
            if need > limit * (1 + 1e-9) >= float(weight @ x) * (1 + 1e-9) and \
                    not any(np.array_equal(x[search.binary], seen[search.binary]) for _, seen in state["over"]):
                state["over"].append((need, x))

        def prices(first: tuple) -> None:
            """Prices of the row from 0 (`first`: that probe's answer), 8x apart until a plan fits
            whole, then Newton's steps between the dearest that does not fit and the cheapest that does."""
            lo, lo_line = 0.0, first[1:]
            lam, hi, hi_line = 1e-2 * max(first[1], 1e-12) / max(first[2], 1.0), None, None
            stalled = 0  # probes in a row whose plan fit the row yet needed no less than the leanest before
            early = None  # the first plan over by its temporaries alone, polished from the price that found it
            for _ in range(24):  # prices 8x apart until one fits (none: not even the leanest plan fits)
                leanest = state["leanest_need"]
                got = probe(lam)
                if early is None and state["over"] and budget.polish:
                    early = polish_over_aside(state["over"][0][1])
                if got is None or search.out_of_time():
                    break
                if got[0]:
                    hi, hi_line = lam, got[1:]
                    break
                # a plan whose row fits is over by its temporaries, which dearer rows may not move; with
                # cuts to fall back on (`_cut_loop`: a fitting plan or a proof), stop after a few such
                row_fits = state["row"] <= limit * (1 + 1e-9)
                stalled = stalled + 1 if budget.cuts and row_fits and got[2] >= leanest * (1 - 1e-6) else 0
                if stalled >= STALLED_PROBES:
                    break
                lo, lo_line, lam = lam, got[1:], lam * 8
            weights_first()  # (the steps between prices below steer by the best plan)
            if early is not None:  # and so does the first plan over, polished
                improve(early.result(), -float("inf"))
            stalled = 0  # probes in a row that improved neither the best plan nor the bound
            for _ in range(16):
                if hi is None or gap() <= budget.gap or search.out_of_time() or hi - lo <= 1e-9 * hi \
                        or stalled >= STALLED_PROBES:
                    break
                (c_lo, w_lo), (c_hi, w_hi) = lo_line, hi_line
                cross = (c_hi - c_lo) / (w_lo - w_hi) if w_lo > w_hi else -1.0
                mid = cross if lo < cross < hi else ((lo + hi) / 2 if lo == 0 else (lo * hi) ** 0.5)
                before = (state["objective"], state["bound"])
                polishing, repairing = polish_over_aside(), repair_aside(steps=True)
                got = probe(mid)
                for aside in (polishing, repairing):  # (joined here whatever the cores: the same path on any number)
                    if aside is not None:
                        improve(aside.result(), -float("inf"))
                if got is None:
                    break
                stalled = stalled + 1 if (state["objective"], state["bound"]) == before else 0
                if got[1:] in (lo_line, hi_line) and mid == cross:
                    break  # the lines meet at the dual optimum: no price finds a better plan
                if got[0]:
                    hi, hi_line = mid, got[1:]
                else:
                    lo, lo_line = mid, got[1:]

        def weights_first() -> None:
            """The weights-first polish's plan joins the search (waiting for it where it is still made)."""
            if state["weights_first"] is not None:
                got, state["weights_first"] = state["weights_first"].result(), None
                if got is not None:
                    improve(got, -float("inf"))
                    met(got, needs(got))

        def polish(best: bool = True, over: bool = False) -> None:
            """The polish columns re-chosen under the row for the best plan (`best`) and (`over`) for the
            cheapest plans that were over by their temporaries alone: with their placements, a few layers
            recomputed may make the room (their extra does not move with the polish columns). Polished
            side by side (`_Search.polish_each`), as many at a time as there are cores; the plans over
            stop once the gap is closed."""
            if not budget.polish:
                return
            mine = [state["x"]] if best and state["x"] is not None else []
            # (each plan over once: this may run after the price search too, and again at the end)
            overs = [x for x in cheaper_overs()[:POLISH_OVER] if id(x) not in state["polished"]] if over else []
            at_once = min(_cores(), POLISH_AT_ONCE)
            while (mine or overs) and not search.out_of_time():
                if gap() <= budget.gap:
                    overs = []
                taken, overs = overs[:at_once - len(mine)], overs[at_once - len(mine):]
                batch, mine = mine + taken, []
                state["polished"].update(map(id, taken))
                for got in search.polish_each(costs, weight, [(room(x), x) for x in batch], np.asarray(budget.polish)):
                    improve(got, -float("inf"))

        def polish_over_aside(x: np.ndarray | None = None) -> "Future | None":
            """The cheapest plan over by its temporaries alone that is cheaper than the best and not yet
            polished, polished (as `polish(over=True)`) beside the price search's next step: the polish that
            closes the gap would otherwise wait for the steps to stall (LLaMA3-8B in transformers at 80 GB: three
            steps, 1 s, that moved nothing, before the polish that took the gap from 2.45% to 0.96%).

            `x`: that plan instead, found by the prices 8x apart (the first over by its temporaries alone, and
            so the cheapest: dearer prices find dearer plans). Its polish starts at once, beside the prices
            still to come, and joins the search where they end, with the weights-first plan (LLaMA3-8B at
            80 GB: found at the third price, its polish closes the gap before any step between prices)."""
            if x is None:
                if not budget.polish or state["x"] is None or gap() <= budget.gap:
                    return None
                x = next((x for x in cheaper_overs() if id(x) not in state["polished"]), None)
                if x is None:
                    return None
            state["polished"].add(id(x))
            return _aside(search.polish, costs, weight, room(x), x, np.asarray(budget.polish))

        def cheaper_overs() -> list[np.ndarray]:
            """The plans over by their temporaries alone that are cheaper than the best, the cheapest first."""
            return sorted((x for _, x in state["over"] if float(costs @ x) < state["objective"]),
                          key=lambda x: float(costs @ x))

        def repair() -> None:
            """The plan the prices found nearest to fitting (the least it needs of those over the budget, by
            their row or their temporaries), with its weights re-laid out under the row (room for its
            temporaries), every other choice kept (as the weights-first polish does for the leanest plan at
            price 0): between a price whose plan is over and a dearer one whose plan fits, the search often
            meets only plans far apart (the 2-layer transformers Llama at 0.8 of its peak: 0.5% over at 4,453,
            fitting at 6,370; repaired, 4,846 in 0.7 s)."""
            got = repair_aside()
            if got is not None:  # (kept if it fits whole; one over by its temporaries is not a cut for the loop
                improve(got.result(), -float("inf"))  # below: the cuts come from the prices' plans, as they did)

        def repair_aside(steps: bool = False) -> "Future | None":
            """`repair`'s polish, unless the plan nearest to fitting was repaired already. `steps`: beside a
            step between prices, where no branch and bound follows (a price's relaxation ran out of its time, or
            a twin priced the search: `branch` would not run, and the repaired plan changes no start of
            one). There the best plan it makes stops the steps sooner: the 2-layer transformers Llama at 0.8 of
            its peak met its nearest plan at the second step and repaired it only after ten more."""
            near = state["nearest"]
            # (with no plan that fits yet, not at all: a fitting plan found here would keep the cut loop, which
            # then runs, from a better one)
            if near is None or state["x"] is None or gap() <= budget.gap or not budget.weights_only or \
                    search.out_of_time() or (steps and not state.get("hard")) or near is state["repaired"]:
                return None
            state["repaired"] = near
            return _aside(search.polish, costs, weight, room(near), near, np.asarray(budget.weights_only),
                          budget.gap)

        def branch() -> None:
            """Branch and bound from the best plan, with room for its temporaries, then the cut loop. Not
            where a price's relaxation ran out of its time: branch and bound's root is that relaxation with
            the row, no easier (the 2-layer transformers Llama at 0.8 of its peak: a price's relaxation
            takes 24-34 s, and branch and bound spent its 10 s without solving its root)."""
            if state["x"] is None or gap() <= budget.gap or search.out_of_time() or state.get("hard"):
                return
            # branch and bound from the best plan, with room for its temporaries
            exact = budget.extra is None  # else the row is a guess at the room, and its bound no bound
            best, stuck = state["objective"], False
            # (a plan as dear as the best to rounding is no better: the 2-layer transformers Llama at 0.8
            # of its peak got its own plan back 1e-12 cheaper, and polished and branched again, 11 s)
            better = lambda: state["objective"] < best - 1e-9 * abs(best)  # noqa: E731
            if not (state["over"] and budget.cuts is not None):
                # no plan was over by its temporaries alone: branch and bound from the best plan, with
                # room for its temporaries (where some were, the cut loop below prices every plan's)
                x, bound, _ = search.branch_and_bound(costs, weight, room(state["x"]), state["x"], budget.gap,
                                                      report if exact else None, budget.seconds)
                improve(x, bound if exact else -float("inf"))
                if x is not None:
                    met(x, needs(x))  # (a plan over by its temporaries here is a cut below)
                # out of time with nothing better and no cut to add: the loop below would run the same
                # branch and bound with a little more room (a 2-layer transformers Llama on (2, 2): 10 s
                # each, neither one past its root)
                stuck = not better() and not state["over"] and (
                    x is None or float(costs @ x) - bound > budget.gap * abs(float(costs @ x)))
            if better():
                polish()
            if gap() > budget.gap and budget.cuts is not None and not exact and not stuck \
                    and not search.out_of_time():
                # branch and bound with the best plan's room (if it ran) could not reach a plan with
                # smaller temporaries. With the whole limit and the cuts of each plan over by its extra,
                # from the best plan, branch and bound finds it, and its bound is a bound
                self._cut_loop(search, costs, weight, limit, budget, state, needs, improve, start=state["x"])
                polish()  # a plan branch and bound left when its time ran out may recompute more than it needs

        # where a twin prices the search, price 0 is this program's (the twin's optimum may be another plan,
        # dearer here): if its plan fits, it is the answer
        first = None if unbudgeted is None else probe(0.0, unbudgeted)
        if first is None or not first[0]:
            first = probe(0.0)
        if first is not None and first[0]:
            # the unbudgeted plan fits; where its relaxation was fractional, it is only the first plan branch
            # and bound found (a random program of 4 choices: 66.0 against an optimum of 56.0 that fits)
            branch()
        elif first is not None:
            if budget.weights_only and not search.out_of_time():
                # the cheapest plan's other placements with its weights re-laid out under the row: a plan
                # for the prices of memory, which may turn slow where the plan changes (within the search's
                # gap: LLaMA3-8B in transformers at 80 GB, 0.76% from its optimum after 2 s, and 8 s more to
                # prove 0.04%, for a plan the polishes below replaced). With a second core it is made beside
                # the prices 8x apart (the 2-layer transformers Llama at 0.8 of its peak: 6 s), on one before
                # them; either way its plan joins the search once they end, before the steps between them
                # that steer by the best plan: the same path on any number of cores
                x = state["leanest"]
                state["weights_first"] = _aside(search.polish, costs, weight, room(x), x,
                                                np.asarray(budget.weights_only), budget.gap)
            prices(first)  # (the weights-first plan joined in it)
            # the best plan polished (cheap, and a better start for branch and bound), and beside it the
            # plans over by their temporaries alone with their layers' recomputation re-chosen: a few
            # seconds each, where branch and bound from the best plan may not finish its root in its time
            # (LLaMA3-8B in transformers at 80 GB: 151k columns, the first cut round's root relaxation
            # unsolved after 10 s, then 15 s of cuts and out of time; the first of these polishes closes
            # the gap, to 0.96%). With no plan that fits yet, those wait until the end: a fitting plan
            # found first would keep the cut loop from a better one. Not once the gap is closed (by the
            # steps between prices, or the polishes beside them): the search is done
            if gap() > budget.gap:
                polish(over=state["x"] is not None)
            branch()
            repair()  # (after branch and bound and the cut loop: a plan it finds first would change their start)
            if state["x"] is None and budget.cuts is not None and state["over"] and not search.out_of_time():
                self._cut_loop(search, costs, weight, limit, budget, state, needs, improve)
                polish()  # the first plan the cuts let through may leave room for fewer recomputed layers
            # last (a plan that fits, found here first, would keep the cut loop from a better one)
            polish(best=False, over=True)
        seconds = time.perf_counter() - t0
        lean = state["leanest"]
        if state["x"] is None and lean is not None and float(weight @ lean) <= limit * (1 + 1e-9):
            # none fits whole, but this one's row does: the plan closest to fitting, for the caller to
            # hand back with a warning (its extra is what does not fit)
            objective = float(costs @ lean)
            bound = min(state["bound"], objective)
            return IlpResult(lean, objective / scale, bound / scale, (objective - bound) / max(abs(objective), 1e-300),
                             seconds,
                             "Over the budget with its temporaries: " + (
                                 "no plan fits (proven); the leanest plan found" if state["proven"] else
                                 "the leanest plan found"), *sizes)
        if state["x"] is None:
            leanest = "" if lean is None else f"; the leanest plan found needs {format_bytes(state['leanest_need'])}"
            status = ("Infeasible: no plan fits the budget" if state["proven"] else
                      "Out of time: no plan found that fits the budget" + leanest
                      if state.get("out_of_time") or search.out_of_time() else
                      f"Not found: no plan that fits the budget after {CUT_ROUNDS} rounds of cuts (not proven "
                      "impossible)" + leanest)
            return IlpResult(np.zeros(len(costs)), float("inf"), float("nan"), float("inf"), seconds, status, *sizes)
        status = (f"Within {gap():.2%} of the bound ({state['probes']} prices of memory tried)"
                  if state["probes"] > 1 or gap() > 1e-9 else "Optimal (the unbudgeted optimum fits)")
        objective = state["objective"]
        return IlpResult(state["x"], objective / scale, min(state["bound"], objective) / scale, gap(), seconds,
                         status, *sizes)

    @staticmethod
    def _cut_loop(search: "_Search", costs, weight, limit: float, budget: Budget, state: dict, needs, improve,
                  start=None) -> None:
        """No plan of the price search fits whole (or, from a `start` that does, the gap is still wide):
        branch and bound with the row and the cuts of each plan that was over by its extra finds the
        cheapest plan satisfying them all. If it fits whole, it is the answer (and branch and bound's
        bound is a bound: every cut holds for every fitting plan); if not, its own cuts join the others
        and the search goes again. Infeasible (without a start) means no plan fits."""
        cuts = list(dict.fromkeys(c for _, x in state["over"] for c in budget.cuts(x)))
        known: dict[bytes, float] = {}  # what each incumbent needs (the schedule walked once per plan)
        met_over: dict[bytes, np.ndarray] = {}  # the plans of the current round that did not fit whole

        def key_of(x) -> bytes:
            return np.round(x[search.binary]).astype(np.int8).tobytes() + x[~search.binary].tobytes()

        def weigh(x) -> bool:
            """Whether x fits whole. Asked of each incumbent: the leanest plan and the best that fits are
            kept, and each plan over for its cuts (it stops the round: HiGHS may report a few more
            incumbents before it stops)."""
            key = key_of(x)
            if key not in known:
                known[key] = needs(x)
            need = known[key]
            if need < state["leanest_need"]:
                state["leanest"], state["leanest_need"] = x, need
            if need <= limit * (1 + 1e-9):
                improve(x, -float("inf"), need)
                return True
            met_over.setdefault(key, x)
            return False

        def gap_of(x, bound: float) -> float:
            return (float(costs @ x) - bound) / max(abs(float(costs @ x)), 1e-300)

        seconds, extended = budget.seconds, False
        for _ in range(CUT_ROUNDS):
            seed = start if state["x"] is None else state["x"]  # (the best plan that fits, from any round)
            if not (cuts or seed is not None) or search.out_of_time():
                return
            met_over.clear()
            x, bound, infeasible = search.branch_and_bound(costs, weight, limit, seed, budget.gap, None,
                                                           seconds, cuts, weigh)
            if x is None and not infeasible and seed is None and not search.out_of_time():
                # nothing in a round's time, and no proof: the rest of the solve's time for this round
                x, bound, infeasible = search.branch_and_bound(costs, weight, limit, None, budget.gap, None,
                                                               search.remaining(), cuts, weigh)
            if x is None:
                state["proven"] = state["proven"] or (infeasible and seed is None)
                return
            weigh(x)  # (HiGHS's incumbent: one it asked about, or none over was met and it fits)
            improve(x, bound, known[key_of(x)])
            if not met_over:  # a round that met no plan over: it ended there, with a plan that fits
                if start is None and not extended and gap_of(x, bound) > budget.gap and not search.out_of_time():
                    # the first plan through, found in a round's time: the rest of the solve's time to
                    # improve on it (ViT-120B at batch 512: 19% from the bound after 10 s, 0.7% after 27)
                    seconds, extended = search.remaining(), True
                    continue
                return
            # the cuts of the plans over that the round met (the one it returns too, if over), and again
            more = list(dict.fromkeys(c for y in met_over.values() for c in budget.cuts(y) if c not in cuts))
            if not more:
                return
            cuts += more

    def _choice_groups(self, binary: np.ndarray) -> list[np.ndarray]:
        """The "exactly one of these binary columns" rows, as column arrays."""
        rows, cols = np.asarray(self._rows, dtype=np.int64), np.asarray(self._cols, dtype=np.int64)
        vals = np.asarray(self._vals, dtype=float)
        ones = np.asarray(self._rhs) == 1.0
        ones &= np.asarray(self._lower) == 1.0
        bad = np.zeros(len(self._rhs), dtype=bool)
        if len(rows):
            np.logical_or.at(bad, rows, ~binary[cols] | (vals != 1.0))
        keep = ones & ~bad
        order = np.argsort(rows, kind="stable")
        rows, cols = rows[order], cols[order]
        starts = np.searchsorted(rows, np.flatnonzero(keep))
        ends = np.searchsorted(rows, np.flatnonzero(keep), side="right")
        return [cols[s:e] for s, e in zip(starts, ends)]

    def _model(self, costs: np.ndarray, upper: np.ndarray | None = None,
               row_lower: np.ndarray | None = None) -> "highspy.HighsLp":
        """The program as HiGHS's column-wise LP (duplicate entries summed), by default with its own bounds
        (shared costs then exact: `_priced`)."""
        if upper is None or row_lower is None:
            _, upper, row_lower = self._priced(np.ones(len(self._shared), dtype=bool))
        n, m = len(costs), len(self._rhs)
        if self._matrix is None or self._matrix[0] != (len(self._vals), m, n):
            rows, cols = np.asarray(self._rows, dtype=np.int64), np.asarray(self._cols, dtype=np.int64)
            key, where = np.unique(cols * max(m, 1) + rows, return_inverse=True)
            values = np.bincount(where, weights=np.asarray(self._vals, dtype=float), minlength=len(key))
            starts = np.concatenate([[0], np.cumsum(np.bincount(key // max(m, 1), minlength=n))])
            self._matrix = ((len(self._vals), m, n), starts, key % max(m, 1), values)
        _, starts, index, values = self._matrix
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = n, m
        lp.col_cost_ = costs
        lp.col_lower_, lp.col_upper_ = np.zeros(n), upper
        lp.row_lower_, lp.row_upper_ = row_lower, np.asarray(self._rhs, dtype=float)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, m
        lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = starts, index, values
        return lp


def _report(mip: "highspy.Highs", on_progress, fits=None) -> None:
    """Have branch and bound call `on_progress(incumbent, bound, gap)` as its incumbent improves and
    each time it logs, and (`fits`) ask `fits(x)` of every incumbent x and stop soon after the first for
    which it is false (HiGHS checks for the stop between nodes: a few more incumbents may come first)."""
    if on_progress is None and fits is None:
        return
    kinds = highspy.cb.HighsCallbackType
    over = []

    def callback(kind, message, out, into, user):
        if kind == kinds.kCallbackMipInterrupt:
            into.user_interrupt = bool(over)
            return
        if kind == kinds.kCallbackMipImprovingSolution and fits is not None \
                and not fits(np.array(out.mip_solution, dtype=float)):  # (a copy: HiGHS reuses its buffer)
            over.append(True)
        if on_progress is not None and np.isfinite(out.mip_primal_bound):
            on_progress(out.mip_primal_bound, out.mip_dual_bound, max(0.0, out.mip_gap))

    mip.setCallback(callback, None)
    mip.startCallback(kinds.kCallbackMipImprovingSolution)
    if on_progress is not None:
        mip.startCallback(kinds.kCallbackMipLogging)
    if fits is not None:
        mip.startCallback(kinds.kCallbackMipInterrupt)


def _added(status) -> None:
    """HiGHS rejects a malformed row (a column twice, say) with an error status, not an exception: a cut
    row dropped so would pass plans that do not fit."""
    if status == highspy.HighsStatus.kError:  # (a warning: coefficients under 1e-9 dropped, the row stands)
        raise SpmdInternalError(f"HiGHS refused a row of the budgeted program ({status})")


def _add_cuts(mip: "highspy.Highs", cuts, limit: float) -> None:
    """Add `cuts` (`Cut`) to `mip` as rows `<= limit`, each helper a new column in [0, 1] after the
    program's with its rows z - sum(row) >= const. All at once: HiGHS's addRow costs about a millisecond
    a call on a program of LLaMA3-8B's size (53k cut and helper rows one by one took 61 s)."""
    if not cuts:
        return
    first = mip.getNumCol()
    lower, upper, starts, index, values = [], [], [], [], []

    def row(coef: dict, lo: float, hi: float) -> None:
        lower.append(lo)
        upper.append(hi)
        starts.append(len(index))
        index.extend(coef)
        values.extend(coef.values())

    z = first
    for cut in cuts:
        terms = dict(cut.terms)
        for size, rows in cut.helpers:
            terms[z] = terms.get(z, 0.0) + size
            for terms_of, const in rows:  # z - sum(row) >= const
                coef = {z: 1.0}
                for c, v in terms_of:  # (a row may name a column twice; HiGHS refuses that unsummed)
                    coef[c] = coef.get(c, 0.0) - v
                row(coef, float(const), highspy.kHighsInf)
            z += 1
        row(terms, -highspy.kHighsInf, limit)
    if z > first:
        none = np.zeros(0, dtype=np.int32)
        _added(mip.addCols(z - first, np.zeros(z - first), np.zeros(z - first), np.ones(z - first), 0, none, none,
                           np.zeros(0)))
    _added(mip.addRows(len(lower), np.asarray(lower, dtype=float), np.asarray(upper, dtype=float), len(index),
                       np.asarray(starts, dtype=np.int32), np.asarray(index, dtype=np.int32),
                       np.asarray(values, dtype=float)))


def _seed(mip: "highspy.Highs", x: np.ndarray) -> None:
    """Start branch and bound from the solution `x` (HiGHS ignores it if infeasible)."""
    seed = highspy.HighsSolution()
    seed.col_value = list(map(float, x))
    seed.value_valid = True
    mip.setSolution(seed)


def _time_limit(h: "highspy.Highs", seconds: float) -> None:
    """Let `h`'s next run take `seconds`. HiGHS checks `time_limit` against the instance's run time summed
    over all its runs: an instance re-solved for each price of memory, given the seconds left, stopped
    early by all it had run before ("Time limit reached" after 0.04 s, on a relaxation that had taken 10)."""
    h.setOptionValue("time_limit", h.getRunTime() + float(seconds))


def _highs(time_limit: float, presolve: bool) -> "highspy.Highs":
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("presolve", "on" if presolve else "off")
    return h


def _cores() -> int:
    """The cores this machine has: where there are two or more, HiGHS instances run side by side."""
    return os.cpu_count() or 1


def _aside(fn: Callable, *args) -> Future:
    """`fn(*args)` on a thread of its own where there is a second core (HiGHS lets go of Python while it
    runs), else now; its answer is the future's either way."""
    if _cores() >= 2:
        pool = ThreadPoolExecutor(1, thread_name_prefix="spmd-polish")
        future = pool.submit(fn, *args)
        pool.shutdown(wait=False)  # (its thread ends with its task)
        return future
    done = Future()
    done.set_result(fn(*args))
    return done


class _Beside:
    """An interior point instance (`make()`) made, `after` seconds from now unless stopped before, and run
    on a thread of its own until it finishes or is stopped."""

    def __init__(self, make: Callable[[], "highspy.Highs"], after: float):
        self.ipm, self._stopped = None, threading.Event()

        def interrupt(kind, message, out, into, user):
            into.user_interrupt = self._stopped.is_set()

        def run():
            if self._stopped.wait(after):  # (not needed after all: never made)
                return
            self.ipm = make()
            self.ipm.setCallback(interrupt, None)
            self.ipm.startCallback(highspy.cb.HighsCallbackType.kCallbackIpmInterrupt)
            if not self._stopped.is_set():
                self.ipm.run()

        # not a daemon: a process that ends right after a plan waits for it (a stopped instance ends at its
        # first interior point iteration). Killed inside HiGHS at exit, it aborted the process (SIGABRT,
        # exit status 134: "terminate called without an active exception") after a plan that had succeeded
        self._thread = threading.Thread(target=run, name="spmd-interior-point", daemon=False)
        self._thread.start()

    def finished(self) -> "highspy.Highs":
        """The instance, once its run has ended."""
        self._thread.join()
        return self.ipm

    def stop(self) -> None:
        """Stop it. Once its instance runs, without waiting: one still in its presolve, which no callback
        interrupts, ends at its first interior point iteration, on its own thread (which the end of the
        process waits for)."""
        self._stopped.set()
        if self.ipm is None:  # (not made, or being made: it ends without running)
            self._thread.join()


class _LazyShares:
    """A relaxation with shared costs at their shares until a solution takes one partly (`IlpBuilder.solve`):
    each solve goes on in rounds until none is, and the shared costs made exact stay so for the next (the
    budget's price search solves at many prices)."""

    def __init__(self, builder: IlpBuilder, scale: float, exact: np.ndarray, search: "_Search"):
        self.builder, self.scale, self.exact, self.search = builder, scale, exact, search
        self.by_parts = False  # (once a round went by parts, `_partly_taken`, every later one does)
        self.costs = builder._priced(exact)[0] * scale
        self.whole = builder._priced(np.ones(len(exact), dtype=bool))[0] * scale  # (every plan's true cost)

    def droppable(self, rows: tuple[int, ...]) -> None:
        """Rows the relaxation may leave out (`Budget.droppable`)."""
        self.search.droppable = tuple(rows)

    def integral(self, extra: np.ndarray | None = None, **options) -> tuple[np.ndarray | None, float, str]:
        """`_Search.integral` at the program's costs (plus `extra`), its solution completed (`_completed`):
        a solution of the exact program, and a bound on it.

        Each round's plan, completed, is a plan of the next round's program too (with the shared costs
        still at their shares left out), so it seeds that round's branch and bound, and the cheapest of
        the rounds' plans at the true costs is the answer: a round whose branch and bound runs out of
        time with a worse plan than the last one's never makes the result worse (a 2-layer GPT on
        (2, 2, 2) returned a plan 3.5x the first round's that way). Every round's bound holds for the
        exact program; the largest is returned."""
        builder = self.builder
        whole = self.whole if extra is None else self.whole + extra
        best, best_value, best_bound, best_status, start = None, np.inf, -np.inf, "", None
        while True:
            costs = self.costs if extra is None else self.costs + extra
            # (a probe's plan is its rounded relaxation, taken as it is: rounded first; else a fractional
            # relaxation is tightened first, and rounded once, with the branching below)
            x, bound, status = self.search.integral(costs, start=start, branch=False,
                                                    round_first=options.get("first_found", False), **options)
            if bound == bound:  # (not nan)
                best_bound = max(best_bound, bound)
            if status == FRACTIONAL:
                _, missed, self.by_parts = builder._partly_taken(x, self.exact, self.by_parts)
                if missed.any() and not self.search.out_of_time():
                    self._more_exact(missed)  # a tighter relaxation first, then branch and bound once
                    start = None if best is None else builder._at_shares(best, self.exact)
                    continue
                x, bound, status = self.search.integral(costs, start=start, **options)  # (warm: no iterations)
                if bound == bound:
                    best_bound = max(best_bound, bound)
            if x is not None:
                done = builder._completed(x)
                value = float(whole @ done)
                if value < best_value:
                    best, best_value, best_status = done, value, status
                else:  # (an earlier round's plan stays: the status says so, not this round's "Optimal")
                    best_status = f"an earlier round's plan, cheaper than the last round's ({status})"
            if x is None or self.search.out_of_time():
                return (None, bound, status) if best is None else (best, best_bound, best_status)
            _, missed, self.by_parts = builder._partly_taken(x, self.exact, self.by_parts)
            if not missed.any():
                return best, best_bound, best_status
            self._more_exact(missed)
            start = builder._at_shares(best, self.exact)

    def _more_exact(self, missed: np.ndarray) -> None:
        """Price the shared costs `missed` exactly from now on, in the relaxation, from its last basis.
        (Moving to the exact program, solved afresh, once more than a quarter were taken partly was slower
        or no faster: bench/results_plan.md, session 45.)"""
        builder, f = self.builder, self.builder._shared_arrays()
        new = missed & ~self.exact
        self.exact |= missed
        costs, upper, row_lower = builder._priced(self.exact)
        cols, rows = f["y"][new], f["row"][new[f["row_group"]]]  # (what changes: their y and y's rows)
        self.search.reprice(lambda: builder._model(costs * self.scale, upper, row_lower),
                            cols, upper[cols], rows, row_lower[rows], np.asarray(builder._rhs, dtype=float)[rows])
        self.costs = costs * self.scale


class _Search:
    """One HiGHS instance over the program without the budget row, re-solved from its last basis as
    its costs change."""

    def __init__(self, lp, binary: np.ndarray, groups: list[np.ndarray], deadline: float, mip_rel_gap: float):
        self._lp, self.binary, self.groups, self.deadline = lp, binary, groups, deadline
        self.mip_rel_gap = mip_rel_gap
        self.droppable: tuple[int, ...] = ()  # rows the relaxation may leave out (`Budget.droppable`)
        self.dropped: tuple[int, ...] = ()  # and those it has left out
        self.solved = False  # whether the relaxation has been solved once (later solves start warm)
        self.fixed = None  # a second instance, for plans with every choice fixed
        self.entries: Entries | None = None  # the program's matrix, for the polishes (`restrict`)
        self.relaxed = _highs(self.remaining(), presolve=False)
        self.relaxed.passModel(lp)
        self.simplex_iterations = max(SIMPLEX_ITERATIONS_MIN, int(SIMPLEX_ITERATIONS_PER_COLUMN * len(binary)))
        self.columns = np.arange(len(binary), dtype=np.int32)
        # rounding fixes every binary column: possible when each is in exactly one choice
        self.covered = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
        self.roundable = len(self.covered) == int(binary.sum()) == len(np.unique(self.covered))

    def remaining(self) -> float:
        return max(1.0, self.deadline - time.perf_counter())

    @property
    def lp(self):
        """The program (a `HighsLp`), made when first needed after a `reprice`."""
        if callable(self._lp):
            self._lp = self._lp()
        return self._lp

    def reprice(self, lp: Callable[[], object], cols: np.ndarray, upper: np.ndarray, rows: np.ndarray,
                row_lower: np.ndarray, row_upper: np.ndarray) -> None:
        """The program becomes `lp()`: the same columns and rows, the columns `cols` with new upper bounds and
        the rows `rows` (the program's indices) with new bounds (and new costs, which `integral` sets). The
        relaxation keeps its basis and goes on from it; only what changed is changed there and in the
        instance completing rounded plans (a whole program's bounds and matrix cost 0.06 s a round on the
        70B-shaped search's 100k rows)."""
        dropped = np.asarray(sorted(self.dropped), dtype=np.int64)
        if np.isin(rows, dropped).any():
            raise SpmdInternalError("_Search.reprice: a repriced row is one the relaxation dropped")
        at = (rows - np.searchsorted(dropped, rows)).astype(np.int32)  # (the relaxation's rows: those not dropped)
        cols = np.asarray(cols, dtype=np.int32)
        for h in (self.relaxed, self.fixed):
            if h is not None:
                h.changeColsBounds(len(cols), cols, np.zeros(len(cols)), np.asarray(upper, dtype=float))
                h.changeRowsBounds(len(at), at, np.asarray(row_lower, dtype=float), np.asarray(row_upper, dtype=float))
        self._lp = lp  # (its matrix, and so `entries`, stays as it was: only bounds and costs change)

    def out_of_time(self) -> bool:
        return time.perf_counter() > self.deadline

    def integral(self, costs: np.ndarray, first_found: bool = False, on_progress=None,
                 seconds: float | None = None, start: np.ndarray | None = None,
                 branch: bool = True, round_first: bool = True) -> tuple[np.ndarray | None, float, str]:
        """An optimal integral solution at `costs`, the relaxation's optimum (a bound), and a status.
        `first_found`: where the relaxation is fractional, the first integral solution branch and bound
        finds (a probe of the budget search needs a plan and a bound, not the best plan at its price).
        `on_progress(objective, bound, gap)`: branch and bound's progress, in these costs' units.
        `seconds`: at most this long (else until the deadline). `start`: a solution of this program to
        start branch and bound from, where the rounded relaxation is no better (or there is none).
        `branch=False`: where the relaxation is fractional and its rounding does not meet its bound, its
        solution as it is, status "Fractional" (no branch and bound); with `round_first=False` too, without
        rounding it first (for a caller that tightens a fractional relaxation before anything else: a
        rounding completes its plan in a second HiGHS instance, 0.1-0.16 s on the 70B-shaped search)."""
        until = self.deadline if seconds is None else min(self.deadline, time.perf_counter() + seconds)
        if len(costs):
            self.relaxed.changeColsCost(len(costs), self.columns, costs)
        _time_limit(self.relaxed, max(1.0, until - time.perf_counter()))
        # with rows it may drop, the relaxation keeps them only while they stay cheap (`Budget.droppable`)
        self.relaxed.setOptionValue("simplex_iteration_limit",
                                    min(self.simplex_iterations, DROPPABLE_ITERATIONS) if self.droppable else
                                    self.simplex_iterations)
        beside = None
        if not self.solved and not self.droppable and len(costs) >= BESIDE_MIN_COLUMNS and _cores() >= 2:
            beside = _Beside(lambda: self._interior_point_instance(costs, until, self.lp), after=BESIDE_AFTER)
        self.solved = True
        try:
            self.relaxed.run()
            if self.relaxed.getModelStatus() == highspy.HighsModelStatus.kIterationLimit and self.droppable:
                self._drop_rows()
                _time_limit(self.relaxed, max(1.0, until - time.perf_counter()))
                self.relaxed.setOptionValue("simplex_iteration_limit", self.simplex_iterations)
                self.relaxed.run()
            if self.relaxed.getModelStatus() == highspy.HighsModelStatus.kIterationLimit:
                self._interior_point(costs, until, None if beside is None else beside.finished())
        finally:
            if beside is not None:
                beside.stop()
        if self.relaxed.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None, float("nan"), self.relaxed.modelStatusToString(self.relaxed.getModelStatus())
        x = np.asarray(self.relaxed.getSolution().col_value)
        bound = float(costs @ x)
        if np.all(np.abs(x[self.binary] - np.round(x[self.binary])) <= 1e-7):
            x = x.copy()
            x[self.binary] = np.round(x[self.binary])
            return x, bound, "Optimal (the LP relaxation's optimum is integral)"
        if not branch and not round_first:
            return x, bound, FRACTIONAL
        rounded = self.rounded(x, costs)
        if rounded is not None:
            if float(costs @ rounded) <= bound + 1e-9 * max(1.0, abs(bound)):
                return rounded, bound, "Optimal (the rounded relaxation meets its bound)"
            if first_found:
                return rounded, bound, "Rounded (each choice its relaxation's largest)"
        if not branch:
            return x, bound, FRACTIONAL
        near = self.near(x, costs, until)
        near_cost = np.inf if near is None else float(costs @ near)
        if near_cost < (np.inf if rounded is None else float(costs @ rounded)):
            if first_found:
                return near, bound, "Rounded (branch and bound on the relaxation's fractional choices)"
            if near_cost <= bound + self.mip_rel_gap * abs(near_cost):
                return near, bound, "Optimal (within the gap of the relaxation's bound)"
            rounded = near  # (the better start)
        # branch and bound gets BRANCH_SECONDS to find a plan (or start from the rounded one) and improve
        # or prove it: on symmetric meshes it can spend its whole time limit closing a gap of 0.3%, and a
        # 2-layer GPT with FlexAttention on (2, 2), whose rounding is inconsistent, spent 46 s proving a
        # plan it held at 0.07% after 9 s. Only if it has no plan by then does it get the rest of the limit.
        incumbent = rounded
        if start is not None and (incumbent is None or float(costs @ start) < float(costs @ incumbent)):
            incumbent = start
        mip = self._mip(costs, min(BRANCH_SECONDS, max(1.0, until - time.perf_counter())))
        if first_found:
            mip.setOptionValue("mip_max_improving_sols", 1)
        if incumbent is not None:  # an incumbent to prune with from the start
            _seed(mip, incumbent)
        _report(mip, on_progress)
        mip.run()
        if incumbent is None and mip.getInfo().primal_solution_status != 2 and not self.out_of_time() and seconds is None:
            _time_limit(mip, self.remaining())
            mip.run()
        status = mip.modelStatusToString(mip.getModelStatus())
        if mip.getInfo().primal_solution_status != 2:
            return (None, bound, status) if incumbent is None else (incumbent, bound, status)
        found = np.asarray(mip.getSolution().col_value)
        settled = self.settled(found, costs)
        return found if settled is None else settled, max(bound, float(mip.getInfo().mip_dual_bound)), status

    def _drop_rows(self) -> None:
        """Leave `droppable` out of the relaxation (and of the instance completing rounded plans) from now
        on; branch and bound keeps them (it starts from `lp`)."""
        rows = np.asarray(sorted(self.droppable), dtype=np.int32)
        for h in (self.relaxed, self.fixed):
            if h is not None:
                h.deleteRows(len(rows), rows)
        self.dropped, self.droppable = tuple(self.droppable), ()

    def _interior_point_instance(self, costs: np.ndarray, until: float, lp=None) -> "highspy.Highs":
        """An instance solving the relaxation at `costs` by interior point and crossover, by `until`
        (`lp`: the program, by default the relaxation's, without the rows it dropped)."""
        ipm = _highs(max(1.0, until - time.perf_counter()), presolve=True)
        ipm.setOptionValue("solver", "ipm")
        ipm.setOptionValue("run_crossover", "on")
        ipm.passModel(self.relaxed.getLp() if lp is None else lp)
        if len(costs):
            ipm.changeColsCost(len(costs), self.columns, costs)
        return ipm

    def _interior_point(self, costs: np.ndarray, until: float, ipm: "highspy.Highs | None" = None) -> None:
        """Solve the relaxation at `costs` by interior point and crossover (or take `ipm`, an instance that
        has, `_Beside`), and hand its optimal basis to the simplex instance, which then finishes (and later
        warm-starts) from there, by `until`."""
        if ipm is None:
            ipm = self._interior_point_instance(costs, until)
            ipm.run()
        if ipm.getModelStatus() == highspy.HighsModelStatus.kOptimal and ipm.getBasis().valid:
            self.relaxed.setBasis(ipm.getBasis())
        _time_limit(self.relaxed, max(1.0, until - time.perf_counter()))
        self.relaxed.setOptionValue("simplex_iteration_limit", highspy.kHighsIInf)
        self.relaxed.run()

    def rounded(self, x: np.ndarray, costs: np.ndarray) -> np.ndarray | None:
        """The plan taking, in each choice, the option the relaxation `x` weighs most (None if those
        choices are inconsistent, e.g. across tied nodes, or a binary column is in no choice)."""
        if not self.roundable:
            return None
        chosen = np.zeros(len(self.lp.col_cost_), dtype=float)
        chosen[[g[np.argmax(x[g])] for g in self.groups]] = 1.0
        return self.settled(chosen, costs)

    def settled(self, x: np.ndarray, costs: np.ndarray) -> np.ndarray | None:
        """The cheapest solution with `x`'s binary columns (rounded), its continuous columns at their least
        cost: a plan branch and bound hands back where it stopped within its gap may carry slack in them
        (a bucket's latency paid twice); None if those columns admit no solution."""
        if not self.roundable:
            return x
        covered = self.covered
        lower = np.round(x[covered])
        upper = np.minimum(lower, np.asarray(self.lp.col_upper_)[covered])
        if self.fixed is None:
            self.fixed = _highs(self.remaining(), presolve=True)
            self.fixed.passModel(self.relaxed.getLp())
        self.fixed.changeColsCost(len(costs), self.columns, costs)
        self.fixed.changeColsBounds(len(covered), covered.astype(np.int32), lower, upper)
        _time_limit(self.fixed, self.remaining())
        self.fixed.run()
        if self.fixed.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        return np.asarray(self.fixed.getSolution().col_value)

    def near(self, x: np.ndarray, costs: np.ndarray, until: float) -> np.ndarray | None:
        """The cheapest plan that keeps every binary column the relaxation `x` holds at 0 or 1 where it is
        (branch and bound over its fractional choices only), or None where none does (in time)."""
        whole = np.flatnonzero(self.binary & (np.abs(x - np.round(x)) <= 1e-7)).astype(np.int32)
        mip = self._mip(costs, min(BRANCH_SECONDS, max(1.0, until - time.perf_counter())))
        mip.changeColsBounds(len(whole), whole, np.round(x[whole]), np.round(x[whole]))
        mip.run()
        if mip.getInfo().primal_solution_status != 2:
            return None
        return self.settled(np.asarray(mip.getSolution().col_value), costs)

    def branch_and_bound(self, costs, weight, limit, start, rel_gap, on_progress, seconds, cuts=(), fits=None):
        """Branch and bound with the budget row and `cuts` (rows with the same limit), from the solution
        `start` (or None), for at most `seconds`: (solution or None, bound, whether the program was proven
        infeasible).

        `fits(x)`: whether a solution fits whole (the row cannot see all it needs). Each incumbent branch
        and bound finds is asked; after the first that does not fit, the search stops (and returns its
        incumbent, that one or one found just after it): it will be cut off, and proving it optimal
        first only delays the round that cuts it (the e2e budget case: three rounds of 10 s, each
        proving a plan the next round cut)."""
        mip = self._mip(costs, min(seconds, self.remaining()))
        mip.setOptionValue("mip_rel_gap", rel_gap)
        cols = np.flatnonzero(weight).astype(np.int32)
        mip.addRow(-highspy.kHighsInf, limit, len(cols), cols, weight[cols])
        n = len(costs)
        _add_cuts(mip, cuts, limit)
        # the seed's value of each helper column: the least its rows allow
        helpers = [] if start is None else [
            min(1.0, max([0.0, *(sum(v * start[c] for c, v in row) + const for row, const in lower)]))
            for cut in cuts for _, lower in cut.helpers]
        if start is not None:
            _seed(mip, np.concatenate([start, helpers]))
        _report(mip, on_progress, None if fits is None else (lambda x: fits(x[:n])))
        mip.run()
        info = mip.getInfo()
        x = np.asarray(mip.getSolution().col_value)[:n] if info.primal_solution_status == 2 else None
        return x, float(info.mip_dual_bound), mip.getModelStatus() == highspy.HighsModelStatus.kInfeasible

    def polish(self, costs, weight, limit, x, free: np.ndarray, rel_gap: float | None = None) -> np.ndarray | None:
        """The cheapest solution with the budget row that keeps `x`'s binary columns, except `free`
        (`rel_gap`: or one proven within this of it), over the part of the program those free columns
        reach (`restrict`: the rest keep `x`'s values; LLaMA3-8B's recomputation polish at 80 GB, 22k of
        151k columns: 0.5 s where HiGHS's presolve of the whole took 0.55 s alone)."""
        fixed = np.setdiff1d(np.flatnonzero(self.binary), free)
        if self.entries is None:
            self.entries = Entries.of(self.lp)
        part = restrict(self.lp, self.entries, x, fixed, self.binary)
        mip = _highs(min(BRANCH_SECONDS, self.remaining()), presolve=True)
        mip.setOptionValue("mip_rel_gap", self.mip_rel_gap if rel_gap is None else rel_gap)
        mip.setOptionValue("presolve_rule_off", NO_PROBING)
        mip.passModel(part.lp)
        n = len(part.cols)
        mip.changeColsCost(n, np.arange(n, dtype=np.int32), costs[part.cols])
        # the budget row over the restricted columns, less the rest's bytes
        rest = float(weight @ part.values) - float(weight[part.cols] @ part.values[part.cols])
        cols = np.flatnonzero(weight[part.cols]).astype(np.int32)
        mip.addRow(-highspy.kHighsInf, limit - rest, len(cols), cols, weight[part.cols][cols])
        if float(weight @ x) <= limit:  # (HiGHS tries a seed over the row, with an LP, and drops it: 0.1 s
            _seed(mip, x[part.cols])    # of each of LLaMA3-8B's polishes at 80 GB)
        mip.run()
        if mip.getInfo().primal_solution_status != 2:
            return None
        return part.whole(np.asarray(mip.getSolution().col_value))

    def polish_each(self, costs, weight, starts: list[tuple[float, np.ndarray]], free: np.ndarray
                    ) -> list[np.ndarray | None]:
        """`polish` from each (limit, x) of `starts`, in order; two or more side by side on threads of
        their own (each a fresh instance of the program: HiGHS lets go of Python while it runs)."""
        if len(starts) < 2:
            return [self.polish(costs, weight, limit, x, free) for limit, x in starts]
        with ThreadPoolExecutor(max_workers=len(starts), thread_name_prefix="spmd-polish") as pool:
            return list(pool.map(lambda start: self.polish(costs, weight, *start, free), starts))

    def _mip(self, costs: np.ndarray, time_limit: float) -> "highspy.Highs":
        """A fresh instance of the program at `costs` with its binary columns integral."""
        mip = _highs(time_limit, presolve=True)
        mip.setOptionValue("mip_rel_gap", self.mip_rel_gap)
        mip.passModel(self.lp)
        mip.changeColsCost(len(costs), self.columns, costs)
        integral = np.flatnonzero(self.binary).astype(np.int32)
        mip.changeColsIntegrality(len(integral), integral,
                                  np.full(len(integral), highspy.HighsVarType.kInteger))
        return mip
