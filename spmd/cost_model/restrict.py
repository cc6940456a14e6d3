"""A program restricted to the part a polish can change.

A polish (`solver._Search.polish`) keeps a plan's binary columns where the plan has them, but for a few it
re-chooses (a stack's recomputation, the weights' layouts). Handed the whole program with the others fixed,
HiGHS's presolve spends most of the polish finding what those fixed columns leave free: LLaMA3-8B at
80 GB, 151k columns and 90k rows, presolve 0.55 s of a 1.2 s polish, for 561 free binary columns.

`restrict` does that part in numpy, in three steps:

1. Bounds. Each row's least and greatest activity, from its columns' bounds, bounds each of its columns
   (`a * y <= upper - (least activity of the rest)`); a column whose bounds meet is fixed. Repeated until
   nothing tightens. (A fixed layout's column at 0 fixes its edge and scaled columns at 0, which fixes
   more: three rounds on LLaMA3-8B, 96k columns fixed.)
2. Components. Columns still free are connected through the rows they share; only the components that
   hold a free binary column stay. The rest keep the plan's values: the plan is a solution, so they meet
   their rows, and no row joins them to a column that stays.
3. The program of those columns, with each row's bounds less what the others contribute at their values.

Every solution of the restricted program, with the other columns at their values, is a solution of the
whole one (bounds only tightened where the rows imply it; the columns left out keep values that meet their
rows), so a polish over it finds a plan. It may find a dearer one than over the whole program: a free
continuous column outside the components kept could, there, have traded cost for bytes of the budget row
(the budget row is not in the program, and joins no components). LLaMA3-8B's polish finds the same plan,
over 22k columns and 5.7k rows in 0.45 s.
"""
from __future__ import annotations

from dataclasses import dataclass

import highspy
import numpy as np

TOLERANCE = 1e-9  # bounds closer than this meet (the column is fixed at its lower bound)
ROUNDS = 20  # rounds of bound tightening at most (LLaMA3-8B's polishes: 3 to a fixed point)


@dataclass(frozen=True)
class Entries:
    """A column-wise matrix's entries as three arrays (row, column, value), from a `HighsLp`."""

    rows: np.ndarray
    cols: np.ndarray
    values: np.ndarray
    num_rows: int
    num_cols: int

    @staticmethod
    def of(lp: "highspy.HighsLp") -> "Entries":
        starts = np.asarray(lp.a_matrix_.start_, dtype=np.int64)
        cols = np.repeat(np.arange(lp.num_col_, dtype=np.int64), np.diff(starts))
        return Entries(np.asarray(lp.a_matrix_.index_, dtype=np.int64), cols,
                       np.asarray(lp.a_matrix_.value_, dtype=float), lp.num_row_, lp.num_col_)


@dataclass(frozen=True)
class Restricted:
    """The restricted program (`lp`, over the columns `cols` of the whole one) and `values`: a solution
    of the whole program's other columns (its own entries at `cols` are the plan's)."""

    lp: "highspy.HighsLp"
    cols: np.ndarray
    values: np.ndarray

    def whole(self, x: np.ndarray) -> np.ndarray:
        """The whole program's solution for the restricted program's solution `x`."""
        out = self.values.copy()
        out[self.cols] = x
        return out


def restrict(lp: "highspy.HighsLp", entries: Entries, x: np.ndarray, fixed: np.ndarray,
             binary: np.ndarray) -> Restricted:
    """`lp` with the columns `fixed` at `x`'s values (rounded: they are binary), restricted to the
    components of what stays free that hold a free binary column (`binary`: the binary columns, as a
    mask). `x` must be a solution of `lp` (a plan, settled)."""
    lower = np.asarray(lp.col_lower_, dtype=float).copy()
    upper = np.asarray(lp.col_upper_, dtype=float).copy()
    lower[fixed] = upper[fixed] = np.round(x[fixed])
    upper = _tightened(entries, lower, upper, np.asarray(lp.row_lower_, dtype=float),
                       np.asarray(lp.row_upper_, dtype=float))
    free = upper > lower
    kept = _components_with(entries, free, free & binary)
    values = np.where(free, x, lower)
    return Restricted(_program(lp, entries, kept, values, lower, upper, binary), np.flatnonzero(kept), values)


def _tightened(entries: Entries, lower: np.ndarray, upper: np.ndarray, row_lower: np.ndarray,
               row_upper: np.ndarray) -> np.ndarray:
    """The columns' upper bounds, tightened by the rows until nothing tightens (the lower bounds stay:
    every column of these programs is at least 0, and it is the upper ones that fixed layouts cut)."""
    r, c, a = entries.rows, entries.cols, entries.values
    pos = a > 0
    for _ in range(ROUNDS):
        # each row's least activity (a > 0 at the lower bound, a < 0 at the upper) and greatest
        least_terms = np.where(pos, a * lower[c], a * upper[c])
        most_terms = np.where(pos, a * upper[c], a * lower[c])
        least = np.bincount(r, weights=np.where(np.isfinite(least_terms), least_terms, 0.0), minlength=entries.num_rows)
        most = np.bincount(r, weights=np.where(np.isfinite(most_terms), most_terms, 0.0), minlength=entries.num_rows)
        least[np.bincount(r, weights=~np.isfinite(least_terms) * 1.0, minlength=entries.num_rows) > 0] = -np.inf
        most[np.bincount(r, weights=~np.isfinite(most_terms) * 1.0, minlength=entries.num_rows) > 0] = np.inf
        with np.errstate(invalid="ignore"):
            # a > 0: a * y <= row_upper - (least of the rest), the rest's least = least - a * lower
            room = np.where(pos, row_upper[r] - least[r], most[r] - row_lower[r])
            bound = lower[c] + room / np.abs(a)
        bound = np.where(np.isfinite(bound), bound, np.inf)
        tighter = np.full(entries.num_cols, np.inf)
        np.minimum.at(tighter, c, bound)
        tighter = np.maximum(tighter, lower)
        moved = tighter < upper - TOLERANCE
        if not moved.any():
            break
        upper = np.minimum(upper, tighter)
        meet = upper - lower <= TOLERANCE
        upper[meet] = lower[meet]
    return upper


def _components_with(entries: Entries, free: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """The columns of `free` connected to a column of `seeds` through rows (each row's free columns are
    connected), as a mask: labels spread to each row's least, then jump to their label's label, until
    they settle (each label is a column of its component; at the end, one per component)."""
    at = free[entries.cols]
    r, c = entries.rows[at], entries.cols[at]
    label = np.arange(entries.num_cols)
    none = entries.num_cols
    while True:
        least = np.full(entries.num_rows, none)
        np.minimum.at(least, r, label[c])
        spread = label.copy()
        np.minimum.at(spread, c, least[r])
        while True:  # (pointer jumping: chains of labels halve each time)
            jumped = spread[spread]
            if np.array_equal(jumped, spread):
                break
            spread = jumped
        if np.array_equal(spread, label):
            break
        label = spread
    return free & np.isin(label, label[seeds])


def _program(lp: "highspy.HighsLp", entries: Entries, kept: np.ndarray, values: np.ndarray,
             lower: np.ndarray, upper: np.ndarray, binary: np.ndarray) -> "highspy.HighsLp":
    """`lp` over the columns `kept`, the others at `values`, without costs: each row that holds a kept
    column, its bounds less the others' part."""
    r, c, a = entries.rows, entries.cols, entries.values
    inside = kept[c]
    others = np.bincount(r[~inside], weights=a[~inside] * values[c[~inside]], minlength=entries.num_rows)
    rows = np.unique(r[inside])
    new_row = np.full(entries.num_rows, -1, dtype=np.int64)
    new_row[rows] = np.arange(len(rows))
    cols = np.flatnonzero(kept)
    counts = np.bincount(c[inside], minlength=entries.num_cols)[cols]
    out = highspy.HighsLp()
    out.num_col_, out.num_row_ = len(cols), len(rows)
    out.col_cost_ = np.zeros(len(cols))  # (the caller's costs)
    out.col_lower_, out.col_upper_ = lower[cols], upper[cols]
    out.row_lower_ = np.asarray(lp.row_lower_, dtype=float)[rows] - others[rows]
    out.row_upper_ = np.asarray(lp.row_upper_, dtype=float)[rows] - others[rows]
    out.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    out.a_matrix_.start_ = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    out.a_matrix_.index_ = new_row[r[inside]].astype(np.int32)  # (entries are column-wise: in order)
    out.a_matrix_.value_ = a[inside]
    out.integrality_ = [highspy.HighsVarType.kInteger if b else highspy.HighsVarType.kContinuous
                        for b in binary[cols]]
    return out
