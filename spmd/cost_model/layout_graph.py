"""The layouts of one tensor on a mesh as a graph: a vertex per even layout, an arc per single legal step
(`redistribute.single_steps`, priced by `comm.step_cost`), and the cheapest distance between every two.

`comm.reshard_paths` answers "from this layout, the cheapest steps to every other" one source at a time
(Dijkstra over exactly these arcs). The solver asks the other question: for an edge whose producer may
make any layout of A and whose consumer may need any of B, which steps can lie on a cheapest path from
some a to some b? Those arcs carry a unit of flow from the producer's choice to the consumer's
(solve_placements), and a program of arcs is far smaller than one of (a, b) pairs on meshes with
three axes: a 4-D activation has 216 layouts on a (4, 4, 4) mesh, so 46,656 pairs, but a few thousand
arcs, of which the cheapest paths use a fraction.

Only layouts whose Partials are sums are vertices: that is the graph `reshard_paths` searches from
any such source (its Partial targets are Partial(sum) and the source's own), so distances here equal
its distances. Edges touching another reduction keep the pair formulation.

`cheapest_paths` is what the cost table asks (layout -> (seconds, steps) from one source): from this
graph's distances and first arcs, one graph per tensor shape instead of one Dijkstra per source (on a
(4, 4, 4) mesh a program asks for thousands of sources), and `pair_table` gives a whole edge's
(made, needed) seconds and "holds a collective" at once. Paths follow the first arcs Floyd-Warshall
kept (the earliest arc, in breadth-first order, among equally cheap ones): the same on every rank.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from torch.distributed.tensor import Partial, Replicate

from spmd.core.redistribute import Step, single_steps
from spmd.core.specs import Placements, TensorInfo
from spmd.cost_model.comm import reshard_paths, step_cost


@dataclass(frozen=True, slots=True)
class Arc:
    """One legal step from layout `src` to layout `dst` and its seconds."""

    src: Placements
    dst: Placements
    step: Step
    seconds: float


class LayoutGraph:
    """Every even layout of `tensor` reachable from Replicate on `mesh` (Partials: sums only), the single
    steps between them, and all-pairs cheapest distances (`dist[i, j]`, seconds; inf where none)."""

    def __init__(self, tensor: TensorInfo, mesh, bucket_bytes: float | None = None):
        start = tuple(Replicate() for _ in mesh.shape)
        self.layouts: list[Placements] = [start]
        self.index: dict[Placements, int] = {start: 0}
        self.arcs: list[Arc] = []
        k = 0
        while k < len(self.layouts):  # breadth first, in a fixed order: equal on every rank
            cur = self.layouts[k]
            k += 1
            for nxt, step in single_steps(cur, tensor, mesh, [Partial("sum")]):
                self.arcs.append(Arc(cur, nxt, step, step_cost(step, mesh, bucket_bytes)))
                if nxt not in self.index:
                    self.index[nxt] = len(self.layouts)
                    self.layouts.append(nxt)
        n = len(self.layouts)
        self._u = np.array([self.index[a.src] for a in self.arcs], dtype=np.int64)
        self._v = np.array([self.index[a.dst] for a in self.arcs], dtype=np.int64)
        self._c = np.array([a.seconds for a in self.arcs], dtype=float)
        dist = np.full((n, n), np.inf)
        np.fill_diagonal(dist, 0.0)
        first = np.full((n, n), -1, dtype=np.int64)  # the first arc of the kept cheapest path i -> j
        for k, (u, v, c) in enumerate(zip(self._u.tolist(), self._v.tolist(), self._c.tolist())):
            if c < dist[u, v] - _TIE:
                dist[u, v], first[u, v] = c, k
        for m in range(n):  # Floyd-Warshall, a row of numpy per intermediate layout
            via = dist[:, m:m + 1] + dist[m:m + 1, :]
            better = via < dist - _TIE
            np.copyto(dist, via, where=better)
            np.copyto(first, np.broadcast_to(first[:, m:m + 1], first.shape), where=better)
        self.dist, self._first = dist, first
        self._collective = None

    @property
    def collective(self) -> np.ndarray:
        """collective[i, j]: the kept path i -> j holds a collective (not only local slices)."""
        if self._collective is None:
            n = len(self.layouts)
            arc_collective = np.array([a.step.is_collective for a in self.arcs] + [False], dtype=bool)
            at = np.broadcast_to(np.arange(n)[:, None], (n, n)).copy()
            target = np.broadcast_to(np.arange(n)[None, :], (n, n))
            found = np.zeros((n, n), dtype=bool)
            while True:  # walk every path at once, an arc per round
                arc = self._first[at, target]
                moving = (at != target) & (arc >= 0)
                if not moving.any():
                    break
                found |= moving & arc_collective[arc]
                at = np.where(moving, self._v[arc], at)
            self._collective = found
        return self._collective

    def steps(self, i: int, j: int) -> tuple[Step, ...]:
        """The steps of the kept cheapest path from layout i to layout j."""
        out = []
        while i != j:
            k = int(self._first[i, j])
            out.append(self.arcs[k].step)
            i = int(self._v[k])
        return tuple(out)

    def pair_table(self, sources, targets) -> tuple[np.ndarray, np.ndarray] | None:
        """(seconds, holds a collective) for every (source, target) pair, inf seconds where none; None if a
        layout is not a vertex."""
        try:
            a = [self.index[tuple(s)] for s in sources]
            b = [self.index[tuple(t)] for t in targets]
        except KeyError:
            return None
        return self.dist[np.ix_(a, b)], self.collective[np.ix_(a, b)]

    def between(self, sources, targets) -> tuple[Arc, ...] | None:
        """The arcs that can lie on a cheapest path from one of `sources` to one of `targets`: those
        tight from some source (dist[a, u] + c = dist[a, v]) and tight towards some target
        (c + dist[v, b] = dist[u, b]). Every cheapest path keeps all its arcs, so a flow over these
        costs exactly the cheapest redistribution. None if a layout is not a vertex here (another
        reduction, or an uneven one)."""
        try:
            a = np.array([self.index[tuple(s)] for s in sources], dtype=np.int64)
            b = np.array([self.index[tuple(t)] for t in targets], dtype=np.int64)
        except KeyError:
            return None
        u, v, c = self._u, self._v, self._c
        da_u, da_v = self.dist[a][:, u], self.dist[a][:, v]
        from_source = (np.isfinite(da_u) & (da_u + c <= da_v * (1 + 1e-9) + 1e-15)).any(axis=0)
        db_u, db_v = self.dist[:, b][u].T, self.dist[:, b][v].T
        to_target = (np.isfinite(db_v) & (c + db_v <= db_u * (1 + 1e-9) + 1e-15)).any(axis=0)
        return tuple(self.arcs[i] for i in np.flatnonzero(from_source & to_target))


_TIE = 1e-15  # seconds: a path must be cheaper than this to replace one found before


def layout_graph(tensor: TensorInfo, mesh, bucket_bytes: float | None = None) -> LayoutGraph:
    """The tensor's graph, built once per (tensor, mesh, bucket size) however the call spells them
    (`lru_cache` keys `f(t, m)` and `f(t, m, None)` apart: every graph of a 70B-shaped search was
    built twice, 0.37 s)."""
    return _layout_graph(tensor, mesh, bucket_bytes)


@functools.lru_cache(maxsize=4096)
def _layout_graph(tensor: TensorInfo, mesh, bucket_bytes: float | None) -> LayoutGraph:
    return LayoutGraph(tensor, mesh, bucket_bytes)


class _Paths(Mapping):
    """layout -> (seconds, steps) from one source, each path built when first asked for."""

    def __init__(self, graph: LayoutGraph, source: int):
        self._graph, self._source = graph, source
        self._row = graph.dist[source]
        self._reached = [graph.layouts[j] for j in np.flatnonzero(np.isfinite(self._row))]
        self._built: dict = {}

    def __getitem__(self, layout):
        found = self._built.get(layout)
        if found is None:
            j = self._graph.index.get(layout)
            if j is None or not np.isfinite(self._row[j]):
                raise KeyError(layout)
            found = self._built[layout] = (float(self._row[j]), self._graph.steps(self._source, j))
        return found

    def __iter__(self):
        return iter(self._reached)

    def __len__(self) -> int:
        return len(self._reached)


@functools.lru_cache(maxsize=65536)
def cheapest_paths(src: Placements, tensor: TensorInfo, mesh, bucket_bytes: float | None = None) -> Mapping:
    """layout -> (seconds, steps) for every layout reachable from `src`, as `comm.reshard_paths` answers
    it (same distances), out of the tensor's layout graph; sources with a non-sum Partial are searched
    on their own (`reshard_paths`)."""
    graph = layout_graph(tensor, mesh, bucket_bytes)
    i = graph.index.get(tuple(src))
    if i is None:
        return reshard_paths(tuple(src), tensor, mesh, bucket_bytes)
    return _Paths(graph, i)
