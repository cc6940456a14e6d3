"""stamp_layers: grow a graph traced with a truncated layer stack back to the model's full depth.

Before: a `TracedGraph` of the model with each `LayerStack` cut to its first `TRACED` layers (see
find_layer_stacks.py), and the full model. After: the graph tracing the full model would give, up to node
names and order among independent nodes: every missing layer is a copy of the middle traced layer,
forward and (joint graphs) backward, with its own parameter placeholders and gradient outputs, its
nodes' module paths renumbered, and the layers after it renumbered; `state` holds the full model's
tensors. Tracing costs ~1 ms per ATen node; stamping ~0.04 ms.

How layers chain is read off the trace, not assumed. With traced layers P, M, N (M copied):

    forward    P ─▶ M ─▶ [M+1 ... M+n] ─▶ N            backward   N ─▶ [M+n ... M+1] ─▶ M ─▶ P
    copy c: inputs in M stay inside copy c; inputs in P come from copy c-1 (M for c = 1); in the
    backward, inputs in N's backward come from copy c+1 (N itself for c = n). N's inputs from M come
    from copy n, M's backward inputs from N's backward from copy 1.

That needs P, M and N to be position-by-position identical (find_repeated_blocks.signature) in each
phase; anything else (a node outside the stack reading M, an input from a farther layer, a gradient
made outside M's backward) means the layers do not chain simply, and the pass returns the reason
instead of a graph, so the caller traces the whole model.
"""
from __future__ import annotations

import functools
import heapq

import torch
import torch.fx as fx

from spmd.core.graph_facts import module_prefix, renumber
from spmd.passes.find_layer_stacks import TRACED, LayerStack
from spmd.passes.find_repeated_blocks import instances, signature
from spmd.passes.trace_module import GraphInput, GraphOutput, TracedGraph, flat_outputs, with_graph

MIDDLE = TRACED - 2  # P = MIDDLE - 1, M = MIDDLE, N = MIDDLE + 1 = the last traced layer


class CannotStamp(Exception):
    """The truncated trace does not show a simple chain of layers (the message says where)."""


def stamp_layers(traced: TracedGraph, stacks: tuple[LayerStack, ...], model: torch.nn.Module) -> TracedGraph:
    """The full-depth graph; raises CannotStamp with the reason when the layers do not chain simply."""
    for stack in stacks:
        traced = _stamp(traced, stack)
    state = dict(traced.state)
    for stack in stacks:
        module = model.get_submodule(stack.fqn)
        state = {k: v for k, v in state.items() if not k.startswith(stack.fqn + ".")}
        for kind in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
            state.update({f"{stack.fqn}.{name}": t.detach() for name, t in kind})
    frozen = frozenset(k for k, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad)
    traced.state, traced.frozen = state, frozen
    return traced


def _layer_of(fqn: str, stack: str) -> int | None:
    if fqn.startswith(stack + "."):
        head = fqn[len(stack) + 1:].split(".", 1)[0]
        if head.isdigit():
            return int(head)
    return None


def _renumbered(fqn: str, stack: str, layer: int) -> str:
    rest = fqn[len(stack) + 1:].split(".", 1)
    return f"{stack}.{layer}" + (f".{rest[1]}" if len(rest) > 1 else "")


def _stamp(traced: TracedGraph, stack: LayerStack) -> TracedGraph:
    graph = traced.graph
    updated = [k.name for k in traced.output_kinds() if k.kind == "buffer_update" and _layer_of(k.name, stack.fqn) is not None]
    if updated:  # (each copy would need its own buffers' new values among the outputs: traced whole instead)
        raise CannotStamp(f"layer buffers are updated in place ({updated[0]})")
    n = stack.depth - TRACED  # layers to add
    P, M, N = MIDDLE - 1, MIDDLE, MIDDLE + 1
    phases = ("fwd", "bwd") if traced.joint else ("fwd",)
    by_key = instances(traced)
    fqns = [i.name for i in traced.inputs if i.kind in ("parameter", "buffer")]
    prefix = module_prefix(traced.graph, fqns) if traced.joint else ""  # a loss_fn's wrapper, not a child `model`

    def members(layer: int, phase: str) -> list[fx.Node]:
        found = by_key.get(f"{prefix}{stack.fqn}.{layer}/{phase}")
        if not found:
            raise CannotStamp(f"layer {stack.fqn}.{layer} put no {phase} nodes in the graph")
        return found

    block = {(layer, phase): members(layer, phase) for layer in (P, M, N) for phase in phases}
    for phase in phases:
        layers = (P, M, N) if phase == "fwd" else (M, N)
        sigs = {signature(block[(layer, phase)]) for layer in layers}
        if len(sigs) != 1:
            raise CannotStamp(f"layers {', '.join(f'{stack.fqn}.{i}' for i in layers)} differ in the {phase} graph")
    where = {node: (layer, phase, i) for (layer, phase), nodes in block.items() for i, node in enumerate(nodes)}

    # parameters (and buffers) of layer M get one placeholder per copy; later layers are renumbered
    by_placeholder = traced.input_by_placeholder()
    m_inputs = [node for node in graph.nodes if node.op == "placeholder"
                and node.name in by_placeholder and _layer_of(by_placeholder[node.name].name, stack.fqn) == M]
    per_layer = set(m_inputs)
    for node in graph.nodes:
        if node.op == "placeholder" and node.name in by_placeholder and node not in per_layer:
            layer = _layer_of(by_placeholder[node.name].name, stack.fqn)
            if layer is not None and layer not in (P, N) and layer < TRACED:
                raise CannotStamp(f"unexpected input {by_placeholder[node.name].name}")

    # what a copy of M's node reads: (copy, source) pairs, or original nodes (copy 0)
    def source_of(copy: int, arg: fx.Node) -> tuple[int, fx.Node]:
        """The node (copy index, node in M or an original) that `arg` of a node of copy `copy` maps to."""
        if arg in per_layer:
            return copy, arg
        pos = where.get(arg)
        if pos is None:
            return 0, arg  # outside the stack: shared by every layer (rotary tables, masks)
        layer, phase, i = pos
        if layer == M:
            return copy, arg
        if layer == P and phase == "fwd":  # the previous layer's activations
            return copy - 1, block[(M, "fwd")][i]
        if layer == N and phase == "bwd":  # the next layer's input gradient
            return (0, arg) if copy == n else (copy + 1, block[(M, "bwd")][i])
        raise CannotStamp(f"{arg.name} ({stack.fqn}.{layer}, {phase}) feeds layer {stack.fqn}.{M}")

    def original_source(node: fx.Node, arg: fx.Node) -> tuple[int, fx.Node]:
        pos, apos = where.get(node), where.get(arg)
        if apos is None or pos is None:
            gradient = node.op == "output" and apos is not None and apos[1] == "bwd"  # of M's parameters
            if apos is not None and apos[0] == M and not gradient:
                raise CannotStamp(f"{node.name}, outside the stack, reads {arg.name} of layer {stack.fqn}.{M}")
            return 0, arg
        if pos[0] == N and apos[0] == M and apos[1] == "fwd":
            return n, arg  # N now follows the last copy
        if pos[:2] == (M, "bwd") and apos[:2] == (N, "bwd"):
            return 1, block[(M, "bwd")][apos[2]]
        return 0, arg

    # order: originals keep theirs; copies of M's forward go after it, copies of M's backward before it
    index = {node: i for i, node in enumerate(graph.nodes)}
    m_fwd_end, m_bwd_start = index[block[(M, "fwd")][-1]], index[block[(M, "bwd")][0]] if traced.joint else 0
    m_last_input = index[m_inputs[-1]] if m_inputs else 0
    virtual: list[tuple[tuple, int, fx.Node]] = []  # (sort key, copy, source node)
    for node in graph.nodes:
        if node.op != "output":
            virtual.append(((index[node], 0, 0, 0), 0, node))
    for c in range(1, n + 1):
        virtual += [((m_last_input, 1, c, index[p]), c, p) for p in m_inputs]
        virtual += [((m_fwd_end, 1, c, index[x]), c, x) for x in block[(M, "fwd")]]
        if traced.joint:
            virtual += [((m_bwd_start, -1, n - c, index[x]), c, x) for x in block[(M, "bwd")]]

    def deps(copy: int, node: fx.Node) -> list[tuple[int, fx.Node]]:
        args = node.all_input_nodes
        return [source_of(copy, a) for a in args] if copy else [original_source(node, a) for a in args]

    keyed = {(c, node): key for key, c, node in virtual}
    users: dict[tuple[int, fx.Node], list[tuple[int, fx.Node]]] = {}
    waiting = {}
    for key, c, node in virtual:
        ds = deps(c, node)
        waiting[(c, node)] = len(ds)
        for d in ds:
            users.setdefault(d, []).append((c, node))
    ready = [(key, c, node) for key, c, node in virtual if waiting[(c, node)] == 0]  # keys are unique
    heapq.heapify(ready)
    order = []
    while ready:
        _, c, node = heapq.heappop(ready)
        order.append((c, node))
        for u in users.get((c, node), ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (keyed[u], *u))
    if len(order) != len(virtual):
        raise CannotStamp("the stamped graph has a cycle")

    # layer numbers: copy c is layer M + c; traced layers after M move up by n
    def layer_after(c: int) -> dict[int, int]:
        return {M: M + c} if c else {i: i + n for i in range(M + 1, TRACED)}

    new = fx.Graph()
    env: dict[tuple[int, fx.Node], fx.Node] = {}
    inputs: list[GraphInput] = []
    for c, node in order:
        if c:
            new_node = new.node_copy(node, lambda a, c=c: env[source_of(c, a)])
        else:
            new_node = new.node_copy(node, lambda a, node=node: env[original_source(node, a)])
        new_node.meta = _renumber_meta(node.meta, prefix + stack.fqn, layer_after(c))
        env[(c, node)] = new_node
        if node.op == "placeholder":
            new_node.target = new_node.name  # a placeholder's target is its argument name in the code
            gi = by_placeholder[node.name]
            layer = _layer_of(gi.name, stack.fqn)
            if layer is not None and (c or layer > M):
                gi = GraphInput(new_node.name, gi.kind, _renumbered(gi.name, stack.fqn, M + c if c else layer + n))
            inputs.append(GraphInput(new_node.name, gi.kind, gi.name))

    # outputs: gradients of copy c's parameters after M's, in parameter order; others renumbered
    out = graph.output_node()
    flat, kinds = flat_outputs(out), traced.output_kinds()
    grads_of_m = [(a, k) for a, k in zip(flat, kinds) if k.kind == "grad" and _layer_of(k.name, stack.fqn) == M]
    new_flat, new_kinds = [], []
    for a, k in zip(flat, kinds):
        layer = _layer_of(k.name, stack.fqn) if k.kind == "grad" else None
        new_flat.append(env[original_source(out, a)] if isinstance(a, fx.Node) else a)
        new_kinds.append(GraphOutput(k.kind, _renumbered(k.name, stack.fqn, layer + n)) if layer is not None and layer > M
                         else k)
        if (a, k) == (grads_of_m[-1] if grads_of_m else None):
            for c in range(1, n + 1):
                for ga, gk in grads_of_m:
                    if ga not in where or where[ga][:2] != (M, "bwd"):
                        raise CannotStamp(f"the gradient of {gk.name} is made outside layer {stack.fqn}.{M}'s backward")
                    new_flat.append(env[(c, ga)])
                    new_kinds.append(GraphOutput("grad", _renumbered(gk.name, stack.fqn, M + c)))
    new.output(tuple(new_flat) if isinstance(out.args[0], (tuple, list)) else new_flat[0])
    new.output_node().meta = dict(out.meta)
    stamped = {f"{prefix}{stack.fqn}.{M + c}/{phase}": f"{prefix}{stack.fqn}.{M}/{phase}"
               for c in range(1, n + 1) for phase in phases}
    return with_graph(traced, new, inputs=tuple(inputs), outputs=tuple(new_kinds) if traced.outputs else (),
                      stamped={**traced.stamped, **stamped})


def _renumber_meta(meta: dict, stack_path: str, moves: dict[int, int]) -> dict:
    """A copy of a node's meta whose module paths under `stack_path.<i>` read `stack_path.<moves[i]>`."""
    if not moves:
        return dict(meta)
    meta = dict(meta)
    key = tuple(moves.items())
    for field in ("nn_module_stack", "fwd_nn_module_stack"):
        if meta.get(field):
            meta[field] = {_renumbered_path(k, stack_path, key): (_renumbered_path(path, stack_path, key), typ)
                           for k, (path, typ) in meta[field].items()}
    return meta


@functools.lru_cache(maxsize=1 << 16)
def _renumbered_path(text: str, stack_path: str, moves: tuple[tuple[int, int], ...]) -> str:
    """`renumber`, remembered: a stamped copy's nodes share a handful of module paths."""
    return renumber(text, stack_path, dict(moves))
