"""The compiler pipeline: one tuple, read top to bottom.

    nn.Module ──trace (find_layer_stacks, trace_module | trace_joint, stamp_layers)──▶ ATen FX graph
       ──index_by_arange──▶ lookups by whole-dim aranges as views ──gather_rows──▶ row lookups as gathers
       ──unmerge_bmm──▶ 4-D matmuls whole again
       ──kernel_layouts──▶ the kernels' strides ──as_strided_views──▶ in-order as_strided as views
       ──merge_tied_parameters──▶ one placeholder per tensor ──find_repeated_blocks──▶ identical layers
       ──enumerate_strategies──▶ candidates per node ──merge_followers (large graphs)──▶ fewer choices
       ──estimate_costs──▶ compute + resharding costs ──solve_placements (budget loop)──▶ Plan
       ──insert_collectives──▶ global graph with explicit steps ──emit_rank_graph──▶ this rank's graph
       ──recompute_layers, fuse_decomposed_ops──▶ what backward runs again; decomposed kernels fused
       ──reduce_in_place──▶ all_reduces without a copy where nothing else reads their input
       ──split_joint_graph, bucket_gradients (training)──▶ forward and backward graphs
       ──overlap_collectives──▶ all_reduces launched early, waited for late

Each `Pass` names the values it reads and the one it writes; the runner hands it those values, stores
what it returns, and (with `PlanOptions.verify` or SPMD_VERIFY=1) checks the pass's postcondition
(compiler/verify.py) and (with `dump_dir` or SPMD_DUMP=dir) writes the annotated graph. Nothing lives
in module globals: two compilations in one process never interfere. `run_pipeline` returns a frozen
`Compilation`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from spmd.compiler import dump as dumps
from spmd.compiler import fx_sources
from spmd.compiler.progress import Progress
from spmd.compiler.agreement import graph_digest, placeholder_shapes, summarize
from spmd.compiler import axis_search
from spmd.compiler.budget import solve_within_budget
from spmd.compiler.dump import Dumper
from spmd.compiler.given_plan import take_given_plan
from spmd.compiler.options import PlanOptions, RankBinding
from spmd.compiler.verify import CHECKS
from spmd.core import collectives as C
from spmd.core.errors import SpmdError, SpmdInternalError, describe_node, user_stacklevel
from spmd.core.graph_facts import dropout_p, is_random
from spmd.core.plan import Plan
from spmd.cost_model.comm import all_reduce_seconds
from spmd.passes.as_strided_views import as_strided_views, viewable
from spmd.passes.bucket_gradients import bucket_gradients, local_bytes
from spmd.passes.check_dtypes import check_dtypes
from spmd.passes.check_stamping import check_stamping
from spmd.passes.emit_rank_graph import emit_rank_graph
from spmd.passes.enumerate_strategies import StrategyTable, enumerate_strategies
from spmd.passes.estimate_costs import CostTable, estimate_costs
from spmd.passes.find_recomputable_layers import Recomputable, find_recomputable_layers
from spmd.passes.find_layer_stacks import MIN_LAYERS, TRACED, find_layer_stacks, truncated
from spmd.passes.find_repeated_blocks import AUTO_MIN_REPEATS, RepeatedBlocks, find_repeated_blocks
from spmd.passes.fuse_decomposed_ops import fuse_decomposed_ops
from spmd.passes.gather_rows import gather_rows, row_lookups
from spmd.passes.index_by_arange import identity_indexes, index_by_arange
from spmd.passes.insert_collectives import insert_collectives
from spmd.passes.kernel_layouts import kernel_layouts, laid_out_otherwise
from spmd.passes.merge_followers import AUTO_MIN_NODES, merge_followers
from spmd.passes.merge_tied_parameters import merge_tied_parameters
from spmd.passes.overlap_collectives import Estimates, overlap_collectives
from spmd.passes.recompute_layers import recompute_layers
from spmd.passes.reduce_in_place import reduce_in_place
from spmd.passes.split_joint_graph import SplitGraphs, split_joint_graph
from spmd.passes.stamp_layers import CannotStamp, stamp_layers
from spmd.passes.trace_joint import loss_targets, refuse_gradient_hooks, trace_joint, with_loss
from spmd.passes.trace_module import (TracedGraph, refuse_lazy_modules, refuse_rnn_dropout, refuse_script_modules,
                                      refuse_shared_memory, trace_module, warn_module_hooks)
from spmd.passes.unmerge_bmm import unmerge_bmm, unmergeable


@dataclass(frozen=True)
class Compilation:
    """What one run of the pipeline made. `global_gm`, `rank_gm` and `split` exist only for a rank
    (`binding`); `plan_only` runs stop at the plan."""

    model: torch.nn.Module
    example_inputs: tuple
    mesh: Any  # MeshSpec
    options: PlanOptions
    binding: RankBinding | None
    traced: TracedGraph
    blocks: RepeatedBlocks | None
    recomputable: Recomputable
    strategies: StrategyTable
    costs: CostTable
    plan: Plan
    global_gm: fx.GraphModule | None = None
    rank_gm: fx.GraphModule | None = None
    split: SplitGraphs | None = None
    timings: dict = field(default_factory=dict)  # pass name -> seconds


@dataclass(frozen=True)
class Pass:
    """`run(*reads) -> the value of writes`. A read may name an attribute ("options.pins")."""

    name: str
    run: Callable[..., Any]
    reads: tuple[str, ...]
    writes: str | tuple[str, ...]
    when: Callable[[dict], bool] = lambda v: True
    dump: Callable[[dict], str] | None = None


# ---- the steps that are more than one call ---------------------------------------------------------

def _trace(model, example_inputs, options: PlanOptions, stacks, binding) -> tuple[TracedGraph, str]:
    """The full-depth graph, and how it was made. With layer stacks: the model traced with each stack
    cut to its first layers, stamped to full depth; when the cut model does not trace or its layers do
    not chain simply, the whole model traced (the note says why). For a graph that will run (`binding`),
    stamping is checked first against the forward at full depth (`check_stamping`). Hooks are looked at on
    the whole model first (a stamped layer's are not traced)."""
    refuse_lazy_modules(model)
    if options.joint:
        refuse_gradient_hooks(model)
        parametrize = torch.nn.utils.parametrize  # (found by a probe: fake-tensor words, advice on control flow)
        if parametrize._cache_enabled and any(parametrize.is_parametrized(m) for m in model.modules()):
            raise SpmdError(
                "the model is compiled for training inside torch.nn.utils.parametrize.cached(), where each "
                "parametrized weight is computed once and kept as a plain tensor: a training graph must compute it "
                "from its parameters at every step. What to do: compile outside the `with parametrize.cached():` "
                "block.")
    warn_module_hooks(model)
    refuse_rnn_dropout(model)
    refuse_script_modules(model)
    refuse_shared_memory(model)

    def trace(m):
        traced = trace_joint(m, example_inputs, options.loss_fn) if options.joint else trace_module(m, example_inputs)
        check_dtypes(traced.graph)
        return traced

    note = ""
    if stacks:
        try:
            if binding is not None:
                root = with_loss(model, options.loss_fn) if options.joint else model  # as `trace` calls it
                differs = check_stamping(root, example_inputs, model, stacks, options.joint)
                if differs:
                    raise CannotStamp(differs)
            with truncated(model, stacks) as read:
                short = trace(model)
            if read:
                raise CannotStamp(f"the layers differ in {', '.join(sorted(read))}, which the forward reads")
            return _warned(stamp_layers(short, stacks, model), model, options), "; ".join(
                f"{s.fqn}: {TRACED} traced, {s.depth - TRACED} stamped" for s in stacks)
        except SpmdError as e:
            note = f"none: the model with {TRACED} layers per stack did not trace ({e})"
        except CannotStamp as e:
            note = f"none: {e}; traced every layer"
    return _warned(trace(model), model, options), note


def _warned(traced: TracedGraph, model, options: PlanOptions) -> TracedGraph:
    """The graph kept, once what it says about the model is said (a forward-only graph's dropout)."""
    if not options.joint:
        _warn_dropout_in_inference(traced.graph, model)
    return traced


# (dropout's draws; not `bernoulli.default`, a draw from a tensor of probabilities: sampling, which eval() keeps)
_DROPOUTS = frozenset({torch.ops.aten.native_dropout.default, torch.ops.aten.bernoulli.p,
                       torch.ops.aten.bernoulli_.float})


def _warn_dropout_in_inference(graph: fx.Graph, model: torch.nn.Module) -> None:
    """A model compiled for inference while in train mode (as a model built from its config, transformers' too, is)
    runs its dropout: equal to that model, but a dropout inside attention keeps the attention whole on every rank
    (its kernel draws its mask itself; rules/attention.py), and the forward is not the evaluation one. Said of the
    graph kept (stamped to full depth, or traced whole where stamping gave up)."""
    if not any(m.training for m in model.modules()):
        return
    drops = [n for n in graph.nodes if n.op == "call_function" and (
        n.target in _DROPOUTS or (is_random(n) and dropout_p(n.target, n.args, n.kwargs) is not None))]
    if drops:
        warnings.warn(
            "spmd: the model is compiled for inference (training=False) in train mode, so its dropout runs in the "
            f"compiled forward ({describe_node(drops[0])}, and {len(drops) - 1} more); a dropout inside attention keeps "
            "the attention whole on every rank. What to do: `model.eval()` before compiling for evaluation or "
            "serving (a model built from its config starts in train mode); where dropout at inference is meant "
            "(Monte Carlo dropout), nothing.", stacklevel=user_stacklevel())


def stamping_unchecked(model, example_inputs, options: PlanOptions) -> str | None:
    """Where the layers a plan stamped without the check (`spmd.plan` skips it, for speed) are not what the model
    runs at full depth (`check_stamping`), or None. For what uses the stamped layers' placements as the model's
    own (the DTensor export)."""
    stacks = find_layer_stacks(model) if options.stamp_layers is not False else ()
    if not stacks:
        return None
    return check_stamping(with_loss(model, options.loss_fn) if options.joint else model, example_inputs, model, stacks,
                          options.joint)


def _stamping(v: dict) -> bool:
    return v["options"].stamp_layers is not False


def _merging(v: dict) -> bool:
    if not _plans_here(v):
        return False
    merge = v["options"].merge_followers
    if merge is None:
        return sum(1 for n in v["traced"].graph.nodes if n.op == "call_function") > AUTO_MIN_NODES
    return merge


def _solve(traced, strategies, costs, options: PlanOptions, blocks, binding, stamp_note, progress,
           recomputable, mesh) -> Plan:
    if options.plan is not None:  # solved before: every rank takes it, once it is checked against this trace
        return take_given_plan(options.plan, traced, mesh, options, stamp_note)

    def make() -> Plan:
        stats = {"merged_followers": strategies.merged_followers} if strategies.merged_followers else {}
        stats["graph"] = graph_digest(traced)
        stats["wired_graph"] = graph_digest(traced, wiring=True)  # (what a plan given to compile is checked by)
        stats["placeholders"] = placeholder_shapes(traced)  # (and, where it differs, what it names)
        stats["optimizer_state_factor"] = options.optimizer_state_factor
        if stamp_note:
            stats["stamped_layers"] = stamp_note
        if traced.custom_functions:
            stats["custom_functions"] = list(traced.custom_functions)
        if options.loss_fn is not None:  # (the trailing inputs: for the export, which runs the model alone)
            inputs = [gi.name for gi in traced.inputs if gi.kind == "input"]
            stats["loss_targets"] = inputs[len(inputs) - loss_targets(options.loss_fn):]
        return solve_within_budget(traced, strategies, costs, options.memory_budget, blocks, stats,
                                   options.bucket_bytes, on_progress=progress.solving, recompute=recomputable,
                                   time_limit=options.solver_time_limit,
                                   by_axes=axis_search.wanted(strategies, len(costs.mesh.shape), options.axis_search))

    return make() if binding is None or binding.share_plan is None else binding.share_plan(make)


def _plans_here(v: dict) -> bool:
    """This process builds the placement program (on a live mesh only one rank does, and none where a plan was
    given; see `_solve`)."""
    if v["binding"] is None:
        return True
    return v["binding"].plans and v["options"].plan is None


def planning_tables(traced, mesh, options: PlanOptions, blocks) -> tuple:
    """(strategies, costs) for a compilation whose plan another rank made (`RankBinding.plans` off): made
    again from this rank's trace, which the ranks agreed is the same, when its plan is explained."""
    values = {"traced": traced, "mesh": mesh, "options": options, "blocks": blocks, "binding": None}
    for p in PIPELINE:
        if p.name in ("enumerate_strategies", "merge_followers", "estimate_costs") and p.when(values):
            values[p.writes] = p.run(*[_read(values, r) for r in p.reads])
    return values["strategies"], values["costs"]


def _emit(global_gm, mesh, binding: RankBinding):
    return emit_rank_graph(global_gm, mesh, binding.rank, binding.group_names, binding.device)


def _bucket(split: SplitGraphs, mesh, options: PlanOptions) -> SplitGraphs:
    backward = bucket_gradients(split.backward, mesh.shape, options.bucket_bytes, options.defer_waits)
    return dataclasses.replace(split, backward=backward)


def _reduce_in_place(rank_gm: fx.GraphModule, traced: TracedGraph) -> fx.GraphModule:
    return reduce_in_place(rank_gm, frozenset(i.placeholder for i in traced.inputs if i.kind == "tangent"))


def _estimates(plan: Plan, mesh, binding: RankBinding) -> Estimates:
    """The plan's seconds for each op (a recomputed copy's: its original's; 0 for what it did not price), and for
    each launch's all_reduce from its pieces' bytes on its axis's link (unknown: as long as any work, so all may
    hide it)."""
    def collective(launch: fx.Node) -> float:
        inputs = launch.args[0] if launch.target is C.bucket_start else [launch.args[0]]
        group = launch.kwargs.get("group")
        if group not in binding.group_names or not all(
                isinstance(i, fx.Node) and "val" in i.meta and "spmd_placements" in i.meta for i in inputs):
            return float("inf")
        nbytes = sum(local_bytes(i, mesh.shape) for i in inputs)
        return all_reduce_seconds(mesh, binding.group_names.index(group), nbytes)

    def compute(node: fx.Node) -> float:  # (a recomputed copy: its original's)
        return plan.node_costs.get(node.meta.get("spmd_recomputes", node.name), 0.0)

    return Estimates(compute, collective)


def _overlap(split: SplitGraphs, plan: Plan, mesh, binding: RankBinding) -> SplitGraphs:
    estimates = _estimates(plan, mesh, binding)
    return dataclasses.replace(split, forward=overlap_collectives(split.forward, estimates),
                               backward=overlap_collectives(split.backward, estimates))


def _overlap_rank(rank_gm: fx.GraphModule, plan: Plan, mesh, binding: RankBinding) -> fx.GraphModule:
    return overlap_collectives(rank_gm, _estimates(plan, mesh, binding))


def _bound(v: dict) -> bool:
    return v["binding"] is not None


def _training_rank(v: dict) -> bool:
    return v["binding"] is not None and v["traced"].joint


# Why each pass sits where it does:
PIPELINE: tuple[Pass, ...] = (
    # Deep models: stacks of identical layers are traced a few layers deep and stamped to full depth.
    Pass("find_layer_stacks", find_layer_stacks, ("model",), "stacks", _stamping,
         lambda v: "\n".join(map(str, v["stacks"])) or f"no stack of {MIN_LAYERS} or more interchangeable layers"),
    # ATen graph first: every later pass reasons about core ATen ops with static shapes. Training traces
    # the joint forward+backward graph; after that, both take the same road.
    Pass("trace", _trace, ("model", "example_inputs", "options", "stacks", "binding"), ("traced", "stamp_note"),
         dump=dumps.dump_traced),
    # A lookup by aranges over whole dims (transformers' attention masks) is its source's values: as views, a
    # batch-split plan keeps the mask split instead of gathering it at every call.
    Pass("index_by_arange", index_by_arange, ("traced",), "traced", lambda v: bool(identity_indexes(v["traced"].graph)),
         dumps.dump_traced),
    # A lookup of one position per row (`logits[arange(B), last]`, sequence classification) is a gather along the
    # rows, and its backward's index_put a scatter_add: split on the rows, where the lookup wanted its source whole.
    Pass("gather_rows", gather_rows, ("traced",), "traced", lambda v: bool(row_lookups(v["traced"].graph)),
         dumps.dump_traced),
    # A matmul of 4-D tensors, decomposed to a bmm over their merged leading dims, is one matmul again: split on
    # heads (Megatron) as well as on the batch, where the merged dim kept only the batch split.
    Pass("unmerge_bmm", unmerge_bmm, ("traced",), "traced", lambda v: bool(unmergeable(v["traced"].graph)),
         dumps.dump_traced),
    # The values' strides as the device's kernels lay them out (batch norm over a transposed input), which the
    # random ops' rules read to draw as one device does; only where a kernel lays out otherwise than traced.
    Pass("kernel_layouts", kernel_layouts, ("traced",), "traced", lambda v: bool(laid_out_otherwise(v["traced"].graph)),
         dumps.dump_traced),
    # An as_strided that reads a tensor of its own in order (pooling over a transposed tensor traces them) is a
    # view, which splits as its input does, where the as_strided had no rule and ran replicated.
    Pass("as_strided_views", as_strided_views, ("traced",), "traced", lambda v: bool(viewable(v["traced"].graph)),
         dumps.dump_traced),
    # Tied weights are one tensor: one placeholder, one gradient (the sum over uses).
    Pass("merge_tied_parameters", merge_tied_parameters, ("traced",), "traced", dump=dumps.dump_traced),
    # On a live mesh, before the first collective: every rank compiled the same graph for the same inputs
    # with the same options (else an SpmdError on every rank naming the first difference, never a hang).
    Pass("agree_across_ranks", lambda traced, mesh, options, binding: binding.check(summarize(traced, mesh, options)),
         ("traced", "mesh", "options", "binding"), "agreed", lambda v: v["binding"] is not None
         and v["binding"].check is not None),
    # Identical layers, found once, let the next three passes do one layer's work for all of them.
    Pass("find_repeated_blocks", lambda traced, tie, pins: find_repeated_blocks(
             traced, 2, dict(pins.params), AUTO_MIN_REPEATS if tie is None else 2),
         ("traced", "options.tie_blocks", "options.pins"), "blocks", lambda v: v["options"].tie_blocks is not False,
         lambda v: v["blocks"].summary()),
    # Training: what recomputing each layer in backward would run again and free, for the solver to weigh.
    Pass("find_recomputable_layers", find_recomputable_layers,
         ("traced", "blocks", "options.recompute", "options.memory_budget"),
         "recomputable", lambda v: v["traced"].joint or bool(v["options"].recompute), lambda v: "\n".join(
             f"{len(s)} x {s[0].key}: {len(s[0].nodes)} nodes, frees {len(s[0].frees)}, adds {len(s[0].adds)}" + (
                 f"; selectively {len(s[0].selective.nodes)} nodes, frees {len(s[0].selective.frees)}, adds "
                 f"{len(s[0].selective.adds)}" if s[0].selective else "") for s in v["recomputable"].stacks)),
    # Candidates need shapes (evenness) and the mesh; pins cut them down before any cost is paid.
    Pass("enumerate_strategies", enumerate_strategies, ("traced", "mesh", "options.pins", "blocks"), "strategies",
         _plans_here, dumps.dump_strategies),
    # Large graphs only (an approximation): single-input ops follow their input instead of choosing.
    Pass("merge_followers", merge_followers, ("traced", "strategies"), "strategies", _merging, dumps.dump_strategies),
    # Costs for every candidate and edge, from the same redistribute planner codegen uses.
    Pass("estimate_costs", estimate_costs, ("traced", "strategies", "mesh", "options.optimizer_state_factor",
                                            "options.bucket_bytes", "blocks"), "costs", _plans_here, dumps.dump_costs),
    # One global choice (ILP), then the schedule's temporaries under the budget. Optimal plans can tie
    # and the solver breaks ties by timing, so on a live mesh one rank plans (the three passes above and
    # this one) and every rank takes its plan.
    Pass("solve_placements", _solve, ("traced", "strategies", "costs", "options", "blocks", "binding", "stamp_note",
                                      "progress", "recomputable", "mesh"),
         "plan", dump=dumps.dump_plan),
    # Structural passes from here, for a rank only: explicit steps, then this rank's local graph.
    Pass("insert_collectives", insert_collectives, ("traced", "plan"), "global_gm", _bound,
         lambda v: dumps.dump_placed(v["global_gm"])),
    Pass("emit_rank_graph", _emit, ("global_gm", "mesh", "binding"), "rank_gm", _bound, lambda v: v["rank_gm"].code),
    # Before the cut: the layers the plan recomputes get their forward copied into backward.
    Pass("recompute_layers", recompute_layers, ("rank_gm", "recomputable", "plan.recompute",
                                                "plan.recompute_selective"), "rank_gm",
         lambda v: _training_rank(v) and bool(v["plan"].recompute or v["plan"].recompute_selective),
         lambda v: v["rank_gm"].code),
    # Ops traced apart so that a split class dim could reduce across ranks, one kernel again where this
    # rank runs them on whole rows (log_softmax and its backward).
    Pass("fuse_decomposed_ops", fuse_decomposed_ops, ("rank_gm",), "rank_gm", _bound, lambda v: v["rank_gm"].code),
    # Then, with every reader of every value in sight (the joint graph: a value backward reads has a
    # reader here), each all_reduce whose input nothing else reads reduces it where it is, without a copy.
    Pass("reduce_in_place", _reduce_in_place, ("rank_gm", "traced"), "rank_gm", _bound, lambda v: v["rank_gm"].code),
    # Last: autograd runs forward and backward separately, so the joint rank graph is cut in two ...
    Pass("split_joint_graph", split_joint_graph, ("rank_gm", "traced"), "split", _training_rank,
         lambda v: v["split"].forward.code + "\n" + v["split"].backward.code),
    # ... and the gradient all_reduces of backward are packed into buckets (the cost model priced them so).
    Pass("bucket_gradients", _bucket, ("split", "mesh", "options"), "split", _training_rank,
         lambda v: v["split"].backward.code),
    # Then each all_reduce is launched as soon as its input is ready and waited for where it is read, with
    # the work that needs neither in between (the buckets are launches too).
    Pass("overlap_collectives", _overlap_rank, ("rank_gm", "plan", "mesh", "binding"), "rank_gm",
         lambda v: _bound(v) and not v["traced"].joint and v["options"].defer_waits, lambda v: v["rank_gm"].code),
    Pass("overlap_collectives", _overlap, ("split", "plan", "mesh", "binding"), "split",
         lambda v: _training_rank(v) and v["options"].defer_waits,
         lambda v: v["split"].forward.code + "\n" + v["split"].backward.code),
)


def _read(values: dict, name: str):
    head, _, attr = name.partition(".")
    if head not in values:
        raise SpmdInternalError(f"pipeline: a pass reads {name!r}, which no earlier pass wrote")
    value = values[head]
    return getattr(value, attr) if attr else value


def _graph_modules(values: dict) -> list[fx.GraphModule]:
    """The graph modules among the pipeline's values and their fields (traced.gm, rank_gm, split...)."""
    found = []
    for v in values.values():
        inner = [getattr(v, f.name) for f in dataclasses.fields(v)] if dataclasses.is_dataclass(v) else []
        found += [x for x in (v, *inner) if isinstance(x, fx.GraphModule)]
    return found


_collector_lock = threading.Lock()
_collector_pausers = 0  # pipelines running now (threads may compile at once)
_collector_paused_by_us = False


def _collector_after_fork() -> None:
    """A process forked while a pipeline ran starts with none running: the collector as it was before."""
    global _collector_lock, _collector_pausers, _collector_paused_by_us
    if _collector_pausers and _collector_paused_by_us:
        gc.enable()
    _collector_lock, _collector_pausers, _collector_paused_by_us = threading.Lock(), 0, False


os.register_at_fork(after_in_child=_collector_after_fork)


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while the pipeline runs, as it was after. The passes make
    millions of small objects that live until the pipeline ends (FX nodes, placements, the program's
    rows); every 700 allocations the collector walks the young ones, and each time the heap grows by a
    quarter it walks all of them: 0.6-1.7 s of LLaMA3-8B's 3.7-6.4 s plan on (8, 8) went there. The
    cycles the passes leave behind are freed by the first collection after (peak RSS 0.70 GB against
    0.65 GB over three such plans in one process). Pipelines running at once in several threads pause it
    together; the last to end turns it back on, and only if it was on before the first began. `spmd.plan`
    and `spmd.compile` hold it over their copy of a meta model too (`fake_model`, a deepcopy of every
    module: LLaMA3-8B's took 0.06 s paused, 0.37-0.41 s with the collector walking an earlier plan's
    objects)."""
    global _collector_pausers, _collector_paused_by_us
    with _collector_lock:
        if _collector_pausers == 0:
            _collector_paused_by_us = gc.isenabled()
            gc.disable()
        _collector_pausers += 1
    try:
        yield
    finally:
        with _collector_lock:
            _collector_pausers -= 1
            if _collector_pausers == 0 and _collector_paused_by_us:
                gc.enable()


# The passes between the trace and the strategies that rewrite the traced graph (what a plan's names refer to)
GRAPH_REWRITES = ("index_by_arange", "gather_rows", "unmerge_bmm", "kernel_layouts", "as_strided_views",
                  "merge_tied_parameters")


def rewritten(traced: TracedGraph) -> TracedGraph:
    """`traced` as the pipeline rewrites it before planning (`GRAPH_REWRITES`): for what prices a plan on a
    graph traced apart, at other sizes (report/whatif.py's cost formulas; a review: a plan's `matmul` nodes were
    missing from the plain trace, so its products went unpriced)."""
    for p in PIPELINE:
        if p.name in GRAPH_REWRITES and p.when({"traced": traced}):
            traced = p.run(traced)
    return traced


def run_pipeline(model: torch.nn.Module, example_inputs: tuple, mesh, options: PlanOptions | None = None,
                 binding: RankBinding | None = None, quiet: bool = False) -> Compilation:
    """Plan `model` on `mesh` (a `MeshSpec`) for `example_inputs`; with a `binding`, also emit that rank's
    graphs. The garbage collector is paused meanwhile (`collector_paused`). `quiet`: no progress line and
    no dumps whatever SPMD_DUMP says (a compilation of spmd's own, such as the host probe's)."""
    with collector_paused():
        return _run_pipeline(model, example_inputs, mesh, options, binding, quiet)


def _run_pipeline(model: torch.nn.Module, example_inputs: tuple, mesh, options: PlanOptions | None,
                  binding: RankBinding | None, quiet: bool) -> Compilation:
    options = options or PlanOptions()
    values: dict[str, Any] = {"model": model, "example_inputs": tuple(example_inputs), "mesh": mesh,
                              "options": options, "binding": binding, "stacks": (), "blocks": None,
                              "strategies": None, "costs": None,
                              "stamp_note": "", "recomputable": Recomputable(), "global_gm": None, "rank_gm": None, "split": None}
    where = None if quiet else options.dump_dir or os.environ.get("SPMD_DUMP")
    if where and binding is not None and binding.share_plan is not None:
        # (on a live mesh every rank dumps, and only one runs the planning passes: in one folder the ranks wrote
        # the same names over each other, numbered apart, `08-emit_rank_graph.txt` of any rank; found by a probe)
        where = os.path.join(where, f"rank{binding.rank}")
    dump = Dumper(where)
    verify = options.verify or os.environ.get("SPMD_VERIFY", "") not in ("", "0")
    timings: dict[str, float] = {}
    since = fx_sources.mark()
    progress = Progress([p.name for p in PIPELINE], binding.rank if binding is not None else None, enabled=not quiet)
    values["progress"] = progress
    try:
        for p in PIPELINE:
            if not p.when(values):
                continue
            args = [_read(values, r) for r in p.reads]
            progress.start(p.name)
            t0 = time.perf_counter()
            out = p.run(*args)
            timings[p.name] = time.perf_counter() - t0
            if isinstance(p.writes, tuple):
                values.update(zip(p.writes, out))
            else:
                values[p.writes] = out
            if verify and p.name in CHECKS:
                CHECKS[p.name](p.name, values)
            if dump.directory and p.dump is not None:
                dump(p.name, p.dump(values))
            progress.done(p.name, values)
    finally:
        progress.close()
        # torch.fx keeps the source of every graph module it ever generated; keep only the ones handed back
        fx_sources.release_sources(since, _graph_modules(values))
    fields = {f.name for f in dataclasses.fields(Compilation)}
    return Compilation(**{k: v for k, v in values.items() if k in fields}, timings=timings)
