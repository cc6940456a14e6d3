"""Per-rank memory of a plan: parameters, gradients, optimizer state, saved activations, inputs.

Each term is a value of the graph whose bytes on one rank depend on the placements the plan gives it:
`nbytes / (product of the mesh axes sharding it) * factor`. Parameters, optimizer state, buffers and
inputs are held all the time. In training, every activation saved for backward is alive when backward
starts, and no gradient is yet; backward then frees the activations layer by layer as it makes the
gradients, which are all alive when it ends. These terms are linear in the solver's choices: the
persistent ones with the saved activations form the `memory_budget` row (the bytes alive when backward
starts, less its temporaries), the persistent ones with the gradients a second row (when it ends).

`Schedule` walks the schedule with the chosen placements: the bytes of intermediate values alive at
each point, each parameter's gradient from the node that makes it to the end. Its worst point is the
plan's predicted peak (with the persistent terms). Measured on one H200 (bench/results_gpu.md), counting
every gradient and every saved activation at once overstated a GPT's step by 11-26%: its peak comes
when backward starts, where no gradient exists yet.
"""
from __future__ import annotations

from dataclasses import dataclass

from spmd.core.graph_facts import is_view, view_base
from spmd.core.specs import Placements, TensorInfo, Value, pieces


# the kinds alive when backward ends, not when it starts: every gradient, and the optimizer step's temporaries
AT_THE_STEP = ("gradients", "optimizer step")


@dataclass(frozen=True)
class MemoryTerm:
    value: Value
    kind: str  # parameters | gradients | optimizer | optimizer step | buffers | inputs | activations
    info: TensorInfo
    factor: float = 1.0

    def bytes(self, placements: Placements, mesh_shape: tuple[int, ...]) -> float:
        return self.info.nbytes / pieces(placements, mesh_shape) * self.factor


def stepped_parameters(traced) -> set[str]:
    """The placeholders of the parameters a training step's optimizer updates: those backward gives a
    gradient (not frozen, and reached from the loss: torch's optimizers skip a parameter whose .grad is
    None). Empty for an inference graph."""
    if not traced.joint:
        return set()
    outs = traced.graph.output_node().args[0]
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    graded = {k.name for a, k in zip(outs, traced.output_kinds()) if k.kind == "grad" and a is not None}
    return {gi.placeholder for gi in traced.inputs
            if gi.kind == "parameter" and gi.name not in traced.frozen and gi.name in graded}


def optimizer_step_factor(optimizer_state_factor: float, device) -> float:
    """What the optimizer's step allocates at once, in parameter sizes: an Adam-family optimizer (2 values of
    state per element) in torch's multi-tensor form, the default where `device.foreach_optimizer` (CUDA), makes
    the square root of every second moment before it divides (`_foreach_sqrt`): one more copy of the state's
    second half, alive with the parameters, all gradients and the state. SGD's momentum is updated in place,
    and the per-tensor form (CPU) holds two temporaries of one piece at a time: neither is counted."""
    return 1.0 if optimizer_state_factor >= 2 and device.foreach_optimizer else 0.0


def memory_terms(traced, optimizer_state_factor: float = 2.0, step_factor: float = 0.0) -> list[MemoryTerm]:
    """What one rank holds, as terms over graph values. `optimizer_state_factor`: optimizer state per
    parameter element, in parameter sizes (Adam/AdamW 2, SGD with momentum 1, plain SGD 0). A parameter
    that backward gives no gradient (frozen, or not reached from the loss: its output is None) gets no
    gradient and no optimizer state (torch's optimizers skip a parameter whose .grad is None). `step_factor`
    (`optimizer_step_factor`): the optimizer step's temporaries, "optimizer step", held only at the step,
    after backward, with every gradient."""
    terms: list[MemoryTerm] = []
    stepped = stepped_parameters(traced)
    for gi in traced.inputs:
        info = traced.tensor_info[gi.placeholder]
        value = (gi.placeholder, 0)
        if gi.kind == "parameter":
            terms.append(MemoryTerm(value, "parameters", info))
            if gi.placeholder in stepped:
                terms.append(MemoryTerm(value, "gradients", info))
                if optimizer_state_factor:
                    terms.append(MemoryTerm(value, "optimizer", info, optimizer_state_factor))
                if step_factor:
                    terms.append(MemoryTerm(value, "optimizer step", info, step_factor))
        elif gi.kind in ("buffer", "constant"):
            terms.append(MemoryTerm(value, "buffers", info))
        elif gi.kind == "input":
            terms.append(MemoryTerm(value, "inputs", info))
    if traced.joint:
        seen: set[str] = set()
        for node in traced.graph.nodes:
            if node.op != "call_function" or node.meta.get("partitioner_tag") == "is_backward":
                continue
            if not any(u.meta.get("partitioner_tag") == "is_backward" for u in node.users):
                continue
            base = view_base(node)  # a saved view keeps its base alive, not a copy
            info = traced.tensor_info.get(base.name)
            if base.op != "call_function" or base.name in seen or not isinstance(info, TensorInfo):
                continue
            seen.add(base.name)
            terms.append(MemoryTerm((base.name, 0), "activations", info))
    return terms


@dataclass(frozen=True)
class LivePoint:
    """One point of the schedule: the `index`-th node (`at`) while it runs, with its output made (`made`)
    or not yet. `values`: the nodes whose outputs are alive there, whatever the placements (a view's base
    stands for it). A resharded copy is alive there when one of its readers starts at or before `index`
    and one ends at or after it (`Schedule.spans`)."""

    index: int
    at: str
    made: bool
    values: tuple[str, ...]
    gradients: tuple[str, ...] = ()  # the parameters (placeholders) whose gradients are held there


class Schedule:
    """When each intermediate value of a graph is alive in its schedule (node order), independent of the
    placements; `walk` goes through it point by point under chosen placements (`peak`, `hills`), `point`
    says what is alive at one point.

    A value is alive from the node that makes it to its last reader; a view allocates nothing but keeps
    its base alive as long as it lives. Placeholders (parameters, inputs, tangents) and the values in
    `exclude` (parameter gradients, counted as "gradients") are left out. A resharded copy one reader
    reads (an edge of the plan: a weight gathered for a matmul, an all_reduced partial sum) is alive over
    `spans[reader]`: from the reader to its last use through views. As insert_collectives makes them,
    one copy per (value, layout, phase) serves every reader in that phase, alive from the first to the
    last. `gradients` (gradient node -> its parameter's placeholder): from the node that makes it to the
    end, each parameter's gradient is held in the parameter's layout (the piece the rank graph returns).
    `bucket_bytes`: the gradient all_reduces are packed into buckets of at most that many bytes
    (bucket_gradients): at each bucket's launch, after its last gradient is made, its flat copy is alive
    beside the gradients it copies (`_bucket_packing`).
    """

    def __init__(self, graph, tensor_info: dict, exclude: set[str] = frozenset(),
                 gradients: dict[str, str] | None = None, bucket_bytes: float | None = None):
        self.nodes, self.tensor_info, self.bucket_bytes = list(graph.nodes), tensor_info, bucket_bytes
        self._exclude = frozenset(exclude)
        order = {n: i for i, n in enumerate(self.nodes)}
        base: dict = {}
        for n in self.nodes:
            if n.op == "call_function" and is_view(n.target) and n.args and hasattr(n.args[0], "op"):
                base[n] = base.get(n.args[0], n.args[0])
        # a parameter's gradient (or what it is a view of) leaves through its output as soon as backward is
        # done with it: the rank graph reduces it there, and the reduced piece is counted as "gradients"
        transient = {base.get(n, n) for n in self.nodes if n.name in exclude}
        last: dict = {}
        for n in self.nodes:
            for a in n.all_input_nodes:
                root = base.get(a, a)
                if n.op != "output" or root not in transient:
                    last[root] = max(last.get(root, order[root]), order[n])
        for root in transient - last.keys():
            last[root] = order[root]
        # (node, first index alive, last index alive) of every value that may hold bytes
        self.values = [(n, order[n], last.get(n, order[n])) for n in self.nodes
                       if n.op == "call_function" and n not in base]
        self.roots = {n for n, _, _ in self.values}
        self.last = {n: i for n, _, i in self.values}
        self.frees: dict[int, list] = {}
        for n, _, i in self.values:
            self.frees.setdefault(i, []).append(n)
        self._order, self._base = order, base
        self._rebuilt_memo: dict[tuple, tuple] = {}
        self.spans = {n.name: (order[n], _last_through_views(n, order)) for n in self.nodes if n.op != "output"}
        self.phase = {n.name: n.meta.get("partitioner_tag") for n in self.nodes}
        self._split: dict[str, tuple] = {}
        # index -> the parameters whose gradient is made there, held from then on
        self.gradient_at: dict[int, list[str]] = {}
        for n in self.nodes:
            if gradients and n.name in gradients:
                self.gradient_at.setdefault(order[n], []).append(gradients[n.name])

    def temporaries(self, plan, rebuilt=(), packing: bool = False) -> tuple[float, LivePoint | None]:
        """What a plan's schedule holds at its worst point beyond its saved activations (`rebuilt`: the
        regions its backward runs again, see `walk`): the gradients made by then and the intermediate
        values, what the budget row cannot see; and that point. `packing`: with the gradient buckets' flat
        copies (`walk`), which the budget's cuts cannot express (the plan's prediction counts them)."""
        peak, point = self.peak(plan.choices, plan.mesh.shape, plan.edges, rebuilt, packing)
        return max(0.0, peak - plan.memory.get("activations", 0.0)), point

    def peak(self, choices: dict, mesh_shape: tuple[int, ...], edges=(), rebuilt=(), packing: bool = False
             ) -> tuple[float, LivePoint | None]:
        """The most bytes of intermediate values one rank holds at any point under the chosen placements
        (`choices`, node -> strategy; `edges`, the plan's reshardings: their copies), and where."""
        peak, at = 0.0, None
        for live, i, made in self.walk(choices, mesh_shape, edges, rebuilt, packing):
            if live > peak:
                peak, at = live, (i, made)
        return peak, None if at is None else self.point(*at)

    def hills(self, plan, above: float, most: int, rebuilt=()) -> list[LivePoint]:
        """The points where `plan`'s schedule (`rebuilt`: see `walk`) holds more than `above` bytes: the
        highest of each run of such points, at most `most` of them, highest first."""
        runs: list[tuple[float, int, bool]] = []  # the top of each run over `above`
        over = False  # (the point before was over too: the same run)
        for live, i, made in self.walk(plan.choices, plan.mesh.shape, plan.edges, rebuilt):
            if live > above and not over:
                runs.append((live, i, made))
            elif live > above and live > runs[-1][0]:
                runs[-1] = (live, i, made)
            over = live > above
        return [self.point(i, made) for _, i, made in sorted(runs, key=lambda r: -r[0])[:most]]

    def rebuilt_lives(self, regions) -> tuple[tuple[dict[int, list], dict[int, list], dict[int, list]], set,
                                              dict[str, int]]:
        """How the schedule changes when backward runs `regions` (tuples of forward node names) again, as
        recompute_layers rewrites the rank graph: a region's copy runs just before the first backward node
        that reads one of its values, and backward reads the copy. So each value of the region that
        backward reads dies after its last forward reader, and is made again there, alive until its last
        backward reader; what the region reads from outside it stays alive until the copy runs.
        Returns ((index -> values whose life ends there now, index -> values made again before it runs,
        index -> the copies that die there), the values whose life changed, region member -> where its
        region's copy starts). A resharded copy a region member reads runs again with it (`walk`)."""
        key = tuple(regions)
        if key in self._rebuilt_memo:
            return self._rebuilt_memo[key]
        order, base, phase = self._order, self._base, self.phase
        by_name = {n.name: n for n in self.nodes}

        def readers(n):  # (forward, backward) reader indices, through views
            fwd, bwd = [], []
            for u in n.users:
                if u.op == "output":
                    continue
                if base.get(u) is not None:
                    f, b = readers(u)
                    fwd += f
                    bwd += b
                (bwd if phase.get(u.name) == "is_backward" else fwd).append(order[u])
            return fwd, bwd

        ends, again, dies, starts = {}, {}, {}, {}
        for region in regions:
            nodes = [by_name[name] for name in region if name in by_name]
            members = set(nodes)
            lives, firsts = [], []
            for n in nodes:  # (a view in the region, of a value outside it, is copied too: its readers count)
                fwd, bwd = readers(n)
                firsts += bwd[:1] and [min(bwd)]
                if n in self.roots and bwd:
                    lives.append((n, max([order[n], *fwd]), max(bwd)))
            if not lives:
                continue
            start = min(firsts)
            starts.update(dict.fromkeys((n.name for n in nodes), start))
            for n, forward_end, backward_end in lives:
                ends[n] = forward_end
                again.setdefault(start, []).append(n)
                dies.setdefault(backward_end, []).append(n)
            for n in nodes:  # what the copy reads from outside the region lives until it runs
                for a in n.all_input_nodes:
                    root = base.get(a, a)
                    if root not in members and root in self.roots and self.last[root] < start:
                        ends[root] = max(ends.get(root, start), start)
        moved: dict[int, list] = {}
        for root, i in ends.items():
            moved.setdefault(i, []).append(root)
        out = (moved, again, dies), set(ends), starts
        self._rebuilt_memo[key] = out
        return out

    def walk(self, choices: dict, mesh_shape: tuple[int, ...], edges=(), rebuilt=(), packing: bool = False):
        """(bytes alive, node index, its output made) at every point of the schedule, in order.
        `rebuilt`: the regions (forward node names) backward runs again (`rebuilt_lives`). `packing`: and where
        a gradient bucket is launched, once more with its flat copy (`_bucket_packing`)."""
        tensor_info = self.tensor_info
        frees, again, dies, starts = self.frees, {}, {}, {}
        if rebuilt:
            (moved, again, dies), changed, starts = self.rebuilt_lives(rebuilt)
            frees = {i: [r for r in roots if r not in changed] for i, roots in self.frees.items()}
            for i, roots in moved.items():
                frees.setdefault(i, []).extend(roots)
        copies_again: dict = {}
        copies: dict[tuple, list] = {}  # (value, layout, phase) -> [first reader, last reader, bytes]
        rerun: set = set()  # forward copies every reader of which is in one recomputed region: they run again
        if starts:
            where: dict[tuple, set] = {}
            for e in edges:
                if e.consumer in self.spans and self.phase[e.consumer] != "is_backward":
                    where.setdefault((e.value, e.dst), set()).add(starts.get(e.consumer))
            rerun = {key for key, found in where.items() if len(found) == 1 and None not in found}
        for e in edges:
            span = self.spans.get(e.consumer)
            info = tensor_info.get(e.value[0])
            info = info[e.value[1]] if isinstance(info, tuple) else info
            if span is None or not isinstance(info, TensorInfo):
                continue  # an output sink: a gradient in its parameter's layout, counted as "gradients"
            size = info.nbytes / pieces(e.dst, mesh_shape)
            if (e.value, e.dst) in rerun and e.consumer in starts:  # forward's copy dies with the region's
                forward_last, backward_last = self.split_spans[e.consumer]  # forward readers; backward's
                span = (span[0], forward_last)  # is made again with the region's copy
                if backward_last is not None:
                    key = (e.value, e.dst, "again", starts[e.consumer])
                    if key in copies:
                        copies[key][1] = max(copies[key][1], backward_last)
                    else:
                        copies[key] = [starts[e.consumer], backward_last, size]
            key = (e.value, e.dst, self.phase[e.consumer])
            if key in copies:
                copies[key][0], copies[key][1] = min(copies[key][0], span[0]), max(copies[key][1], span[1])
            else:
                copies[key] = [span[0], span[1], size]
        packed = self._bucket_packing(edges) if packing else {}
        copy_alloc: dict[int, float] = {}
        copy_free: dict[int, float] = {}
        for first, last, size in copies.values():
            copy_alloc[first] = copy_alloc.get(first, 0.0) + size
            copy_free[last] = copy_free.get(last, 0.0) + size
        live = 0.0
        sizes: dict = {}
        for i, n in enumerate(self.nodes):
            live += copy_alloc.get(i, 0.0)  # the node's resharded inputs, alive while it runs
            for root in again.get(i, ()):  # a recomputed region's values, made again before it runs
                copies_again[root] = value_bytes(tensor_info.get(root.name), choices[root.name].outputs, mesh_shape) \
                    if root.name in choices else 0.0
                live += copies_again[root]
            yield live, i, False
            made = n in self.roots and n.name in choices
            held = self.gradient_at.get(i, ())
            if made:
                sizes[n] = value_bytes(tensor_info.get(n.name), choices[n.name].outputs, mesh_shape)
                live += sizes[n]
            if made or held:
                live += sum(value_bytes(tensor_info.get(p), choices[p].outputs, mesh_shape)
                            for p in held if p in choices)
                yield live, i, True
            if i in packed:  # (a bucket launched here: its flat copy, for as long as the launch copies into it)
                yield live + packed[i], i, True
            for root in frees.get(i, ()):
                live -= sizes.pop(root, 0.0)
            for root in dies.get(i, ()):
                live -= copies_again.pop(root, 0.0)
            live -= copy_free.get(i, 0.0)

    def _bucket_packing(self, edges) -> dict[int, float]:
        """Node index -> the bytes of the largest gradient bucket launched after it: the plan's gradient
        all_reduces (not shared), grouped as bucket_gradients groups them (per mesh axis, reduction and element
        size, in the order backward makes the gradients, at most `bucket_bytes` each). `bucket_start` copies a
        bucket's gradients into one flat buffer while they are alive, so the launch holds them twice (found by a
        memory probe: a small GPT's step peaked at the launch of its one dp bucket, 1.21x the prediction). Of
        buckets launched at one point the largest counts (each launch frees the gradients it copied before the
        next copies), and of a gradient reduced on two axes its first all_reduce (the second copies the first's
        result, after its wait, where the gradient itself is gone): found by a review, twice the copy on (2, 2)."""
        if not self.bucket_bytes:
            return {}
        order = {n.name: i for n, i in self._order.items()}
        members = sorted((order[e.value[0]], first.axis, first.reduce_op, first.itemsize, first.in_bytes)
                         for e in edges if e.value[0] in self._exclude and not e.shared and e.value[0] in order
                         for first in [next((s for s in e.steps if s.kind == "all_reduce"), None)] if first)
        open_: dict[tuple, list] = {}  # (axis, reduction, element size) -> [bytes, index of its last gradient]
        packing: dict[int, float] = {}
        for index, *key, nbytes in members:
            bucket = open_.get(tuple(key))
            if bucket is not None and bucket[0] + nbytes > self.bucket_bytes:
                packing[bucket[1]] = max(packing.get(bucket[1], 0.0), bucket[0])
                bucket = None
            if bucket is None:
                bucket = open_[tuple(key)] = [0.0, index]
            bucket[0] += nbytes
            bucket[1] = index
        for size, index in open_.values():
            packing[index] = max(packing.get(index, 0.0), size)
        return packing

    def point(self, index: int, made: bool) -> LivePoint:
        """What is alive at the `index`-th node, before (`made` False) or after its output is made."""
        alive = tuple(n.name for n, first, last in self.values
                      if (first <= index if made else first < index) and index <= last)
        held = tuple(p for i, ps in self.gradient_at.items() if (i <= index if made else i < index) for p in ps)
        return LivePoint(index, self.nodes[index].name, made, alive, held)

    @property
    def split_spans(self) -> dict[str, tuple[int, int | None]]:
        """Node -> (where a value it reads dies if only forward reads through it: itself or its views'
        last forward reader; the last backward reader through its views, or None)."""
        if not self._split:
            self._split = {n.name: _last_split(n, self._order, self.phase) for n in self.nodes if n.op != "output"}
        return self._split

    def gradient_bytes(self, point: LivePoint, choices: dict, mesh_shape: tuple[int, ...]) -> float:
        """Bytes of the gradients held at `point` under the chosen placements."""
        return sum(value_bytes(self.tensor_info.get(p), choices[p].outputs, mesh_shape)
                   for p in point.gradients if p in choices)


def value_bytes(infos, outputs, mesh_shape: tuple[int, ...]) -> float:
    """Bytes on one rank of a node's outputs (`infos`, one TensorInfo or a tuple) laid out as `outputs`."""
    infos = infos if isinstance(infos, tuple) else (infos,)
    return sum(info.nbytes / pieces(ps, mesh_shape) for info, ps in zip(infos, outputs)
               if isinstance(info, TensorInfo) and ps is not None)


def peak_live_bytes(graph, choices: dict, tensor_info: dict, mesh_shape: tuple[int, ...],
                    exclude: set[str] = frozenset(), edges=()) -> tuple[float, str | None]:
    """The most bytes of intermediate values one rank holds at any point of the graph's schedule under
    the chosen placements, and the node where that happens (see `Schedule`)."""
    peak, point = Schedule(graph, tensor_info, exclude).peak(choices, mesh_shape, edges)
    return peak, None if point is None else point.at


def _last_through_views(node, order: dict) -> int:
    """Where a value read by `node` dies: after `node`, or, when `node` is a view of it, after the last
    reader of that view (and of views of it)."""
    last = order[node]
    if node.op == "call_function" and is_view(node.target):
        for user in node.users:
            last = max(last, _last_through_views(user, order))
    return last


def _last_split(node, order: dict, phase: dict) -> tuple[int, int | None]:
    """`_last_through_views`, split: the last forward reader (or `node` itself) and the last backward one."""
    forward, backward = order[node], None
    if node.op == "call_function" and is_view(node.target):
        for user in node.users:
            if user.op == "output":
                continue
            f, b = _last_split(user, order, phase)
            if phase.get(user.name) == "is_backward":
                backward = max(backward or 0, f, b or 0)
            else:
                forward = max(forward, f)
                backward = b if backward is None else max(backward, b or 0)
    return forward, backward
