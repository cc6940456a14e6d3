"""find_recomputable_layers: what recomputing each layer in backward would run again, free and save.

Before: a joint traced graph (nodes tagged forward/backward, carrying their module paths) and the
classes of identical layers (`RepeatedBlocks`, may be empty). After: `Recomputable`, the layers grouped
into stacks (a class of identical layers, in forward order, or a layer of its own), each layer with:
    nodes  its forward nodes backward would run again (`graph_facts.recompute_region`)
    frees  the saved activations (by base, as `memory_terms` counts them) no longer held
    adds   the values outside the region backward then reads saved that it did not before
and the same three for recomputing it selectively (`selective`): its matmuls and attention kernels stay
saved and only the ops between them run again (norms, activations, elementwise: most of the bytes, a
small share of the time), or None where that is no different or frees nothing.
The solver (`solve_placements`) chooses how many layers of each stack to recompute, whole and
selectively, trading the regions' seconds against the bytes they free; `recompute_layers` rewrites the
rank graph for the layers it chose. Nothing here changes the graph.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from spmd.core.errors import SpmdError
from spmd.core.graph_facts import is_selectively_kept, phase_of, recompute_region, view_base
from spmd.core.specs import TensorInfo
from spmd.passes.find_repeated_blocks import RepeatedBlocks, instances


@dataclass(frozen=True)
class RecomputableLayer:
    key: str  # "model.layers.3": the module-list element
    nodes: tuple[str, ...]  # run again in backward, in graph order
    frees: tuple[str, ...]  # saved activations no longer held (base node names)
    adds: tuple[str, ...]  # values newly held for backward (base node names)
    selective: "RecomputableLayer | None" = None  # the same, keeping the matmuls and attention saved


@dataclass(frozen=True)
class Recomputable:
    """`stacks`: layers that share placements (a class of identical layers, the representative first,
    then forward order) or a layer alone. `mode`: "auto" (the solver decides, under a memory budget),
    "all" (every layer of every stack), "selective" (every layer that can be, selectively; the others
    not at all), "never" (the solver recomputes none; a saved plan may)."""

    stacks: tuple[tuple[RecomputableLayer, ...], ...] = ()
    mode: str = "auto"

    def __bool__(self) -> bool:
        return bool(self.stacks)


def find_recomputable_layers(traced, blocks: RepeatedBlocks | None, recompute: bool | str | None,
                             memory_budget: float | None = None) -> Recomputable:
    """`recompute`: None lets the solver decide (under `memory_budget`), True recomputes every layer,
    "selective" every layer selectively, False none. None where the model checkpoints every one of its layers
    itself (`torch.utils.checkpoint`, transformers' `activation_checkpointing_enable()`: `traced.checkpoints`,
    the modules the trace ran through it) and there is no budget: every layer, as the model asked. (A model
    that checkpoints some layers only, or through a function of no module, `checkpoint_sequential`: as
    without checkpoints.)"""
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
    read_back_of: dict = {}  # base -> the forward nodes living in it that backward reads
    for n in read_back:
        read_back_of.setdefault(view_base(n), []).append(n)
    saved = {b for b in read_back_of if b.op == "call_function" and isinstance(traced.tensor_info.get(b.name), TensorInfo)}

    def region_of(key: str, nodes, keep=None) -> RecomputableLayer | None:
        region, frontier = recompute_region([n for n in nodes if not in_backward(n)], in_backward, keep)
        if not region:
            return None
        members = set(region)
        held = {view_base(n) for n in frontier}  # (and a base some reader outside the region keeps)
        frees = [b for b in dict.fromkeys(view_base(n) for n in region) if b in saved and b not in held
                 and all(n in members for n in read_back_of[b])]
        adds = [b for b in dict.fromkeys(view_base(f) for f in frontier)
                if b.op == "call_function" and b not in saved and isinstance(traced.tensor_info.get(b.name), TensorInfo)]
        return RecomputableLayer(key, tuple(n.name for n in region), tuple(b.name for b in frees),
                                 tuple(b.name for b in adds))

    def layer(key: str, nodes) -> RecomputableLayer | None:
        whole = region_of(key, nodes)
        light = region_of(key, nodes, is_selectively_kept) if whole is not None else None
        if light is None or len(light.nodes) == len(whole.nodes) or not light.frees:
            return whole  # no matmul to keep, or keeping them frees nothing
        return dataclasses.replace(whole, selective=light)

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
            if any(lay.selective is None for lay in layers):  # a stack recomputes its layers alike
                layers = [dataclasses.replace(lay, selective=None) for lay in layers]
            stacks.append(tuple(layers))
    stacks.sort(key=lambda s: order[found[s[0].key][0]])
    checkpointed = [c for c in traced.checkpoints if c]
    if recompute is None and memory_budget is None and checkpointed and stacks and all(
            any(layer.key == c or layer.key.startswith(c + ".") for c in checkpointed) for s in stacks for layer in s):
        return Recomputable(tuple(stacks), "all")  # (the model checkpoints every layer: so does the plan)
    if recompute and not stacks:
        # (layers there, none of which saves an activation: the list is not the matter)
        why, way = ((f"; its module lists' {len(found)} elements save none: recomputing them would free nothing",
                     "leave recompute unset.") if found else
                    ("", "keep the blocks in a module list, or leave recompute unset."))
        raise SpmdError(f"recompute={recompute!r}: the model has no layers to recompute (a layer is an element of "
                        f"an nn.ModuleList or nn.Sequential whose forward saves activations for backward{why}). "
                        f"What to do: {way}")
    if recompute == "selective" and not any(s[0].selective for s in stacks):
        raise SpmdError("recompute='selective': no layer has a matmul or attention to keep saved with ops between "
                        "them to run again. What to do: recompute=True recomputes the layers whole.")
    return Recomputable(tuple(stacks), {None: "auto", True: "all", "selective": "selective", False: "never"}[recompute])
