"""Why the plan is what it is: per-node cost splits, the best alternative, and a summary in Megatron terms.

`plan.explain()` (and `compiled.explain()`, `spmd explain plan.json`) print three tables:

    modules      how each parameterized module is laid out per mesh axis, in Megatron/FSDP words
                 ("blocks.*.attn.q_proj  Linear  column-parallel on tp; replicated on dp")
    collectives  count, bytes and estimated seconds per (collective kind, mesh axis)
    nodes        every costed node: chosen placements, its compute / communication / memory, the best
                 other strategy with the rest of the plan held fixed, and why that one lost

The details come from the tables the solver saw (`PlanSources`: graph, `StrategyTable`, `CostTable`),
computed on first use and cached on the plan; a plan loaded from a file carries them as saved.
"""
from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from spmd.specs import Placements, placements_str

_VIEW_LIKE = ("view", "_unsafe_view", "reshape", "permute", "t", "transpose", "expand", "unsqueeze", "squeeze",
              "alias", "detach", "clone", "slice", "select", "split", "contiguous")


@dataclass
class PlanSources:
    """What planning saw, kept by `spmd.plan` / `spmd.compile` for explain and visualize (never saved).
    No parameter values: a compiled rank keeps only its shards."""

    graph: fx.Graph  # the traced ATen graph (node names are the plan's)
    emitted: fx.GraphModule | Callable[[], fx.GraphModule] | None  # insert_collectives' output, or how to make it
    strategies: Any  # StrategyTable
    costs: Any  # CostTable
    kinds: dict[str, str]  # placeholder -> parameter | buffer | constant | input | tangent
    joint: bool = False
    blocks: Any = None  # RepeatedBlocks: repeated layers are reported once, with their count

    @property
    def global_gm(self) -> fx.GraphModule | None:
        """The sharded graph with explicit steps (made on first use when planning skipped it)."""
        if callable(self.emitted) and not isinstance(self.emitted, fx.GraphModule):
            self.emitted = self.emitted()
        return self.emitted


@dataclass(frozen=True)
class Split:
    """One choice's cost on one rank: seconds of compute, of resharding its inputs, of resharding its
    outputs for their consumers as they are, and bytes held."""

    compute: float
    comm_in: float
    comm_out: float
    memory: float

    @property
    def time(self) -> float:
        """What changes with this node's choice alone (each edge is counted at both of its ends)."""
        return self.compute + self.comm_in + self.comm_out


@dataclass(frozen=True)
class NodeReport:
    """One costed node: the chosen placements and the best other strategy (the rest of the plan fixed)."""

    name: str
    label: str  # parameter FQN / input name for placeholders, else the node name
    op: str  # "aten.addmm", "parameter", "input", "output"
    module: str  # module path ("blocks.0.attn.q_proj"); "" at the top level
    phase: str  # "forward" | "backward" | "" (a forward-only graph)
    chosen: str
    cost: Split
    alternative: str | None
    alternative_cost: Split | None
    reason: str  # why the alternative lost
    n_strategies: int
    count: int = 1  # identical nodes of repeated layers this row stands for (same choice)

    @property
    def delta(self) -> float | None:
        """Seconds the best alternative adds (the rest of the plan fixed)."""
        return None if self.alternative_cost is None else self.alternative_cost.time - self.cost.time


@dataclass(frozen=True)
class ParamUse:
    """How one parameter is laid out and used: `roles[i]` names its layout on mesh axis i."""

    fqn: str
    module: str
    module_type: str  # "Linear", "Embedding", "LayerNorm", ...
    placements: str
    roles: tuple[str, ...]  # column-parallel | row-parallel | vocab-parallel | FSDP | replicated | sharded dim d


@dataclass
class PlanDetails:
    nodes: list[NodeReport] = field(default_factory=list)
    params: list[ParamUse] = field(default_factory=list)
    inputs: dict[str, str] = field(default_factory=dict)  # user input name -> placements


# ---- gathering the details ----------------------------------------------------------------------

def op_label(node: fx.Node) -> str:
    """`addmm`, `add.Tensor`, `getitem`: the ATen op without its namespace and default overload."""
    target = node.target
    if hasattr(target, "_schema"):
        overload = target._overloadname
        return target.overloadpacket.__name__ + ("" if overload == "default" else f".{overload}")
    return getattr(target, "__name__", str(target))


def _short_type(t) -> str:
    return getattr(t, "__name__", str(t)).rsplit(".", 1)[-1]


def module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """(module path, class name) from outermost to innermost: `nn_module_stack` from torch.export, or
    `fwd_nn_module_stack` on backward nodes of a joint graph (the forward module they differentiate)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    return [(path, _short_type(t)) for path, t in stack.values()]


def module_prefix(graph: fx.Graph, fqns: list[str]) -> str:
    """The path prefix a training wrapper added ("model." when a loss_fn wraps the model)."""
    paths = {p for n in graph.nodes for p, _ in module_stack(n) if p}
    if paths and all(p == "model" or p.startswith("model.") for p in paths) and \
            not any(f.startswith("model.") for f in fqns):
        return "model."
    return ""


def module_paths(graph: fx.Graph, fqns: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """node name -> innermost module path, and module path -> class name, wrapper prefix removed."""
    prefix = module_prefix(graph, fqns)
    where, types = {}, {}
    for n in graph.nodes:
        stack = [(p.removeprefix(prefix) if p != prefix.rstrip(".") else "", t) for p, t in module_stack(n)]
        for p, t in stack:
            types.setdefault(p, t)
        if stack:
            where[n.name] = stack[-1][0]
    return where, types


def phase_of(node: fx.Node) -> str:
    tag = node.meta.get("partitioner_tag")
    return {"is_forward": "forward", "is_backward": "backward"}.get(tag, "")


def _follows(ns, table) -> bool:
    """Views and getitem: one strategy per placement of their single input (they add no variables)."""
    if len(ns.inputs) != 1 or ns.source in ("placeholder", "output"):
        return False
    ins = [s.inputs[0] for s in ns.strategies]
    return len(set(ins)) == len(ins) and set(ins) == set(table.output_candidates(ns.inputs[0]))


class _Local:
    """Cost of one node's strategy with every other node's choice held fixed."""

    def __init__(self, plan, table, costs):
        self.plan, self.table, self.costs = plan, table, costs
        self.consumers: dict[tuple, list[tuple[str, int]]] = defaultdict(list)
        for name, ns in table.nodes.items():
            for j, v in enumerate(ns.inputs):
                self.consumers[v].append((name, j))
        self.follower = {n: _follows(ns, table) for n, ns in table.nodes.items()}
        self.tied_to = {ns.tie: n for n, ns in table.nodes.items() if ns.tie is not None}
        self.memory = defaultdict(list)  # node name -> its memory terms
        for term in costs.memory:
            self.memory[term.value[0]].append(term)
        self._deliver: dict = {}

    def _edge(self, value, src, dst, consumer) -> float:
        ns = self.table.nodes[consumer]
        gradient = ns.source == "output" and ns.tie is not None
        try:
            return self.costs.edge_cost(value, src, dst, gradient)
        except KeyError:
            return math.inf

    def deliver(self, value, ps) -> float:
        """Seconds to bring `value`, laid out as `ps`, to every consumer as it now reads it (views follow)."""
        key = (value, ps)
        if key not in self._deliver:
            total = 0.0
            for c, j in self.consumers.get(value, ()):
                if self.follower[c]:
                    match = [s for s in self.table.nodes[c].strategies if s.inputs[0] == ps]
                    total += sum(self.deliver((c, k), o) for k, o in enumerate(match[0].outputs)
                                 if o is not None) if match else math.inf
                else:
                    total += self._edge(value, ps, self.plan.choices[c].inputs[j], c)
            self._deliver[key] = total
        return self._deliver[key]

    def split(self, name: str, idx: int) -> Split:
        ns = self.table.nodes[name]
        s = ns.strategies[idx]
        compute = self.costs.node_costs.get(name, [0.0] * len(ns.strategies))[idx]
        comm_in = sum(self._edge(v, self.plan.output_placements(v), s.inputs[j], name)
                      for j, v in enumerate(ns.inputs))
        comm_out = sum(self.deliver((name, k), o) for k, o in enumerate(s.outputs) if o is not None)
        shape = self.costs.mesh.shape
        memory = sum(t.bytes(s.inputs[0] if ns.source == "output" else s.outputs[t.value[1]], shape)
                     for t in self.memory.get(name, ()))
        return Split(compute, comm_in, comm_out, memory)

    def with_tie(self, name: str, idx: int) -> Split:
        """A tied pair (gradient sink == parameter, tangent == output) moves together."""
        own = self.split(name, idx)
        partner = self.table.nodes[name].tie or self.tied_to.get(name)
        if partner is None:
            return own
        ns, other = self.table.nodes[name], self.table.nodes[partner]
        key = ns.key(ns.strategies[idx])
        match = [i for i, s in enumerate(other.strategies) if other.key(s) == key]
        if not match:
            return Split(own.compute, math.inf, own.comm_out, own.memory)
        theirs = self.split(partner, match[0])
        return Split(own.compute + theirs.compute, own.comm_in + theirs.comm_in, own.comm_out + theirs.comm_out,
                     own.memory + theirs.memory)


def _us(seconds: float) -> str:
    return "inf" if math.isinf(seconds) else f"{seconds * 1e6:.1f} us"


def _why(chosen: Split, alt: Split, budget: float | None) -> str:
    delta = alt.time - chosen.time
    if math.isinf(alt.time):
        return "cannot be reached from the neighbours' layouts"
    tol = 5e-8 + 1e-6 * chosen.time  # below what the table shows (0.1 us)
    if delta > tol:
        dc = alt.compute - chosen.compute
        dm = alt.comm_in + alt.comm_out - chosen.comm_in - chosen.comm_out
        parts = [f"{'+' if x >= 0 else '-'}{_us(abs(x))} {what}" for x, what in
                 ((dm, "communication"), (dc, "compute")) if abs(x) > tol]
        return f"{_us(delta)} slower ({', '.join(parts)})"
    if alt.memory > chosen.memory:
        extra = (alt.memory - chosen.memory) / 2**20
        return f"as fast, {extra:.2f} MiB more memory per rank" + (" (budget)" if budget else "")
    if delta < -tol:
        return f"{_us(-delta)} faster alone, but not together with the rest of the plan (global optimum)"
    return "tie: as fast and as small; the solver's pick is deterministic"


def _param_roles(plan, table, fqn_of: dict[str, str], where: dict[str, str], types: dict[str, str],
                 follower: dict[str, bool]) -> list[ParamUse]:
    """Name each parameter's layout per axis. A sharded weight that is all_gathered on that axis before
    use is FSDP (stored sharded, computed whole); one used sharded is tensor parallelism."""
    consumers = defaultdict(list)
    for name, ns in table.nodes.items():
        for v in ns.inputs:
            consumers[v[0]].append(name)
    edges_into = defaultdict(list)
    for e in plan.edges:
        edges_into[e.consumer].append(e)
    out = []
    for ph, fqn in fqn_of.items():
        ps = plan.choices[ph].outputs[0]
        # the nodes on the way from the parameter to its uses, through views
        path, todo = {ph}, [ph]
        while todo:
            for c in consumers[todo.pop()]:
                if c not in path:
                    path.add(c)
                    if follower[c]:
                        todo.append(c)
        gathered = {s.axis for c in path for e in edges_into[c] if e.value[0] in path
                    for s in e.steps if s.kind == "all_gather"}
        module = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        mtype = types.get(module, "")
        leaf = fqn.rsplit(".", 1)[-1]
        roles = []
        for axis, p in enumerate(ps):
            if isinstance(p, Replicate):
                roles.append("replicated")
            elif isinstance(p, Shard) and axis in gathered:
                roles.append("FSDP")
            elif isinstance(p, Shard) and mtype == "Linear":
                roles.append("column-parallel" if p.dim == 0 else "row-parallel")
            elif isinstance(p, Shard) and mtype == "Embedding" and leaf == "weight":
                roles.append("vocab-parallel" if p.dim == 0 else "hidden-sharded")
            elif isinstance(p, Shard):
                roles.append(f"sharded dim {p.dim}")
            else:
                roles.append(str(p))
        out.append(ParamUse(fqn, module, mtype, placements_str(ps), tuple(roles)))
    return out


def compute_details(plan) -> PlanDetails:
    src: PlanSources = plan.sources
    table, costs = src.strategies, src.costs
    params = {ph: plan.labels[ph] for ph, k in src.kinds.items() if k in ("parameter", "buffer")}
    where, types = module_paths(src.graph, list(params.values()))
    nodes = {n.name: n for n in src.graph.nodes}
    local = _Local(plan, table, costs)
    incoming = {e.consumer for e in plan.edges}
    # a node of a repeated layer that chose what its representative chose is one more of that row
    rep_of = src.blocks.representative if src.blocks is not None else {}
    folded = {n for n, r in rep_of.items() if n in plan.choices and r in plan.choices
              and plan.choices[n] == plan.choices[r]}
    count = Counter(rep_of[n] for n in folded)
    reports = []
    for name, ns in table.nodes.items():
        kind = src.kinds.get(name)
        if kind == "tangent" or local.follower[name] or (ns.source == "output" and ns.tie is not None):
            continue  # tangents and gradient sinks move with their tie partner; views follow their input
        if name in folded:
            continue
        chosen = plan.choices[name]
        idx = ns.strategies.index(chosen)
        cost = local.with_tie(name, idx)
        if ns.source not in ("placeholder", "output") and cost.compute == 0.0 and name not in incoming:
            continue
        best, best_split = None, None
        for i, s in enumerate(ns.strategies):
            if i == idx:
                continue
            sp = local.with_tie(name, i)
            if best is None or (sp.time, sp.memory) < (best_split.time, best_split.memory):
                best, best_split = s, sp
        node = nodes.get(name)
        phase = phase_of(node) if node is not None and kind is None else ""
        if kind is not None:
            op, module = kind, (plan.labels[name].rsplit(".", 1)[0] if kind in ("parameter", "buffer") and
                                "." in plan.labels[name] else "")
        elif ns.source == "output":
            op, module = "output", ""
        else:
            op, module = op_label(node), where.get(name, "")
        label, n = plan.labels.get(name, name), count.get(name, 0) + 1
        if n > 1:  # "layers.0.mlp" -> "layers.*.mlp"
            label, module = _any_layer(label) if kind is not None else label, _any_layer(module)
        reports.append(NodeReport(
            name, label, op, module, phase,
            _show(chosen, ns.source), cost, _show(best, ns.source, chosen) if best else None, best_split,
            _why(cost, best_split, plan.memory_budget) if best else "the only strategy", len(ns.strategies), n))
    inputs = {plan.labels[ph]: placements_str(plan.choices[ph].outputs[0])
              for ph, k in src.kinds.items() if k == "input"}
    return PlanDetails(reports, _param_roles(plan, table, params, where, types, local.follower), inputs)


def _show(s, source: str, other=None) -> str:
    """A strategy in the fewest words: its output placements, plus its inputs where only they differ."""
    if source == "output":
        return placements_str(s.inputs[0])
    outs = ", ".join(placements_str(p) for p in s.outputs[:1] if p is not None) or "-"
    if other is not None and s.outputs == other.outputs:
        return outs + " (in " + " ".join(placements_str(p) for p in s.inputs) + ")"
    return outs


def details_of(plan) -> PlanDetails | None:
    """The plan's details, computed once from its sources (None for a plan without either)."""
    if plan.details is None and plan.sources is not None:
        plan.details = compute_details(plan)
    return plan.details


# ---- the text -----------------------------------------------------------------------------------

def _fmt_bytes(b: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths))).rstrip() for r in rows]


def describe_roles(roles: tuple[str, ...], axis_names) -> str:
    """"column-parallel on tp; replicated on dp" (tensor parallelism first)."""
    if all(r == "replicated" for r in roles):
        return "replicated"
    order = sorted(range(len(roles)), key=lambda i: roles[i] == "replicated")
    return "; ".join(f"{roles[i]} on {axis_names[i]}" for i in order)


def module_summary(details: PlanDetails, axis_names) -> list[tuple[str, str, str]]:
    """(module pattern, type, description) per parameterized module; repeated blocks described alike
    fold into one line with `*` for the block index."""
    by_module: dict[str, list[ParamUse]] = {}
    for p in details.params:
        by_module.setdefault(p.module, []).append(p)
    described = {}
    for module, uses in by_module.items():
        main = next((u for u in uses if u.fqn.endswith(".weight")), uses[0])
        text = describe_roles(main.roles, axis_names)
        if len(uses) > 1 and any(u.roles != main.roles for u in uses if u is not main):
            text += "; " + ", ".join(f"{u.fqn.rsplit('.', 1)[-1]} {u.placements}" for u in uses if u is not main)
        described[module] = (main.module_type, text)
    groups: dict[tuple, list[str]] = {}
    for module, (mtype, text) in described.items():
        pattern = re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", module)
        groups.setdefault((pattern, mtype, text), []).append(module)
    counts = defaultdict(int)
    for pattern, _, _ in groups:
        counts[pattern] += 1
    rows = []
    for (pattern, mtype, text), modules in groups.items():
        if counts[pattern] == 1 and len(modules) > 1:
            rows.append((pattern, mtype, text))
        else:
            rows.extend((m, mtype, text) for m in modules)
    return rows


def step_seconds(plan) -> list[tuple[Any, Any, float]]:
    """(edge, step, seconds) for every step: the plan's edge cost (gradient buckets included) shared
    over its steps in proportion to their own cost."""
    from spmd.cost_model.comm import step_cost

    out = []
    for e in plan.edges:
        raw = [step_cost(s, plan.mesh) for s in e.steps]
        scale = e.cost / sum(raw) if sum(raw) > 0 else 1.0
        out += [(e, s, r * scale) for s, r in zip(e.steps, raw)]
    return out


def collective_totals(plan) -> list[tuple[str, str, int, float, float]]:
    """(kind, axis, count, bytes, seconds) per collective kind and mesh axis."""
    totals: dict[tuple[str, str], list] = {}
    for _, s, seconds in step_seconds(plan):
        if not s.is_collective:
            continue
        row = totals.setdefault((s.kind, plan.mesh.axis_names[s.axis]), [0, 0.0, 0.0])
        row[0] += 1
        row[1] += s.in_bytes
        row[2] += seconds
    return [(k, a, c, b, t) for (k, a), (c, b, t) in sorted(totals.items())]


def explain(plan) -> str:
    details = details_of(plan)
    names = plan.mesh.axis_names
    lines = [f"Plan on mesh {plan.mesh}: estimated {plan.objective * 1e3:.3f} ms per call "
             f"(compute {plan.compute_cost * 1e3:.3f} ms, communication {plan.comm_cost * 1e3:.3f} ms), "
             f"optimality gap {plan.gap:.2%}"]
    if plan.memory:
        lines.append(f"predicted memory per rank: {_fmt_bytes(plan.predicted_peak_bytes)} (" +
                     ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in plan.memory.items()) + ")")
    if details is None:
        lines.append("(no per-node details: this plan was saved without them)")
        return "\n".join(lines) + "\n"
    lines += ["", "Modules (layout per mesh axis):"]
    rows = module_summary(details, names)
    lines += _table([[m or "(root)", t, d] for m, t, d in rows]) if rows else ["  (no parameters)"]
    for name, ps in details.inputs.items():
        batch = [names[i] for i, p in enumerate(_parse_list(ps)) if p == "S(0)"]
        note = f": batch split on {', '.join(batch)} (data parallel)" if batch else ""
        lines.append(f"  input {name} {ps}{note}")
    lines += ["", "Collectives per call:"]
    totals = collective_totals(plan)
    if totals:
        rows = [["kind", "axis", "count", "bytes", "time"]]
        rows += [[k, a, str(c), _fmt_bytes(b), _us(t)] for k, a, c, b, t in totals]
        rows.append(["total", "", str(sum(r[2] for r in totals)), _fmt_bytes(sum(r[3] for r in totals)),
                     _us(sum(r[4] for r in totals))])
        lines += _table(rows)
    else:
        lines.append("  none")
    lines += ["", "Nodes (per rank and call: compute, resharding of the inputs, memory held; the best "
              "alternative is the cheapest other strategy with the rest of the plan fixed):"]
    rows = [["node", "module", "op", "chosen", "compute", "comm in", "memory", "best alternative",
             "why it lost"]]
    for r in details.nodes:
        where = " ".join(x for x in (r.module, f"({r.phase})" if r.phase else "", f"x{r.count}" if r.count > 1 else "")
                         if x)
        rows.append([r.label, where, r.op, r.chosen, _us(r.cost.compute), _us(r.cost.comm_in),
                     _fmt_bytes(r.cost.memory) if r.cost.memory else "-", r.alternative or "-", r.reason])
    lines += _table(rows)
    return "\n".join(lines) + "\n"


def _any_layer(path: str) -> str:
    """The first list index in a module path or FQN made a wildcard: "layers.0.attn" -> "layers.*.attn"."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", path, count=1)


def _parse_list(ps: str) -> list[str]:
    return [p.strip() for p in ps.strip("[]").split(",")]


def keep_sources(c) -> Any:
    """Give `c.plan` what explain and visualize read (no parameter values); returns the plan."""
    from spmd.passes.insert_collectives import insert_collectives

    kinds = {gi.placeholder: gi.kind for gi in c.traced.inputs}
    traced, plan = c.traced, c.plan
    emitted = c.global_gm if c.global_gm is not None else (lambda: insert_collectives(traced, plan))
    c.plan.sources = PlanSources(c.traced.graph, emitted, c.strategies, c.costs, kinds, c.traced.joint, c.blocks)
    return c.plan
