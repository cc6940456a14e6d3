"""Per-rank memory of a plan: parameters, gradients, optimizer state, saved activations, inputs.

Each term is a value of the graph whose bytes on one rank depend on the placements the plan gives it:
`nbytes / (product of the mesh axes sharding it) * factor`. The predicted peak is their sum: in
training everything here is alive at once when backward starts (parameters, their gradients and
optimizer state, every activation saved for backward).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.tensor import Shard

from spmd.cost_model.compute import is_view
from spmd.specs import Placements, TensorInfo

Value = tuple[str, int]


@dataclass(frozen=True)
class MemoryTerm:
    value: Value
    kind: str  # parameters | gradients | optimizer | buffers | inputs | activations
    info: TensorInfo
    factor: float = 1.0

    def bytes(self, placements: Placements, mesh_shape: tuple[int, ...]) -> float:
        pieces = math.prod(n for p, n in zip(placements, mesh_shape) if isinstance(p, Shard))
        return self.info.nbytes / pieces * self.factor


def memory_terms(traced, optimizer_state_factor: float = 2.0) -> list[MemoryTerm]:
    """What one rank holds, as terms over graph values. `optimizer_state_factor`: optimizer state per
    parameter element, in parameter sizes (Adam/AdamW 2, SGD with momentum 1, plain SGD 0)."""
    terms: list[MemoryTerm] = []
    for gi in traced.inputs:
        info = traced.tensor_info[gi.placeholder]
        value = (gi.placeholder, 0)
        if gi.kind == "parameter":
            terms.append(MemoryTerm(value, "parameters", info))
            if traced.joint and gi.name not in traced.frozen:
                terms.append(MemoryTerm(value, "gradients", info))
                if optimizer_state_factor:
                    terms.append(MemoryTerm(value, "optimizer", info, optimizer_state_factor))
        elif gi.kind in ("buffer", "constant"):
            terms.append(MemoryTerm(value, "buffers", info))
        elif gi.kind == "input":
            terms.append(MemoryTerm(value, "inputs", info))
    if traced.joint:
        seen: set[str] = set()
        for node in traced.graph.nodes:
            if node.op != "call_function" or node.meta.get("partitioner_tag") == "is_backward":
                continue
            if not any(u.meta.get("partitioner_tag") == "is_backward" for u in node.users):
                continue
            base = node
            while base.op == "call_function" and is_view(base.target) and base.args and hasattr(base.args[0], "op"):
                base = base.args[0]  # a saved view keeps its base alive, not a copy
            info = traced.tensor_info.get(base.name)
            if base.op != "call_function" or base.name in seen or not isinstance(info, TensorInfo):
                continue
            seen.add(base.name)
            terms.append(MemoryTerm((base.name, 0), "activations", info))
    return terms
