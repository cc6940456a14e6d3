"""`compiled.verify(*inputs)`: this rank's graph against one device, node by node, before a long run.

Every rank interprets its own graph (forward, or forward+backward when training); the rank graphs hold
every node of the traced graph under its own name, in an order that respects the traced graph's edges.
At each traced node, all ranks gather its full value (its placements are the plan's) and rank 0 compares
it with a reference computed on one device:

    "one device"   the reference runs the traced graph on full tensors alongside, from the full weights
                   and inputs: the errors are what a user sees end to end. Needs rank 0 to hold the
                   single-device run (its live values, freed after their last use).
    "op by op"     each op runs once more on the gathered full values of its own arguments: the error of
                   every op in isolation. Needs only the largest op's full arguments; chosen when the
                   single-device run does not fit rank 0's free memory ("auto").

The outputs (and gradients, in training) are then gathered from the rank graph's own outputs, through the
collectives that produce them, and compared with the reference. Ops drawing random numbers (dropout)
cannot agree with a second draw: their reference takes the gathered value, so what follows is compared.
Nothing is written to the module: parameters, gradients and the optimizer are untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from spmd.core.errors import SpmdInternalError, user_source_line
from spmd.core.mesh import ranks_on_this_host
from spmd.runtime.distribute import gather_full, local_shard

# The error allowed, as a fraction of the reference's largest magnitude: a few units of the dtype's
# precision, times the reduction orders a sharded plan changes (partial sums added in another order).
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 5e-3}


@dataclass(frozen=True)
class Difference:
    """The largest difference in one value: `max_abs` = max |actual - reference|, `scale` = max |reference|."""

    what: str  # "output 0", "grad fc1.weight" or the node's name
    node: str
    op: str
    line: str  # the user's source line, when the trace kept it
    max_abs: float
    scale: float
    tolerance: float
    floor: float = 1e-6  # the least scale `error` divides by (see `with_floors`)
    via: str = ""  # an output's last step when a collective after `node` makes it

    @property
    def error(self) -> float:
        """`max_abs` relative to the reference's scale, or to `floor` when that is larger."""
        return self.max_abs / max(self.scale, self.floor)

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance

    def row(self) -> str:
        mark = "ok " if self.ok else "BAD"
        at = f"  {self.line}" if self.line else ""
        via = f" then {self.via}" if self.via else ""
        return f"  {mark} {self.what:<32} {self.max_abs:10.3g} {self.error:10.3g}  {self.node} ({self.op}){via}{at}"


@dataclass(frozen=True)
class VerifyReport:
    """What `compiled.verify` found; `ok` when every output, gradient and node is within tolerance."""

    mode: str  # "one device" or "op by op"
    outputs: tuple[Difference, ...]
    gradients: tuple[Difference, ...]
    worst: Difference | None  # the first node out of tolerance in graph order, else the largest error
    nodes_compared: int
    random_ops: tuple[str, ...]  # nodes whose reference took the gathered value

    @property
    def ok(self) -> bool:
        return (all(d.ok for d in self.outputs + self.gradients) and (self.worst is None or self.worst.ok))

    @property
    def max_error(self) -> float:
        return max((d.error for d in self.outputs + self.gradients), default=0.0)

    def __str__(self) -> str:
        head = (f"verify ({self.mode}): {'OK' if self.ok else 'MISMATCH'}; {self.nodes_compared} nodes compared, "
                "errors relative to the reference's largest magnitude")
        lines = [head, f"       {'value':<32} {'max |diff|':>10} {'error':>10}  node"]
        lines += [d.row() for d in self.outputs + self.gradients]
        if self.worst is not None:
            first = "first node out of tolerance" if not self.worst.ok else "largest node error"
            lines.append(f"{first}:")
            lines.append(self.worst.row())
        if self.random_ops:
            lines.append(f"random ops (reference takes the sharded draw): {', '.join(self.random_ops)}")
        if self.mode == "op by op":
            lines.append("each op was checked on the gathered values of its own inputs: errors are per op, not end "
                         "to end")
        return "\n".join(lines)


def with_floors(diffs: list[Difference], groups: list) -> list[Difference]:
    """A value that is zero in exact arithmetic (the gradient of a bias that softmax cancels) is rounding
    noise on one device and on many, and differs by 100% relative to itself. So each difference is taken
    relative to its own scale or to 1% of the largest scale in its group (outputs, gradients, forward
    nodes, backward nodes), whichever is larger."""
    top: dict = {}
    for d, g in zip(diffs, groups):
        top[g] = max(top.get(g, 0.0), d.scale)
    return [replace(d, floor=max(d.floor, 1e-2 * top[g])) for d, g in zip(diffs, groups)]


def _is_random(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags


_CONVERSIONS = frozenset({torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default})


def inherited_tolerances(gm: fx.GraphModule, infos: dict) -> dict[str, float]:
    """node name -> the tolerance of the least precise arithmetic it was computed from (itself included): a
    float64 gradient through a loss computed in float32 (transformers' causal LM losses) carries float32's
    rounding, which float64's tolerance would call a mismatch. Only ops that compute from values round: inputs,
    constants and factories hold the same values in both runs, and a conversion to a dtype as precise as its
    input's (a bf16 mask made float32) loses nothing."""
    def tol(name: str) -> float:
        info = infos.get(name)
        return max((TOLERANCE.get(i.dtype, 0.0) for i in (info if isinstance(info, tuple) else (info,))
                    if getattr(i, "dtype", None) is not None), default=0.0)

    tolerance: dict[str, float] = {}
    for node in gm.graph.nodes:
        inputs = node.all_input_nodes
        own = tol(node.name) if node.op == "call_function" and inputs else 0.0
        if node.target in _CONVERSIONS and own <= max((tol(a.name) for a in inputs), default=0.0):
            own = 0.0  # (widened, or kept: exact)
        tolerance[node.name] = max([own, *(tolerance.get(a.name, 0.0) for a in inputs)])
    return tolerance


def _difference(what: str, node: fx.Node, actual: torch.Tensor, ref: torch.Tensor,
                tolerances: dict | None = None) -> Difference:
    a, r = actual.detach().double(), ref.detach().double().to(actual.device)
    if a.shape != r.shape:
        max_abs = float("inf")
    else:
        # (equal elements differ by 0, infinities and NaNs in the same places included: an attention mask's -inf
        # made nan, and transformers' SDPA models failed verify at a `scalar_tensor(-inf)` they computed alike)
        same = (a == r) | (a.isnan() & r.isnan())
        max_abs = float((a - r).abs().masked_fill(same, 0.0).max()) if a.numel() else 0.0
    finite = r.abs()[r.isfinite()]  # (the scale of what is finite: an infinity would hide every difference)
    scale = float(finite.max()) if finite.numel() else 0.0
    op = str(node.target) if node.op == "call_function" else node.op
    own = TOLERANCE.get(actual.dtype, 0.0 if not actual.is_floating_point() else 1e-4)
    return Difference(what, node.name, op, user_source_line(node), max_abs, scale,
                      max(own, (tolerances or {}).get(node.name, 0.0)))


def _last_users(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """value name -> the node that reads it last."""
    return {a.name: node for node in gm.graph.nodes for a in node.all_input_nodes}


def _live_peak_bytes(gm: fx.GraphModule, infos: dict) -> int:
    """Peak bytes of a single-device run of `gm` that frees each value after its last use."""
    frees: dict[str, list[str]] = {}
    for value, user in _last_users(gm).items():
        frees.setdefault(user.name, []).append(value)
    live = peak = 0
    sizes = {}
    for node in gm.graph.nodes:
        info = infos.get(node.name)
        parts = info if isinstance(info, (tuple, list)) else (info,)
        sizes[node.name] = sum(i.nbytes for i in parts if i is not None)
        live += sizes[node.name]
        peak = max(peak, live)
        for value in frees.get(node.name, ()):
            live -= sizes.get(value, 0)
    return peak


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux: assume the model fits
        return 1 << 62
    return available // ranks_on_this_host()


def _in_layout_of(full: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`full` laid out in memory in `local`'s dim order (a later `view` may depend on it)."""
    if local.dim() < 2 or local.is_contiguous():
        return full
    order = sorted(range(local.dim()), key=lambda d: -local.stride(d))
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return full.permute(order).contiguous().permute(inverse)


def _tensors(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _close(actual, ref) -> bool:
    """Whether a random op's gathered draw is the reference's: floats within a loose tolerance, integers equal
    (a `randperm` or `multinomial` drawn again by the reference was taken as the same draw: a probe's mixup was
    reported BAD at the `index` after it, the op itself unnamed)."""
    for a, r in zip(_tensors(actual), _tensors(ref)):
        if isinstance(a, torch.Tensor) and isinstance(r, torch.Tensor):
            if a.shape != r.shape:
                return False
            if a.is_floating_point() or a.is_complex():
                if not torch.allclose(a, r.to(a.device), rtol=1e-3, atol=1e-5):
                    return False
            elif not torch.equal(a, r.to(a.device)):
                return False
    return True


# ops whose values are whatever the memory held (`F.affine_grid` makes one and writes it): the reference takes the
# rank's, as for a draw; compared, they were a mismatch of garbage (a probe: `BAD empty`, 1.34e+152)
_UNINITIALIZED = frozenset({torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                            torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default,
                            torch.ops.aten.new_empty_strided.default, torch.ops.aten.empty_permuted.default})


def _adopt(actual, ref):
    """`actual`'s values in `ref`'s layout."""
    if isinstance(ref, torch.Tensor):
        return ref.copy_(actual) if isinstance(actual, torch.Tensor) else actual
    return type(ref)(_adopt(a, r) for a, r in zip(actual, ref))


class _Lockstep(fx.Interpreter):
    """Interprets this rank's graph; after each traced node, `check` gathers and compares it."""

    def __init__(self, gm, check):
        super().__init__(gm, garbage_collect_values=False)
        self.check = check

    def run_node(self, n):
        value = super().run_node(n)
        self.check(n, value, self.env)
        return value


def _output_paths(spec) -> list[str]:
    """Each flat output's path in what the forward returns (`[0]`, `.logits`, `['hidden'][1]`; "" for a tensor
    alone), so a report names a dataclass's or dict's field rather than a flat position (a probe)."""
    positions = tree_unflatten(list(range(spec.num_leaves)), spec)
    return [keystr(path) for path, _ in tree_flatten_with_path(positions)[0]]


def verify(module, full_inputs: tuple, mode: str = "auto") -> VerifyReport:
    """See the module docstring; `module` is a CompiledModule, `full_inputs` are the same on every rank."""
    if mode not in ("auto", "one device", "op by op"):
        raise ValueError(f"verify: mode must be 'auto', 'one device' or 'op by op', not {mode!r}")
    traced_gm, inputs, plan = module._traced_gm, module._graph_inputs, module.plan
    rank0 = dist.get_rank() == 0
    device = module._device or torch.device("cpu")
    if mode == "auto":
        box = [None]
        if rank0:
            fits = _live_peak_bytes(traced_gm, module._tensor_info) < _free_bytes(device) // 2
            box = ["one device" if fits else "op by op"]
        dist.broadcast_object_list(box, src=0)
        mode = box[0]
    whole = mode == "one device"

    mesh, coord, groups = module.mesh_spec, module.coord, module.group_names
    ref_nodes = {n.name: n for n in traced_gm.graph.nodes}
    rank_nodes = {n.name: n for n in module.graph_module.graph.nodes}
    by_placeholder = {gi.placeholder: gi for gi in inputs}
    full_by_name = {s.name: t for s, t in zip(module._input_specs, full_inputs)}

    def placements(name: str, k: int = 0):
        return plan.choices[name].outputs[k]

    def gather(local, ps):
        return _in_layout_of(gather_full(local.detach().contiguous(), ps, mesh, coord, groups), local)

    # the rank graph's arguments: this rank's state, its input shards, and ones as the incoming gradients
    args = []
    for node in module.graph_module.graph.find_nodes(op="placeholder"):
        gi = by_placeholder[node.name]
        if gi.kind in ("parameter", "buffer", "constant"):
            args.append(module.piece(gi.name).detach())
        else:
            info = module._tensor_info[node.name]
            full = (full_by_name[gi.name] if gi.kind == "input"
                    else torch.ones(info.shape, dtype=info.dtype))
            args.append(local_shard(full.to(device), placements(node.name), mesh.shape, coord))

    ref_env: dict[str, object] = {}
    feeds_output = {a.name for a in traced_gm.graph.output_node().all_input_nodes}  # (kept to the end)
    tolerances = inherited_tolerances(traced_gm, module._tensor_info)
    # value -> the rank graph's node whose reference reads it last: the reference runs in the rank graph's
    # order, which may differ from the traced one (a traced order's last reader, run earlier, freed a value
    # another node still read: Mixtral's router softmax, "KeyError: '_softmax_2'")
    last_use: dict[str, str] = {}
    for n in module.graph_module.graph.nodes:
        if (ref_node := ref_nodes.get(n.name)) is not None and n.op != "output" and ref_node.op == "call_function":
            for c in [ref_nodes[name] for name in n.meta.get("spmd_fused", ())] or [ref_node]:
                last_use.update((a.name, n.name) for a in c.all_input_nodes if a.name not in feeds_output)
    kept: dict[str, object] = {}  # op by op: the gathered values that feed the outputs
    # op by op: values a collective later reduces in place (passes/reduce_in_place.py), gathered when made; read
    # back from the rank graph's values when used, they were the sum already (Mixtral's aux loss: 0.155 "off")
    reduced_later = {n.args[0].name for n in module.graph_module.graph.nodes
                     if n.op == "call_function" and n.kwargs.get("inplace") and n.args and isinstance(n.args[0], fx.Node)}
    as_made: dict[str, object] = {}
    failure: list[str] = []  # rank 0's reference run failed: the first error
    diffs: list[Difference] = []
    phases: list[str] = []  # forward or backward, per difference
    random_ops: list[str] = []

    def full_value(node: fx.Node, local):
        """The gathered full value of a traced node (a tuple for multi-output nodes)."""
        if isinstance(local, torch.Tensor):
            return gather(local, placements(node.name))
        if isinstance(local, (tuple, list)):
            return type(local)(gather(t, placements(node.name, k)) if isinstance(t, torch.Tensor) else t
                               for k, t in enumerate(local))
        return local

    def check(n: fx.Node, local, env):
        ref_node = ref_nodes.get(n.name)
        if ref_node is None or n.op == "output" or ref_node.op == "output":
            return
        if ref_node.op == "get_attr":
            if rank0:
                ref_env[n.name] = getattr(traced_gm, ref_node.target)
            return
        if ref_node.op == "placeholder" and not whole and n.name not in feeds_output | reduced_later:
            return  # op by op gathers each argument where it is used
        actual = full_value(ref_node, local)
        if rank0 and not whole and n.name in feeds_output:
            kept[n.name] = actual
        if not whole and n.name in reduced_later:
            as_made[n.name] = actual
        if ref_node.op == "placeholder":
            if rank0 and whole:
                ref_env[n.name] = actual
            return
        # a node fuse_decomposed_ops made of a traced chain (named as its last node): the chain replayed
        chain = [ref_nodes[name] for name in n.meta.get("spmd_fused", ())] or [ref_node]
        if whole:
            lookup = ref_env
        else:  # the op's own arguments, gathered from this rank's values
            inside = {c.name for c in chain}
            lookup = {a.name: as_made[a.name] if a.name in as_made else full_value(a, env[rank_nodes[a.name]])
                      for c in chain for a in c.all_input_nodes if a.name not in inside}
            for name in [name for name in as_made if last_use.get(name) == n.name]:
                del as_made[name]
        if rank0 and not failure:
            try:
                reference(n, chain, actual, lookup)
            except Exception as e:  # rank 0 goes on gathering with the others, and reports at the end
                failure.append(f"{n.name} ({ref_node.target}): {type(e).__name__}: {e}")

    def reference(n, chain, actual, lookup):
        """Rank 0: the node's single-device value (its chain's, for a fused node), compared with the
        gathered one."""
        made: dict[str, object] = {}  # the chain's inner values
        for ref_node in chain:
            ref_args = fx.node.map_arg((ref_node.args, ref_node.kwargs),
                                       lambda a: made[a.name] if a.name in made else lookup[a.name])
            # (a view as the rank graphs run it: a reshape, since a kernel may lay its output out otherwise than the
            # trace's fake one did: batch norm over a transposed input returns it contiguous; found by a probe)
            view = ref_node.target is torch.ops.aten.view.default
            target = torch.ops.aten.reshape.default if view else ref_node.target
            made[ref_node.name] = ref = target(*ref_args[0], **ref_args[1])
        garbage = ref_node.target in _UNINITIALIZED
        if _is_random(ref_node) and not _close(actual, ref):  # another draw: take the sharded one
            ref = _adopt(actual, ref)
            random_ops.append(n.name)
        elif garbage:  # (whatever memory held, either way: the rank's, not compared)
            ref = _adopt(actual, ref)
        if isinstance(actual, torch.Tensor) and isinstance(ref, torch.Tensor) and actual.is_floating_point() and \
                not garbage:
            diffs.append(_difference(n.name, ref_node, actual, ref, tolerances))
            phases.append(ref_node.meta.get("partitioner_tag", "is_forward"))
        if whole:
            ref_env[n.name] = ref
            for a in (a for c in chain for a in c.all_input_nodes):
                if last_use.get(a.name) == n.name:
                    ref_env.pop(a.name, None)

    with torch.no_grad():
        flat_out = _Lockstep(module.graph_module, check).run(*args)
        # the outputs through the collectives that make them, against the reference's outputs
        flat_out, _ = tree_flatten(flat_out)
        last_steps = tree_flatten(module.graph_module.graph.output_node().args[0])[0]
        ref_outputs = tree_flatten(traced_gm.graph.output_node().args[0])[0]
        kinds = module._graph_outputs
        paths = _output_paths(module._out_spec)
        outputs, grads = [], []
        for k, (value, ref_node) in enumerate(zip(flat_out, ref_outputs)):
            choice = plan.choices.get(f"output_{k}")
            if not isinstance(value, torch.Tensor) or choice is None or not isinstance(ref_node, fx.Node):
                continue
            full = gather(value, choice.inputs[0])
            if not rank0 or failure or not full.is_floating_point():
                continue
            # one device: the reference run's value; op by op: the node's gathered value (its op was
            # checked above), so what is compared here is the collectives after it
            ref = ref_env[ref_node.name] if whole else kept[ref_node.name]
            kind = kinds[k] if k < len(kinds) else None
            step = last_steps[k] if k < len(last_steps) else None
            via = step.name if isinstance(step, fx.Node) and step.name != ref_node.name else ""
            if kind is not None and kind.kind == "grad":
                grads.append(replace(_difference(f"grad {kind.name}", ref_node, full, ref, tolerances), via=via))
            elif kind is not None and kind.kind == "buffer_update":
                outputs.append(replace(_difference(f"buffer {kind.name}", ref_node, full, ref, tolerances), via=via))
            else:  # (the user's outputs come first: `trace_module.user_outputs_first`)
                what = f"output {k}" + (f" (out{paths[k]})" if k < len(paths) and paths[k] not in ("", f"[{k}]") else "")
                outputs.append(replace(_difference(what, ref_node, full, ref, tolerances), via=via))

    report = None
    if rank0 and failure:
        report = failure[0]
    elif rank0:
        diffs = with_floors(diffs, phases)
        outputs, grads = with_floors(outputs, [0] * len(outputs)), with_floors(grads, [0] * len(grads))
        bad = [d for d in diffs if not d.ok]
        worst = bad[0] if bad else max(diffs, key=lambda d: d.error, default=None)
        report = VerifyReport(mode, tuple(outputs), tuple(grads), worst, len(diffs), tuple(random_ops))
    box = [report]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise SpmdInternalError(f"verify: rank 0 could not run the single-device reference at node {box[0]}",
                                traced_gm.code)
    return box[0]


