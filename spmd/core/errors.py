"""The two kinds of failure.

`SpmdError`: the model or the constraints cannot be partitioned as asked; the message says what, where
(node, ATen op, the user's source line), why, and what to do.
`SpmdInternalError`: a pass broke an invariant; it carries the graph dump for the bug report.
"""
from __future__ import annotations

import os

import torch.fx as fx

TORCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(fx.__file__)))  # torch's own source files
_SPMD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SpmdError(Exception):
    """The model or the user's constraints cannot be partitioned as asked."""


class SpmdCollectiveError(SpmdError):
    """A collective of a compiled graph failed or timed out: the message names it, its mesh axis and
    ranks, and the user's line that needed it (spmd/core/collectives.py)."""


class SpmdInternalError(RuntimeError):
    """A pass broke an invariant. `graph_dump` holds the graph it was working on."""

    def __init__(self, message: str, graph_dump: str = ""):
        super().__init__(message + ("\n\n--- graph ---\n" + graph_dump if graph_dump else ""))
        self.graph_dump = graph_dump


def user_stacklevel() -> int:
    """The `stacklevel` for `warnings.warn`, called from spmd, that points at the innermost caller outside
    spmd and torch (the user's `spmd.compile(...)` line), however deep in the pipeline the warning is."""
    import sys

    frame, level = sys._getframe(1), 1
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_SPMD_DIR + os.sep) and not path.startswith(TORCH_DIR):
            return level
        frame, level = frame.f_back, level + 1
    return 1


def user_source_line(node: fx.Node) -> str:
    """The innermost frame of `node`'s stack trace outside torch and spmd: the user's `file:line  code`
    (spmd's own, such as the wrapper that calls a loss_fn, when no frame of the user's is there)."""
    trace = node.meta.get("stack_trace") or ""
    lines = trace.strip().splitlines()
    best = inner = ""
    for i, line in enumerate(lines):
        line = line.strip()
        if not line.startswith("File "):
            continue
        try:
            path = line.split('"')[1]
            lineno = line.split("line ")[1].split(",")[0]
        except IndexError:
            continue
        if os.path.abspath(path).startswith(TORCH_DIR) or path.startswith("<eval_with_key>"):
            continue  # (a GraphModule's generated code: a torch.cond branch's, found by a probe)
        code = lines[i + 1].strip() if i + 1 < len(lines) else ""
        line = f"{path}:{lineno}  {code}".rstrip()
        if os.path.abspath(path).startswith(_SPMD_DIR + os.sep):
            inner = line  # spmd's own frame (the loss wrapper): only when the user's is missing
        else:
            best = line
    return best or inner or "<no source location>"


def describe_node(node: fx.Node) -> str:
    """`node 'addmm_3' (aten.addmm.default) at models.py:54  q = self.q_proj(x)`"""
    target = getattr(node.target, "__name__", str(node.target))
    if hasattr(node.target, "_schema"):
        target = str(node.target).replace("aten::", "aten.")
    return f"node '{node.name}' ({target}) at {user_source_line(node)}"
