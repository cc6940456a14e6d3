"""solve_placements: choose one strategy per node minimizing compute + resharding cost, exactly.

Before: a `StrategyTable` and its `CostTable`. After: a `Plan` with one strategy per node and the
redistribute steps of every edge. Deterministic (same graph, mesh and pins give the same plan on every
rank). Nodes that merely follow their single input (views, getitem) add no variables: their choice is
the producer's choice re-labelled.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable

import numpy as np

from spmd.core.errors import SpmdError, SpmdInternalError
from spmd.core.graph_facts import follows_input, format_bytes, is_gradient_sink, is_view
from spmd.core.plan import Edge, Plan
from spmd.core.specs import Placements, TensorInfo, Value, pieces
from spmd.cost_model.comm import bucket_share
from spmd.cost_model.layout_graph import layout_graph
from spmd.cost_model.memory import AT_THE_STEP, LivePoint, Schedule, value_bytes
from spmd.cost_model.solver import Budget, Cut, IlpBuilder
from spmd.passes.enumerate_strategies import StrategyTable
from spmd.passes.estimate_costs import CostTable, keeps_whole
from spmd.passes.find_recomputable_layers import Recomputable, RecomputableLayer

Expr = tuple[int, ...]  # columns whose sum is 1 when the choice holds

FLOW_MIN_PAIRS = 64  # an edge with at least this many (made, needed) layout pairs may become a flow
# With a budget, the price search solves the program's pooled twin (`_Program`) where the pair columns of
# the reads it pools are at least this share of the program's columns. Measured: the 2-layer transformers
# Llama on (2, 2), 32% (at 0.8 of its peak 14.2 s and 22.09 ms before, 19.4 s and 14.66 ms with the twin);
# tests' 2-layer GPT on (2, 2) at 0.7, 29% (14.5 -> 3.5 s and 14.7 -> 2.4 s, the same plans); not LLaMA3-8B on
# (8, 8) at 80 GB, 22% (its search 20 s against 8, a plan 4.4% dearer, gap 24%: reads of a large value that
# need different layouts, each priced at 1/k, are its backward's large reshardings), nor a 1-D mesh (13%)
POOLED_SHARE = 0.25
# A plan over the budget by its temporaries gives a cut at each of this many hills of its schedule (the worst
# first): the next plan is often over at the plan's second hill (a 2-layer GPT on (4,): at the two matmuls
# of its last MLP, one cut loop round each)
CUT_POINTS = 4
WALKS_KEPT = 8  # plans whose schedule walk a budgeted solve keeps (the search asks again of plans it holds)


def _shard_all(info, mesh_shape):
    """Placements cutting the largest dim by every axis: a floor for the budget message."""
    from torch.distributed.tensor import Replicate, Shard

    if not info.shape:
        return [Replicate()] * len(mesh_shape)
    d = max(range(len(info.shape)), key=lambda i: info.shape[i])
    return [Shard(d)] * len(mesh_shape)


def _bucket_latency(ilp: IlpBuilder, buckets: dict[int, list[tuple[int, float]]], costs: CostTable) -> None:
    """Gradient all_reduces on one axis share buckets of `bucket_bytes`: together they pay the link's
    latency max(1, sum of their bucket shares) times (`comm.bucketed_latency`: the buckets
    `bucket_gradients` will launch, to within rounding up), and nothing if no gradient is reduced there:
        z >= y,  z >= sum(share * x),  y >= x for each gradient column x,  cost latency * z."""
    for axis, entries in sorted(buckets.items()):
        latency = costs.mesh.links[axis].alpha_beta("all_reduce")[0]
        total = sum(share for _, share in entries)
        z = ilp.add_var(latency, binary=False, upper=max(1.0, total))
        y = ilp.add_var(0.0, binary=False)
        ilp.add_ge([(z, 1.0), (y, -1.0)], 0.0)
        ilp.add_ge([(z, 1.0)] + [(col, -share) for col, share in entries], 0.0)
        for col in dict.fromkeys(col for col, _ in entries):
            ilp.add_ge([(y, 1.0), (col, -1.0)], 0.0)


def _shareable(steps, gradient: bool) -> bool:
    """Whether consumers of one value that need these steps share them in the program's pricing: where
    they hold a collective, and the value is not a gradient leaving (reduced in its own bucket). A local
    slice is shared by code generation too, but costs next to nothing, and pooling it would add a row per
    consumer and pair (8.6k more for LLaMA3-8B on (8, 8))."""
    return not gradient and any(step.is_collective for step in steps)


def _add_flow_balance(ilp: IlpBuilder, made: dict, needed: dict, arcs, arc_cols, col=lambda c: c) -> None:
    """Per layout v: flow in - flow out = [needed v] - [made v], over `arc_cols` (one per arc of `arcs`);
    `made`/`needed`: placements -> the choice columns selecting them, each read through `col` (a
    recomputed run's scaled copy of it)."""
    balance: dict[Placements, list[tuple[int, float]]] = {}
    for ps, cols in made.items():
        balance.setdefault(ps, []).extend((col(c), 1.0) for c in cols)
    for ps, cols in needed.items():
        balance.setdefault(ps, []).extend((col(c), -1.0) for c in cols)
    for g, arc in zip(arc_cols, arcs):
        balance.setdefault(arc.src, []).append((g, -1.0))
        balance.setdefault(arc.dst, []).append((g, 1.0))
    for terms in balance.values():
        ilp.add_eq(terms, 0.0)


@dataclasses.dataclass(frozen=True)
class Rebuild:
    """One layer's region as backward may run it again, for the cuts: while its copy is alive (from the
    first backward reader of the region to the last), the bytes the budget row says recomputing it frees
    are held again. In the program the layer is one of a run of `n` alike layers sharing scaled columns
    w = m * x (m of them recomputed); it is recomputed when m >= k. The cut adds back
    (m - k + 1) / (n - k + 1) of what it frees: at most what it holds (nothing or less when m < k, all
    when m = n, and 1 / (n - k + 1) of it when m = k), so every plan that fits still satisfies the cut,
    and where the whole run is recomputed (or the layer is a run of its own) the cut is exact.
    `freed`: (w column, layout column x, bytes one layer frees there; negative for what it newly holds for
    its copy, which the row counts for every recomputed layer (as held when backward starts) and a cut
    drops: before it is made, or after the copy ran, it is not held). `held`: for the layer the row lets
    free nothing (the last of the last stack, a run of its own), what it does free from its last forward
    reader until its copy runs, which the cut takes off there; `held_copies` the same for the resharded
    copies kept for it that only its region reads (u = [recomputed] z, exact at 0-1 points, outside the
    row)."""

    region: tuple[str, ...]
    k: int
    n: int
    freed: tuple[tuple[int, int, float], ...]
    run: tuple = ()  # (stack, first layer, way): the layers of one run share `freed`
    held: tuple[tuple[str, int, float], ...] = ()  # the held last layer: (value, w column, bytes) it frees
    held_copies: tuple[tuple[int, float, tuple[str, ...]], ...] = ()  # and (u column, bytes, forward readers)


def _recompute(ilp: IlpBuilder, recompute: Recomputable, table: StrategyTable, costs: CostTable, node_expr: dict,
               value_expr: dict, col_group: dict, edge_at: dict, edge_groups: list, memory_row: dict,
               flows: dict, copies: dict, rebuilds: list) -> list[tuple[list[tuple[int, int]], list[int]]]:
    """How many layers of each stack backward recomputes whole (the first K of its N) and selectively
    (the last J), as one column per allowed pair (K, J), K + J <= N, exactly one of them 1 (J = 0 where
    the stack's layers have no selective region); returns (pairs, columns) per stack. One choice over
    pairs, not a count of each tied by a row: the relaxation of two counts mixed "all whole" and "all
    selective" half and half, and rounding each count to its larger half gave "none" (ViT-120B at batch
    512: a 990 GB plan at every price, and no plan found).

    Recomputing a layer adds its region's seconds (its nodes' compute and the reshardings into them, a
    collective several of them share once) and frees its saved bytes (and the resharded copies its
    forward kept for backward, `copies`: see `_saved_copies`), less what it saves instead.
    Backward starts at the last layer, so when that one is recomputed (J >= 1, or K = N) its rebuilt
    activations are held while its backward runs: it frees nothing (a layer recomputed later finds the
    layers after it gone). Whole layers first, selective ones last: the last layer costs less to rebuild.
    Layers of a stack share columns where their placements are tied, but not always all of them: the
    first layer's input comes from the embedding, not from a layer, and its first nodes may be laid out
    apart. So the stack is cut into runs of consecutive layers priced alike (`_runs`); a run [a, b)
    recomputes m = clamp(K - a, 0, b - a) of its layers whole and m' = clamp(J - (N - b), 0, b - a)
    selectively (a column each, equal to its sum over the pair columns), each a linear function of its
    first layer's choices, made linear exactly per "exactly one of" group G of columns x: w_g = m * x_g
    and w'_g = m' * x_g by sum_{g in G} w_g = m,  sum_{g in G} w'_g = m',  w_g, w'_g >= 0,
    w_g + w'_g <= (b - a) x_g.
    The last layer is a run of its own, so what it frees and holds again meet on one column and cancel
    in the relaxation too (as two columns, a fractional layout let them part: the relaxation freed bytes
    no plan frees, and its rounding was a plan over the budget)."""
    counts = []
    last_stack = _last_stack(recompute, table)
    for s, stack in enumerate(recompute.stacks):
        n = len(stack)
        # only the layer backward reaches first holds its rebuilt activations with every other layer's
        # saved ones: a stack's last layer before another stack's layers frees what it saves
        held_last = s == last_stack
        light = [layer.selective for layer in stack] if stack[0].selective is not None else []
        pairs = {"all": [(n, 0)], "selective": [(0, n) if light else (0, 0)]}.get(
            recompute.mode, [(k, j) for k in range(n + 1) for j in range(n + 1 - k if light else 1)])
        cols = [ilp.add_var(0.0, binary=True) for _ in pairs]
        ilp.add_eq([(c, 1.0) for c in cols], 1.0)
        counts.append((pairs, cols))

        def scaled(col: int, cache: dict, m: int, upper: float) -> int:
            group = col_group[col]
            if group not in cache:
                cache[group] = {g: ilp.add_var(0.0, binary=False, upper=upper) for g in group}
                ilp.add_eq([(w, 1.0) for w in cache[group].values()] + [(m, -1.0)], 0.0)
            return cache[group][col]

        for a, b in _runs(stack, table, costs, node_expr, value_expr, edge_at):
            times: list[dict[tuple, dict[int, int]]] = []
            copy_frees: dict[int, list[int]] = {}  # z -> what each way of recomputing frees of that copy
            for layers, mode in ((stack, 0), (light, 1)):
                first = a if mode == 0 else n - b  # the run holds clamp(count - first, 0, b - a) of them
                per_pair = [(c, float(min(pair[mode] - first, b - a))) for pair, c in zip(pairs, cols)
                            if pair[mode] > first]
                if not layers or not per_pair:
                    continue
                m = ilp.add_var(0.0, binary=False, upper=float(b - a))
                ilp.add_eq([(m, 1.0)] + [(c, -v) for c, v in per_pair], 0.0)
                times.append({})
                # the last layer frees nothing: its rebuilt activations are held while its backward runs
                layer = layers[a] if b < n or not held_last else dataclasses.replace(layers[a], frees=())
                w = (lambda col: scaled(col, times[-1], m, float(b - a)))
                freed = _price_run(ilp, layer, b - a, w, table, costs, node_expr, value_expr, edge_at, edge_groups,
                                   memory_row, flows, m, copies if b < n or not held_last else {}, copy_frees)
                held, held_copies = (), []
                if layer is not layers[a]:  # the held last layer, a run of its own: w = [recomputed] x
                    held = tuple((base, w(col), costs.value_info[(base, 0)].nbytes / pieces(ps, costs.mesh.shape))
                                 for base in layers[a].frees for ps, expr in value_expr[(base, 0)].items()
                                 for col in expr)
                    region = set(layers[a].nodes)  # and the copies kept for it that its region alone reads
                    for z, size, _, readers in dict.fromkeys(c for name in layers[a].nodes for c in copies.get(name, ())):
                        if readers and readers <= region:
                            u = _times(ilp, m, z, 1)
                            ilp.add_le([(u, 1.0), (z, -1.0)], 0.0)
                            held_copies.append((u, size, tuple(sorted(readers))))
                # each layer i of the run is recomputed when the count reaches it: whole ones first
                # (k = i - a + 1), selective ones last (k = b - i); see `Rebuild`
                for i in range(a, b):
                    if layers[i] is not None:
                        rebuilds.append(Rebuild(layers[i].nodes, i - a + 1 if mode == 0 else b - i, b - a,
                                                tuple(freed), (s, a, mode), held, tuple(held_copies)))
            # a layer is recomputed one way or not at all: per layout, both ways' counts share the run's
            # layers laid out so (w_g + w'_g <= (b - a) x_g; bounded apart, the relaxation counted a
            # fractional layout's layers twice, and freed more bytes than they hold)
            for group in dict.fromkeys(g for cache in times for g in cache):
                for g in group:
                    ilp.add_le([(cache[group][g], 1.0) for cache in times if group in cache] +
                               [(g, -float(b - a))], 0.0)
            for z, frees in copy_frees.items():  # and frees a kept copy once, if there is one
                ilp.add_le([(u, 1.0) for u in frees] + [(z, -float(b - a))], 0.0)
    return counts


def _last_stack(recompute: Recomputable, table: StrategyTable) -> int:
    """The stack whose last layer backward reaches first (the last in forward order)."""
    position = {name: i for i, name in enumerate(table.nodes)}
    return max(range(len(recompute.stacks)), default=0,
               key=lambda s: max((position.get(name, -1) for name in recompute.stacks[s][-1].nodes), default=-1))


def rebuilt_regions(plan: Plan, recompute: Recomputable | None) -> tuple[tuple[str, ...], ...]:
    """The forward nodes backward runs again under `plan`, one region per recomputed layer (whole or
    selective), for `Schedule.walk`."""
    if not recompute or not (plan.recompute or plan.recompute_selective):
        return ()
    layers = {layer.key: layer for stack in recompute.stacks for layer in stack}
    regions = [layers[key].nodes for key in plan.recompute if key in layers]
    regions += [layers[key].selective.nodes for key in plan.recompute_selective
                if key in layers and layers[key].selective is not None]
    return tuple(regions)


def _runs(stack, table: StrategyTable, costs: CostTable, node_expr: dict, value_expr: dict,
          edge_at: dict) -> list[tuple[int, int]]:
    """The stack cut into maximal runs [a, b) of consecutive layers that the program prices alike (the
    same columns, node costs and edge groups for their nodes, and the same columns and sizes for what
    they free and add, whole and selectively), and the last layer alone (it frees nothing: see
    `_recompute`)."""
    def signature(layer: RecomputableLayer | None) -> tuple:
        if layer is None:
            return ()
        nodes = tuple((tuple(node_expr[name]), tuple(costs.node_costs.get(name, ())),
                       tuple(edge_at.get((name, j)) for j in range(len(table.nodes[name].inputs))))
                      for name in layer.nodes if name in table.nodes)
        held = tuple(tuple((costs.value_info[(base, 0)].nbytes, tuple(value_expr[(base, 0)].items())) for base in names)
                     for names in (layer.frees, layer.adds))
        return nodes, held, signature(layer.selective)

    runs, last = [], None
    for i, layer in enumerate(stack[:-1]):
        sig = signature(layer)
        if sig != last:
            runs.append([i, i + 1])
            last = sig
        else:
            runs[-1][1] = i + 1
    return [(a, b) for a, b in runs] + [(len(stack) - 1, len(stack))]


def _price_run(ilp: IlpBuilder, layer: RecomputableLayer, length: int, w: Callable[[int], int],
               table: StrategyTable, costs: CostTable, node_expr: dict, value_expr: dict, edge_at: dict,
               edge_groups: list, memory_row: dict, flows: dict, count: int, copies: dict,
               copy_frees: dict[int, list[int]]) -> list[tuple[int, int, float]]:
    """Objective and budget-row terms of recomputing the layers of one run, `layer` its first: `w(col)`
    is a column equal to (how many of the run are recomputed) * col, `count` the column of that number.
    A flow edge into the run (`flows`: its first arc column -> (made, needed, arcs)) is priced as a flow
    of that many units: over new arc columns, from the made layout's scaled columns to the needed one's.
    A copy the layer's forward kept for backward (`copies`: reader -> (z, bytes, value, the value's
    forward readers), z its 0/1 column, the same in every layer of the run), whose value the region
    alone reads in forward, is freed by each layer recomputed: a column u = count * z, exact
    where z is 0 or 1 (u <= count, u >= count - length * (1 - z)), listed in `copy_frees[z]`; the caller
    bounds the run's u of each z by length * z. Returns what one layer of the run frees on each scaled
    column: (w column, its layout column, bytes; what it newly holds negative)."""
    seconds: dict[int, float] = {}
    shared: dict[tuple, tuple[float, dict[str, list[int]]]] = {}
    flow_uses: dict[int, int] = {}
    for name in layer.nodes:
        ns = table.nodes.get(name)
        if ns is None:
            continue
        for expr, c in zip(node_expr[name], costs.node_costs.get(name, ())):
            for col in expr:
                seconds[col] = seconds.get(col, 0.0) + c
        for j, value in enumerate(ns.inputs):
            if (name, j) not in edge_at:
                continue
            terms = edge_groups[edge_at[(name, j)]][0]
            if terms and terms[0][0] in flows:
                flow_uses[terms[0][0]] = flow_uses.get(terms[0][0], 0) + 1
                continue
            for col, sec, pair in terms:
                if pair is None:
                    seconds[col] = seconds.get(col, 0.0) + sec
                else:
                    shared.setdefault((value, pair), (sec, {}))[1].setdefault(name, []).append(col)
    for sec, per_use in shared.values():
        if len(per_use) == 1:
            for col in next(iter(per_use.values())):
                seconds[col] = seconds.get(col, 0.0) + sec
            continue
        q = ilp.add_var(sec, binary=False, upper=float(length))  # the run's count if any consumer uses it
        for use in per_use.values():
            ilp.add_ge([(q, 1.0)] + [(w(col), -1.0) for col in use], 0.0)
    for col, sec in seconds.items():
        if sec:
            ilp.add_cost(w(col), sec)
    for first, uses in flow_uses.items():
        made, needed, arcs = flows[first]
        scaled = [ilp.add_var(arc.seconds * uses, binary=False, upper=float(length)) for arc in arcs]
        _add_flow_balance(ilp, made, needed, arcs, scaled, w)
    freed: list[tuple[int, int, float]] = []  # (w column, layout column, bytes one layer frees on it)
    for names, sign in ((layer.frees, 1.0), (layer.adds, -1.0)):
        for base in names:
            info = costs.value_info[(base, 0)]
            for ps, expr in value_expr[(base, 0)].items():
                for col in expr:
                    b = sign * info.nbytes / pieces(ps, costs.mesh.shape)
                    memory_row[w(col)] = memory_row.get(w(col), 0.0) - b
                    freed.append((w(col), col, b))
    held: dict[int, float] = {}  # z -> bytes of the layer's copies it stands for
    region = set(layer.nodes)
    for z, size, _, readers in dict.fromkeys(copy for name in layer.nodes for copy in copies.get(name, ())):
        if readers <= region:  # (read elsewhere too, the copy stays for them)
            held[z] = held.get(z, 0.0) + size
    for z, size in held.items():
        u = _times(ilp, count, z, length)
        copy_frees.setdefault(z, []).append(u)
        memory_row[u] = memory_row.get(u, 0.0) - size
    return freed


def _times(ilp: IlpBuilder, count: int, z: int, length: int) -> int:
    """A column u = count * z for a count in [0, length] and a 0/1 column z, exact where z is 0 or 1
    (u <= count, u >= count - length * (1 - z)); the caller bounds u by length * z."""
    u = ilp.add_var(0.0, binary=False, upper=float(length))
    ilp.add_le([(u, 1.0), (count, -1.0)], 0.0)
    ilp.add_ge([(u, 1.0), (count, -1.0), (z, -float(length))], -float(length))
    return u


def recompute_figures(layers: list[RecomputableLayer], choices: dict, node_costs: dict, edges,
                      costs: CostTable) -> tuple[float, float]:
    """(seconds, net bytes freed) of recomputing `layers` (whole or selective regions; a stack's last
    layer with nothing freed), as `_recompute` prices them."""
    mesh_shape = costs.mesh.shape
    into: dict[str, list[Edge]] = {}
    for e in edges:
        into.setdefault(e.consumer, []).append(e)

    def nbytes(names) -> float:
        return sum(costs.value_info[(b, 0)].nbytes / pieces(choices[b].outputs[0], mesh_shape) for b in names)

    seconds = freed = 0.0
    for layer in layers:
        seconds += sum(node_costs.get(name, 0.0) for name in layer.nodes)
        paid = set()
        for e in (e for name in layer.nodes for e in into.get(name, ())):
            if (e.value, e.dst) not in paid:
                paid.add((e.value, e.dst))
                seconds += costs.edge_cost(e.value, e.src, e.dst)
        freed += nbytes(layer.frees) - nbytes(layer.adds)
    return seconds, freed


def saved_readers(schedule: Schedule | None) -> frozenset[str]:
    """Forward views through which backward reads what they read: a backward node reads the view (or a
    view of it), so a resharded copy the view reads stays alive into backward (as `Schedule` keeps it).
    Such a copy is saved as surely as an activation: an input all_gathered for a column-parallel matmul
    whose weight gradient reads the same view, a weight gathered before its transpose (FSDP keeping it
    gathered). (A getitem is not a view: a copy read through split/chunk is not seen, here or there.)"""
    if schedule is None:
        return frozenset()
    phase = schedule.phase

    def read_in_backward(view) -> bool:
        return any(phase.get(u.name) == "is_backward" or u.op == "call_function" and is_view(u.target)
                   and read_in_backward(u) for u in view.users)

    return frozenset(n.name for n in schedule.nodes if n.op == "call_function" and phase.get(n.name) == "is_forward"
                     and is_view(n.target) and read_in_backward(n))


def _forward_readers(table: StrategyTable, saved: frozenset[str], phase: dict) -> dict[Value, frozenset[str]]:
    """Value -> the forward nodes reading it, for the values `saved` readers read."""
    wanted = {v for name in saved if name in table.nodes for v in table.nodes[name].inputs}
    found: dict[Value, set[str]] = {}
    for name, ns in table.nodes.items():
        if phase.get(name) == "is_forward":
            for v in ns.inputs:
                if v in wanted:
                    found.setdefault(v, set()).add(name)
    return {v: frozenset(names) for v, names in found.items()}


def _saved_copies(ilp: IlpBuilder, table: StrategyTable, costs: CostTable, node_expr: dict, value_expr: dict,
                  saved: frozenset[str], forward_readers: dict, memory_row: dict) -> dict[str, list[tuple]]:
    """Budget-row terms of the resharded copies forward keeps for backward (`saved_readers`): one copy per
    (value, layout) those readers need (insert_collectives makes one per value, layout and phase), kept
    when a saved reader needs layout L and the value is not made in L. Its column z is exactly that at
    every integral point: z >= [r needs L] - [made in L] per saved reader r, z <= sum_r [r needs L],
    z <= 1 - [made in L]; its bytes go into the row. Copies whose rows are the same (tied layers' twins,
    or alike values of one layer) share one z, their bytes counted per copy. (The value's own term stays
    too, in the layout it is made in, though the rank graph may keep only the copy: an overstatement of
    1 / (the axes gathered over) of each copy, the same in the row, the plan and the schedule's walk.)
    Returns, per saved reader, its copies' (z, bytes, value, the value's forward readers): recomputing a
    layer frees a copy when every forward reader of its value is in the layer's region (`_price_run`);
    a copy other layers read too stays."""
    mesh_shape = costs.mesh.shape
    by_value: dict[Value, list[tuple[str, int]]] = {}
    for name in saved:
        ns = table.nodes.get(name)
        if ns is None or ns.source == "follow":  # a getitem takes its element as made: no copy
            continue
        for j, value in enumerate(ns.inputs):
            if isinstance(costs.value_info.get(value), TensorInfo):
                by_value.setdefault(value, []).append((name, j))
    columns: dict[tuple, int] = {}
    of_reader: dict[str, list[tuple]] = {}
    for value, group in sorted(by_value.items()):  # sorted: the same program on every rank
        made = value_expr[value]
        readers_of_value = forward_readers.get(value, frozenset())
        needs = {r: _needed(table.nodes[r[0]], r[1], node_expr[r[0]]) for r in sorted(group)}
        for layout in dict.fromkeys(layout for r in needs for layout in needs[r]):
            readers = sorted({tuple(needs[r][layout]) for r in needs if layout in needs[r]})
            made_cols = tuple(made.get(layout, ()))
            if all(set(cols) <= set(made_cols) for cols in readers):
                continue  # read only where made so (a view follows its input): never a copy
            size = costs.value_info[value].nbytes / pieces(layout, mesh_shape)
            key = (made_cols, layout, size, tuple(readers))
            z = columns.get(key)
            if z is None:
                z = columns[key] = ilp.add_var(0.0, binary=False)
                minus_made = [(c, 1.0) for c in made_cols]
                for cols in readers:
                    ilp.add_ge([(z, 1.0)] + [(c, -1.0) for c in cols] + minus_made, 0.0)
                ilp.add_le([(z, 1.0)] + [(c, -1.0) for c in dict.fromkeys(c for cols in readers for c in cols)], 0.0)
                if made_cols:
                    ilp.add_le([(z, 1.0)] + minus_made, 1.0)
            memory_row[z] = memory_row.get(z, 0.0) + size
            for name in dict.fromkeys(r[0] for r in needs if layout in needs[r]):
                of_reader.setdefault(name, []).append((z, size, value, readers_of_value))
    return of_reader


def _readers_by_phase(table: StrategyTable, schedule: Schedule, regions: dict) -> dict[tuple, list[tuple[str, int]]]:
    """(value, phase) -> the nodes of the schedule reading it, as (consumer, input slot): who may need a
    resharded copy of it (followers take their input as made)."""
    readers: dict[tuple, list[tuple[str, int]]] = {}
    for name, ns in table.nodes.items():
        if name in schedule.spans and ns.source != "follow":
            for j, value in enumerate(ns.inputs):
                readers.setdefault((value, regions.get(name)), []).append((name, j))
    return readers


def _cut(point: LivePoint, schedule: Schedule, table: StrategyTable, costs: CostTable,
         node_expr: dict, value_expr: dict, memory_row: dict[int, float], readers: dict,
         saved_copies: frozenset[int] = frozenset(), rebuilt: tuple = ()) -> Cut:
    """The predicted peak at one point of the schedule (where a plan was over) as a row of the choices: the
    memory row without the saved activations and saved copies (`saved_copies`, their columns; the
    schedule counts both where they are alive; what recomputation frees stays), plus each value alive
    there in the layout chosen for it, the gradients made by then in their parameters' layouts, plus
    every resharded copy alive there; where a recomputed layer's copy is alive (`rebuilt`: (first
    index, last index, `Rebuild`)), what the row says recomputing it frees, added back (exactly where
    its whole run is recomputed, less otherwise: see `Rebuild`). Where no layer is recomputed it equals,
    at every plan, what the schedule walk holds at that point; with recomputation it is at most that
    (where a layer's count is partial, a layer's copy not yet run still holds what it newly read, a
    resharding of a recomputed region is read elsewhere too). So it holds for every plan that fits, and
    cuts off the plan that was over there, and every other plan over at the same point.

    A copy of value v in layout L read in one phase is alive at the point when a reader in that phase
    needs L, v is not made in L, and the readers needing L start at or before the point and end at or
    after it: a helper column z >= [r1 needs L] + [r2 needs L] - [v made in L] - 1 for each such pair
    (z >= [r needs L] - [made in L] for a reader spanning the point), for every layout some reader
    of v may need (`readers`: `_readers_by_phase`). (Helpers for the plan's own copies alone made a cut
    that the next plan, over at the same point with other copies, passed: a 2-layer GPT on (4,) took four
    rounds of the cut loop.)"""
    mesh_shape = costs.mesh.shape
    terms = {col: b for col, b in memory_row.items() if col not in saved_copies}
    for term in costs.memory:
        if term.kind == "activations":
            for ps, expr in value_expr[term.value].items():
                for col in expr:
                    terms[col] -= term.bytes(ps, mesh_shape)
    held = set(point.gradients)  # gradients made by then, in their parameters' layouts
    for term in costs.memory:
        if term.kind == "gradients" and term.value[0] in held:
            for ps, expr in value_expr[term.value].items():
                for col in expr:
                    terms[col] = terms.get(col, 0.0) + term.bytes(ps, mesh_shape)
    for name in point.values:
        ns = table.nodes.get(name)
        if ns is None:
            continue
        info = schedule.tensor_info.get(name)
        for s, expr in zip(ns.strategies, node_expr[name]):
            size = value_bytes(info, s.outputs, mesh_shape)
            for col in expr:
                terms[col] = terms.get(col, 0.0) + size
    runs = set()
    for lo, hi, r, ends in rebuilt:
        if lo <= point.index <= hi:  # a recomputed layer's copy alive here holds again what the row says it frees
            share = 1.0 / (r.n - r.k + 1)
            for w, x, b in r.freed:
                if b > 0:
                    terms[w] = terms.get(w, 0.0) + b * share
                    terms[x] = terms.get(x, 0.0) - b * (r.k - 1) * share
        for base, w, b in r.held:  # the held last layer, recomputed, frees its values until its copy runs
            if ends.get(base, lo) < point.index < lo:
                terms[w] = terms.get(w, 0.0) - b
        for u, b, read_by in r.held_copies:  # and the copies kept for it that its region alone reads
            end = max(schedule.split_spans[c][0] for c in read_by)
            if end < point.index < lo:
                terms[u] = terms.get(u, 0.0) - b
        if r.run not in runs:  # what a recomputed layer newly holds for its copy: not yet made, or gone
            runs.add(r.run)
            for w, _, b in r.freed:
                if b < 0:
                    terms[w] = terms.get(w, 0.0) + b
    i, spans = point.index, schedule.spans
    helpers = []
    for (value, phase), group in readers.items():
        before = [r for r in group if spans[r[0]][0] <= i]
        after = [r for r in group if spans[r[0]][1] >= i]
        if not before or not after or not isinstance(costs.value_info.get(value), TensorInfo):
            continue
        needs = {r: _needed(table.nodes[r[0]], r[1], node_expr[r[0]]) for r in group if r in before or r in after}
        for layout in dict.fromkeys(L for r in needs for L in needs[r]):
            need = {r: needs[r].get(layout, ()) for r in needs}
            made = value_expr[value].get(layout, ())
            lower = [(_summed(need[r], made), 0.0) for r in before if r in after and need[r]]
            lower += [(_summed([*need[a], *need[b]], made), -1.0)
                      for a in before if a not in after and need[a] for b in after if b not in before and need[b]]
            if lower:  # (readers of tied layers share columns: their rows are one row)
                size = costs.value_info[value].nbytes / pieces(layout, mesh_shape)
                helpers.append((size, tuple(dict.fromkeys(lower))))
    return Cut(tuple(terms.items()), tuple(helpers))


def _summed(needs, made) -> tuple[tuple[int, float], ...]:
    """sum(needs) - sum(made) as (column, coefficient) pairs, each column once, in column order."""
    coef: dict[int, float] = {}
    for c in needs:
        coef[c] = coef.get(c, 0.0) + 1.0
    for c in made:
        coef[c] = coef.get(c, 0.0) - 1.0
    return tuple(sorted((c, v) for c, v in coef.items() if v))


def _needed(ns, slot: int, exprs: list[Expr]) -> dict[Placements, list[int]]:
    """Layout of input `slot` -> the columns of the strategies that read it so."""
    needed: dict[Placements, list[int]] = {}
    for s, expr in zip(ns.strategies, exprs):
        needed.setdefault(s.inputs[slot], []).extend(expr)
    return needed


def _by_key(ns, exprs: list[Expr]) -> dict[Placements, list[int]]:
    out: dict[Placements, list[int]] = {}
    for s, expr in zip(ns.strategies, exprs):
        out.setdefault(ns.key(s), []).extend(expr)
    return out


@dataclasses.dataclass(frozen=True)
class _Program:
    """One build of the placement program (`solve_placements`), and what reading its solutions needs.

    With a memory budget, where the reads of values read several times in one region make much of the
    program (the layouts of small tensors on a 2-D mesh: 20-36 each), the program has a twin for the price
    search, `pooled`: the same binary columns in the same order, and the same budget row at every plan, but
    each of the k reads of such a value in one region a unit of flow over the layout graph, from the layout
    the value is made in to the one the read needs, its arcs at 1/k of their cost. For any plan that costs
    (1/k) of the k reads' reshardings, each at its cheapest path: no more than the program's price, where
    a resharding several reads share is paid once and each read pays its own otherwise, and the same
    where all k need one layout and its steps hold a collective, the usual case. So the twin's relaxations
    are bounds on the program's, over a few arcs per read where the program has a transport of layout
    pairs per read and a column per shared resharding (the 2-layer transformers Llama on (2, 2): 188k
    columns, 89k in the twin). A value with a read the twin cannot pool (a gradient's, a fused chain's)
    keeps the program's edges for all its reads in that region. The twin leaves out the reshardings of
    those reads that recomputing a layer runs again (also a bound).
    `pooled_columns`: in the program, the columns of the reads the twin pools (pair columns)."""

    ilp: IlpBuilder
    node_expr: dict
    value_expr: dict
    memory_row: dict
    droppable: tuple
    copies: dict
    counts: list
    rebuilds: list
    last_stack: int
    pooled_columns: int
    ending: dict  # column -> bytes held when backward ends and the optimizer steps (the "ending" row)


def solve_placements(table: StrategyTable, costs: CostTable, labels: dict[str, str] | None = None,
                     memory_budget: float | None = None, time_limit: float = 60.0,
                     blocks=None, schedule: Schedule | None = None,
                     on_progress: Callable[[float, float, float], None] | None = None,
                     regions: dict[str, str] | None = None, recompute: Recomputable | None = None) -> Plan:
    """`memory_budget`: bytes per rank the plan's predicted peak (see `cost_model.memory`) may use.
    `blocks`: a `RepeatedBlocks`; a node of a repeated layer reuses its representative's variables (and
    edges between reused variables reuse their edge variables), so identical layers get identical
    placements and the program's size stops growing with depth. The optimum is then the best plan
    among those that lay out identical layers alike.
    `schedule`: the graph's (cost_model/memory.py): with a budget, only plans whose linear memory terms
    plus the schedule's temporaries fit are accepted, and where none of the price search's plans does,
    the bytes alive at the hills of their schedules become rows of the program (`_cut`, `IlpBuilder.solve`).
    `on_progress(objective, bound, gap)`: called as the solver improves (seconds).
    `regions`: consumer -> "is_forward"/"is_backward" (`TracedGraph.regions`). Consumers of one value in
    one region that need the same placements share one resharding in the rank graph (insert_collectives),
    so the program prices it once (`IlpBuilder.add_shared`: at even shares while the solution takes it
    for all of them or none, else exactly).
    `recompute`: layers backward may run again instead of saving their activations (see `_recompute`):
    chosen where a memory budget needs it ("auto", only with a budget) or everywhere ("all")."""
    regions = regions or {}
    mesh_shape = costs.mesh.shape
    saved = saved_readers(schedule)  # (without a budget the row is not built: the plan still reports them)
    forward_readers = _forward_readers(table, saved, schedule.phase) if saved else {}

    def build(pooled: bool) -> _Program:
        """The program (`pooled`: its price-search twin, see `_Program`)."""
        rep_of = blocks.representative if blocks is not None else {}
        shared_edges: dict[tuple, dict] = {}  # column structure of an edge -> its edge variables
        group_index: dict[tuple, int] = {}  # (structure, tensor, gradient) -> its index in edge_groups
        edge_groups: list[tuple] = []  # (terms, bucket shares) of each distinct edge
        uses: dict[Value, list[tuple[int, str | None]]] = {}  # value -> (edge group, region) per consumer
        own_vars: set[str] = set()  # nodes with one choice column per strategy (not followers)
        variants: dict[str, list[str]] = {}  # representative -> counterparts with their own columns
        ilp = IlpBuilder()
        node_expr: dict[str, list[Expr]] = {}
        col_group: dict[int, tuple[int, ...]] = {}  # column -> the columns of its "exactly one of" (choices, edge pairs)
        edge_at: dict[tuple[str, int], int] = {}  # (consumer, input slot) -> its edge group
        value_expr: dict[Value, dict[Placements, Expr]] = {}
        # The edges of a value read by one consumer in its region may be flows over the layout graph: no
        # other consumer shares their collectives, so the cheapest path is all they cost.
        readers: dict[tuple[Value, str | None], int] = {}
        for name, ns in table.nodes.items():
            for value in ns.inputs:
                readers[(value, regions.get(name))] = readers.get((value, regions.get(name)), 0) + 1
        flows: dict[int, tuple] = {}  # first arc column -> (made, needed, arcs), for `_recompute`
        # (`pooled`) the reads of a value in one region to price as flows: (value, region) -> (consumer, slot,
        # producer, needed, structure) per read; their flows' first arc columns; (not `pooled`) the pair columns
        # of the reads the twin would pool
        reads: dict[tuple[Value, str | None], list[tuple]] = {}
        kept: set[tuple[Value, str | None]] = set()  # (value, region) with a read the twin cannot pool
        pooled_flows: dict[tuple, int] = {}
        pooled_columns = 0

        # Nodes of tied layers share their strategy list (its variant) and their columns with an earlier
        # twin, so what is derived from (strategies, columns) is derived once and looked up after that:
        # hashing placements is most of the work of building the program for a deep model.
        memo: dict[tuple, object] = {}

        def publish(name: str) -> None:
            ns = table.nodes[name]
            for k in range(len(ns.outputs)):
                key = ("out", ns.variant, k, tuple(node_expr[name]))
                if key not in memo:
                    groups: dict[Placements, list[int]] = {}
                    for s, expr in zip(ns.strategies, node_expr[name]):
                        if s.outputs[k] is not None:
                            groups.setdefault(s.outputs[k], []).extend(expr)
                    memo[key] = {ps: tuple(cols) for ps, cols in groups.items()}
                value_expr[(name, k)] = memo[key]

        def follows(ns, producer: dict) -> bool:
            key = ("follows", ns.variant, id(producer))  # `producer` is a memo entry: alive, so its id is its own
            if key not in memo:
                memo[key] = follows_input(ns, producer)
            return memo[key]

        def followed(ns, producer: dict) -> list[Expr]:
            """A follower's columns per strategy: its producer's for the placements it takes as they come."""
            key = ("followed", ns.variant, id(producer))
            if key not in memo:
                memo[key] = [producer.get(s.inputs[0], ()) for s in ns.strategies]
            return memo[key]

        # Layouts as small integers, for the keys that pool the consumers of a value reading one resharding:
        # hashing a pair of placements tuples per term and consumer was a quarter of all hashing in a 3-D search.
        layout_ids: dict[Placements, int] = {}

        def _flow_terms(value: Value, producer: dict, needed: dict, arcs, structure: tuple):
            """Terms pricing one edge as a unit of flow over `arcs` (the layout graph's arcs on cheapest
            paths from a made to a needed layout): per layout v, flow in - flow out = [needed v] - [made v].
            For chosen layouts a and b the cheapest flow is the cheapest path, exactly the pair's cost; the
            relaxation is the same transport problem over the same distances as the pair form's."""
            key = ("flow", structure, costs.value_info[value])
            first = shared_edges.get(key)
            if first is None:
                first = shared_edges[key] = ilp.add_vars(len(arcs))
                flows[first] = (producer, needed, arcs)
                _add_flow_balance(ilp, producer, needed, arcs, range(first, first + len(arcs)))
            return [(first + k, arc.seconds, None) for k, arc in enumerate(arcs)], []

        def _edge_terms(value: Value, producer: dict, needed: dict, gradient: bool, structure: tuple, alone: bool,
                        chain_dim: int | None):
            """(column, seconds, (src, dst layout ids) or None) terms pricing one edge, with edge variables
            where both ends have choices; the placements where consumers of the value share the steps
            (`_shareable`); for a gradient, also (axis, column, share of a bucket) per bucketed all_reduce.
            `alone`: no other consumer in the region reads the value (a large edge may then be a flow).
            `chain_dim`: both ends are nodes of a chain priced fused (`CostTable.chains`) reducing this dim;
            a resharding between layouts that both keep it whole is forbidden (it would cut the chain)."""
            made, wanted = list(producer), list(needed)
            if chain_dim is None and alone and not gradient and len(made) > 1 and len(wanted) > 1 and len(made) * len(wanted) >= FLOW_MIN_PAIRS:
                arcs = layout_graph(costs.value_info[value], costs.mesh).between(made, wanted)
                if arcs is not None and len(arcs) < len(made) * len(wanted):
                    return _flow_terms(value, producer, needed, arcs, structure)
            # paths[i][k]: (seconds, shareable, steps) from made[i] to wanted[k]; None where no steps reach it;
            # looked up once per pair of placements (hashing placements is the slow part of building the
            # program). Away from gradients (whose bucketed all_reduces need the steps) a pair needs only its
            # seconds and whether its steps hold a collective, which the layout graph has for all pairs at once.
            table = None if gradient else costs.pair_table(value, made, wanted)
            if table is not None:
                inf = float("inf")
                paths = [[None if sec == inf else (sec, coll, ()) for sec, coll in zip(sec_row, coll_row)]
                         for sec_row, coll_row in zip(table[0].tolist(), table[1].tolist())]
            else:
                paths = []
                for a in made:
                    row = costs.paths_from(value, a, gradient)
                    found = [(0.0, ()) if a == r else row.get(r) for r in wanted]
                    paths.append([None if p is None else (p[0], _shareable(p[1], gradient), p[1]) for p in found])
            if len(made) == 1:
                pairs = [(col, 0, k) for k, rcols in enumerate(needed.values()) for col in rcols]
            elif len(wanted) == 1:
                pairs = [(col, i, 0) for i, acols in enumerate(producer.values()) for col in acols]
            else:
                e = shared_edges.get(structure)
                if e is None:
                    first = ilp.add_vars(len(made) * len(wanted))  # e[i * len(wanted) + k]: made[i] -> wanted[k]
                    e = shared_edges[structure] = range(first, first + len(made) * len(wanted))
                    col_group.update(dict.fromkeys(e, tuple(e)))
                    for i, acols in enumerate(producer.values()):
                        ilp.add_eq([(e[i * len(wanted) + k], 1.0) for k in range(len(wanted))] + [(c, -1.0) for c in acols], 0.0)
                    for k, rcols in enumerate(needed.values()):
                        ilp.add_eq([(e[i * len(wanted) + k], 1.0) for i in range(len(made))] + [(c, -1.0) for c in rcols], 0.0)
                pairs = ((col, i, k) for col, (i, k) in zip(e, itertools.product(range(len(made)), range(len(wanted)))))
            terms, shares = [], []
            rank = len(costs.value_info[value].shape)
            made_ids = [layout_ids.setdefault(a, len(layout_ids)) for a in made]
            wanted_ids = [layout_ids.setdefault(r, len(layout_ids)) for r in wanted]
            for col, i, k in pairs:
                path = paths[i][k]
                if path is None:  # no sequence of steps turns a into r (e.g. into P(avg)): not an option
                    ilp.forbid(col)
                    continue
                if chain_dim is not None and made[i] != wanted[k] and \
                        keeps_whole(made[i], chain_dim, rank) and keeps_whole(wanted[k], chain_dim, rank):
                    ilp.forbid(col)
                    continue
                seconds, shareable, steps = path
                for step in steps if gradient and costs.bucket_bytes else ():
                    if step.kind == "all_reduce":  # its latency share moves to the per-axis bucket floor
                        share = bucket_share(step.in_bytes, costs.bucket_bytes)
                        seconds -= share * costs.mesh.links[step.axis].alpha_beta("all_reduce")[0]
                        shares.append((step.axis, col, share))
                terms.append((col, seconds, (made_ids[i], wanted_ids[k]) if shareable else None))
            return terms, shares

        def _edges(name: str, ns, exprs: list[Expr]) -> None:
            """Resharding costs of every input of a node whose strategies are chosen by `exprs`. Edges of
            tied layers have the same columns on both ends, hence the same placements (equal strategies,
            output index and slot fixed) and, for the same tensor, the same terms: priced once, counted."""
            exprs_key = tuple(exprs)
            for j, value in enumerate(ns.inputs):
                producer = value_expr[value]
                key = ("in", ns.variant, j, exprs_key)
                if key not in memo:
                    needed: dict[Placements, list[int]] = {}
                    for s, expr in zip(ns.strategies, exprs):
                        needed.setdefault(s.inputs[j], []).extend(expr)
                    memo[key] = needed, tuple(tuple(rcols) for rcols in needed.values())
                needed, needed_cols = memo[key]
                gradient = is_gradient_sink(ns)  # a parameter's gradient leaving
                structure = (value[1], j, tuple(producer.values()), needed_cols)
                alone = readers.get((value, regions.get(name))) == 1
                chain = costs.chains.get(name)
                chain_dim = chain[1] if chain is not None and costs.chains.get(value[0]) == chain else None
                poolable = not alone and not gradient and chain_dim is None and \
                    isinstance(costs.value_info[value], TensorInfo)
                if pooled and poolable:  # (priced with the value's other reads in the region, below)
                    reads.setdefault((value, regions.get(name)), []).append((name, j, producer, needed, structure))
                    continue
                if pooled and not alone:  # (a read that shares the value's reshardings as they are priced here:
                    kept.add((value, regions.get(name)))  # the others keep theirs too, below)
                _edge(name, j, value, producer, needed, gradient, structure, alone, chain_dim, poolable)

        def _edge(name, j, value, producer, needed, gradient, structure, alone, chain_dim, poolable) -> None:
            nonlocal pooled_columns
            group = (structure, costs.value_info[value], gradient, alone, chain_dim)
            if group not in group_index:
                group_index[group] = len(edge_groups)
                before = len(ilp.cost)
                edge_groups.append(_edge_terms(value, producer, needed, gradient, structure, alone, chain_dim))
                if poolable:
                    pooled_columns += len(ilp.cost) - before
            uses.setdefault(value, []).append((group_index[group], regions.get(name)))
            edge_at[(name, j)] = group_index[group]

        def _pool(value: Value, group_reads: list[tuple]) -> bool:
            """Each of the k reads of `value` in one region as a unit of flow over the layout graph, from the
            layout it is made in to the one the read needs, its arcs at 1/k of their cost (see `_Program`);
            its edge has no terms of its own. False (nothing added) where some read's layouts are not all
            vertices of the layout graph."""
            info, share = costs.value_info[value], 1.0 / len(group_reads)
            graph = layout_graph(info, costs.mesh)
            arcs = [graph.between(list(producer), list(needed)) for _, _, producer, needed, _ in group_reads]
            if any(a is None for a in arcs):
                return False
            for (name, j, producer, needed, structure), read_arcs in zip(group_reads, arcs):
                key = (structure, info, tuple(producer), tuple(needed))
                first = pooled_flows.get(key)
                if first is None:  # (tied layers' reads have the same columns: one flow, priced for each)
                    first = pooled_flows[key] = ilp.add_vars(len(read_arcs))
                    _add_flow_balance(ilp, producer, needed, read_arcs, range(first, first + len(read_arcs)))
                for g, arc in enumerate(read_arcs, start=first):
                    ilp.add_cost(g, arc.seconds * share)
                edge_at[(name, j)] = no_terms
            return True

        for name, ns in table.nodes.items():
            node_cost = costs.node_costs.get(name, [0.0] * len(ns.strategies))
            if ns.source == "follow" or ns.source != "placeholder" and ns.inputs and follows(ns, value_expr[ns.inputs[0]]):
                # a getitem always takes its element as the producer makes it (code generation reshards
                # nothing between them); a placement its producer no longer offers is never chosen
                src = value_expr[ns.inputs[0]]
                node_expr[name] = followed(ns, src)
                for expr, c in zip(node_expr[name], node_cost):
                    for col in expr:
                        ilp.add_cost(col, c)
                publish(name)
                continue
            if not ns.strategies:
                raise SpmdInternalError(f"node {name} has no strategy")
            rep = rep_of.get(name)
            seen = variants.setdefault(rep, [rep] if rep in own_vars else []) if rep is not None else []
            twin = next((v for v in seen if table.nodes[v].variant == ns.variant or
                         table.nodes[v].strategies == ns.strategies), None)
            if twin is not None:  # an identical node of an earlier layer: the same choice, its columns
                cols = [expr[0] for expr in node_expr[twin]]
                for col, c in zip(cols, node_cost):
                    ilp.add_cost(col, c)
            else:
                seen.append(name)
                cols = [ilp.add_var(c, binary=True) for c in node_cost]
                ilp.add_eq([(c, 1.0) for c in cols], 1.0)
                col_group.update(dict.fromkeys(cols, tuple(cols)))
            own_vars.add(name)
            node_expr[name] = [(c,) for c in cols]
            _edges(name, ns, node_expr[name])
            publish(name)

        no_terms = len(edge_groups)
        edge_groups.append(([], []))
        for (value, region), group_reads in reads.items():
            if (value, region) in kept or not _pool(value, group_reads):  # (then every read keeps its edge)
                for name, j, producer, needed, structure in group_reads:
                    _edge(name, j, value, producer, needed, False, structure, False, None, True)

        # Values of tied layers have the same edges on the same columns: priced once, counted.
        pools: dict[tuple, int] = {}
        for value_uses in uses.values():
            pools[tuple(value_uses)] = pools.get(tuple(value_uses), 0) + 1
        buckets: dict[int, list[tuple[int, float]]] = {}  # mesh axis -> (column, bucket share)
        for value_uses, count in pools.items():
            # (region, src, dst) -> (seconds, per consumer the columns selecting it: at most one is 1)
            by_pair: dict[tuple, tuple[float, dict[int, list[int]]]] = {}
            for use, (group, region) in enumerate(value_uses):
                terms, shares = edge_groups[group]
                for axis, col, share in shares:
                    buckets.setdefault(axis, []).append((col, share * count))
                for col, seconds, pair in terms:
                    if pair is None:
                        ilp.add_cost(col, seconds * count)
                    else:
                        by_pair.setdefault((region, *pair), (seconds, {}))[1].setdefault(use, []).append(col)
            for (_, made, _), (seconds, per_use) in by_pair.items():  # paid once
                ilp.add_shared(seconds * count, list(per_use.values()), family=value_uses, part=made)
        _bucket_latency(ilp, buckets, costs)

        # Ties: both nodes pick the same placements. The parameters of tied layers and their gradients have
        # their twins' columns (equal columns mean equal strategies), so their rows are the same rows, added
        # once (63 of the 76 ties of the 1.1B's programs).
        tied: set[tuple] = set()
        for name, ns in table.nodes.items():
            if ns.tie is None:
                continue
            key = (tuple(node_expr[name]), tuple(node_expr[ns.tie]))
            if key in tied:
                continue
            tied.add(key)
            other = table.nodes[ns.tie]
            mine, theirs = _by_key(ns, node_expr[name]), _by_key(other, node_expr[ns.tie])
            for ps in dict.fromkeys([*mine, *theirs]):  # ordered: rows must be the same on every rank
                ilp.add_eq([(c, 1.0) for c in mine.get(ps, ())] + [(c, -1.0) for c in theirs.get(ps, ())], 0.0)

        # The budget row: what one rank holds when backward starts (parameters, optimizer state, buffers, inputs,
        # saved activations). The gradients come later, as backward frees activations: the schedule holds each
        # from the node that makes it (`Schedule`), and all of them with the persistent terms, when backward
        # ends, are a second row, kept in the program (the price search's relaxation drops it where it makes
        # the relaxation too hard: `Budget.droppable`). (Without a schedule, the row counts them too.)
        # Only a budget, or recomputation (which takes what it frees off the row), reads them.
        memory_row: dict[int, float] = {}
        ending: dict[int, float] = {}
        recomputing = bool(recompute) and (memory_budget is not None and recompute.mode == "auto" or
                                           recompute.mode in ("all", "selective"))
        for term in costs.memory if memory_budget is not None or recomputing else ():
            for ps, expr in value_expr[term.value].items():
                b = term.bytes(ps, mesh_shape) if expr else 0.0
                for col in expr:
                    if term.kind != "activations":
                        ending[col] = ending.get(col, 0.0) + b
                    if term.kind not in AT_THE_STEP or schedule is None:
                        memory_row[col] = memory_row.get(col, 0.0) + b
        droppable = ()
        if memory_budget is not None and schedule is not None and any(t.kind == "gradients" for t in costs.memory):
            droppable = (ilp.add_le(sorted(ending.items()), memory_budget),)

        copies = _saved_copies(ilp, table, costs, node_expr, value_expr, saved, forward_readers, memory_row) \
            if saved and memory_budget is not None else {}

        counts: list[tuple[list, list[int]]] = []  # per stack, the (whole, selective) counts allowed and their columns
        rebuilds: list[Rebuild] = []  # per recomputable layer and way, for the cuts
        if recomputing:
            counts = _recompute(ilp, recompute, table, costs, node_expr, value_expr, col_group, edge_at, edge_groups,
                                memory_row, flows, copies, rebuilds)
        last_stack = _last_stack(recompute, table) if counts else 0  # (its last layer, recomputed, frees nothing)
        return _Program(ilp, node_expr, value_expr, memory_row, droppable, copies, counts, rebuilds, last_stack,
                        pooled_columns, ending)

    program = build(pooled=False)
    ilp, node_expr, value_expr, memory_row, droppable = (program.ilp, program.node_expr, program.value_expr,
                                                         program.memory_row, program.droppable)
    copies, counts, rebuilds, last_stack = program.copies, program.counts, program.rebuilds, program.last_stack
    copy_cols = frozenset(z for kept in copies.values() for z, *_ in kept)

    # Every (node, strategy) pair's columns, flat, to read a solution's choices with numpy (the search
    # reads a plan from each candidate it checks whole)
    # (lists extended in C per node: a 70B-shaped model's search has ~370k pairs per program)
    strategies_per_node, columns_per_pair, cols = [], [], []
    for name in table.nodes:
        exprs = node_expr[name]
        strategies_per_node.append(len(exprs))
        columns_per_pair.extend(map(len, exprs))
        cols.extend(itertools.chain.from_iterable(exprs))
    pairs = len(columns_per_pair)
    pair_node = np.repeat(np.arange(len(strategies_per_node), dtype=np.int64), strategies_per_node)
    first_pair = np.cumsum(strategies_per_node, dtype=np.int64) - strategies_per_node
    pair_strategy = np.arange(pairs, dtype=np.int64) - np.repeat(first_pair, strategies_per_node)
    pair_of_col = np.repeat(np.arange(pairs, dtype=np.int64), columns_per_pair)
    col_of = np.asarray(cols, dtype=np.int64)

    resharding: dict[tuple, tuple] = {}  # (tensor, output, maker's and reader's strategies, slot, gradient) -> (src, dst, steps, s)

    def to_plan(x, result) -> Plan:
        """The plan a solution vector makes (`result`: the solve's figures, None while searching)."""
        chosen_pairs = np.bincount(pair_of_col, weights=np.asarray(x, dtype=float)[col_of],
                                   minlength=len(pair_node)) > 0.5
        per_node = np.bincount(pair_node[chosen_pairs], minlength=len(table.nodes))
        if np.any(per_node != 1):
            n = int(np.flatnonzero(per_node != 1)[0])
            raise SpmdInternalError(f"solve_placements: node {list(table.nodes)[n]} has {per_node[n]} chosen strategies")
        choices, chosen_cost = {}, {}
        for (name, ns), i in zip(table.nodes.items(), pair_strategy[chosen_pairs].tolist()):
            choices[name] = ns.strategies[i]
            chosen_cost[name] = costs.node_costs[name][i] if name in costs.node_costs else 0.0

        edges, made, bucketed = [], set(), {}
        for name, ns in table.nodes.items():
            gradient = is_gradient_sink(ns)
            for j, value in enumerate(ns.inputs):
                # (strategies are the table's own objects, alive through the solve: their ids are keys; the
                # steps depend on the tensor, not on which one: tied layers' edges are worked out once)
                key = (costs.value_info[value], value[1], id(choices[value[0]]), id(choices[name]), j, gradient)
                found = resharding.get(key)
                if found is None:
                    src, dst = choices[value[0]].outputs[value[1]], choices[name].inputs[j]
                    found = resharding[key] = (src, dst, () if src == dst else costs.redistribute(
                        value, src, dst, gradient), 0.0 if src == dst else costs.edge_cost(value, src, dst, gradient))
                src, dst, steps, cost = found
                if src != dst:
                    key = (value, dst, regions.get(name))
                    shared = key in made and _shareable(steps, gradient)  # as the program prices it
                    made.add(key)
                    edges.append(Edge(value, name, j, src, dst, steps, 0.0 if shared else cost, shared))
                    if gradient and costs.bucket_bytes and not shared:
                        for step in steps:
                            if step.kind == "all_reduce":  # (their shares of a launch, as the program prices them)
                                row = bucketed.setdefault(costs.mesh.axis_names[step.axis], [0, 0])
                                row[0] += 1
                                row[1] += bucket_share(step.in_bytes, costs.bucket_bytes)
        stats = {} if result is None else {"binary": result.n_binary, "continuous": result.n_continuous,
                                           "rows": result.n_rows, "status": result.status}
        if bucketed:  # {axis: [gradient all_reduces, their shares of a launch, launches]}: explain's count
            stats["gradient_all_reduces"] = {axis: [n, shares, max(1, math.ceil(shares - 1e-9))]
                                             for axis, (n, shares) in bucketed.items()}
        memory: dict[str, float] = {}
        for term in costs.memory:
            src = choices[term.value[0]]
            ps = src.outputs[term.value[1]] if table.nodes[term.value[0]].source != "output" else src.inputs[0]
            memory[term.kind] = memory.get(term.kind, 0.0) + term.bytes(ps, mesh_shape)
        kept_by = [e for e in edges if e.consumer in saved]  # reading copies kept for backward
        kept = dict.fromkeys((e.value, e.dst) for e in kept_by)
        if kept:
            memory["activations"] = memory.get("activations", 0.0) + sum(
                costs.value_info[v].nbytes / pieces(dst, mesh_shape) for v, dst in kept)
        whole, selective, layers = [], [], []  # keys recomputed whole, selectively; the regions run again
        freeing = []  # the regions run again that free their copies (all but a stack's held last layer)
        by_reader: dict[str, list[Edge]] = {}
        for e in kept_by:
            by_reader.setdefault(e.consumer, []).append(e)
        for s, (stack, (pairs, cols)) in enumerate(zip(recompute.stacks if counts else (), counts)):
            k, j = next(pair for pair, c in zip(pairs, cols) if x[c] > 0.5)
            n = len(stack)
            whole += [layer.key for layer in stack[:k]]
            selective += [layer.key for layer in stack[n - j:]]
            redone = [*stack[:k], *(layer.selective for layer in stack[n - j:])]
            if s == last_stack and (j or k == n):  # the last layer, recomputed, frees nothing (as `_recompute`)
                redone[-1] = dataclasses.replace(redone[-1], frees=())
                freeing += redone[:-1]
            else:
                freeing += redone
            layers += redone
        redo_s, freed = recompute_figures(layers, choices, chosen_cost, edges, costs) if layers else (0.0, 0.0)
        # a recomputed layer (not the last) keeps no copy for backward whose value only its region reads
        # in forward (as `_price_run` prices it)
        gone = {}
        for layer in freeing:
            region = set(layer.nodes)
            gone.update(dict.fromkeys((e.value, e.dst) for name in layer.nodes for e in by_reader.get(name, ())
                                      if forward_readers.get(e.value, frozenset()) <= region))
        freed += sum(costs.value_info[v].nbytes / pieces(dst, mesh_shape) for v, dst in gone)
        if layers:
            memory["activations"] = memory.get("activations", 0.0) - freed
        figures = (0.0, 0.0, 0.0, 0.0) if result is None else (result.objective, result.lower_bound, result.gap,
                                                               result.seconds)
        return Plan(costs.mesh, choices, chosen_cost, tuple(edges), *figures, stats, dict(labels or {}), memory,
                    memory_budget, joint=costs.bucket_bytes is not None, recompute=tuple(whole),
                    recompute_cost=redo_s, recomputed_bytes=freed, recompute_selective=tuple(selective))

    budget = None
    if memory_budget is not None:
        # the plans asked about last (by their binary columns: a plan is its choices): (plan, (temporaries,
        # worst point)). Making a plan and walking it take ~0.3 s on LLaMA3-8B, and the search asks again
        # of plans it holds (the polishes' starts): 16 walks where 9 plans were asked about.
        walked: dict[bytes, tuple] = {}
        binary = np.asarray(ilp.integral, dtype=bool)

        def walked_plan(x) -> tuple:
            key = np.round(np.asarray(x)[:len(binary)][binary]).astype(np.int8).tobytes()
            if key in walked:
                walked[key] = walked.pop(key)  # (the last asked is the last evicted)
            else:
                plan = to_plan(x, None)
                walked[key] = plan, schedule.temporaries(plan, rebuilt_regions(plan, recompute))
                if len(walked) > WALKS_KEPT:
                    del walked[next(iter(walked))]
            return walked[key]

        # the ending row less the budget row, per column, where the step's temporaries are counted
        beyond = {c: program.ending.get(c, 0.0) - memory_row.get(c, 0.0) for c in {*program.ending, *memory_row}} \
            if any(t.kind == "optimizer step" for t in costs.memory) else None

        def over_at_step(x) -> float:
            """What the optimizer's step holds (the ending row: every gradient and the step's temporaries) beyond
            the budget row, where the step's temporaries are counted: the search judges a plan by its row and
            extra, and the ending row alone is dropped from its relaxations (a review: a plan over at the step
            came back, warned as the leanest, where one that fits existed)."""
            return -math.inf if beyond is None else sum(b * x[c] for c, b in beyond.items())

        def walk(x) -> tuple[float, LivePoint | None]:
            extra, worst = walked_plan(x)[1]
            return max(extra, over_at_step(x)), worst

        def cuts(x) -> tuple[Cut, ...]:
            """A cut at each hill of x's schedule over the budget, the worst first (`CUT_POINTS` at most)."""
            plan, (extra, worst) = walked_plan(x)
            row = sum(b * x[c] for c, b in memory_row.items())
            step = (Cut(tuple(sorted(program.ending.items()))),) \
                if row + over_at_step(x) > memory_budget * (1 + 1e-9) else ()  # (the step's row, as a cut)
            if worst is None:
                return step
            # a point is over when row - saved activations + what is alive there > budget
            level = memory_budget - row + plan.memory.get("activations", 0.0)
            points = schedule.hills(plan, level, CUT_POINTS, rebuilt_regions(plan, recompute)) or [worst]
            if not by_phase:  # (once per solve, at the first cut)
                by_phase.update(_readers_by_phase(table, schedule, regions))
            if rebuilds and not spans:  # (once per solve) where each layer's copy would be alive
                for r in rebuilds:
                    (moved, again, dies), _, _ = schedule.rebuilt_lives((r.region,))
                    if again:
                        region = set(r.region)
                        ends = {root.name: i for i, roots in moved.items() for root in roots if root.name in region}
                        spans.append((min(again), max(dies), r, ends))
            return step + tuple(_cut(point, schedule, table, costs, node_expr, value_expr, memory_row, by_phase,
                                     copy_cols, tuple(spans)) for point in points)

        by_phase: dict = {}
        spans: list = []  # (where a recomputed layer's copy starts, ends, its `Rebuild`, its values' forward ends)
        held = {term.value[0] for term in costs.memory
                if term.kind in ("parameters", "gradients", "optimizer", "optimizer step")}
        held |= {name for name, ns in table.nodes.items() if ns.tie in held}  # (a gradient equals its parameter)
        weights_only = tuple(sorted({c for name in held for expr in node_expr[name] for c in expr}))
        budget = Budget(memory_row, memory_budget, None if schedule is None else lambda x: walk(x)[0],
                        weights_only=weights_only,
                        polish=tuple(c for _, cols in counts for c in cols), cuts=None if schedule is None else cuts,
                        droppable=droppable)

    twin = None  # (the price search's program and budget row, where pooling the reads shrinks it: see `_Program`)
    if budget is not None and program.pooled_columns >= POOLED_SHARE * len(ilp.cost):
        pooled = build(pooled=True)
        twin = pooled.ilp, Budget(pooled.memory_row, memory_budget, droppable=pooled.droppable)
    result = ilp.solve(time_limit=time_limit, on_progress=on_progress, budget=budget, twin=twin)
    if result.objective == float("inf"):
        if memory_budget is not None:
            least = {}  # each kind sharded as far as the mesh allows
            for t in costs.memory:
                least[t.kind] = least.get(t.kind, 0.0) + t.bytes(tuple(_shard_all(t.info, mesh_shape)), mesh_shape)
            held = sum(b for k, b in least.items() if k not in (*AT_THE_STEP, "activations"))
            grads, acts = sum(least.get(k, 0.0) for k in AT_THE_STEP), least.get("activations", 0.0)
            floor = held + (max(grads, acts) if schedule is not None else grads + acts)
            # what every plan needs: the floor, or with recomputation (which frees saved activations) what is
            # alive when backward ends; above the budget, nothing fits (a proof the search may not have)
            proof = held + grads if counts and schedule is not None else floor
            if result.status.startswith(("Out of time", "Not found")) and proof <= memory_budget:
                how = (f"ran out of its {time_limit:g} s" if result.status.startswith("Out of time") else
                       "gave up after its rounds of cuts")
                raise SpmdError(
                    f"solve_placements: the search {how} before it found a plan that "
                    f"fits memory_budget={format_bytes(memory_budget)} per rank. That is not proven impossible: "
                    f"sharding every tensor as far as the mesh allows needs about {format_bytes(floor)} "
                    f"({result.status}; a program of {result.n_binary} binary and {result.n_continuous} continuous "
                    "columns). What to do: pin the largest parameters sharded (param_placements=) so the search "
                    "starts nearer a fitting plan, give it more time (solver_time_limit=), raise the budget, or plan "
                    "a smaller batch.")
            raise SpmdError(
                f"solve_placements: no plan fits memory_budget={format_bytes(memory_budget)} per rank "
                f"(even sharding every tensor as far as the mesh allows needs about {format_bytes(floor)}). "
                "What to do: raise the budget, use a bigger mesh, or a smaller batch.")
        slow = "time limit" in result.status.lower() or result.status.startswith("Out of time")
        raise SpmdError(
            f"solve_placements: the solver found no plan ({result.status}) for a program of {result.n_binary} "
            f"binary and {result.n_continuous} continuous columns (most of them the layout pairs of edges: a mesh "
            "with more axes has many more layouts per value). What to do: "
            + (f"give it more time (solver_time_limit=, {time_limit:g} s now: a slow or loaded host takes longer), "
               "or " if slow else "") + "pin the inputs and the largest weights "
            "(in_placements=, param_placements=) so fewer layouts remain, pass merge_followers=True (a smaller "
            "program, near-optimal plans), or plan on a mesh with fewer axes.")
    return to_plan(result.values, result)
