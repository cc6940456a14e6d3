"""Differences between two plans: placements, collectives, costs (`spmd.diff_plans`, `spmd diff a b`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from spmd.core.plan import Plan
from spmd.core.specs import Strategy, placements_str


@dataclass
class PlanDiff:
    """What changed from plan `a` to plan `b`. Falsy when nothing did."""

    mesh: tuple[str, str] | None = None
    placements: list[tuple[str, str, str]] = field(default_factory=list)  # (node or FQN, in a, in b)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    collectives: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)  # (kind, axis) -> counts
    # (kind, axis) -> bytes entering the collectives, where the counts agree and the bytes do not (another size)
    collective_bytes: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    # (kind, axis) -> bytes entering the collectives, where the counts differ (a probe: the counts alone were shown)
    counted_bytes: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    costs: dict[str, tuple[float, float]] = field(default_factory=dict)  # seconds / bytes in a and b
    recompute: list[tuple[str, str, str]] = field(default_factory=list)  # (layer, in a, in b)
    # the graphs differ (another model, or parameters added): ops were not compared node by node
    graphs_differ: bool = False
    # the same nodes, whose ops take other numbers or give other shapes (compared by the plans' graph digests)
    ops_differ: bool = False

    def __bool__(self) -> bool:
        return bool(self.layout_differs or self.collective_bytes or self.costs_differ or self.ops_differ)

    @property
    def layout_differs(self) -> bool:
        return bool(self.mesh or self.placements or self.only_a or self.only_b or self.collectives or self.recompute
                    or self.graphs_differ)

    @property
    def costs_differ(self) -> bool:
        """Whether a cost differs beyond rounding (another size, dtype, link or device profile, or option gives
        the same layouts at another price: a diff of GPT plans of hidden 64 and 128 said "the same")."""
        return any(abs(a - b) > 1e-9 * max(abs(a), abs(b), 1e-30) for a, b in self.costs.values())

    def __str__(self) -> str:
        if not self:
            return "plans are the same (placements, collectives and costs)"
        lines = []
        if not self.layout_differs:
            lines.append("placements and collectives are the same; the sizes or costs differ (another model size, "
                         "dtype, mesh profile or option):")
        if self.mesh:
            lines.append(f"mesh: {self.mesh[0]} -> {self.mesh[1]}")
        if self.placements:
            width = max(len(n) for n, _, _ in self.placements)
            lines.append(f"placements ({len(self.placements)} changed):")
            lines += [f"  {n:<{width}}  {a} -> {b}" for n, a, b in self.placements]
        if self.graphs_differ:
            lines.append("the graphs differ: parameters and inputs compared by name, ops not compared")
        if self.ops_differ:
            lines.append("the graphs' ops take other numbers or give other shapes (another configuration, such as the "
                         "number of heads, or another batch): compared node by node")
        if self.recompute:
            width = max(len(n) for n, _, _ in self.recompute)
            lines.append(f"recomputation ({len(self.recompute)} changed):")
            lines += [f"  {n:<{width}}  {a} -> {b}" for n, a, b in self.recompute]
        for what, names in (("only in a", self.only_a), ("only in b", self.only_b)):
            if names:
                lines.append(f"{what} ({len(names)}): " + ", ".join(names[:20]) + (" ..." if len(names) > 20 else ""))
        if self.collectives:
            lines.append("collectives:")
            moved = self.counted_bytes
            lines += [f"  {k} on {ax}: {a} -> {b} ({b - a:+d})" + (
                f", {moved[k, ax][0] / 2**10:.1f} -> {moved[k, ax][1] / 2**10:.1f} KiB" if (k, ax) in moved else "")
                for (k, ax), (a, b) in sorted(self.collectives.items())]
        if self.collective_bytes:
            lines.append("collective bytes (the same counts):")
            lines += [f"  {k} on {ax}: {a / 2**10:.1f} -> {b / 2**10:.1f} KiB"
                      for (k, ax), (a, b) in sorted(self.collective_bytes.items())]
        for name, (a, b) in self.costs.items():
            if name == "memory per rank":
                lines.append(f"{name}: {a / 2**20:.3f} -> {b / 2**20:.3f} MiB ({(b - a) / 2**20:+.3f})")
            else:
                lines.append(f"{name}: {a * 1e3:.3f} -> {b * 1e3:.3f} ms ({(b - a) * 1e3:+.3f})")
        return "\n".join(lines)


def _show(s: Strategy, other: Strategy | None) -> str:
    outs = ", ".join(placements_str(p) for p in s.outputs if p is not None)
    if other is not None and s.outputs == other.outputs and s.inputs or not outs:
        return f"{outs} (in {' '.join(placements_str(p) for p in s.inputs)})".lstrip()
    return outs


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    """Parameters and inputs are matched by name (FQN, argument name). Ops are matched by graph node name
    where both plans come from the same graph (the same node names, parameters and inputs in the same
    order); otherwise only parameters, inputs, collectives, recomputation and costs are compared."""
    d = PlanDiff()
    if a.mesh != b.mesh:
        d.mesh = (_mesh_text(a.mesh, b.mesh), _mesh_text(b.mesh, a.mesh))
    same_graph = list(a.choices) == list(b.choices) and \
        [a.labels.get(n) for n in a.choices] == [b.labels.get(n) for n in b.choices]
    d.graphs_differ = not same_graph
    # (the same nodes, whose ops take other numbers or give other shapes: another number of heads, causal or not)
    # (compared where both plans have one: a plan saved before the digest existed has none)
    d.ops_differ = same_graph and None not in (a.stats.get("graph"), b.stats.get("graph")) and \
        a.stats["graph"] != b.stats["graph"]

    def keyed(plan: Plan) -> dict[str, tuple]:
        return {plan.labels.get(n, n): s for n, s in plan.choices.items() if same_graph or n in plan.labels}

    ka, kb = keyed(a), keyed(b)
    # (on meshes of other shapes, a layout is compared by the pieces it makes: `[R, R]` on (2, 2) is `[R]` on (4,),
    # `[S(0), S(0)]` is `[S(0)]`; a probe saw every replicated weight listed as changed)
    same = (lambda sa, sb: sa == sb) if a.mesh.shape == b.mesh.shape else \
        (lambda sa, sb: _pieces(sa, a.mesh) == _pieces(sb, b.mesh))
    for label, sa in ka.items():
        sb = kb.get(label)
        if sb is None:
            d.only_a.append(label)
        elif not same(sa, sb):
            shown = (_show(sa, sb), _show(sb, sa))
            if shown[0] == shown[1]:  # (the same text on meshes of other sizes: `[S(0)]` in 4 pieces and in 2)
                shown = (f"{shown[0]} on {a.mesh}", f"{shown[1]} on {b.mesh}")
            d.placements.append((label, *shown))
    d.only_b = [label for label in kb if label not in ka]
    how = lambda plan, layer: ("recomputed" if layer in plan.recompute else  # noqa: E731
                               "recomputed, matmuls kept" if layer in plan.recompute_selective else "saved")
    layers = sorted(set(a.recompute) | set(b.recompute) | set(a.recompute_selective) | set(b.recompute_selective))
    d.recompute = [(layer, how(a, layer), how(b, layer)) for layer in layers if how(a, layer) != how(b, layer)]
    ca, cb = a.collective_summary(), b.collective_summary()
    d.collectives = {k: (ca.get(k, 0), cb.get(k, 0)) for k in sorted(set(ca) | set(cb)) if ca.get(k, 0) != cb.get(k, 0)}
    ba, bb = _collective_bytes(a), _collective_bytes(b)
    d.collective_bytes = {k: (ba[k], bb[k]) for k in sorted(set(ba) & set(bb))
                          if k not in d.collectives and ba[k] != bb[k]}
    d.counted_bytes = {k: (ba.get(k, 0), bb.get(k, 0)) for k in d.collectives}
    d.costs = {"estimated time": (a.objective, b.objective), "compute": (a.compute_cost, b.compute_cost),
               "communication": (a.comm_cost, b.comm_cost)}
    if a.memory or b.memory:
        d.costs["memory per rank"] = (a.predicted_peak_bytes, b.predicted_peak_bytes)
    return d


def _pieces(s: Strategy, mesh) -> tuple:
    """A strategy as what each of its layouts makes of a tensor, whatever the mesh's shape: per tensor dim the
    number of pieces, and how many ranks' values a partial one sums (by reduction)."""
    def one(ps):
        if ps is None:
            return None
        ways: dict[tuple, int] = {}
        for p, n in zip(ps, mesh.shape):
            key = ("S", p.dim) if p.is_shard() else ("P", p.reduce_op) if p.is_partial() else None
            if key is not None and n > 1:
                ways[key] = ways.get(key, 1) * n
        return tuple(sorted(ways.items()))
    return tuple(map(one, s.outputs)), tuple(map(one, s.inputs))


def _collective_bytes(plan: Plan) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for _, step in plan.collectives():
        key = (step.kind, plan.mesh.axis_names[step.axis])
        out[key] = out.get(key, 0) + step.in_bytes
    return out


def _mesh_text(mesh, other) -> str:
    """The mesh as `(dp=2, tp=2)`, with its links and device where that is all that differs from `other`."""
    text = str(mesh)
    if text != str(other):
        return text
    links = ", ".join(f"{n}: {link.name} {link.latency_s * 1e6:.3g} us {link.bandwidth / 1e9:.3g} GB/s"
                      for n, link in zip(mesh.axis_names, getattr(mesh, "links", ())))
    device = getattr(mesh, "device", None)
    return f"{text} [{links}; device {getattr(device, 'name', '?')}]"
