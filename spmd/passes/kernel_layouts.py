"""kernel_layouts: a traced graph whose values carry the meta kernels' strides -> the device kernels' strides.

Before: each node's `meta["val"]` is what torch's meta kernels made while tracing. A few kernels lay their
output out otherwise: batch norm over a non-contiguous input, a transposed activation
(`bn(h.transpose(1, 2))`), returns a tensor contiguous in the input's suggested memory format, on CPU and CUDA
alike, where its meta kernel keeps the input's strides.

After: those nodes' values, and every value computed from them, carry the strides the kernels give. Shapes
and dtypes are unchanged. What reads strides is the random ops' rules, which draw as one device's kernel
fills memory (rules/random.py): a dropout after such a batch norm drew another mask than one device did,
0.036 off its loss (found by a probe). A graph without such a node is returned as it is; one whose values
cannot be computed again (an op the fake tensors refuse) keeps its values, as before this pass.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._prims_common import suggest_memory_format

from spmd.passes.trace_module import TracedGraph

aten = torch.ops.aten

# (kernels whose first output is contiguous in their first input's suggested memory format)
LAID_OUT_BY_INPUT = frozenset({
    aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit.no_stats, aten._native_batch_norm_legit_no_training.default,
    aten.native_batch_norm.default,
})


def laid_out_otherwise(graph: fx.Graph) -> list[fx.Node]:
    """The nodes whose traced values have other strides than their kernels give (the pipeline runs this pass
    where there are some)."""
    return [n for n in graph.nodes if n.target in LAID_OUT_BY_INPUT and _misplaced(n)]


def kernel_layouts(traced: TracedGraph) -> TracedGraph:
    """See the module docstring. The graph is changed in place (its values' strides) and returned."""
    graph = traced.graph
    laid_out = laid_out_otherwise(graph)
    if not laid_out:
        return traced
    run = set(laid_out) | _downstream(laid_out)
    fake_mode = detect_fake_mode([n.meta["val"][0] for n in laid_out])
    attributes = dict(traced.gm.named_modules())
    values: dict[fx.Node, object] = {}

    def value(a):
        if a in values:
            return values[a]
        if a.op == "get_attr":  # (a higher-order op's subgraph)
            return attributes.get(a.target, getattr(traced.gm, a.target, None))
        return a.meta["val"]

    try:
        with fake_mode:
            for node in graph.nodes:
                if node not in run or node.op != "call_function":
                    continue
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), value)
                # (a view the new strides do not allow runs as the rank graphs run it: a reshape, emit_rank_graph)
                op = aten.reshape.default if node.target is aten.view.default else node.target
                out = op(*args, **kwargs)
                if node.target in LAID_OUT_BY_INPUT:
                    first = out[0].contiguous(memory_format=suggest_memory_format(args[0]))
                    out = (first, *out[1:])
                values[node] = out
    except Exception:  # (the values as traced: this pass only ever makes strides truer)
        return traced
    for node, val in values.items():
        node.meta["val"] = val
    return traced


def _misplaced(node: fx.Node) -> bool:
    """Whether the traced value of a `LAID_OUT_BY_INPUT` node has other strides than its kernel gives."""
    val, source = node.meta.get("val"), node.args[0]
    if not isinstance(val, (tuple, list)) or not isinstance(source, fx.Node):
        return False
    x = source.meta.get("val")
    if not isinstance(x, torch.Tensor) or not isinstance(val[0], torch.Tensor) or x.layout != torch.strided:
        return False
    want = torch.empty(tuple(val[0].shape), device="meta", memory_format=suggest_memory_format(x)).stride()
    return tuple(val[0].stride()) != tuple(want)


def _downstream(nodes: list[fx.Node]) -> set[fx.Node]:
    """Every node computed from `nodes`."""
    seen: set[fx.Node] = set()
    stack = [u for n in nodes for u in n.users]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.users)
    return seen
