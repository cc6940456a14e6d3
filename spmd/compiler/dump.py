"""Readable dumps of the graph between passes (`SPMD_DUMP=dir` or `compile(..., dump_dir=...)`).

Each line is one node, its annotation at the right; the user's source line heads each block of nodes
that came from it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch.fx as fx

from spmd.core.errors import user_source_line
from spmd.core.specs import placements_str


def _call_text(node: fx.Node) -> str:
    target = node.target
    name = str(target).replace("aten::", "aten.") if hasattr(target, "_schema") else getattr(target, "__name__", str(target))
    args = ", ".join([str(a) for a in node.args] + [f"{k}={v}" for k, v in node.kwargs.items()])
    if node.op == "placeholder":
        return f"{node.name} = input"
    if node.op == "output":
        return f"return {args}"
    return f"{node.name} = {name}({args})"


def format_graph(graph: fx.Graph, annotate: Callable[[fx.Node], str] = lambda n: "") -> str:
    lines, last_src = [], None
    for node in graph.nodes:
        src = user_source_line(node) if node.op == "call_function" else None
        if src and src != last_src:
            lines.append(f"# {src}")
            last_src = src
        text = _call_text(node)
        note = annotate(node)
        lines.append(f"{text:<88}  # {note}" if note else text)
    return "\n".join(lines) + "\n"


class Dumper:
    """Writes `NN-<pass>.txt` into `directory` after each pass (no-op when directory is None)."""

    def __init__(self, directory: str | os.PathLike | None):
        self.directory = Path(directory) if directory else None
        self.count = 0
        if self.directory:
            self.directory.mkdir(parents=True, exist_ok=True)

    def __call__(self, pass_name: str, text: str) -> None:
        if not self.directory:
            return
        self.count += 1
        (self.directory / f"{self.count:02d}-{pass_name}.txt").write_text(text)


# ---- what each pass's dump shows ----------------------------------------------------------------

def dump_traced(v: dict) -> str:
    traced = v["traced"]
    return format_graph(traced.graph, lambda n: f"{traced.tensor_info.get(n.name, '')} "
                                                f"{n.meta.get('partitioner_tag', '')}".rstrip())


def dump_strategies(v: dict) -> str:
    table = v["strategies"]

    def note(n):
        ns = table.nodes.get(n.name)
        if ns is None:
            return ""
        uneven = f", {ns.excluded} excluded as uneven" if ns.excluded else ""
        return f"{len(ns.strategies)} strategies ({ns.source}{uneven})"
    return format_graph(v["traced"].graph, note)


def dump_costs(v: dict) -> str:
    costs = v["costs"]

    def note(n):
        row = costs.node_costs.get(n.name)
        return f"compute {min(row) * 1e6:.1f}..{max(row) * 1e6:.1f} us" if row else ""
    return format_graph(v["traced"].graph, note)


def dump_plan(v: dict) -> str:
    plan = v["plan"]

    def note(n):
        s = plan.choices.get(n.name)
        if s is None:
            return ""
        outs = ", ".join(placements_str(p) for p in s.outputs if p is not None)
        return f"{outs}  {plan.node_costs.get(n.name, 0.0) * 1e6:.1f} us"
    return format_graph(v["traced"].graph, note) + "\n" + plan_table(plan) + "\n"


def dump_placed(gm) -> str:
    """A graph whose nodes carry `spmd_placements` (insert_collectives' output)."""
    def note(node):
        ps = node.meta.get("spmd_placements")
        return ", ".join(placements_str(p) for p in ps if p is not None) if ps else ""
    return format_graph(gm.graph, note)


def plan_table(plan) -> str:
    """Inputs and parameters with their placements, then every op that costs something, with the
    collectives feeding it; views and other free followers are left out (see the dumps for all)."""
    lines = [f"Plan on mesh {plan.mesh}: estimated {plan.objective * 1e3:.3f} ms per call "
             f"(compute {plan.compute_cost * 1e3:.3f} ms, communication {plan.comm_cost * 1e3:.3f} ms); "
             f"lower bound {plan.lower_bound * 1e3:.3f} ms, gap {plan.gap_text}, solved in {plan.solve_seconds:.2f} s"]
    if plan.memory:
        parts = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in plan.memory.items())
        budget = f" (budget {plan.memory_budget / 2**20:.2f} MiB)" if plan.memory_budget else ""
        lines.append(f"  predicted memory per rank: {plan.predicted_peak_bytes / 2**20:.2f} MiB{budget}: {parts} MiB")
    incoming: dict[str, list] = {}
    for e in plan.edges:
        incoming.setdefault(e.consumer, []).append(e)
    width = max((len(plan.labels.get(n, n)) for n in plan.choices), default=4)
    lines.append("  inputs and parameters:")
    for name, s in plan.choices.items():
        if name in plan.labels:
            step = plan.node_costs.get(name, 0.0) * 1e6  # a parameter in training: the optimizer's step
            lines.append(f"    {plan.labels[name]:<{width}}  {placements_str(s.outputs[0])}"
                         + (f"  optimizer step {step:.1f} us" if step >= 0.05 else ""))
    lines.append("  ops (placements of outputs, compute per rank; <- resharding of an input):")
    for name, s in plan.choices.items():
        if name in plan.labels or (plan.node_costs.get(name, 0.0) == 0.0 and name not in incoming):
            continue
        outs = ", ".join(placements_str(p) for p in s.outputs if p is not None) or "-"
        lines.append(f"    {name:<{width}}  {outs:<16} {plan.node_costs.get(name, 0.0) * 1e6:9.1f} us")
        for e in incoming.get(name, []):
            steps = ", ".join(str(st) for st in e.steps)
            lines.append(f"    {'':<{width}}    <- {plan.labels.get(e.value[0], e.value[0])}: {placements_str(e.src)} -> "
                         f"{placements_str(e.dst)}  {steps}  {e.cost * 1e6:.1f} us")
    summary = plan.collective_summary()
    if summary:
        lines.append("  collectives: " + ", ".join(f"{k} on {a}: {c}" for (k, a), c in sorted(summary.items())))
    else:
        lines.append("  collectives: none")
    return "\n".join(lines)
