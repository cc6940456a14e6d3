"""Readable dumps of the graph between passes (`SPMD_DUMP=dir` or `compile(..., dump_dir=...)`).

Each line is one node, its annotation at the right; the user's source line heads each block of nodes
that came from it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch.fx as fx

from spmd.errors import user_source_line


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
