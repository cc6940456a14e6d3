"""emit_rank_graph: the graph one rank runs, on its local shards.

Before: the graph from `insert_collectives` (global shapes, steps naming mesh axes). After: a plain
GraphModule for rank `rank`: shape arguments of views and factories rewritten to local shapes, each
step bound to this rank's process group name, axis size and coordinate, ops that index a split dim
(vocab-parallel embedding and loss) rewritten to their masked local forms for this rank's rows, and size
arguments of the whole tensors made this rank's (`rules/local_sizes.py`: squeeze, group norm), and the matrices of
ops that read their layout given the traced one (`LAYOUT_SENSITIVE`). Its code is what `compiled.code` prints.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from spmd.core.collectives import STEP_FUNCTIONS
from spmd.core.errors import SpmdError, describe_node, user_source_line
from spmd.core.local_ops import in_traced_layout, owning_contiguous, owns_its_storage
from spmd.core.specs import local_shape
from spmd.passes.rules import LOCAL_REWRITES
from spmd.passes.rules.registry import TracedShape

aten = torch.ops.aten

# op -> index of its shape argument that must become the local shape of the output.
SHAPE_ARG = {
    aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1, aten.expand.default: 1,
    aten.new_zeros.default: 1, aten.new_ones.default: 1, aten.new_empty.default: 1, aten.new_full.default: 1,
    aten.view_copy.default: 1, aten.expand_copy.default: 1,
    aten.full.default: 0, aten.zeros.default: 0, aten.ones.default: 0, aten.empty.memory_format: 0,
    aten.empty_permuted.default: 0, aten._efficientzerotensor.default: 0,
}
# resizes' backwards, whose input_size is the gradient's shape (DTensor splits them on batch and channels): it stayed
# global, and every antialiased resize's backward failed on its piece (found by a probe; the others decompose)
SHAPE_ARG.update({getattr(aten, name).default: 2 for name in (
    "upsample_nearest1d_backward", "upsample_nearest2d_backward", "upsample_nearest3d_backward",
    "_upsample_nearest_exact1d_backward", "_upsample_nearest_exact2d_backward", "_upsample_nearest_exact3d_backward",
    "upsample_linear1d_backward", "upsample_bilinear2d_backward", "upsample_bicubic2d_backward",
    "upsample_trilinear3d_backward", "_upsample_bilinear2d_aa_backward", "_upsample_bicubic2d_aa_backward",
    "_upsample_lanczos2d_aa_backward") if hasattr(aten, name)})

# ops whose result depends on whether their matrix is contiguous (they factor its transpose then), with a backward
# traced for the layout they saw: their input is given that layout (`in_traced_layout`)
LAYOUT_SENSITIVE = {aten._linalg_det.default, aten._linalg_slogdet.default, aten._linalg_solve_ex.default}

# ops that read their input's storage by strides and offset, not its values as a tensor: their input must be laid
# out as traced, which only a contiguous tensor owning its storage can be everywhere (`owning_contiguous`)
READS_STORAGE = {aten.as_strided.default, aten.as_strided_copy.default, aten.as_strided_scatter.default}


def _refuse_a_view_read_through(node: fx.Node) -> None:
    """An `as_strided` of a view (a transposed, sliced or offset tensor) reads the storage under the view, which
    no rank holds as one device does: each holds a piece, or a copy gathered contiguous (found by a review: 0.60
    off, silently, for `h.mT.as_strided(...)`; an out-of-bounds error for a slice)."""
    val = node.args[0].meta.get("val")
    if not isinstance(val, torch.Tensor) or owns_its_storage(val):
        return
    raise SpmdError(
        f"{describe_node(node)}: as_strided reads the memory under its input, and its input is a view of another "
        f"tensor (strides {tuple(val.stride())}, offset {val.storage_offset()}, over {val.untyped_storage().nbytes()}"
        " bytes): no rank holds that memory as one device does (each holds its piece, or a copy gathered anew), so it "
        "would read other values. What to do: give it a tensor of its own first (`x.clone().as_strided(...)`), or "
        "use view ops that name what they take (`unfold`, slicing, `diagonal`, `movedim`).")


def _first_arg_through(graph: fx.Graph, node: fx.Node, fn, *args) -> None:
    """`node`'s first argument given as `fn(it, *args)`, called just before it."""
    with graph.inserting_before(node):
        given = graph.call_function(fn, (node.args[0], *args))
    node.args = (given, *node.args[1:])


def emit_rank_graph(global_gm: fx.GraphModule, mesh, rank: int, group_names: tuple[str, ...],
                    device: torch.device | None = None) -> fx.GraphModule:
    """`device`: where this rank runs; factory ops traced on another device of the same type (say
    cuda:0 while this rank owns cuda:3) are moved to it."""
    coord = mesh.coordinate(rank)
    nodes = {n.name: n for n in global_gm.graph.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in global_gm.graph.nodes:
        new = graph.node_copy(node, lambda n: env[n])
        env[node] = new
        if node.op != "call_function":
            continue
        traced_device = new.kwargs.get("device")
        if device is not None and isinstance(traced_device, torch.device) and traced_device.type == device.type:
            new.kwargs = {**new.kwargs, "device": device}
        if node.target in STEP_FUNCTIONS.values():
            kwargs = dict(new.kwargs)
            axis = kwargs.pop("mesh_axis")
            world = mesh.shape[axis]
            if node.target in (STEP_FUNCTIONS["shard_local"],):
                kwargs.update(index=coord[axis], world=world)
            elif node.target is STEP_FUNCTIONS["partial_local"]:
                kwargs.update(index=coord[axis])
            else:
                kwargs.update(group=group_names[axis], world=world, where=_where(node, mesh.axis_names[axis], nodes))
            new.kwargs = kwargs
        if node.target in LAYOUT_SENSITIVE and isinstance(node.args[0], fx.Node) \
                and isinstance(val := node.args[0].meta.get("val"), torch.Tensor):
            _first_arg_through(graph, new, in_traced_layout, val.is_contiguous())
        if node.target in READS_STORAGE and isinstance(node.args[0], fx.Node):
            _refuse_a_view_read_through(node)
            _first_arg_through(graph, new, owning_contiguous)
        if node.target in LOCAL_REWRITES and "spmd_strategy" in node.meta:
            shapes = tuple(TracedShape.of(a.meta.get("val")) if isinstance(a, fx.Node) else None for a in node.args)
            local = LOCAL_REWRITES[node.target](new.args, node.meta["spmd_strategy"], shapes, mesh.shape, coord)
            if local is not None:
                new.target, new.args = local[:2]
                new.kwargs = new.kwargs if local[2] is None else local[2]
        if node.target is aten.view.default:
            # Local tensors can be laid out differently from the traced run (collectives return
            # contiguous tensors, kernels pick layouts by shape), so a view may need a copy: reshape.
            new.target = aten.reshape.default
        if node.target in SHAPE_ARG:
            i = SHAPE_ARG[node.target]
            val = node.meta["val"]
            local = local_shape(tuple(val.shape), node.meta["spmd_placements"][0], mesh.shape)
            args = list(new.args)
            old = list(args[i])
            args[i] = [(-1 if o == -1 else s) for o, s in zip(old, local)] if len(old) == len(local) else list(local)
            new.args = tuple(args)
    gm = fx.GraphModule(global_gm, graph)
    gm.recompile()
    return gm


def _where(step: fx.Node, axis_name: str, nodes: dict) -> str:
    """"addmm_3 on mesh axis tp, needed by add_1 at model.py:54": what a failing collective was doing."""
    value, consumer = step.meta.get("spmd_for", (step.name, None))
    reader = nodes.get(consumer)
    line = user_source_line(reader if reader is not None else step)
    return f"{value} on mesh axis {axis_name}, needed by {consumer or 'the output'}" + (
        f" at {line}" if line != "<no source location>" else "")
