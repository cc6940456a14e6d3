"""Axis search: plan a mesh of three or more axes two axes at a time.

A value has (placements per axis)^axes layouts, so the exact program grows with the power of the mesh's
rank: a 4-D activation has 36 layouts on a 2-D mesh and 216 on a 3-D one, and the edges between them
hold millions of layout pairs (a 1.1B Llama on (4, 4, 4): 2.4M columns, not solved in minutes). Each
step here solves the same program, exactly, over a subset of every node's strategies, one the size of
a 2-D mesh's:

    start      the outer axes hold equal placements (dp and fsdp act as one axis of their product),
               the last axis (tp) is free
    improve    for each pair of axes: those two free, every other axis as the incumbent plan has it;
               keep the better plan; repeat until a round changes nothing

The incumbent is always among the next step's strategies, so the objective never rises, and the
result is a plan no change on any two axes improves. It is not proven optimal: the plan's
`lower_bound` and `gap` are NaN and `stats["axis_search"]` says what was solved. Exact solves stay the
default wherever the whole program is small (`AUTO_MIN_PAIRS`), and where pins keep the outer axes from
holding equal placements (the start has no plan) the whole program is solved instead.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Callable

from spmd.core.errors import SpmdError
from spmd.core.memo import ByIdentity
from spmd.core.plan import Plan
from spmd.core.specs import Strategy
from spmd.passes.enumerate_strategies import NodeStrategies, StrategyTable
from spmd.passes.estimate_costs import CostTable

AUTO_MIN_PAIRS = 1_000_000  # layout pairs on the program's edges above which a 3+-axis mesh is searched
MAX_ROUNDS = 3


def layout_pairs(table: StrategyTable) -> int:
    """How many (made, needed) layout pairs the exact program's edges would hold: its size (an edge
    between strategy lists already counted, as tied layers' are, is counted once)."""
    total, seen = 0, set()
    for ns in table.nodes.values():
        for j, value in enumerate(ns.inputs):
            key = (ns.variant, j, table.nodes[value[0]].variant, value[1])
            if key in seen:
                continue
            seen.add(key)
            made = len(table.output_candidates(value))
            needed = len({s.inputs[j] for s in ns.strategies})
            if made > 1 and needed > 1:
                total += made * needed
    return total


def wanted(table: StrategyTable, mesh_axes: int, option: bool | None) -> bool:
    """Whether to search by axes: `option` (PlanOptions.axis_search) when set, else on meshes of three or
    more axes whose exact program is large."""
    if option is not None:
        return option and mesh_axes >= 3
    return mesh_axes >= 3 and layout_pairs(table) > AUTO_MIN_PAIRS


def _on_axes(s: Strategy, axes: tuple[int, ...]) -> tuple:
    return tuple([None if ps is None else tuple([ps[a] for a in axes]) for ps in (*s.inputs, *s.outputs)])


def _projected(strategies: tuple[Strategy, ...], axes: tuple[int, ...]) -> tuple[dict, dict]:
    """(projection on `axes` -> the indices of the strategies with it, id of a strategy -> the same)."""
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(strategies):
        groups.setdefault(_on_axes(s, axes), []).append(i)
    by_projection = {p: tuple(ix) for p, ix in groups.items()}
    return by_projection, {id(strategies[i]): ix for ix in by_projection.values() for i in ix}


class _Projections:
    """A strategy list's strategies by their placements on some mesh axes (`_on_axes`): projection ->
    indices, worked out once per list (nodes of tied layers share theirs, and every step asks again)."""

    def __init__(self):
        self._lists = ByIdentity()  # (list, axes) -> (projection -> indices, id of a strategy -> indices)

    def _of(self, ns: NodeStrategies, axes: tuple[int, ...]) -> tuple[dict, dict]:
        return self._lists.get(ns.strategies, axes, lambda: _projected(ns.strategies, axes))

    def __call__(self, ns: NodeStrategies, axes: tuple[int, ...]) -> dict[tuple, tuple[int, ...]]:
        return self._of(ns, axes)[0]

    def alike(self, ns: NodeStrategies, axes: tuple[int, ...], s: Strategy) -> tuple[int, ...]:
        """The indices of the strategies placed as `s` is on `axes` (none if no strategy is)."""
        by_projection, by_strategy = self._of(ns, axes)
        found = by_strategy.get(id(s))  # (a plan's choices are the list's own objects: no placements hashed)
        return by_projection.get(_on_axes(s, axes), ()) if found is None else found


def restrict(table: StrategyTable, costs: CostTable,
             keep: Callable[[str, NodeStrategies], tuple[int, ...]]) -> tuple[StrategyTable, CostTable]:
    """The table and costs with only the strategies whose indices `keep` gives (all of a node's if it
    gives none). Nodes that shared a strategy list (one variant) and keep the same part share the new list."""
    nodes, node_costs = dict(table.nodes), dict(costs.node_costs)
    fresh = max((ns.variant for ns in table.nodes.values()), default=0) + 1
    variants: dict[tuple, tuple[int, tuple]] = {}  # (variant, kept) -> (its new variant, its strategies)
    rows = ByIdentity()  # (a cost row, kept) -> its kept part: tied nodes share rows
    for name, ns in table.nodes.items():
        kept = keep(name, ns)
        if not kept or len(kept) == len(ns.strategies):
            continue
        listed = variants.get((ns.variant, kept))
        if listed is None:
            listed = variants[(ns.variant, kept)] = (fresh + len(variants), tuple(ns.strategies[i] for i in kept))
        variant, strategies = listed
        nodes[name] = NodeStrategies(strategies, ns.inputs, ns.outputs, ns.source, variant, ns.excluded, ns.tie,
                                     ns.buffer_update)
        row = costs.node_costs.get(name)
        if row is not None:
            node_costs[name] = rows.get(row, kept, lambda: tuple([row[i] for i in kept]))
    return (StrategyTable(nodes, table.fallbacks, table.copied, table.merged_followers),
            dataclasses.replace(costs, node_costs=node_costs))


def solve_by_axes(solve: Callable[[StrategyTable, CostTable], Plan], table: StrategyTable, costs: CostTable,
                  mesh_axes: int) -> Plan:
    """The search above; `solve(table, costs)` is one exact solve (budget and all)."""
    t0 = time.perf_counter()
    outer = tuple(range(mesh_axes - 1))
    on_axes = _Projections()

    diagonals = ByIdentity()  # strategy list -> its diagonal: nodes of tied layers share theirs

    def diagonal(name: str, ns: NodeStrategies) -> tuple[int, ...]:
        return diagonals.get(ns.strategies, None, lambda: tuple(sorted(
            i for p, ix in on_axes(ns, outer).items() if all(ps is None or len(set(ps)) == 1 for ps in p)
            for i in ix)))

    t = time.perf_counter()
    try:
        best = solve(*restrict(table, costs, diagonal))
    except SpmdError:  # pins (or ties to them) that the outer axes cannot hold equal: solve it whole
        return solve(table, costs)
    steps = [f"outer axes equal: {best.objective * 1e3:.3f} ms ({time.perf_counter() - t:.1f} s)"]
    pairs = list(itertools.combinations(range(mesh_axes), 2))
    solved_at: dict[tuple, int] = {}  # neighbourhood -> the incumbent's version it was last solved from
    version = 0
    for _ in range(MAX_ROUNDS):
        for free in pairs:
            if solved_at.get(free) == version:
                continue  # nothing changed since: the incumbent is that neighbourhood's optimum
            fixed = tuple(a for a in range(mesh_axes) if a not in free)
            t = time.perf_counter()
            plan = solve(*restrict(table, costs, lambda name, ns: on_axes.alike(ns, fixed, best.choices[name])))
            steps.append(f"axes {free[0]},{free[1]} free: {plan.objective * 1e3:.3f} ms ({time.perf_counter() - t:.1f} s)")
            if plan.objective < best.objective * (1 - 1e-9):
                best, version = plan, version + 1
            solved_at[free] = version
        if all(solved_at.get(free) == version for free in pairs):
            break
    search = {"solves": len(steps), "seconds": time.perf_counter() - t0, "steps": steps,
              "note": "local optimum: no change on any two mesh axes improves it (not proven optimal)"}
    return dataclasses.replace(best, lower_bound=math.nan, gap=math.nan,
                               stats={**best.stats, "axis_search": search})
