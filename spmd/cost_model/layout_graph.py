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
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from torch.distributed.tensor import Partial, Replicate

from spmd.core.redistribute import Step, single_steps
from spmd.core.specs import Placements, TensorInfo
from spmd.cost_model.comm import step_cost


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
        np.minimum.at(dist, (self._u, self._v), self._c)
        for m in range(n):  # Floyd-Warshall, a row of numpy per intermediate layout
            np.minimum(dist, dist[:, m:m + 1] + dist[m:m + 1, :], out=dist)
        self.dist = dist

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


@functools.lru_cache(maxsize=4096)
def layout_graph(tensor: TensorInfo, mesh, bucket_bytes: float | None = None) -> LayoutGraph:
    return LayoutGraph(tensor, mesh, bucket_bytes)
