"""check_dtypes: the traced graph's matrix products take operands of one dtype, as torch's kernels demand.

Before: a traced graph (forward, or forward+backward), every tensor node with `meta["val"]`. After: the same
graph, unchanged; or an `SpmdError` naming the first product whose operands differ in dtype. The trace runs on
fake tensors, whose matmuls do not check dtypes (`addmm(float32, float64, float32)` comes out float64), so a
float32 model compiled with float64 example inputs traced, planned and compiled, then failed at its first call
inside a rank graph with torch's raw error (found by a probe). Autocast's casts are in the graph, so a model run
under it passes.
"""
from __future__ import annotations

import torch
from torch import fx

from spmd.core.errors import SpmdError, describe_node

aten = torch.ops.aten
# the products whose kernels refuse operands of two dtypes (the bias of addmm/baddbmm included; matmul where a graph
# holds it whole: unmerge_bmm's run after this check)
PRODUCTS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
            aten.matmul.default, aten.linear.default}


def check_dtypes(graph: fx.Graph) -> None:
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in PRODUCTS:
            continue
        operands = [a for a in node.args if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        dtypes = [a.meta["val"].dtype for a in operands]
        if len(set(dtypes)) > 1:
            shown = ", ".join(f"{a.name} {d}" for a, d in zip(operands, dtypes))
            raise SpmdError(
                f"check_dtypes: {describe_node(node)} multiplies tensors of different dtypes ({shown}), which "
                "torch refuses when it runs (the trace, on fake tensors, did not). What to do: give example inputs "
                "in the dtype the model computes in (`x.to(next(model.parameters()).dtype)`), or convert the "
                "model before compiling (`model.double()`), or compile under torch.autocast.")
