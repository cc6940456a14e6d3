"""Why the plan is what it is, node by node: each choice's cost split (compute, resharding in and out,
memory held) and the best other strategy with the rest of the plan held fixed, and each parameter's
layout per mesh axis in Megatron/FSDP words. `report/explain.py` turns these into text; plan files
keep them, so a loaded plan explains as the one that was saved.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from torch.distributed.tensor import Replicate, Shard

from spmd.core.graph_facts import any_layer, follows_input, format_seconds, is_gradient_sink, module_paths, \
    op_label, phase_of
from spmd.core.specs import placements_str
from spmd.report.tp_regions import StyleRegions, style_of, style_regions


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
    tied: tuple[str, ...] = ()  # the parameter's other names (`lm_head.weight` for a tied `shared.weight`)
    # the graph runs the module under this path (not: a tie's first name, T5's `shared`, or a module whose weight
    # the forward reads directly): a parallel style's hooks would run at no call, so none is given
    called: bool = True


@dataclass(frozen=True)
class PlanDetails:
    nodes: tuple[NodeReport, ...] = ()
    params: tuple[ParamUse, ...] = ()
    inputs: dict[str, str] = field(default_factory=dict)  # user input name -> placements
    # mesh axis name -> where DTensor's parallel styles need whole tensors to compute what the plan does
    # (report/tp_regions.py); None: not worked out (a plan file from before it)
    style_regions: dict[str, StyleRegions] | None = None
    # user input name -> the mesh axes its batch split is gathered on before any op reads it (`_gathered_on`)
    inputs_gathered: dict[str, tuple[str, ...]] = field(default_factory=dict)


class _Local:
    """Cost of one node's strategy with every other node's choice held fixed."""

    def __init__(self, plan, table, costs):
        self.plan, self.table, self.costs = plan, table, costs
        self.consumers: dict[tuple, list[tuple[str, int]]] = defaultdict(list)
        for name, ns in table.nodes.items():
            for j, v in enumerate(ns.inputs):
                self.consumers[v].append((name, j))
        self.follower = {n: follows_input(ns, table.output_candidates(ns.inputs[0])) if len(ns.inputs) == 1 else False
                         for n, ns in table.nodes.items()}
        self.tied_to = {ns.tie: n for n, ns in table.nodes.items() if ns.tie is not None}
        self.memory = defaultdict(list)  # node name -> its memory terms
        for term in costs.memory:
            self.memory[term.value[0]].append(term)
        self._deliver: dict = {}
        self.planned = {(e.consumer, e.slot): e for e in plan.edges}

    def _edge(self, value, src, dst, consumer, slot) -> float:
        if src == self.plan.output_placements(value) and dst == self.plan.choices[consumer].inputs[slot]:
            e = self.planned.get((consumer, slot))  # as the plan pays it (a shared resharding: nothing)
            return e.cost if e is not None else 0.0
        gradient = is_gradient_sink(self.table.nodes[consumer])
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
                    total += self._edge(value, ps, self.plan.choices[c].inputs[j], c, j)
            self._deliver[key] = total
        return self._deliver[key]

    def split(self, name: str, idx: int) -> Split:
        ns = self.table.nodes[name]
        s = ns.strategies[idx]
        compute = self.costs.node_costs.get(name, [0.0] * len(ns.strategies))[idx]
        comm_in = sum(self._edge(v, self.plan.output_placements(v), s.inputs[j], name, j)
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


def _why(chosen: Split, alt: Split, budget: float | None) -> str:
    """Why the best alternative lost, in the order that decides it: time first (it is the objective),
    then memory (what a budget weighs)."""
    delta = alt.time - chosen.time
    if math.isinf(alt.time):
        return "cannot be reached from the neighbours' layouts"
    tol = 5e-8 + 1e-6 * chosen.time  # below what the table shows (0.1 us)
    more = (alt.memory - chosen.memory) / 2**20
    if delta > tol:
        dc = alt.compute - chosen.compute
        dm = alt.comm_in + alt.comm_out - chosen.comm_in - chosen.comm_out
        parts = [f"{'+' if x >= 0 else '-'}{format_seconds(abs(x))} {what}" for x, what in
                 ((dm, "communication"), (dc, "compute")) if abs(x) > tol]
        return f"{format_seconds(delta)} slower ({', '.join(parts)})"
    if delta < -tol:
        if budget and more > 0:
            return f"{format_seconds(-delta)} faster alone, but {more:.2f} MiB more memory per rank (budget)"
        return f"{format_seconds(-delta)} faster alone, but not together with the rest of the plan (global optimum)"
    if more > 0:
        return f"as fast, {more:.2f} MiB more memory per rank" + (" (budget)" if budget else "")
    return "tie: as fast and as small; the solver's pick is deterministic"


def _param_roles(plan, table, fqn_of: dict[str, str], where: dict[str, str], types: dict[str, str],
                 entered: dict[str, str], follower: dict[str, bool], backward: frozenset = frozenset(),
                 tied: dict[str, list[str]] | None = None) -> list[ParamUse]:
    """Name each parameter's layout per axis. A sharded weight that is all_gathered on that axis before
    its forward use is FSDP (stored sharded, computed whole); one used sharded is tensor parallelism. (A
    gather only in backward, a column-parallel weight gathered there for another matmul, is not FSDP: a
    probe found such a weight labelled so.) `backward`: the names of the backward graph's nodes."""
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
        forward = {c for c in path if c not in backward} or path
        gathered = {s.axis for c in forward for e in edges_into[c] if e.value[0] in path
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
            elif isinstance(p, Shard) and mtype == "Conv1D":  # transformers' GPT-2 Linear: weight (in, out)
                roles.append("column-parallel" if p.dim == 1 or leaf == "bias" else "row-parallel")
            elif isinstance(p, Shard) and mtype == "Embedding" and leaf == "weight":
                roles.append("vocab-parallel" if p.dim == 0 else "hidden-sharded")
            elif isinstance(p, Shard):
                roles.append(f"sharded dim {p.dim}")
            else:
                roles.append(str(p))
        out.append(ParamUse(fqn, module, mtype, placements_str(ps), tuple(roles), tuple((tied or {}).get(fqn, ())),
                            module in entered))
    return out


def compute_details(plan, src) -> PlanDetails:
    """`src`: the `PlanSources` the plan was solved from (report/result.py)."""
    table, costs = src.tables
    params = {ph: plan.labels[ph] for ph, k in src.kinds.items() if k in ("parameter", "buffer")}
    where, entered = module_paths(src.graph, list(params.values()))
    # (with the modules the graph never enters by their own path, named in the table: a tie's first name, a weight
    # read directly; no parallel style is given to them: its hooks would run at no call, or at another name's)
    types = {**src.module_types, **entered}
    nodes = {n.name: n for n in src.graph.nodes}
    local = _Local(plan, table, costs)
    incoming = {e.consumer for e in plan.edges}
    # a node of a repeated layer that chose what its representative chose is one more of that row
    rep_of = src.blocks.representative if src.blocks is not None else {}
    folded = {n for n, r in rep_of.items() if n in plan.choices and r in plan.choices
              and plan.choices[n] == plan.choices[r]}
    count = Counter(rep_of[n] for n in folded)
    copies: dict[str, list[str]] = {}
    for n in folded:
        copies.setdefault(rep_of[n], []).append(n)
    reports = []
    for name, ns in table.nodes.items():
        kind = src.kinds.get(name)
        if kind == "tangent" or is_gradient_sink(ns) or name in folded:
            continue  # tangents and gradient sinks move with their tie partner (shown in its row)
        chosen = plan.choices[name]
        idx = ns.strategies.index(chosen)
        follower = local.follower[name]  # (a view, or a one-input op that keeps its input's layout: no choice of its
        # own, its consumers' resharding paid in its producer's row; shown where it computes or holds something,
        # so that the rows add up to the plan's compute and memory: a probe found bias gradients' sums left out)
        # (a row of repeated layers shows the mean over its layers, so that rows x count add up, and its
        # alternative shifted by as much: the first layer's copy reads the embedding's output, the others their layer's; a probe found a
        # row showing its representative's 9.9 us for a twin that pays 1.0 us)
        members = [name, *copies.get(name, ())]
        own = local.with_tie(name, idx)  # (the best alternative is found, and weighed, at the representative)
        cost = _over(local, table, members, chosen) if len(members) > 1 else own
        if ns.source not in ("placeholder", "output") and cost.compute == 0.0 and cost.memory == 0.0 and \
                (follower or not incoming.intersection(members)):
            continue
        if follower:
            cost = Split(cost.compute, 0.0, 0.0, cost.memory)
        best, best_split = None, None
        for i, s in enumerate(() if follower else ns.strategies):  # (each layer's would cost a walk: seconds)
            if i == idx:
                continue
            sp = local.with_tie(name, i)
            if best is None or (sp.time, sp.memory) < (best_split.time, best_split.memory):
                best, best_split = s, sp
        why = "follows its input" if follower else _why(own, best_split, plan.memory_budget) if best else \
            "the only strategy"
        if best is not None and cost != own:  # (shown on the row's basis: the representative's margins)
            best_split = Split(*(getattr(best_split, f) + getattr(cost, f) - getattr(own, f) for f in _SPLIT_FIELDS))
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
            label, module = any_layer(label) if kind is not None else label, any_layer(module)
        reports.append(NodeReport(
            name, label, op, module, phase,
            _show(chosen, ns.source), cost, _show(best, ns.source, chosen) if best else None, best_split,
            why, len(ns.strategies), n))
    inputs = {plan.labels[ph]: placements_str(plan.choices[ph].outputs[0])
              for ph, k in src.kinds.items() if k == "input"}
    gathered = {plan.labels[ph]: axes for ph, k in src.kinds.items() if k == "input"
                for axes in [_gathered_on(plan, ph, local.consumers[(ph, 0)])] if axes}
    backward = frozenset(name for name, node in nodes.items() if node is not None and phase_of(node) == "backward")
    tied: dict[str, list[str]] = {}
    for alias, canonical in src.aliases.items():
        tied.setdefault(canonical, []).append(alias)
    uses = _param_roles(plan, table, params, where, types, entered, local.follower, backward, tied)
    regions = {}
    for i, axis in enumerate(plan.mesh.axis_names):
        styles = {p.module: style for p in uses if p.fqn.rsplit(".", 1)[-1] == "weight" and p.called
                  for style in [style_of(p.module_type, p.roles[i])] if style is not None}
        if styles:
            embeddings = frozenset(p.module for p in uses if p.module in styles and p.module_type == "Embedding")
            regions[axis] = style_regions(src.graph, plan, table, styles, where, i, embeddings)
    return PlanDetails(tuple(reports), tuple(uses), inputs, regions, inputs_gathered=gathered)


def _gathered_on(plan, ph: str, consumers: list[tuple[str, int]]) -> tuple[str, ...]:
    """The mesh axes on which input `ph` comes split on its batch (dim 0) and every op reading it takes it
    otherwise: the split is undone before use, gathered or moved to another axis, and no op runs data parallel on
    that axis (a probe: explain called such an input data parallel while every rank gathered it first)."""
    given = plan.choices[ph].outputs[0]
    return tuple(axis for i, axis in enumerate(plan.mesh.axis_names)
                 if given[i] == Shard(0) and consumers
                 and all(plan.choices[c].inputs[j][i] != Shard(0) for c, j in consumers))


def _over(local, table, members: list[str], strategy) -> Split:
    """`strategy`'s cost at each of `members` (a row's layers; their strategy lists are alike), the mean."""
    splits = []
    for m in members:
        strategies = table.nodes[m].strategies
        if strategy in strategies:
            splits.append(local.with_tie(m, strategies.index(strategy)))
    return _mean(splits)


_SPLIT_FIELDS = ("compute", "comm_in", "comm_out", "memory")


def _mean(splits: list[Split]) -> Split:
    return Split(*(sum(getattr(s, f) for s in splits) / len(splits) for f in _SPLIT_FIELDS))


def _show(s, source: str, other=None) -> str:
    """A strategy in the fewest words: its output placements, plus its inputs where only they differ."""
    if source == "output":
        return placements_str(s.inputs[0])
    outs = ", ".join(placements_str(p) for p in s.outputs[:1] if p is not None) or "-"
    if other is not None and s.outputs == other.outputs:
        return outs + " (in " + " ".join(placements_str(p) for p in s.inputs) + ")"
    return outs
