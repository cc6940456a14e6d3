"""find_repeated_blocks: find identical layers (transformer blocks) so later passes do their work once.

Before: a traced graph whose nodes carry the module path they came from (`nn_module_stack`, or for
backward nodes `fwd_nn_module_stack`). After: a `RepeatedBlocks` mapping every node of a repeated
instance to its counterpart in the first instance (its representative), plus parameters by FQN
(`layers.7.mlp.up_proj.weight` -> `layers.0.mlp.up_proj.weight`).

An instance is what one element of a module list (`layers.7`) put in the graph, forward and backward
separately. Instances are bucketed by a Weisfeiler-Lehman hash of their subgraph (networkx) and then
checked position by position: same op, same output shapes, same arguments, and every argument either
inside the instance at the same position or outside it with the same shape. Only exact matches map.

    layers.0 (fwd)  n0 ─ n1 ─ n2 ─ ...      representatives
    layers.1 (fwd)  m0 ─ m1 ─ m2 ─ ...      m_i -> n_i
    layers.1 (bwd)  ...                     its own class, matched against layers.0 (bwd)

Users of the map: `enumerate_strategies` copies a representative's strategies, `estimate_costs` its
costs, `solve_placements` gives the counterpart the same variables (identical layers get the same
placements; the ILP is about one layer deep whatever the depth).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import networkx as nx
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from spmd.core.graph_facts import layer_of, layer_stem, module_prefix, phase_of


@dataclass
class RepeatedBlocks:
    representative: dict[str, str] = field(default_factory=dict)  # node name -> node name in instance 0
    classes: list[list[str]] = field(default_factory=list)  # instance keys per class, representative first
    nodes_per_instance: dict[str, int] = field(default_factory=dict)

    def rep(self, name: str) -> str | None:
        return self.representative.get(name)

    def summary(self) -> str:
        if not self.classes:
            return "no repeated blocks"
        return "; ".join(f"{len(c)} x {c[0]} ({self.nodes_per_instance[c[0]]} nodes)" for c in self.classes)


def _phase(node: fx.Node) -> str:
    return "bwd" if phase_of(node) == "backward" else "fwd"


def _instance_key(node: fx.Node) -> str | None:
    """"model.layers.3/fwd": the module-list element that put `node` in the graph, and the phase;
    "" for a node from a module outside any list; None for a node without a module (glue)."""
    phase = _phase(node)
    stack = node.meta.get("fwd_nn_module_stack" if phase == "bwd" else "nn_module_stack")
    if not stack:
        return None
    layer = layer_of(list(stack.values())[-1][0])
    return f"{layer}/{phase}" if layer else ""


def _stem(key: str) -> str:
    """"model.layers.3/fwd" -> "model.layers.#/fwd": only instances of one list can match."""
    path, phase = key.split("/")
    return layer_stem(path) + "/" + phase


def _info(node) -> str:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return repr(tuple(getattr(v, "shape", None) for v in val))
    return repr((getattr(val, "shape", None), getattr(val, "dtype", None)))


def signature(nodes: list[fx.Node]) -> tuple:
    """Position-relative description of an instance: equal signatures mean identical subgraphs."""
    pos = {n: i for i, n in enumerate(nodes)}
    sig = []
    for n in nodes:
        leaves, spec = tree_flatten((n.args, n.kwargs))
        args = tuple(("in", pos[a]) if a in pos else ("ext", _info(a)) if isinstance(a, fx.Node) else ("c", repr(a))
                     for a in leaves)
        sig.append((str(n.target), _info(n), str(spec), args))
    return tuple(sig)


def _wl_hash(nodes: list[fx.Node]) -> str:
    g = nx.DiGraph()
    members = set(nodes)
    for n in nodes:
        g.add_node(n.name, label=f"{n.target}|{_info(n)}")
        for a in n.all_input_nodes:
            if a in members:
                g.add_edge(a.name, n.name)
    with warnings.catch_warnings():  # networkx 3.5 notes that its directed hashes changed: only equality matters
        warnings.simplefilter("ignore", UserWarning)
        return nx.weisfeiler_lehman_graph_hash(g, node_attr="label", iterations=3)


def _same_ops(nodes: list[fx.Node], others: list[fx.Node]) -> bool:
    """A cheap check that a stamped copy lines up with its source (stamp_layers made it so)."""
    return len(nodes) == len(others) and all(a.target == b.target for a, b in zip(nodes, others))


# By default (`tie_blocks=None`) layers tie from two repeats. Tying only costs optimality among plans that lay
# out identical layers differently, which measured nothing on the tests' models (GPT, Llama, transformers
# GPT-2 and Llama, 2 layers, (2, 2), training: the same objective tied and untied), while a 2-layer
# transformers Llama's untied program (115k columns, 54k rows, degenerate at latency-bound costs: 31k dual
# simplex iterations) took 20 s to plan on `megatron_spec`, 8 s tied. Below `AUTO_MIN_REPEATS` a class
# whose parameters the user pinned stays untied: pins on a few layers are usually meant for those layers
# (`0.weight` of `Sequential(Linear, Tanh, Linear)` would pin `2.weight` too).
AUTO_MIN_REPEATS = 4


def instances(traced) -> dict[str, list[fx.Node]]:
    """"model.layers.3/fwd" -> the call nodes that module-list element put in the graph in that phase, in
    graph order (gradient-accumulation glue included, see below)."""
    found: dict[str, list[fx.Node]] = {}
    owner: dict[fx.Node, str] = {}
    glue: set[fx.Node] = set()
    for node in traced.graph.nodes:
        if node.op != "call_function":
            continue
        key = _instance_key(node)
        if key is None:  # glue without a module (gradient accumulation adds): join the instance of an
            # input that has a module of its own (a chain of glue would drag every add into one layer)
            phase = "/" + _phase(node)
            indirect = [owner[a] for a in node.all_input_nodes if a in owner and owner[a].endswith(phase)]
            direct = [owner[a] for a in node.all_input_nodes if a in owner and a not in glue and owner[a].endswith(phase)]
            key = (direct or indirect or [None])[-1]
            if key is not None:
                glue.add(node)
        if key:
            found.setdefault(key, []).append(node)
            owner[node] = key
    return found


def _tie(blocks: RepeatedBlocks, members: list[str], by_key: dict[str, list[fx.Node]]) -> None:
    """One class of identical instances: each node of the later ones maps to the first's."""
    first = by_key[members[0]]
    blocks.classes.append(members)
    blocks.nodes_per_instance[members[0]] = len(first)
    for key in members[1:]:
        for node, rep in zip(by_key[key], first):
            blocks.representative[node.name] = rep.name


def find_repeated_blocks(traced, min_repeats: int = 2, pinned: dict | None = None,
                         pinned_min_repeats: int = 2) -> RepeatedBlocks:
    """Classes of at least `min_repeats` identical instances; of at least `pinned_min_repeats` where a
    member's parameters are among `pinned` (the user's pins: FQN -> placements). Layers pinned
    otherwise than each other (`layers.1.q` replicated, `layers.2.q` sharded) are not identical: each set of
    pins ties apart (tied, they shared one choice that no placement could meet: "Infeasible", found by a
    probe)."""
    by_key = instances(traced)
    by_fqn = {i.name: i.placeholder for i in traced.inputs if i.kind in ("parameter", "buffer")}
    prefix = module_prefix(traced.graph, by_fqn) if traced.joint else ""  # a loss_fn's wrapper, not a child `model`
    pins_of: dict[str, list] = {}  # layer -> its pins, by the names within the layer
    for fqn, placements in (pinned or {}).items():
        layer = layer_of(prefix + fqn)
        if layer is not None:  # (else a parameter of no layer)
            pins_of.setdefault(layer, []).append(((prefix + fqn)[len(layer):], repr(tuple(placements))))
    pin_key = {layer: tuple(sorted(pins)) for layer, pins in pins_of.items()}
    # layers stamp_layers copied are their source node for node: they join its class unhashed
    copies: dict[str, list[str]] = {}
    for key, source in traced.stamped.items():
        if key in by_key and source in by_key and _same_ops(by_key[key], by_key[source]):
            copies.setdefault(source, []).append(key)
    copied = {key for keys in copies.values() for key in keys}
    order = {key: i for i, key in enumerate(by_key)}
    buckets: dict[tuple[str, str], list[str]] = {}
    for key, nodes in by_key.items():
        if key not in copied:
            buckets.setdefault((_stem(key), _wl_hash(nodes)), []).append(key)

    blocks = RepeatedBlocks()
    param_rep: dict[str, str] = {}
    for keys in buckets.values():
        if len(keys) + sum(len(copies.get(key, ())) for key in keys) < 2:
            continue
        by_sig: dict[tuple, list[str]] = {}
        for key in keys:
            by_sig.setdefault(signature(by_key[key]), []).append(key)
        for similar in by_sig.values():
            similar = sorted(similar + [c for key in similar for c in copies.get(key, ())], key=order.__getitem__)
            least = pinned_min_repeats if any(m.split("/")[0] in pin_key for m in similar) else min_repeats
            alike: dict[tuple, list[str]] = {}
            for key in similar:
                alike.setdefault(pin_key.get(key.split("/")[0], ()), []).append(key)
            for members in alike.values():
                if len(members) >= max(2, least):
                    _tie(blocks, members, by_key)

    # a layer's parameters follow the representative of its forward class (the backward class's may be
    # another layer: backward runs last layer first); a representative is never itself mapped
    for members in sorted(blocks.classes, key=lambda m: m[0].endswith("/bwd")):
        first = members[0].split("/")[0]
        if first in param_rep:
            continue
        for key in members[1:]:
            param_rep.setdefault(key.split("/")[0], first)

    # parameters (placeholders, outside every instance) follow their layer: layers.7.x -> layers.0.x
    for fqn, placeholder in by_fqn.items():
        layer = layer_of(prefix + fqn)
        if layer in param_rep:
            rep_fqn = (param_rep[layer] + (prefix + fqn)[len(layer):])[len(prefix):]
            if rep_fqn in by_fqn and traced.tensor_info[by_fqn[rep_fqn]] == traced.tensor_info[placeholder]:
                blocks.representative[placeholder] = by_fqn[rep_fqn]
    # and so do their gradients' output sinks (`output_k` in the strategy table)
    sink = {o.name: f"output_{k}" for k, o in enumerate(traced.output_kinds()) if o.kind == "grad"}
    ph_to_fqn = {p: f for f, p in by_fqn.items()}
    for placeholder, rep in list(blocks.representative.items()):
        fqn, rep_fqn = ph_to_fqn.get(placeholder), ph_to_fqn.get(rep)
        if fqn in sink and rep_fqn in sink:
            blocks.representative[sink[fqn]] = sink[rep_fqn]
    return blocks
