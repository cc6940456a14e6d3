"""The solved plan: one strategy per node, the resharding on every edge, and what it costs."""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from spmd.redistribute import Step
from spmd.specs import Placements, Strategy, placements_str

Value = tuple[str, int]


@dataclass(frozen=True)
class Edge:
    """`value` flows into input slot `slot` of `consumer`, resharded from `src` to `dst` by `steps`."""

    value: Value
    consumer: str
    slot: int
    src: Placements
    dst: Placements
    steps: tuple[Step, ...]
    cost: float


@dataclass
class Plan:
    mesh: object  # MeshSpec
    choices: dict[str, Strategy]
    node_costs: dict[str, float]
    edges: list[Edge]
    objective: float
    lower_bound: float
    gap: float
    solve_seconds: float
    stats: dict = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # placeholder -> parameter FQN / input name
    memory: dict[str, float] = field(default_factory=dict)  # kind -> predicted bytes per rank
    memory_budget: float | None = None
    # Not part of the plan's identity (never compared or hashed): what explain and visualize read.
    sources: Any = field(default=None, repr=False, compare=False)  # explain.PlanSources (spmd.plan/compile)
    details: Any = field(default=None, repr=False, compare=False)  # explain.PlanDetails, computed or loaded
    replanner: Any = field(default=None, repr=False, compare=False)  # symbolic.Replanner (spmd.plan)
    _formulas: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def cost_formula(self):
        """Estimated seconds per step as a sympy formula in the batch size (`batch`), for this plan's
        placements (cost_model/symbolic.py); `.subs("batch", b)` prices the same plan at batch b."""
        from spmd.cost_model.symbolic import cost_formula

        if "batch" not in self._formulas:
            self._formulas["batch"] = cost_formula(self)
        return self._formulas["batch"]

    def crossover(self, symbol: str = "batch", sizes=None) -> list:
        """Batch sizes at which the best plan changes (re-solving at other sizes; no processes)."""
        from spmd.cost_model.symbolic import crossover

        return crossover(self, symbol, sizes)

    @property
    def predicted_step_s(self) -> float:
        """Estimated seconds per call of the compiled module, what a timer around `compiled(*inputs)`
        (and `.backward()` when training) reads: `objective` (this rank's graph: compute + communication,
        what the solver minimises) plus `wrapper_overhead_s`, which no plan changes."""
        return self.objective + self.wrapper_overhead_s

    @property
    def wrapper_overhead_s(self) -> float:
        """Seconds per call spent around the generated graphs (`CompiledModule.__call__`; in training also
        the autograd Function and engine), from the mesh's `DeviceProfile`: `call_overhead_s` +
        `arg_overhead_s` per placeholder (parameters, buffers, inputs), and when training
        `backward_overhead_s` + `autograd_tensor_overhead_s` per parameter and per value saved for
        backward. Counted on the traced graph; a plan loaded from a file has none, and gets
        `call_overhead_s` alone."""
        d = self.mesh.device
        if self.sources is None:
            return d.call_overhead_s
        if "wrapper_counts" not in self._formulas:
            self._formulas["wrapper_counts"] = _wrapper_counts(self.sources)
        args, params, saved = self._formulas["wrapper_counts"]
        t = d.call_overhead_s + d.arg_overhead_s * args
        if self.sources.joint:
            t += d.backward_overhead_s + d.autograd_tensor_overhead_s * (params + saved)
        return t

    @property
    def predicted_peak_bytes(self) -> float:
        """Parameters + gradients + optimizer state + saved activations + inputs on one rank."""
        return sum(self.memory.values())

    def output_placements(self, value: Value) -> Placements:
        name, idx = value
        return self.choices[name].outputs[idx]

    def collectives(self) -> list[tuple[Edge, Step]]:
        return [(e, s) for e in self.edges for s in e.steps if s.is_collective]

    def collective_summary(self) -> Counter:
        """(kind, mesh axis name) -> count."""
        return Counter((s.kind, self.mesh.axis_names[s.axis]) for _, s in self.collectives())

    @property
    def comm_cost(self) -> float:
        return sum(e.cost for e in self.edges)

    @property
    def compute_cost(self) -> float:
        return sum(self.node_costs.values())

    def fingerprint(self) -> str:
        """Stable hash of every choice and every resharding step: equal on ranks that agree."""
        text = "\n".join(f"{n}:{s}" for n, s in sorted(self.choices.items(), key=lambda kv: kv[0]))
        text += "\n".join(f"{e.consumer}/{e.slot}:{[repr(st) for st in e.steps]}" for e in self.edges)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def explain(self) -> str:
        """Per-module layout in Megatron terms, collective totals, and every costed node with its cost
        split and the best alternative (see `spmd.explain`)."""
        from spmd.explain import explain

        return explain(self)

    def save(self, path) -> None:
        """Write the plan as versioned JSON (`spmd.load_plan` reads it back)."""
        from spmd.plan_io import save_plan

        save_plan(self, path)

    def diff(self, other: "Plan"):
        """What changed from this plan to `other` (see `spmd.diff_plans`)."""
        from spmd.plan_io import diff_plans

        return diff_plans(self, other)

    def to_parallelize_plan(self, axis: str | None = None) -> dict:
        """The tensor-parallel part as a DTensor `parallelize_module` plan (see `spmd.plan_io`)."""
        from spmd.plan_io import to_parallelize_plan

        return to_parallelize_plan(self, axis)

    def visualize(self, path, collapse: bool | None = None, views: bool = False, title: str | None = None):
        """Draw the sharded graph to `path` (.svg, .png, .dot or .html; see `spmd.visualize`)."""
        from spmd.visualize import visualize

        return visualize(self, path, collapse=collapse, views=views, title=title)

    def __str__(self) -> str:
        """Inputs and parameters with their placements, then every op that costs something, with the
        collectives feeding it; views and other free followers are left out (see the dumps for all)."""
        lines = [f"Plan on mesh {self.mesh}: estimated {self.objective * 1e3:.3f} ms per call "
                 f"(compute {self.compute_cost * 1e3:.3f} ms, communication {self.comm_cost * 1e3:.3f} ms); "
                 f"lower bound {self.lower_bound * 1e3:.3f} ms, gap {self.gap:.2%}, solved in {self.solve_seconds:.2f} s"]
        if self.memory:
            parts = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in self.memory.items())
            budget = f" (budget {self.memory_budget / 2**20:.2f} MiB)" if self.memory_budget else ""
            lines.append(f"  predicted memory per rank: {self.predicted_peak_bytes / 2**20:.2f} MiB{budget}: {parts} MiB")
        incoming: dict[str, list[Edge]] = {}
        for e in self.edges:
            incoming.setdefault(e.consumer, []).append(e)
        width = max((len(self.labels.get(n, n)) for n in self.choices), default=4)
        lines.append("  inputs and parameters:")
        for name, s in self.choices.items():
            if name in self.labels:
                lines.append(f"    {self.labels[name]:<{width}}  {placements_str(s.outputs[0])}")
        lines.append("  ops (placements of outputs, compute per rank; <- resharding of an input):")
        for name, s in self.choices.items():
            if name in self.labels or (self.node_costs.get(name, 0.0) == 0.0 and name not in incoming):
                continue
            outs = ", ".join(placements_str(p) for p in s.outputs if p is not None) or "-"
            lines.append(f"    {name:<{width}}  {outs:<16} {self.node_costs.get(name, 0.0) * 1e6:9.1f} us")
            for e in incoming.get(name, []):
                steps = ", ".join(str(st) for st in e.steps)
                lines.append(f"    {'':<{width}}    <- {self.labels.get(e.value[0], e.value[0])}: {placements_str(e.src)} -> {placements_str(e.dst)}"
                             f"  {steps}  {e.cost * 1e6:.1f} us")
        summary = self.collective_summary()
        if summary:
            lines.append("  collectives: " + ", ".join(f"{k} on {a}: {c}" for (k, a), c in sorted(summary.items())))
        else:
            lines.append("  collectives: none")
        return "\n".join(lines)


def _wrapper_counts(sources) -> tuple[int, int, int]:
    """(placeholders the module passes in, parameters, values saved for backward) of a traced graph, as
    `split_joint_graph` will split it: a forward value is saved when a backward node (tagged
    `is_backward`, or reading a tangent or another backward node) reads it."""
    kinds = sources.kinds
    args = sum(1 for k in kinds.values() if k != "tangent")
    params = sum(1 for k in kinds.values() if k == "parameter")
    if not sources.joint:
        return args, params, 0
    backward: set = set()
    for node in sources.graph.nodes:
        if node.op == "output":
            continue
        if (kinds.get(node.name) == "tangent" or node.meta.get("partitioner_tag") == "is_backward"
                or (node.op == "call_function" and any(a in backward for a in node.all_input_nodes))):
            backward.add(node)
    saved = sum(1 for node in sources.graph.nodes
                if node.op != "output" and node not in backward and any(u in backward for u in node.users))
    return args, params, saved
