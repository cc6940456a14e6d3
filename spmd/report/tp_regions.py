"""Where DTensor's parallel styles would compute something other than the plan (`to_parallelize_plan`).

`parallelize_module` with `ColwiseParallel`/`RowwiseParallel` shards the styled modules and runs the
user's code between them eagerly on the local tensors the styles hand out: a column-parallel output is
this rank's last-dim shard, a row-parallel output the whole (all-reduced) value. That is the plan only
where the plan also runs that code on those local tensors, unchanged. It is not where the plan moves an
activation on the tensor-parallel axis between the styles (a softmax over a column-parallel output needs
it whole: the plan all-gathers, the eager code would normalize each shard alone), where a model output
is sharded (the user would get one rank's logits), or where the plan rewrites a size for the shards (a
view to the model's global head count).

`style_regions` walks the forward graph once per tensor-parallel axis, tracking for every activation
outside the styled modules whether the eager code would hold exactly the plan's local tensor (or, where
the plan holds partial sums, their total), and collects the connected regions where it would not. The
export then makes those regions whole: the column-parallel modules feeding them gather their outputs
(`output_layouts=Replicate()`), the row-parallel ones reading from them split their inputs
(`input_layouts=Replicate()`). Inside, the eager code runs on whole tensors as on one device: correct,
and where the plan kept something sharded further, slower (a note says which).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from spmd.core.errors import user_source_line
from spmd.core.graph_facts import phase_of
from spmd.core.specs import local_shape, placements_str
from spmd.passes.emit_rank_graph import SHAPE_ARG
from spmd.passes.rules import LOCAL_REWRITES

COLWISE, ROWWISE = "colwise", "rowwise"
_STYLES = {("Linear", "column-parallel"): COLWISE, ("Linear", "row-parallel"): ROWWISE,
           ("Embedding", "vocab-parallel"): ROWWISE, ("Embedding", "hidden-sharded"): COLWISE}


def style_of(module_type: str, role: str) -> str | None:
    """The DTensor style for a module whose weight has `role` on the axis, or None."""
    return _STYLES.get((module_type, role))


@dataclass(frozen=True)
class StyleRegions:
    """For one axis: the styled modules whose outputs the export gathers and whose inputs it splits,
    and, per region where that is not what the plan does, why (for the export's notes)."""

    gather_outputs: tuple[str, ...] = ()
    split_inputs: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    unstyled: tuple[str, ...] = ()  # modules whose parameter is read elsewhere too: left without a style


# What the eager code holds for a value, against the plan's local tensor: LOCAL, the same tensor (a
# piece of the whole, or partial sums); WHOLE, the whole value (the plan holds its piece of it, or partial
# sums of it: DTensor's row-parallel output is all-reduced). Where the plan holds it replicated, both.
LOCAL, WHOLE = "local", "whole"


def style_regions(graph: fx.Graph, plan, table, styles: dict[str, str], where: dict[str, str],
                  axis: int, embeddings: frozenset[str] = frozenset()) -> StyleRegions:
    """`styles`: module path -> COLWISE | ROWWISE on mesh axis `axis`; `where`: node -> innermost module;
    `embeddings`: the styled modules that are embeddings (they read whole indices whatever the style).

    An op outside the styled modules computes what the plan does when each input is the plan's local
    tensor (LOCAL, or WHOLE where the plan has it replicated: the op then runs the rank graph's op), or
    when every input is WHOLE (the op then runs on the whole values, as on one device, and the plan's
    output is a piece of its result). A LOCAL input the plan reshards, or LOCAL and WHOLE inputs the plan
    uses as pieces together, or a LOCAL op whose sizes the plan rewrites for its pieces, is a difference."""
    mesh_shape = tuple(n if i == axis else 1 for i, n in enumerate(plan.mesh.shape))
    edges = {(e.consumer, e.slot): e for e in plan.edges}
    params = dict(plan.labels)

    def styled(name: str) -> str | None:
        """The styled module `name` belongs to (its own parameters included), or None."""
        path = where.get(name)
        if name in params:
            path = params[name].rsplit(".", 1)[0] if "." in params[name] else None
        while path is not None:
            if path in styles:
                return path
            path = path.rsplit(".", 1)[0] if "." in path else None
        return None

    def placement(ps) -> object:
        return ps[axis] if ps is not None else Replicate()

    backward = {n.name for n in graph.nodes if phase_of(n) == "backward"}
    nodes = [n for n in graph.nodes if n.name in table.nodes and n.name not in backward]
    # the model's outputs (the table's `output_k`), which parallelize_module's user gets whole (a buffer's new value,
    # batch norm's running statistics, is no output of the model's: its buffer's layout is noted with the parameters)
    nodes += [_Output(name) for name, ns in table.nodes.items() if ns.source == "output" and not ns.buffer_update
              and all(v[0] not in backward for v in ns.inputs)]
    # a styled module's parameter read elsewhere (a tied weight, `F.linear(h, self.emb.weight)`) would be a
    # DTensor there: mixed with plain tensors (an error), or a tie broken (parallelize_module replaces one
    # name's tensor), so that module is left unstyled
    unstyled: dict[str, str] = {}
    for node in nodes:
        for value in table.nodes[node.name].inputs:
            owner = styled(value[0]) if value[0] in params and value[0] not in backward else None
            if owner is not None and styled(node.name) != owner and owner not in unstyled:
                reader = styled(node.name) or where.get(node.name) or _what(node)
                unstyled[owner] = (f"{params[value[0]]} is read outside {owner} too (by {reader}: a tied weight, or "
                                   f"code using it directly), where a parallel style would make it a DTensor; "
                                   f"{owner} is left unstyled (whole on every rank)")
    styles = {m: s for m, s in styles.items() if m not in unstyled}
    state: dict[str, str | None] = {}  # value outside the styled modules -> LOCAL | WHOLE | None (differs)
    parent: dict[str, str] = {}  # union-find over those values and "out:<module>" for styled outputs

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def join(a: str, b: str) -> None:
        parent[find(a)] = find(b)

    info: list[str] = []  # differences the export keeps on purpose
    failures: dict[str, list[tuple[str, bool]]] = {}  # a member of the region -> (why, the plan differs)
    direct: list[tuple[str, str, str]] = []  # (producer, consumer, why): styled modules with nothing between

    def fail(at: str, why: str, differs: bool) -> None:
        failures.setdefault(at, []).append((why, differs))

    def held(value, module: str | None) -> tuple[str | None, str]:
        """What the eager code holds for `value`, and why that is none of the plan's."""
        name, idx = value
        p = placement(plan.choices[name].outputs[idx])
        if module is None:
            return state.get(name, WHOLE if table.nodes[name].source == "placeholder" else None), ""
        if styles[module] == ROWWISE:
            return WHOLE, ""  # all-reduced (whatever the plan does next)
        ndim = _ndim(table, value)
        if isinstance(p, Shard) and ndim is not None and p.dim == ndim - 1:
            return LOCAL, ""
        return None, f"{module}'s output is {placements_str((p,))} in the plan, not its last-dim shard"

    for node in nodes:
        if node.op == "placeholder":
            state[node.name] = WHOLE  # the user passes inputs whole; unstyled parameters stay whole
            continue
        module = styled(node.name)
        kinds: list[str | None] = []  # per input: "both" (whole and the plan's), LOCAL, WHOLE (as a piece), None
        for j, value in enumerate(table.nodes[node.name].inputs):
            if value[0] in backward:
                continue  # a gradient: the styles' backward is autograd's through this forward
            vmodule = styled(value[0])
            if module is not None and vmodule == module:
                continue  # inside a styled module: the style shards it as the plan does
            st, why = held(value, vmodule)
            src = placement(plan.choices[value[0]].outputs[value[1]])
            e = edges.get((node.name, j))
            dst = placement(e.dst) if e is not None else src
            if module is not None:  # into a styled module: the style's declared input layout must hold
                if styles[module] == COLWISE or module in embeddings:
                    ok, expected = st == WHOLE, "whole"
                else:
                    ndim = _ndim(table, value)
                    ok = st == LOCAL and isinstance(dst, Shard) and dst == src and ndim is not None \
                        and dst.dim == ndim - 1
                    expected = "as its last-dim shard"
                if not ok:
                    why = why or f"{module} would get {value[0]} {'whole' if st == WHOLE else 'as a piece'}, the " \
                        f"style takes it {expected}"
                    if vmodule is not None:
                        direct.append((vmodule, module, why))
                    else:  # input_layouts=Replicate() splits a whole input as the plan does: no difference
                        fail(value[0], why, st != WHOLE)
                continue
            if st != WHOLE:  # (a region is what pieces reach: whole values do not tie regions together)
                join(node.name, f"out:{vmodule}" if vmodule is not None else value[0])
            if isinstance(node, _Output):
                if not isinstance(dst, Replicate):
                    info.append(f"{_what(node)} is {placements_str((dst,))} in the plan (each rank returns its "
                                "piece); the styles return it whole")
                if st != WHOLE:  # output_layouts=Replicate() gathers a column-parallel output: no difference
                    fail(node.name, why or f"{_what(node)} would be each rank's piece",
                         vmodule is None or styles[vmodule] != COLWISE)
                continue
            if st == WHOLE:
                kinds.append("both" if isinstance(dst, Replicate) else WHOLE)
            elif st == LOCAL and dst == src:
                kinds.append(LOCAL)
            else:
                step = " then ".join(s.kind for s in e.steps if s.axis == axis) if e is not None else ""
                kinds.append(None)
                if st is not None:  # gathering a column-parallel output is what output_layouts=Replicate() does
                    fail(node.name, why or f"the plan runs {step or 'a resharding'} ({placements_str((src,))} -> "
                         f"{placements_str((dst,))}) into {_what(node)}",
                         not (vmodule is not None and isinstance(dst, Replicate)))
        if module is not None or isinstance(node, _Output):
            continue
        parent.setdefault(node.name, node.name)
        out = placement(plan.choices[node.name].outputs[0]) if plan.choices[node.name].outputs else Replicate()
        if None in kinds:
            state[node.name] = None
        elif LOCAL not in kinds:  # every input whole: the op runs as on one device
            state[node.name] = WHOLE
        elif WHOLE not in kinds:  # the rank graph's op on the plan's local tensors
            resized = _resized(node, plan, mesh_shape)
            if resized:
                line = user_source_line(node)
                fail(node.name, f"{_what(node)}{f' at {line}' if line else ''} has the whole model's sizes where "
                     f"each rank holds a piece ({resized}; if the code takes them from its input, the default styles fit "
                     "here too, but the traced graph cannot tell)", True)
            state[node.name] = None if resized else (WHOLE if isinstance(out, Replicate) else LOCAL)
        else:
            state[node.name] = None
            fail(node.name, f"{_what(node)} reads pieces and whole values that the plan splits", True)

    regions: dict[str, list[tuple[str, bool]]] = {}
    for at, whys in failures.items():
        regions.setdefault(find(at), []).extend(whys)
    gather, split, notes = set(), set(), []

    def listed(modules: set) -> str:
        names = sorted(modules)
        return ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")

    def changed(why: str, g: set, sp: set) -> str:
        parts = [f"gathers the output of {listed(g)}" if g else "", f"splits the input of {listed(sp)}" if sp else ""]
        return f"{why}; the export {' and '.join(p for p in parts if p)} (whole tensors where the plan keeps pieces)"

    # a column-parallel module gathered for a pair with nothing between makes the region it feeds whole too
    for producer, _, why in direct:
        if styles[producer] == COLWISE and f"out:{producer}" in parent:
            regions.setdefault(find(f"out:{producer}"), []).append((why, False))
    readers: dict[str, set[str]] = {}  # a styled module's output or a glue value -> the row-parallel modules reading it
    for node in nodes:
        m = styled(node.name)
        if m is not None and styles[m] == ROWWISE:
            for v in table.nodes[node.name].inputs:
                source = styled(v[0])
                if source != m and v[0] not in backward:
                    readers.setdefault(f"out:{source}" if source is not None else v[0], set()).add(m)
    for root, whys in regions.items():
        members = {x for x in parent if find(x) == root}
        g = {m for x in members if x.startswith("out:") for m in [x.removeprefix("out:")] if styles[m] == COLWISE}
        # the row-parallel modules reading the region, or reading a gathered module's output directly
        sp = set().union(*(readers.get(x, set()) for x in members | {f"out:{m}" for m in g}))
        gather |= g
        split |= sp
        differs = [w for w, d in whys if d]
        if differs and (g or sp):
            notes.append(changed(differs[0], g, sp))
    for producer, consumer, why in direct:
        g = {producer} if styles[producer] == COLWISE else set()
        sp = {consumer} if styles[consumer] == ROWWISE else set()
        sp |= readers.get(f"out:{producer}", set()) if g else set()
        gather |= g
        split |= sp
        notes.append(changed(why, g, sp))
    return StyleRegions(tuple(sorted(gather)), tuple(sorted(split)), tuple(notes + info + list(unstyled.values())),
                        tuple(sorted(unstyled)))


@dataclass(frozen=True)
class _Output:
    """One of the model's outputs, as a node of the walk."""

    name: str
    op: str = "output"
    target: str = "the model's output"


def _ndim(table, value) -> int | None:
    info = table.nodes[value[0]].outputs[value[1]]
    return len(info.shape) if info is not None and getattr(info, "shape", None) is not None else None


def _what(node) -> str:
    if isinstance(node, _Output):
        return f"the model's output {node.name.removeprefix('output_')}"
    return f"{node.name} ({getattr(node.target, '__name__', node.target)})"


def _resized(node: fx.Node, plan, mesh_shape: tuple[int, ...]) -> str:
    """The local size the plan gives `node`'s size argument on the axis (empty where it keeps the
    model's): a view to the whole head count on a shard, a group norm's whole channels."""
    strategy = plan.choices.get(node.name)
    if strategy is None or node.op != "call_function":
        return ""
    axis = next(i for i, n in enumerate(mesh_shape) if n > 1) if any(n > 1 for n in mesh_shape) else 0
    for a, p in zip([a for a in node.args if isinstance(a, fx.Node)], strategy.inputs):
        # a number equal to the whole size of a dim this op holds a piece of: the code may read it from the
        # tensor's shape (`h / h.shape[-1]`), which each rank's eager code would read as its own
        val = a.meta.get("val")
        shard = p[axis] if p is not None else None
        if isinstance(val, torch.Tensor) and isinstance(shard, Shard) and shard.dim < val.dim():
            whole = int(val.shape[shard.dim])
            if whole != whole // mesh_shape[axis] and any(
                    type(x) in (int, float) and x == whole for x in node.args[1:]):
                return f"the number {whole}, the whole size of a dim each rank holds {whole // mesh_shape[axis]} of"
    if node.target in SHAPE_ARG and _sized_by_the_user(node):
        val = node.meta.get("val")
        sizes = node.args[SHAPE_ARG[node.target]] if len(node.args) > SHAPE_ARG[node.target] else None
        if isinstance(val, torch.Tensor) and isinstance(sizes, (list, tuple)) and len(sizes) == val.dim():
            local = local_shape(tuple(val.shape), strategy.outputs[0], mesh_shape)
            changed = [f"{s}, each rank's {n}" for s, n in zip(sizes, local) if isinstance(s, int) and s != -1 and s != n]
            return ", ".join(changed)
    if node.target in LOCAL_REWRITES:
        shapes = tuple(tuple(a.meta["val"].shape) if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
                       else None for a in node.args)
        local = LOCAL_REWRITES[node.target](node.args, strategy, shapes, mesh_shape, (0,) * len(mesh_shape))
        if local is not None and (local[0] is not node.target or tuple(local[1]) != tuple(node.args)):
            return "its local form"
    return ""


# the torch functions whose size arguments are the user's (a view or expand a decomposition made, of a
# matmul say, takes its sizes from its inputs, which each rank's eager code reads as its own)
_SIZED = ("view", "reshape", "expand", "new_zeros", "new_ones", "new_empty", "new_full", "unflatten", "view_copy",
          "expand_copy", "_unsafe_view", "broadcast_to")


def _sized_by_the_user(node: fx.Node) -> bool:
    fn = node.meta.get("torch_fn")
    return fn is None or str(fn[1]).rsplit(".", 1)[-1] in _SIZED
