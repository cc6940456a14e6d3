"""find_recomputable_layers: what recomputing each layer in backward would run again, free and save.

Before: a joint traced graph (nodes tagged forward/backward, carrying their module paths) and the
classes of identical layers (`RepeatedBlocks`, may be empty). After: `Recomputable`, the layers grouped
into stacks (a class of identical layers, in forward order, or a layer of its own), each layer with:
    nodes  its forward nodes backward would run again (`graph_facts.recompute_region`)
    frees  the saved activations (by base, as `memory_terms` counts them) no longer held
    adds   the values outside the region backward then reads saved that it did not before
The solver (`solve_placements`) chooses how many layers of each stack to recompute, trading the region's
seconds against the bytes it frees; `recompute_layers` rewrites the rank graph for the layers it chose.
Nothing here changes the graph.
"""
from __future__ import annotations

from dataclasses import dataclass

from spmd.core.errors import SpmdError
from spmd.core.graph_facts import phase_of, recompute_region, view_base
from spmd.core.specs import TensorInfo
from spmd.passes.find_repeated_blocks import RepeatedBlocks, instances


@dataclass(frozen=True)
class RecomputableLayer:
    key: str  # "model.layers.3": the module-list element
    nodes: tuple[str, ...]  # run again in backward, in graph order
    frees: tuple[str, ...]  # saved activations no longer held (base node names)
    adds: tuple[str, ...]  # values newly held for backward (base node names)


@dataclass(frozen=True)
class Recomputable:
    """`stacks`: layers that share placements (a class of identical layers, the representative first,
    then forward order) or a layer alone. `mode`: "auto" (the solver decides, under a memory budget),
    "all" (every layer of every stack), "never" (the solver recomputes none; a saved plan may)."""

    stacks: tuple[tuple[RecomputableLayer, ...], ...] = ()
    mode: str = "auto"

    def __bool__(self) -> bool:
        return bool(self.stacks)


def find_recomputable_layers(traced, blocks: RepeatedBlocks | None, recompute: bool | None) -> Recomputable:
    """`recompute`: None lets the solver decide, True recomputes every layer, False none."""
    if not traced.joint:
        if recompute:
            raise SpmdError("recompute=True: only training recomputes (backward runs a layer's forward again). "
                            "What to do: pass a loss_fn (or training=True), or leave recompute unset.")
        return Recomputable()
    graph = traced.graph

    def in_backward(node) -> bool:
        return phase_of(node) == "backward"

    read_back = [n for n in graph.nodes if n.op == "call_function" and not in_backward(n)
                 and any(in_backward(u) for u in n.users)]
    saved = {view_base(n) for n in read_back}
    saved = {b for b in saved if b.op == "call_function" and isinstance(traced.tensor_info.get(b.name), TensorInfo)}

    def layer(key: str, nodes) -> RecomputableLayer | None:
        region, frontier = recompute_region([n for n in nodes if not in_backward(n)], in_backward)
        if not region:
            return None
        members = set(region)
        still = {view_base(n) for n in (*frontier, *(n for n in read_back if n not in members))}
        frees = [b for b in dict.fromkeys(view_base(n) for n in region) if b in saved and b not in still]
        adds = [b for b in dict.fromkeys(view_base(f) for f in frontier)
                if b.op == "call_function" and b not in saved and isinstance(traced.tensor_info.get(b.name), TensorInfo)]
        return RecomputableLayer(key, tuple(n.name for n in region), tuple(b.name for b in frees),
                                 tuple(b.name for b in adds))

    found = {k[: -len("/fwd")]: nodes for k, nodes in instances(traced).items() if k.endswith("/fwd")}
    order = {n: i for i, n in enumerate(graph.nodes)}
    stacks, placed = [], set()
    classes = [[k[: -len("/fwd")] for k in c] for c in (blocks.classes if blocks is not None else ())
               if c[0].endswith("/fwd")]
    for members in classes + [[k] for k in found]:
        if any(k in placed for k in members):
            continue
        placed.update(members)
        rest = sorted(members[1:], key=lambda k: order[found[k][0]])
        layers = [layer(k, found[k]) for k in [members[0], *rest]]
        if all(lay is not None for lay in layers):
            stacks.append(tuple(layers))
    stacks.sort(key=lambda s: order[found[s[0].key][0]])
    if recompute and not stacks:
        raise SpmdError("recompute=True: the model has no layers to recompute (a layer is an element of an "
                        "nn.ModuleList or nn.Sequential whose forward saves activations for backward). What to do: "
                        "keep the blocks in a module list, or leave recompute unset.")
    return Recomputable(tuple(stacks), {None: "auto", True: "all", False: "never"}[recompute])
