"""Plans as files, differences between plans, and the tensor-parallel part as a DTensor plan.

A plan file is JSON with a schema name and version; placements are written as DTensor prints them
("S(0)", "R", "P(sum)"). A loaded plan explains, prints, diffs and counts its collectives like the one
that was saved (same `fingerprint()`), but holds no graph: it cannot be run or drawn.

    {"schema": "spmd-plan", "version": 1, "fingerprint": "3f1c...",
     "mesh": {"shape": [2, 2], "axis_names": ["dp", "tp"], "links": [...], "device": {...}},
     "objective": 0.0398, ..., "choices": {"addmm": {"inputs": [["R", "S(0)"], ...], "outputs": [...]}},
     "edges": [{"value": ["addmm_3", 0], "consumer": "add_1", "steps": [{"kind": "all_reduce", ...}]}],
     "details": {"nodes": [...], "params": [...], "inputs": {...}}}
"""
from __future__ import annotations

import json
import re
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torch.distributed.tensor import Partial, Replicate, Shard

from spmd.cost_model.profiles import DeviceProfile, LinkProfile
from spmd.explain import NodeReport, ParamUse, PlanDetails, Split, details_of
from spmd.mesh import MeshSpec
from spmd.plan import Edge, Plan
from spmd.redistribute import Step
from spmd.specs import Placements, Strategy, placements_str

SCHEMA = "spmd-plan"
VERSION = 1


# ---- placements as text -------------------------------------------------------------------------

def placement_to_text(p) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    raise ValueError(f"not a DTensor placement: {p!r}")


def placement_from_text(text: str):
    """"S(0)" -> Shard(0), "R" -> Replicate(), "P(sum)" or "P" -> Partial("sum")."""
    text = text.strip()
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial("sum")
    m = re.fullmatch(r"([SP])\((\w+)\)", text)
    if m is None:
        raise ValueError(f"not a placement: {text!r} (expected S(<dim>), R or P(<op>))")
    return Shard(int(m.group(2))) if m.group(1) == "S" else Partial(m.group(2))


def _ps_out(ps: Placements | None):
    return None if ps is None else [placement_to_text(p) for p in ps]


def _ps_in(texts) -> Placements | None:
    return None if texts is None else tuple(placement_from_text(t) for t in texts)


# ---- save / load --------------------------------------------------------------------------------

def _link_json(link: LinkProfile) -> dict:
    return {"name": link.name, "latency_s": link.latency_s, "bandwidth": link.bandwidth, "source": link.source,
            "per_collective": [list(x) for x in link.per_collective]}


def _mesh_json(mesh: MeshSpec) -> dict:
    d = mesh.device
    return {"shape": list(mesh.shape), "axis_names": list(mesh.axis_names),
            "links": [_link_json(link) for link in mesh.links],
            "device": asdict(d)}  # every field: a reloaded plan prices as the saved one


def _mesh_from(d: dict) -> MeshSpec:
    links = tuple(LinkProfile(x["name"], x["latency_s"], x["bandwidth"], x.get("source", ""),
                              tuple(tuple(p) for p in x.get("per_collective", ()))) for x in d["links"])
    return MeshSpec(tuple(d["shape"]), tuple(d["axis_names"]), links, DeviceProfile(**d["device"]))


def _step_json(s: Step) -> dict:
    return {"kind": s.kind, "axis": s.axis, "src_dim": s.src_dim, "dst_dim": s.dst_dim, "reduce_op": s.reduce_op,
            "local_in_shape": list(s.local_in_shape), "itemsize": s.itemsize}


def _details_json(details: PlanDetails | None) -> dict | None:
    if details is None:
        return None
    return {"nodes": [asdict(r) for r in details.nodes], "params": [asdict(p) for p in details.params],
            "inputs": dict(details.inputs)}


def _details_from(d: dict | None) -> PlanDetails | None:
    if d is None:
        return None
    nodes = []
    for r in d["nodes"]:
        r = dict(r)
        r["cost"] = Split(**r["cost"])
        r["alternative_cost"] = Split(**r["alternative_cost"]) if r["alternative_cost"] else None
        nodes.append(NodeReport(**r))
    params = [ParamUse(**{**p, "roles": tuple(p["roles"])}) for p in d["params"]]
    return PlanDetails(nodes, params, dict(d["inputs"]))


def plan_to_json(plan: Plan) -> dict:
    return {
        "schema": SCHEMA, "version": VERSION, "fingerprint": plan.fingerprint(),
        "mesh": _mesh_json(plan.mesh),
        "objective": plan.objective, "lower_bound": plan.lower_bound, "gap": plan.gap,
        "solve_seconds": plan.solve_seconds, "stats": plan.stats,
        "memory": plan.memory, "memory_budget": plan.memory_budget, "labels": plan.labels,
        "choices": {n: {"inputs": [_ps_out(p) for p in s.inputs], "outputs": [_ps_out(p) for p in s.outputs]}
                    for n, s in plan.choices.items()},
        "node_costs": plan.node_costs,
        "edges": [{"value": list(e.value), "consumer": e.consumer, "slot": e.slot, "src": _ps_out(e.src),
                   "dst": _ps_out(e.dst), "cost": e.cost, "steps": [_step_json(s) for s in e.steps]}
                  for e in plan.edges],
        "details": _details_json(details_of(plan)),
    }


def plan_from_json(doc: dict, where: str = "plan") -> Plan:
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{where}: not an spmd plan file (schema {doc.get('schema')!r})")
    if doc.get("version") != VERSION:
        raise ValueError(f"{where}: plan file version {doc.get('version')}, this spmd reads version {VERSION}. "
                         "What to do: re-plan with this version (spmd plan ... --json).")
    choices = {n: Strategy(tuple(_ps_in(p) for p in c["outputs"]), tuple(_ps_in(p) for p in c["inputs"]))
               for n, c in doc["choices"].items()}
    edges = [Edge((e["value"][0], e["value"][1]), e["consumer"], e["slot"], _ps_in(e["src"]), _ps_in(e["dst"]),
                  tuple(Step(s["kind"], s["axis"], s["src_dim"], s["dst_dim"], s["reduce_op"],
                             tuple(s["local_in_shape"]), s["itemsize"]) for s in e["steps"]), e["cost"])
             for e in doc["edges"]]
    plan = Plan(_mesh_from(doc["mesh"]), choices, dict(doc["node_costs"]), edges, doc["objective"],
                doc["lower_bound"], doc["gap"], doc["solve_seconds"], dict(doc.get("stats", {})),
                dict(doc.get("labels", {})), dict(doc.get("memory", {})), doc.get("memory_budget"))
    plan.details = _details_from(doc.get("details"))
    if doc.get("fingerprint") and plan.fingerprint() != doc["fingerprint"]:
        raise ValueError(f"{where}: the plan does not match its fingerprint (edited by hand, or written by another "
                         "version); re-plan.")
    return plan


def save_plan(plan: Plan, path) -> None:
    Path(path).write_text(json.dumps(plan_to_json(plan), indent=1, default=str) + "\n")


def load_plan(path) -> Plan:
    """Read a plan written by `plan.save(path)`: it explains, prints and diffs; it does not run."""
    return plan_from_json(json.loads(Path(path).read_text()), str(path))


# ---- differences --------------------------------------------------------------------------------

@dataclass
class PlanDiff:
    """What changed from plan `a` to plan `b`. Falsy when nothing did."""

    mesh: tuple[str, str] | None = None
    placements: list[tuple[str, str, str]] = field(default_factory=list)  # (node or FQN, in a, in b)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    collectives: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)  # (kind, axis) -> counts
    costs: dict[str, tuple[float, float]] = field(default_factory=dict)  # seconds / bytes in a and b

    def __bool__(self) -> bool:
        return bool(self.mesh or self.placements or self.only_a or self.only_b or self.collectives)

    def __str__(self) -> str:
        if not self:
            return "plans are the same (placements and collectives)"
        lines = []
        if self.mesh:
            lines.append(f"mesh: {self.mesh[0]} -> {self.mesh[1]}")
        if self.placements:
            width = max(len(n) for n, _, _ in self.placements)
            lines.append(f"placements ({len(self.placements)} changed):")
            lines += [f"  {n:<{width}}  {a} -> {b}" for n, a, b in self.placements]
        for what, names in (("only in a", self.only_a), ("only in b", self.only_b)):
            if names:
                lines.append(f"{what} ({len(names)}): " + ", ".join(names[:20]) + (" ..." if len(names) > 20 else ""))
        if self.collectives:
            lines.append("collectives:")
            lines += [f"  {k} on {ax}: {a} -> {b} ({b - a:+d})" for (k, ax), (a, b) in sorted(self.collectives.items())]
        for name, (a, b) in self.costs.items():
            if name == "memory per rank":
                lines.append(f"{name}: {a / 2**20:.3f} -> {b / 2**20:.3f} MiB ({(b - a) / 2**20:+.3f})")
            else:
                lines.append(f"{name}: {a * 1e3:.3f} -> {b * 1e3:.3f} ms ({(b - a) * 1e3:+.3f})")
        return "\n".join(lines)


def _show(s: Strategy, other: Strategy | None) -> str:
    outs = ", ".join(placements_str(p) for p in s.outputs if p is not None)
    if other is not None and s.outputs == other.outputs or not outs:
        return f"{outs} (in {' '.join(placements_str(p) for p in s.inputs)})".lstrip()
    return outs


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    d = PlanDiff()
    if str(a.mesh) != str(b.mesh):
        d.mesh = (str(a.mesh), str(b.mesh))
    for name, sa in a.choices.items():
        sb = b.choices.get(name)
        label = a.labels.get(name, name)
        if sb is None:
            d.only_a.append(label)
        elif sa != sb:
            d.placements.append((label, _show(sa, sb), _show(sb, sa)))
    d.only_b = [b.labels.get(n, n) for n in b.choices if n not in a.choices]
    ca, cb = a.collective_summary(), b.collective_summary()
    d.collectives = {k: (ca.get(k, 0), cb.get(k, 0)) for k in sorted(set(ca) | set(cb)) if ca.get(k, 0) != cb.get(k, 0)}
    d.costs = {"estimated time": (a.objective, b.objective), "compute": (a.compute_cost, b.compute_cost),
               "communication": (a.comm_cost, b.comm_cost)}
    if a.memory or b.memory:
        d.costs["memory per rank"] = (a.predicted_peak_bytes, b.predicted_peak_bytes)
    return d


# ---- DTensor's parallelize_module plan ----------------------------------------------------------

class ParallelizePlan(dict):
    """{module FQN: ColwiseParallel() | RowwiseParallel()} for `parallelize_module` on one mesh axis;
    `notes` says what of the spmd plan this does not express."""

    def __init__(self, styles: dict, axis: str | None, notes: list[str]):
        super().__init__(styles)
        self.axis, self.notes = axis, notes


def to_parallelize_plan(plan: Plan, axis: str | None = None) -> ParallelizePlan:
    """The tensor-parallel layouts on `axis` (default: the axis with the most of them) as DTensor styles:
    Linear column-parallel -> ColwiseParallel, row-parallel -> RowwiseParallel; Embedding sharded on the
    vocabulary -> RowwiseParallel, on the hidden dim -> ColwiseParallel. Anything else (FSDP, data
    parallel, other sharded parameters, biases laid out differently from the style's) goes to `notes`,
    and a warning lists them."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    details = details_of(plan)
    if details is None:
        raise ValueError("to_parallelize_plan needs the plan's details (a plan from spmd.plan/compile, or a "
                         "plan file saved with them)")
    names = plan.mesh.axis_names
    tp_roles = ("column-parallel", "row-parallel", "vocab-parallel", "hidden-sharded")
    if axis is None:
        votes = Counter(names[i] for p in details.params for i, r in enumerate(p.roles) if r in tp_roles)
        axis = votes.most_common(1)[0][0] if votes else None
    notes: list[str] = []
    styles: dict = {}
    if axis is None:
        notes.append("no tensor-parallel layouts in this plan: nothing to export")
    else:
        i = plan.mesh.axis(axis)
        by_module: dict[str, dict[str, ParamUse]] = {}
        for p in details.params:
            by_module.setdefault(p.module, {})[p.fqn.rsplit(".", 1)[-1]] = p
        for module, uses in by_module.items():
            weight = uses.get("weight")
            role = weight.roles[i] if weight else None
            kind = weight.module_type if weight else ""
            style = {("Linear", "column-parallel"): ColwiseParallel, ("Linear", "row-parallel"): RowwiseParallel,
                     ("Embedding", "vocab-parallel"): RowwiseParallel,
                     ("Embedding", "hidden-sharded"): ColwiseParallel}.get((kind, role))
            if style is not None:
                styles[module] = style()
                bias = uses.get("bias")
                want = "column-parallel" if style is ColwiseParallel else "replicated"
                if bias is not None and bias.roles[i] != want:
                    notes.append(f"{bias.fqn}: {bias.roles[i]} on {axis}, {style.__name__} makes it {want}")
            for use in uses.values():
                if use.roles[i] not in ("replicated",) and style is None:
                    notes.append(f"{use.fqn} ({use.module_type or 'no module type'}): {use.roles[i]} on {axis}, "
                                 "no parallel style for it")
        for p in details.params:
            for j, r in enumerate(p.roles):
                if j != i and r != "replicated":
                    notes.append(f"{p.fqn}: {r} on {names[j]} (another axis: use fully_shard / data parallel there)")
        for name, ps in details.inputs.items():
            if "S(" in ps.strip("[]").split(",")[i]:
                notes.append(f"input {name!r} is sharded on {axis} ({ps}); the styles assume it replicated there")
    if notes:
        warnings.warn("to_parallelize_plan: not expressed as parallel styles:\n  " + "\n  ".join(notes), stacklevel=3)
    return ParallelizePlan(styles, axis, notes)
