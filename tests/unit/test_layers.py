"""The house's layers import one way, and no module imports itself round a circle.

    core  ->  cost_model  ->  passes  ->  compiler  ->  runtime | report  ->  api  ->  tools  ->  spmd (the package)

A module may import its own layer or any layer to its left; runtime and report stand side by side and
never import each other (the runtime never imports report code). Every import counts, also one inside a
function.
"""
import ast
from pathlib import Path

import networkx as nx

import spmd

PACKAGE = Path(spmd.__file__).parent
ORDER = ("core", "cost_model", "passes", "compiler", "runtime", "report", "api", "tools", "spmd")
RANK = {"core": 0, "cost_model": 1, "passes": 2, "compiler": 3, "runtime": 4, "report": 4, "api": 5, "tools": 6,
        "spmd": 7}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "spmd"
    return parts[1]


def import_graph() -> nx.DiGraph:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            for t in targets:
                while t not in modules and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in modules and t != name and t.startswith("spmd"):
                    g.add_edge(name, t)
    return g


def test_every_module_is_in_a_layer():
    assert {_layer(m) for m in import_graph()} <= set(ORDER)


def test_no_import_goes_up_a_layer():
    upward = []
    for a, b in import_graph().edges:
        la, lb = _layer(a), _layer(b)
        if RANK[lb] > RANK[la] or (la != lb and RANK[la] == RANK[lb]):
            upward.append(f"{a} ({la}) imports {b} ({lb})")
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, "\n".join(" -> ".join(c + c[:1]) for c in cycles[:10])


def test_the_checks_see_what_they_check():
    """The graph really holds the imports (an empty graph would pass the two tests above)."""
    g = import_graph()
    assert g.has_edge("spmd.passes.solve_placements", "spmd.cost_model.solver")
    assert g.has_edge("spmd.report.result", "spmd.report.explain")
    assert g.has_edge("spmd.api", "spmd.runtime.compiled")
    assert g.number_of_edges() > 100
