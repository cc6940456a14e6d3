"""fuse_decomposed_ops: kernels the trace took apart for the solver, put back together where this rank
runs them on whole rows.

Before: this rank's graph, where `_log_softmax` and its backward were traced as their core-ATen
decompositions (`trace_joint.DECOMPOSED`), every node of one tagged `original_aten` with the op it came
from:

    forward   x ─▶ amax ─▶ sub ─▶ exp ─▶ sum ─▶ log ─▶ sub ─▶ y        (dtype casts around them for bf16)
    backward  g ─▶ sum ─▶ mul(exp(y)) ─▶ sub ─▶ dx

A class dim split over the mesh (a vocabulary-parallel LM head) needs them apart: the max and the sum
are reduced across ranks in between. After: each such chain with no collective inside, one tensor in
(forward: x; backward: g and y), one value read after it and its inner values read by nothing else is a
single `_log_softmax` (`_log_softmax_backward_data`) call. The values are the same up to rounding (what
eager PyTorch computes); the logits are read once instead of four or five times, 2-3 ms of a 29 ms GPT
step on one H200 (bench/results_gpu.md). Chains that do reduce across ranks stay as they are.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.fx as fx

aten = torch.ops.aten

CASTS = frozenset({aten._to_copy.default, torch.ops.prims.convert_element_type.default})
FORWARD_OPS = Counter({aten.amax.default: 1, aten.sub.Tensor: 2, aten.exp.default: 1, aten.sum.dim_IntList: 1,
                       aten.log.default: 1})
BACKWARD_OPS = Counter({aten.exp.default: 1, aten.sum.dim_IntList: 1, aten.mul.Tensor: 1, aten.sub.Tensor: 1})


def _dtype(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return getattr(val, "dtype", None)


def _uncast(node: fx.Node, inside: set) -> fx.Node:
    """The value a chain node reads, looking through the chain's own dtype casts."""
    while node in inside and node.target in CASTS:
        node = node.args[0]
    return node


def _only(chain: list[fx.Node], op) -> fx.Node:
    return next(n for n in chain if n.target == op)


def _one_dim(arg) -> int | None:
    dims = list(arg) if isinstance(arg, (list, tuple)) else [arg]
    return dims[0] if len(dims) == 1 and isinstance(dims[0], int) else None


def _fused_forward(chain: list[fx.Node], inputs: list[fx.Node], out: fx.Node):
    """(op, args) of the one `_log_softmax` call the chain computes, or None."""
    inside = set(chain)
    amax = _only(chain, aten.amax.default)
    x, dim = _uncast(amax.args[0], inside), _one_dim(amax.args[1])
    if inputs != [x] or dim is None or _dtype(out) is None or _dtype(out) != _dtype(x):
        return None
    return aten._log_softmax.default, (x, dim, False)


def _fused_backward(chain: list[fx.Node], inputs: list[fx.Node], out: fx.Node):
    """(op, args) of the one `_log_softmax_backward_data` call the chain computes, or None."""
    inside = set(chain)
    total, exp = _only(chain, aten.sum.dim_IntList), _only(chain, aten.exp.default)
    mul, sub = _only(chain, aten.mul.Tensor), _only(chain, aten.sub.Tensor)
    grad, y, dim = _uncast(total.args[0], inside), _uncast(exp.args[0], inside), _one_dim(total.args[1])
    if len(inputs) != 2 or set(inputs) != {grad, y} or dim is None:
        return None
    # g - exp(y) * sum(g): the difference of the gradient and the product of the other two
    if set(mul.args) != {exp, total} or [_uncast(a, inside) for a in sub.args] != [grad, mul]:
        return None
    if not (_dtype(grad) == _dtype(y) == _dtype(out) is not None):
        return None
    return aten._log_softmax_backward_data.default, (grad, y, dim, _dtype(out))


# keyed by name: the `original_aten` a node carries can be another object for the same overload (graphs
# copied with their meta)
FUSIONS = {
    str(aten._log_softmax.default): (FORWARD_OPS, _fused_forward),
    str(aten._log_softmax_backward_data.default): (BACKWARD_OPS, _fused_backward),
}


def _origin(node: fx.Node) -> str | None:
    op = node.meta.get("original_aten")
    return None if op is None else str(op)


def _chains(graph: fx.Graph) -> list[list[fx.Node]]:
    """Connected runs of nodes decomposed from one fusible op, each in graph order."""
    members = [n for n in graph.nodes if n.op == "call_function" and _origin(n) in FUSIONS]
    parent = {n: n for n in members}

    def root(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in members:
        for a in n.all_input_nodes:
            if a in parent and _origin(a) == _origin(n):
                parent[root(a)] = root(n)
    chains: dict[fx.Node, list[fx.Node]] = {}
    for n in members:
        chains.setdefault(root(n), []).append(n)
    return list(chains.values())


def fusible_chains(graph: fx.Graph) -> list[tuple[list[fx.Node], object, tuple]]:
    """(chain, op, args) of each chain this pass fuses where nothing cuts it: the chain in graph order and
    the one call that computes it (args over the chain's inputs). On a traced graph, these are the
    chains a rank graph runs fused wherever the plan keeps the reduced dim whole on that rank
    (`estimate_costs` prices them so)."""
    found = []
    for chain in _chains(graph):
        want, build = FUSIONS[_origin(chain[0])]
        inside = set(chain)
        if Counter(n.target for n in chain if n.target not in CASTS) != want:
            continue  # another decomposition, or a collective cut the chain in pieces
        outs = [n for n in chain if any(u not in inside for u in n.users)]
        if outs != [chain[-1]]:
            continue  # an inner value is read elsewhere (saved for backward, say): keep them all
        inputs = list(dict.fromkeys(a for n in chain for a in n.all_input_nodes if a not in inside))
        call = build(chain, inputs, chain[-1])
        if call is not None:
            found.append((chain, *call))
    return found


def fuse_decomposed_ops(rank_gm: fx.GraphModule) -> fx.GraphModule:
    """A new graph module with the fusible chains fused (`rank_gm` itself where there are none). A fused
    node takes the name of its chain's last node (what the traced graph and the plan call that value)
    and lists the chain in `meta["spmd_fused"]` (`CompiledModule.verify` replays it there)."""
    fused: dict[fx.Node, tuple] = {}  # a chain's last node -> (op, args, the chain's names)
    skipped: set[fx.Node] = set()
    for chain, op, args in fusible_chains(rank_gm.graph):
        fused[chain[-1]] = (op, args, tuple(n.name for n in chain))
        skipped |= set(chain)
    if not fused:
        return rank_gm
    graph = fx.Graph()
    graph._codegen = rank_gm.graph._codegen  # (a traced graph's pytree calling convention)
    env: dict[fx.Node, fx.Node] = {}
    for node in rank_gm.graph.nodes:
        if node in fused:
            op, args, names = fused[node]
            env[node] = graph.create_node("call_function", op, fx.node.map_arg(args, env.__getitem__), {},
                                          name=node.name)
            env[node].meta = {**{k: v for k, v in node.meta.items() if k != "original_aten"}, "spmd_fused": names}
        elif node not in skipped:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.lint()
    return fx.GraphModule(rank_gm, graph)
