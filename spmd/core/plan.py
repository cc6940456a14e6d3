"""The solved plan: one strategy per node, the resharding on every edge, and what it costs. Frozen data:
what explains, draws or saves a plan lives in `spmd.report`, which reads it."""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field

from spmd.core.graph_facts import format_bytes, format_seconds
from spmd.core.redistribute import Step
from spmd.core.specs import Placements, Strategy, Value


@dataclass(frozen=True)
class Edge:
    """`value` flows into input slot `slot` of `consumer`, resharded from `src` to `dst` by `steps`.
    `shared`: an earlier consumer in the same region (forward or backward) needs the same placements of
    the same value through a collective; the rank graph reuses that resharding, so this edge launches
    nothing and costs nothing (as the solver priced it). Local slices are reused too, but priced per edge."""

    value: Value
    consumer: str
    slot: int
    src: Placements
    dst: Placements
    steps: tuple[Step, ...]
    cost: float
    shared: bool = False


@dataclass(frozen=True)
class Plan:
    """`objective` is the solver's seconds per call on one rank (compute + communication), `lower_bound`
    and `gap` its proof of optimality; `memory` the predicted bytes per rank by kind (parameters,
    gradients, optimizer, buffers, inputs, activations, temporaries); `labels` maps placeholders to
    parameter FQNs and input names; `wrapper_counts` is (placeholders passed in, parameters, values
    saved for backward): what the per-call costs around the graph scale with. `recompute`: the layers
    ("model.layers.3") whose forward backward runs again instead of saving it, `recompute_selective`
    those whose forward it runs again but for their matmuls and attention (saved); `recompute_cost` the
    seconds both add (part of `objective`), `recomputed_bytes` the saved activations they no longer hold
    (net: `memory["activations"]` is what is held). `memory` counts what each kind holds at its most
    (every gradient, as after backward; every saved activation, as when backward starts; the
    temporaries alive at the worst point), so its sum overstates the peak in training: `peak_bytes` is the
    worst point of the schedule (0.0 where none was walked)."""

    mesh: object  # MeshSpec
    choices: dict[str, Strategy]
    node_costs: dict[str, float]
    edges: tuple[Edge, ...]
    objective: float
    lower_bound: float
    gap: float
    solve_seconds: float
    stats: dict = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)
    memory_budget: float | None = None
    wrapper_counts: tuple[int, int, int] | None = None
    joint: bool = False  # a training plan (forward and backward)
    recompute: tuple[str, ...] = ()
    recompute_cost: float = 0.0
    recomputed_bytes: float = 0.0
    recompute_selective: tuple[str, ...] = ()
    peak_bytes: float = 0.0

    @property
    def predicted_step_s(self) -> float:
        """Estimated seconds per call of the compiled module, what a timer around `compiled(*inputs)`
        reads, and when training around the whole step (`.backward()` and the optimizer's step over this
        rank's pieces, of the kind `optimizer_state_factor` says: AdamW by default): `objective` (this
        rank's graph: compute + communication, and the optimizer's step on each parameter, what the solver
        minimises) plus `wrapper_overhead_s`, which no plan changes."""
        return self.objective + self.wrapper_overhead_s

    @property
    def wrapper_overhead_s(self) -> float:
        """Seconds per call spent around the generated graphs (`CompiledModule.__call__`; in training also
        the autograd Function and engine), from the mesh's `DeviceProfile`: `call_overhead_s` +
        `arg_overhead_s` per placeholder (parameters, buffers, inputs), and when training
        `backward_overhead_s` + `autograd_tensor_overhead_s` per parameter and per value saved for
        backward, and the optimizer's `step()` call (`optimizer_call_overhead_s`, where there are
        parameters; its work per parameter is in `objective`). A plan without `wrapper_counts` gets
        `call_overhead_s` alone."""
        d = self.mesh.device
        if self.wrapper_counts is None:
            return d.call_overhead_s
        args, params, saved = self.wrapper_counts
        t = d.call_overhead_s + d.arg_overhead_s * args
        if self.joint:
            t += d.backward_overhead_s + d.autograd_tensor_overhead_s * (params + saved)
            t += d.optimizer_call_overhead_s if params else 0.0
        return t

    @property
    def predicted_peak_bytes(self) -> float:
        """The most bytes one rank holds at once: parameters, optimizer state, buffers and inputs, with
        what the worst point of the schedule holds (saved activations, the gradients made by then,
        temporaries); the sum of `memory` where no schedule was walked."""
        return self.peak_bytes or sum(self.memory.values())

    def output_placements(self, value: Value) -> Placements:
        name, idx = value
        return self.choices[name].outputs[idx]

    def collectives(self) -> list[tuple[Edge, Step]]:
        """The collectives the rank graph launches (a shared edge launches none of its own)."""
        return [(e, s) for e in self.edges if not e.shared for s in e.steps if s.is_collective]

    def collective_summary(self) -> Counter:
        """(kind, mesh axis name) -> the launches the rank graphs make: the gradient all_reduces of a training
        plan count as the buckets the runtime packs them into (passes/bucket_gradients.py), as `explain` counts
        them (a probe found 37 here, in the picture's title and in plan diffs, against explain's 1 and the
        graph's one bucket)."""
        counts = Counter((s.kind, self.mesh.axis_names[s.axis]) for _, s in self.collectives())
        for axis, (n, _, launches) in self.stats.get("gradient_all_reduces", {}).items():
            if counts[("all_reduce", axis)] >= n:
                counts[("all_reduce", axis)] -= n - launches
        return +counts

    @property
    def gap_text(self) -> str:
        """The optimality gap as a percentage, or why there is none (a search that proves no bound)."""
        return "unproven" if self.gap != self.gap else f"{self.gap:.2%}"

    @property
    def comm_cost(self) -> float:
        return sum(e.cost for e in self.edges)

    @property
    def compute_cost(self) -> float:
        """The nodes' seconds, the optimizer's step on the parameters (`optimizer_cost`) included."""
        return sum(self.node_costs.values())

    @property
    def optimizer_cost(self) -> float:
        """The optimizer's step on this rank's parameter pieces, in training (the parameters' rows)."""
        return sum(self.node_costs.get(name, 0.0) for name in self.labels)

    def fingerprint(self) -> str:
        """Stable hash of every choice and every resharding step: equal on ranks that agree."""
        text = "\n".join(f"{n}:{s}" for n, s in sorted(self.choices.items(), key=lambda kv: kv[0]))
        text += "\n".join(f"{e.consumer}/{e.slot}:{[repr(st) for st in e.steps]}" for e in self.edges)
        text += "".join(f"\nrecompute:{key}" for key in self.recompute)
        text += "".join(f"\nrecompute selectively:{key}" for key in self.recompute_selective)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __str__(self) -> str:
        collectives = ", ".join(f"{k} on {a} x{c}" for (k, a), c in sorted(self.collective_summary().items()))
        memory = f"; {format_bytes(self.predicted_peak_bytes)} per rank" if self.memory else ""
        return (f"Plan on mesh {self.mesh}: {format_seconds(self.objective)} per call (gap {self.gap_text}){memory}; "
                f"collectives: {collectives or 'none'}")
