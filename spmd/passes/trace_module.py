"""trace_module: nn.Module + example inputs -> ATen-level FX graph.

Before: an eager module and example inputs. After: a `TracedGraph` whose FX graph has core-ATen nodes
(scaled_dot_product_attention kept whole), `meta["val"]` (shape, dtype) on every tensor node, the user's
stack trace on every call, and one placeholder per parameter, buffer and user input, named in `inputs`.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import linecache
import itertools
import os
import re
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind, OutputKind

from spmd.core.autocast import autocast_off
from spmd.core.errors import SpmdError, describe_node, user_stacklevel
from spmd.core.specs import TensorInfo
from spmd.passes.buffer_aliases import buffers_through_aliases
from spmd.passes.encoder_fast_path import encoder_fast_path_as_eager
from spmd.passes.kept_state import _REGISTRIES, refuse_counted, state_kept
from spmd.passes.made_state import refuse_made_snapshots


@dataclass(frozen=True, slots=True)
class GraphInput:
    """One placeholder: `kind` is parameter | buffer | constant | input | tangent; `name` its FQN, the
    argument name, or for a tangent the name of the output sink it is the gradient of (`output_k`)."""

    placeholder: str
    kind: str
    name: str


@dataclass(frozen=True, slots=True)
class GraphOutput:
    """One flat graph output: `kind` output (the user's) | grad (of parameter `name`) | input_grad (of input
    `name`) | buffer_update (the new value of buffer `name`, which the forward updates in place) | none."""

    kind: str
    name: str


@dataclass
class TracedGraph:
    gm: fx.GraphModule
    inputs: tuple[GraphInput, ...]
    state: dict[str, torch.Tensor]  # FQN -> full tensor of every parameter, buffer and constant
    out_spec: Any  # pytree spec to rebuild the user's output structure
    in_spec: Any = None
    tensor_info: dict[str, TensorInfo] = field(default_factory=dict)
    outputs: tuple[GraphOutput, ...] = ()  # empty: every flat output is the user's
    frozen: frozenset[str] = frozenset()  # parameters with requires_grad=False
    joint: bool = False  # forward+backward graph (nodes carry meta["partitioner_tag"])
    aliases: dict[str, str] = field(default_factory=dict)  # extra name of a shared tensor -> canonical FQN
    custom_functions: tuple[str, ...] = ()  # autograd.Functions traced with their own backward (joint)
    checkpoints: tuple[str, ...] = ()  # the modules torch.utils.checkpoint ran, run through (their paths; joint)
    reentrant: bool = False  # one ran as use_reentrant=True: what it runs gets a gradient only where an input needs one
    loss: bool = False  # traced with a loss_fn: the user's outputs are its (joint)
    # "model.layers.7/fwd" -> "model.layers.1/fwd": a layer stamp_layers copied, and the traced layer it
    # copies node for node (find_repeated_blocks then needs no hash or signature of the copy)
    stamped: dict[str, str] = field(default_factory=dict)
    # module path -> class name for every module of the model, also those whose forward the graph never runs (a
    # tie's first name, a weight read directly as `F.conv1d(x, self.conv1d.weight)`, a module run inside torch.cond)
    module_types: dict[str, str] = field(default_factory=dict)

    def output_kinds(self) -> list[GraphOutput]:
        flat = flat_outputs(self.graph.output_node())
        return list(self.outputs) or [GraphOutput("output", f"output_{k}") for k in range(len(flat))]

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def labels(self) -> dict[str, str]:
        """placeholder name -> parameter/buffer FQN or user input name."""
        return {i.placeholder: i.name for i in self.inputs}

    def input_by_placeholder(self) -> dict[str, GraphInput]:
        return {i.placeholder: i for i in self.inputs}

    def regions(self) -> dict[str, str]:
        """Consumer name -> the region its resharding runs in ("is_forward" or "is_backward"), for a
        joint graph; empty otherwise. Outputs (`output_k`) run in backward when they are gradients.
        Consumers of one value in one region share its resharding (insert_collectives)."""
        if not self.joint:
            return {}
        out = {n.name: n.meta["partitioner_tag"] for n in self.graph.nodes if "partitioner_tag" in n.meta}
        for k, kind in enumerate(self.output_kinds()):
            out[f"output_{k}"] = "is_backward" if kind.kind in ("grad", "input_grad") else "is_forward"
        return out


def graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """`fx.GraphModule(root, graph)` that writes and compiles its Python code on first use, not now:
    a planning pass that never runs the graph skips ~0.1 s per 7,000 nodes (torch's lazy GraphModule;
    the eager one where a torch build lacks it)."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover
        return fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def copy_graph(graph: fx.Graph) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """A copy of `graph` (its output node's metadata too) and the map from its nodes to the copy's."""
    copied, env = fx.Graph(), {}
    output = copied.output(copied.graph_copy(graph, env))
    output.meta, output.type = dict(graph.output_node().meta), graph.output_node().type
    return copied, env


def call_like(graph: fx.Graph, like: fx.Node, op, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """`op(*args)` in `graph`, named as the graph names its own (`clone_3`), with `like`'s metadata (source line,
    module, phase, sequence number) and its own fake value (run under its inputs' fake mode, with autocast off:
    the graph holds autocast's casts already, and a compile under `torch.autocast` gave a float32 product
    bfloat16 values)."""
    from torch._guards import detect_fake_mode

    node = graph.create_node("call_function", op, args, kwargs or {}, name=op.overloadpacket.__name__)
    node.meta = {k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta")}
    vals = fx.node.map_arg(args, lambda a: a.meta["val"])
    with autocast_off(), detect_fake_mode(list(vals)) or contextlib.nullcontext():
        node.meta["val"] = op(*vals, **(kwargs or {}))
    return node


def with_graph(traced: "TracedGraph", graph: fx.Graph, **changes) -> "TracedGraph":
    """`traced` over `graph`, a rewritten copy of its graph: its module and tensor infos anew, and `changes` to its
    other fields (`inputs`, `outputs`, ...)."""
    gm = graph_module(traced.gm, graph)
    return dataclasses.replace(traced, gm=gm, tensor_info=tensor_infos(gm), **changes)


def tensor_infos(gm: fx.GraphModule) -> dict:
    """node name -> TensorInfo (or a tuple of them for multi-output nodes) for every tensor node."""
    return {n.name: info for n in gm.graph.nodes if (info := tensor_info_of(n)) is not None}


def flat_outputs(output_node: fx.Node) -> list:
    """The graph's outputs as one flat list (None where an output is absent): export and AOTAutograd
    graphs both return a flat tuple."""
    outs = output_node.args[0]
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def user_outputs_first(gm: fx.GraphModule, kinds: list[GraphOutput]) -> list[GraphOutput]:
    """The graph's outputs reordered so the user's come first, then the buffers' new values, then the rest
    (gradients), and their kinds so reordered. torch lists a mutated buffer before the user's outputs; with
    the user's first, the user's output i is the graph's flat output i (`output_{i}` in a plan), as where no
    buffer is updated."""
    rank = {"output": 0, "buffer_update": 1}
    order = sorted(range(len(kinds)), key=lambda k: rank.get(kinds[k].kind, 2))
    if order == list(range(len(kinds))):
        return kinds
    out = gm.graph.output_node()
    flat = flat_outputs(out)
    out.args = (tuple(flat[k] for k in order),)
    if isinstance(out.meta.get("desc"), (list, tuple)) and len(out.meta["desc"]) == len(flat):
        out.meta["desc"] = [out.meta["desc"][k] for k in order]
    gm.recompile()
    return [kinds[k] for k in order]


# Random ops kept whole: core ATen decomposes `bernoulli(p)` into `rand_like(p) < p`, which draws other numbers
# than the kernel eager runs, so a model would run and train on other masks than on one device, silently
# (rules/random.py draws them whole on every rank, from the generator state one device has)
DRAWN_WHOLE = ("bernoulli",)

# Ops whose decomposition in torch (2.13) computes something else than their kernel, kept whole (they run
# replicated, as ops without a rule do). multilabel_margin_loss's never masks the target positions after the
# first -1, so each adds a term for class 0: 5.17 where the kernel gives 1.65 (found by a probe).
WRONG_IN_TORCH = ("multilabel_margin_loss_forward",)
_whole_lock = threading.Lock()
_whole_depth = 0
_whole_saved: list = []  # (op overload, torch's Python kernel at its Autograd key) while taken out


@contextlib.contextmanager
def kernels_kept_whole():
    """While this is open (on any thread: the change is process-wide, counted), the ops in `WRONG_IN_TORCH` trace
    as themselves: torch registers their decomposition as a Python kernel at the Autograd key too, which a trace
    runs whatever the decomposition table says."""
    global _whole_depth
    with _whole_lock:
        if _whole_depth == 0:
            for name in WRONG_IN_TORCH:
                packet = getattr(torch.ops.aten, name)
                for overload in packet.overloads():
                    op = getattr(packet, overload)
                    kernel = op.py_kernels.pop(torch._C.DispatchKey.Autograd, None)
                    if kernel is not None:
                        _whole_saved.append((op, kernel))
                        op._dispatch_cache.clear()
        _whole_depth += 1
    try:
        yield
    finally:
        with _whole_lock:
            _whole_depth -= 1
            if _whole_depth == 0:
                for op, kernel in _whole_saved:
                    op.py_kernels[torch._C.DispatchKey.Autograd] = kernel
                    op._dispatch_cache.clear()
                _whole_saved.clear()


@contextlib.contextmanager
def parametrizations_uncached():
    """While this is open, a parametrized weight is computed from its parameters at each read, as a graph must
    compute it: inside the user's `torch.nn.utils.parametrize.cached()` a trace would otherwise store its own
    traced tensor in the user's cache, and the graph would hold the weight as a constant (found by a probe)."""
    parametrize = torch.nn.utils.parametrize
    enabled, parametrize._cache_enabled = parametrize._cache_enabled, 0
    try:
        yield
    finally:
        parametrize._cache_enabled = enabled


_quiet_graphs = contextvars.ContextVar("spmd_partial_graphs_unprinted", default=False)


def _print_but_partial_graphs(*args, **kwargs):
    """torch.export's `print` (its module's name for it), but for the partial graph of a failed trace where
    `partial_graphs_unprinted` is open."""
    if _quiet_graphs.get() and kwargs.get("file") is sys.stderr and len(args) == 1 and isinstance(args[0], str) \
            and "def forward(" in args[0]:
        return
    print(*args, **kwargs)


@contextlib.contextmanager
def partial_graphs_unprinted():
    """While this is open (in this thread or task), torch.export does not print its partial graph of a trace that
    failed to stderr: hundreds of lines before spmd's message for a model's data-dependent branch, once per road
    (found by a probe: 560 lines before a DeBERTa refusal). The message names the model's line."""
    import torch.export._trace as export_trace

    export_trace.print = _print_but_partial_graphs  # (shadows the builtin in that module alone; the same each time)
    token = _quiet_graphs.set(True)
    try:
        yield
    finally:
        _quiet_graphs.reset(token)


@contextlib.contextmanager
def dataclass_outputs_registered(root: torch.nn.Module):
    """While open, a dataclass the forward returns (alone, or in tuples, lists and dicts) that torch's pytree does
    not know is registered with it (`torch.export.register_dataclass`, as torch's own refusal advises), so the
    export can take the output apart and the compiled module gives the same class back. (A training compile takes
    such an output through its loss; a forward-only one was refused with torch's words, found by a probe.) The
    registration is torch's, process-wide, as the user's own would be."""
    import dataclasses

    def register(value, depth: int = 3) -> None:
        if depth < 0:
            return
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            if type(value) not in torch.utils._pytree.SUPPORTED_NODES:
                with contextlib.suppress(Exception):  # (one torch cannot take: its own refusal says why)
                    torch.export.register_dataclass(type(value))
            return
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
        for item in items:
            register(item, depth - 1)

    handle = root.register_forward_hook(lambda module, args, out: register(out))
    try:
        yield
    finally:
        handle.remove()


def without_decompositions(table: dict, names) -> dict:
    """`table` without the decompositions of every overload of the ATen ops `names`."""
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        for overload in (packet.overloads() if packet is not None else ()):
            table.pop(getattr(packet, overload), None)
    return table


def _decomposition_table():
    # SDPA has a sharding rule of its own and its CPU decomposition breaks on GPT-2 (see NOTES).
    return without_decompositions(torch.export.default_decompositions(),
                                  ("scaled_dot_product_attention",) + DRAWN_WHOLE + WRONG_IN_TORCH)


def tensor_info_of(node: fx.Node) -> TensorInfo | tuple | None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return TensorInfo(_static_shape(node, val), val.dtype)
    if isinstance(val, (tuple, list)):
        return tuple(TensorInfo(_static_shape(node, v), v.dtype) if isinstance(v, torch.Tensor) else None for v in val)
    return None


def _static_shape(node: fx.Node, val: torch.Tensor) -> tuple[int, ...]:
    if any(isinstance(d, torch.SymInt) for d in val.shape):
        counts = "bincount" in str(node.target)  # (as the training trace's refusal says it: a review)
        raise SpmdError(
            f"{describe_node(node)} has an output shape that depends on the data ({list(val.shape)}); a plan "
            "needs every shape known when it is made. What to do: compute a fixed-size result instead (" +
            ("a count per index below n: `torch.zeros(n).index_add_(0, idx, torch.ones(len(idx)))`" if counts else
             "a mask and torch.where in place of nonzero or boolean indexing") +
            "), or run this op outside the compiled model.")
    return tuple(val.shape)


# Runtime checks of global metadata: on local shards they would fail, and the trace already proved them.
_ASSERTIONS = {torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default,
               torch.ops.aten.sym_constrain_range_for_size.default}


def _drop_assertions(gm: fx.GraphModule) -> None:
    dropped = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _ASSERTIONS and not n.users]
    for node in dropped:
        gm.graph.erase_node(node)
    if dropped:  # (a recompile of LLaMA3-8B's 3-layer joint graph: 20 ms)
        gm.recompile()


# Side-effecting checks torch.export orders with effect tokens (`with_effects`): they only raise on bad
# values (a singular matrix) and return nothing, and each rank would check its own piece. Dropped, like
# the metadata assertions; any other effectful op is refused.
_EFFECT_CHECKS = {torch.ops.aten._linalg_check_errors.default}


def _drop_effect_tokens(gm: fx.GraphModule, token_names: set[str]) -> None:
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.higher_order.with_effects:
            continue
        op = node.args[1]
        results = [u for u in node.users if u.args[1] != 0]
        if op not in _EFFECT_CHECKS or any(u.users for u in results):
            raise SpmdError(f"{describe_node(node)}: the model calls {op}, which has side effects torch.export "
                            "orders with tokens; spmd cannot partition it. What to do: move it out of the "
                            "compiled model.")
        token_out = [u for u in node.users if u.args[1] == 0]
        out = graph.output_node()
        out.args = (tuple(a for a in out.args[0] if a not in token_out),)
        for u in list(node.users):
            graph.erase_node(u)
        graph.erase_node(node)
        changed = True
    out = graph.output_node()
    for token in [n for n in graph.nodes if n.op == "placeholder" and n.name in token_names]:
        out.args = (tuple(a for a in out.args[0] if a is not token),)
        if not token.users:
            graph.erase_node(token)
        changed = True
    if changed:
        gm.recompile()


def torch_said(error: BaseException) -> tuple[str, str]:
    """(the gist of torch's message: its first line, with the user's line it names, "Caused by: ..."; the whole
    message if there is more): a failed trace put about ten lines of torch's advice before spmd's way out."""
    text = str(error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    gist = lines[0] if lines else type(error).__name__
    caused = next((line for line in lines[1:] if line.startswith("Caused by")), None)
    return (f"{gist} ({caused})" if caused else gist), (text if len(lines) > 1 else "")


def untraceable_message(head: str, error: BaseException, way_out: str) -> str:
    unfaked = _no_fake_kernel(error)
    if unfaked is not None:  # (torch's own message is the op's name alone: a probe was told to look at control flow)
        error, way_out = unfaked
    gist, whole = torch_said(error)
    return f"{head}: {gist}\nWhat to do: {way_out}." + (f"\n\ntorch's whole message:\n{whole}" if whole else "")


def _no_fake_kernel(error: BaseException) -> tuple[BaseException, str] | None:
    """(torch's error, the way out) where what failed the trace is an op of the user's library with no fake (meta)
    implementation, deep in the chain under an error that names the op alone; None otherwise."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, NotImplementedError) and "no fake impl or Meta kernel registered" in str(error):
            op = re.match(r"\s*([\w.]+::[\w.]+):", str(error))
            name = op.group(1) if op else "your_lib::op"
            return error, (f"give the op a fake implementation, which computes its outputs' shapes and dtypes: "
                           f"`@torch.library.register_fake(\"{name}\")` on a function of its arguments (for a "
                           "`torch.library.custom_op`, `@op.register_fake`)")
        error = error.__cause__ or error.__context__
    return None


def _chain_frames(error: BaseException) -> list:
    """The frames `error` and what it was raised from passed through, each traceback innermost last."""
    frames, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        frames += traceback.extract_tb(error.__traceback__)
        error = error.__cause__ or error.__context__
    return frames


def _frames(error: BaseException) -> set[str]:
    """The names of the functions `error` (and what it was raised from) passed through."""
    return {f.name for f in _chain_frames(error)}


def _torch_and_spmd() -> tuple[str, str]:
    """The folders of torch's and spmd's own files: frames in them are not the user's."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (spmd's own folder)
    return os.path.dirname(torch.__file__) + os.sep, here + os.sep


def _original_line(error: BaseException) -> str | None:
    """`file:line: code` of the innermost frame outside torch and spmd in the "Original traceback" torch's FX
    interpreter writes into an error met running a node: the user's line that called the op."""
    skip = _torch_and_spmd()
    texts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        texts += [str(error), *getattr(error, "__notes__", ())]  # (torch's interpreter adds it as a note)
        error = error.__cause__ or error.__context__
    text = "\n".join(texts)
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n[ \t]+(?!File ")(\S.*)', text)
    found = [(f, n, code.strip()) for f, n, code in frames if not f.startswith(skip)]
    return f"{found[-1][0]}:{found[-1][1]}: {found[-1][2]}" if found else None


def _model_line(error: BaseException) -> str | None:
    """`file:line: code` of the innermost frame `error` (or what it was raised from) passed through outside torch
    and spmd: the model's line (or its library's) that read a tensor's values. Torch's own "Caused by" can name
    a line of torch's (found by a probe: transformers' dynamic RoPE update was named as
    `_export/non_strict_utils.py`)."""
    skip = _torch_and_spmd()
    ours = [f for f in _chain_frames(error) if not f.filename.startswith(skip) and not f.filename.startswith("<")]
    return f"{ours[-1].filename}:{ours[-1].lineno}: {(ours[-1].line or '').strip()}" if ours else None


def _data_lines(model: torch.nn.Module | None) -> list[str]:
    """`file:line: code` of each line of the forwards of `model`'s own module classes (not torch's) that reads a
    tensor's `.data`."""
    return _forward_lines(model, "data", r"\.data\b(?!\s*\()")


def _forward_lines(model: torch.nn.Module | None, name: str, pattern: str) -> list[str]:
    """`file:line: code` of each line matching `pattern` in the forwards of `model`'s own module classes (not
    torch's) whose code names `name`."""
    found = []
    for cls in dict.fromkeys(type(m) for m in (model.modules() if model is not None else ())):
        forward = getattr(cls, "forward", None)
        forward = inspect.unwrap(forward) if callable(forward) else forward
        if cls.__module__.startswith("torch.") or name not in getattr(getattr(forward, "__code__", None),
                                                                        "co_names", ()):
            continue
        try:
            lines, start = inspect.getsourcelines(forward)
        except (OSError, TypeError):
            continue
        found += [f"{inspect.getsourcefile(forward) or '?'}:{start + k}: {line.strip()}" for k, line in enumerate(lines)
                  if re.search(pattern, line.split("#")[0])]
    return found


def _unbacked_origin(error: BaseException) -> tuple[str, str | None] | None:
    """(op, `file:line: code`) of the node whose output shape holds a symbol the failed guard of `error` reads
    (torch's partial graph of the trace, `partial_fx_graph`): the op whose output shape depends on its input values,
    where the guard is only where that size met a fixed one (a loss comparing its target's shape). An output of an
    op with several (`_unique2`'s, taken by `getitem`) is that op's."""
    seen = set()
    while error is not None and not hasattr(error, "partial_fx_graph") and id(error) not in seen:
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    symbols = set(re.findall(r"\bu\d+\b", str(getattr(error, "cond", ""))))
    graph = getattr(error, "partial_fx_graph", None)
    if not symbols or not isinstance(graph, str):
        return None
    line, made = None, {}  # (made: variable -> (op, line) of the op that made it)
    for text in graph.splitlines():
        if text.lstrip().startswith("#"):  # (each node's comment says where it came from, or that nothing did)
            where = re.search(r"File: (\S+?):(\d+) in \S+, code: (.*)", text)
            line = f"{where.group(1)}:{where.group(2)}: {where.group(3).strip()}" if where else None
            continue
        node = re.match(r'\s*(\w+)(?:: "([^"]*)")? = (.*)', text)
        if not node:
            continue
        name, annotation, value = node.groups()
        op = re.match(r"torch\.ops\.(\w+\.\w+)\.\w+\(", value)
        if op and op.group(1) in ("aten.item", "aten._local_scalar_dense") and symbols & set(
                re.findall(r"\bu\d+\b", annotation or "")):
            return None  # (a number taken from a tensor's values, `.item()`: its own message; a review)
        item = re.match(r"(\w+)\[\d+\]", value)
        if op:
            made[name] = (op.group(1), line)
        elif item and item.group(1) in made:
            made[name] = made[item.group(1)]
        shape = re.fullmatch(r"\w+\[([^\]]*)\]", annotation or "")  # (a tensor's: `f32[2, u0, 4]`; not a number's)
        if name in made and shape and symbols & set(re.findall(r"\bu\d+\b", shape.group(1))):
            return made[name]
    return None


def _layerdrop(model: torch.nn.Module | None) -> tuple[str, float] | None:
    """(name, value) of a transformers config's LayerDrop probability above 0 (`layerdrop`, `encoder_layerdrop`,
    `decoder_layerdrop`) in a module of `model` in train mode."""
    for m in (model.modules() if model is not None else ()):
        config = getattr(m, "config", None)
        for name in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop"):
            value = getattr(config, name, None)
            if m.training and isinstance(value, (int, float)) and value > 0:
                return name, value
    return None


_PACKING = {"pack_padded_sequence", "pack_sequence", "PackedSequence"}  # (torch.nn.utils.rnn's, as a forward names them)


def untraceable_way_out(error: BaseException, otherwise: str = "", model: torch.nn.Module | None = None) -> str:
    """The way out of a trace that failed with `error` (torch's message names the line), or of what in `model`
    is known to fail so."""
    tail = f" ({otherwise})" if otherwise else ""
    cumulative = [name for name, m in (model.named_modules() if model is not None else ())
                  if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.momentum is None and m.training]
    if cumulative and "data-dependent" in str(error):
        return (f"{', '.join(cumulative[:3])}: a batch norm with momentum=None (a cumulative average of the "
                "statistics) computes its factor from `num_batches_tracked` in Python, which a graph cannot hold. "
                "Give it a momentum (`momentum=0.1`, torch's default), or compile the model in eval mode")
    cache = re.search(r"\b(\w*Cache)\b", str(error))
    # (a cache given as past_key_values: torch's own words alone before, found by a probe; a StaticCache given was
    # told it was returned, found by a serving probe)
    as_input = "get_seq_length" in str(error) or (cache and "Unsupported input type" in str(error))
    if cache and not as_input and ("pytree" in str(error) or "not a known type" in str(error)):  # (returned)
        return (f"the model returns a {cache.group(1)} (transformers' key/value cache, on by default), which a graph "
                "cannot hold: build it with `use_cache=False` in its config, or pass `use_cache=False` in the "
                "example kwargs")
    if as_input:
        given = "a tensor" if "'FakeTensor' object" in str(error) else "a key/value cache"
        return (f"the model was given {given} where it takes `past_key_values` (transformers' key/value cache), which "
                "a compiled graph cannot take: its inputs are tensors of fixed shapes. Pass the inputs by keyword "
                "(`input_ids=`, `attention_mask=`), no cache, and `use_cache=False` (in the config or the kwargs); to "
                "generate, run a buffer of the longest length, right-padded, with its attention_mask at each step "
                "(one compile for every step; each new length would be a compile of its own, 8 at most), keep a "
                "static key/value cache in the model's buffers, or compile transformers' "
                "TorchExportableModuleWithStaticCache around the model (docs/huggingface.md, \"Generation\")")
    unknown = re.search(r"Found <class '([^']+)'> in (\w+), which is not a known type", str(error))
    if unknown:  # (a class of the user's in the output: a plain dataclass)
        name = unknown.group(1).rsplit(".", 1)[-1]
        return (f"the forward's {unknown.group(2)} holds a {name}, which torch's pytree cannot take apart into "
                f"tensors. Return a tuple, a dict or a transformers ModelOutput, or register the class before "
                f"compiling: `torch.utils._pytree.register_dataclass({name})` for a dataclass")
    if type(error).__name__ == "DynamicOutputShapeException":  # (torch says only the op's name)
        # (found by a probe: BartForSequenceClassification's check that every row has as many eos tokens, in its
        # forward, was told to move a loss out; the line it is on is in torch's "Original traceback" text)
        line = _original_line(error)
        func = str(getattr(error, "func", "the op"))
        # (found by a probe: a graph network's node degrees by bincount, told of CTC losses alone)
        fixed = (" (a count per index below n: `torch.zeros(n).index_add_(0, idx, torch.ones(len(idx)))`, or "
                 "`scatter_add_`)") if "bincount" in func else ""
        return (f"{func}'s output shape depends on its input values"
                f"{f' ({line})' if line else ''}, and torch's tracing has no rule for it. Replace it with ops of a "
                f"fixed shape{fixed}, or compute it outside the compiled module: a loss such as CTC's from its outputs "
                "(compiled with `training=True` and no `loss_fn`, they take `.backward()` from a loss computed after "
                "the call, on this rank's pieces as the plan lays them out: pin `out_placements` to the layout it "
                "needs); in a model's own forward, compile the part before it (a transformers model's base, "
                "`model.model`) and run the rest on the gathered outputs" + tail)
    packing = [name or type(model).__name__ for name, m in (model.named_modules() if model is not None else ())
               if not type(m).__module__.startswith("torch.")  # (nn.LSTM's own forward takes a PackedSequence)
               and _PACKING & set(getattr(getattr(type(m).forward, "__code__", None), "co_names", ()))]
    if packing:
        return (f"{', '.join(packing[:3])} packs its sequences (`pack_padded_sequence`): a PackedSequence's batch "
                "sizes come from the lengths' values, and an RNN over one makes its shapes from them, which a graph "
                "cannot hold. Run the RNN on the padded batch and mask what the padding gave: the outputs past each "
                "length (`out * (torch.arange(T) < lengths[:, None])[..., None]`), each sequence's last state taken at "
                "`lengths - 1` (`out.gather`). A bidirectional RNN's backward direction would start in the padding: "
                "keep it outside the compiled module, or left-align it by flipping each sequence" + tail)
    # (found by a probe: torch's words, "'NoneType' object has no attribute 'ignore_fresh_unbacked_symbols'"; torch
    # differentiates both in eager, but its tracing of their backward fails in the joint trace)
    loop = "torch.while_loop" if "higher_order.while_loop" in str(error) or "while_loop" in _frames(error) else \
        "torch's `scan`" if "scan might be aliasing" in str(error) or "higher_order.scan" in str(error) else None
    if loop:
        return (f"the forward runs {loop}, whose backward torch's tracing cannot put into a training graph (eager "
                "PyTorch differentiates it; the joint trace fails). Unroll the loop in Python where its count is "
                "fixed (`for _ in range(3): z = body(z)`; an `associative_scan`, where the combine is associative, "
                "trains too), or compile the model for inference" + tail)
    if "refer to a single memory location" in str(error):
        return ("the forward writes into a tensor a value that views it (`h[mask] = h[0, 0]`), which eager PyTorch "
                "refuses too: write a copy (`h[mask] = h[0, 0].clone()`)" + tail)
    if "modified by an inplace operation" in str(error):  # (found by a probe: told of torch.export's control flow)
        return ("the forward changes in place a tensor autograd saved for backward (a buffer updated after a product "
                "read it), which eager PyTorch refuses too, at its backward. Read a copy where the value is used "
                "(`h * self.avg.clone()`), or update the tensor after its last use" + tail)
    in_constants = "fake tensor in the exported program constant" in str(error)
    differentiates = _forward_lines(model, "grad", r"autograd\.grad\(|\.backward\(") if in_constants else []
    if differentiates:  # (found by a probe: a force field's -dE/dx, told torch's words and "file an issue")
        return (f"`{differentiates[0]}` differentiates inside the forward (forces as the gradient of an energy), "
                "which a graph holds only as part of a training graph, with the gradient's own computation: compile "
                "with `training=True` and take the gradient with `create_graph=True` (a call need not be followed "
                "by a backward)")
    transforms = list(dict.fromkeys(line for name in ("vmap", "jacrev", "jacfwd", "hessian", "grad", "jvp", "vjp")
                                    for line in _forward_lines(model, name, rf"\b{name}\(")))
    if transforms and (in_constants or "has no attribute 'constant'" in str(error)):
        # (found by a probe: told of data-dependent control flow; the same models train equal to one device)
        return (f"`{transforms[0]}` runs a torch.func transform over the model's weights, which torch.export cannot "
                "put into a forward-only graph; AOTAutograd, which traces training graphs, can: compile with "
                "`training=True` (a call under torch.no_grad() then runs the forward alone)")
    through_data = _data_lines(model) if in_constants else []
    if through_data:  # (found by a probe: an EMA buffer updated as `self.ema.data.mul_(d).add_(...)`)
        return (f"`{through_data[0]}` goes through `.data`, which torch.export cannot trace in a forward (it leaves a "
                "fake tensor among the graph's constants). Update the tensor itself under `torch.no_grad()` "
                "(`self.ema.mul_(d).add_(...)`, `self.ema.copy_(new)`): the graph carries out in-place updates of "
                "buffers")
    dropping = _layerdrop(model) if "data-dependent" in str(error) else None
    line = _model_line(error) if dropping else None
    if dropping and (line is None or re.search(r"layerdrop|skip_the_layer|dropout_probability", line, re.I)):
        # (found by a probe: BART's encoder_layerdrop, Wav2Vec2's layerdrop, told to write torch.where; the line is
        # transformers' comparison, or its flag's test)
        return (f"{type(model).__name__} drops whole layers at random in training (LayerDrop: its config's "
                f"`{dropping[0]}={dropping[1]}`), comparing a draw with it in Python"
                f"{f' (`{line}`)' if line else ''}, and a graph holds one outcome. Build the model with "
                f"`{dropping[0]}=0` in its config, or compile it in eval mode" + tail)
    if "data-dependent" in str(error) and "_detect_is_causal_mask" in _frames(error):
        return ("torch's Transformer layers read a mask's values to tell whether it is causal when `is_causal` is "
                "left None (`_detect_is_causal_mask`), and a graph holds one outcome. Pass it: "
                "`encoder(x, mask=mask, is_causal=True)` (or False; `src_is_causal`/`tgt_is_causal` for "
                "nn.Transformer, `tgt_is_causal` for a decoder)" + tail)
    distributions = os.path.join("torch", "distributions", "")
    if "data-dependent" in str(error) and any(distributions in f.filename for f in _chain_frames(error)):
        line = _model_line(error)  # (found by a probe: `Normal(mu, sigma).rsample()` told to write torch.where)
        return (f"{'`' + line + '` builds' if line else 'the forward builds'} a torch.distributions object, "
                "which checks its arguments' values in Python (`validate_args`, on by default), and a graph holds "
                "one outcome. Pass `validate_args=False` to it, or call "
                "`torch.distributions.Distribution.set_default_validate_args(False)` before compiling" + tail)
    if "_local_scalar_dense" in str(error):  # (found by a probe: `.item()` in a loss_fn, told only "the forward")
        line = _model_line(error)
        where = f"`{line}`" if line else "the forward or the loss_fn"
        return (f"{where} takes a Python number from a tensor's values (`.item()`, `float(t)`, `max(1, n.item())`), "
                "which a graph cannot hold: it would keep the traced value for every call. Keep it a tensor "
                "(`loss_sum / (labels != -100).sum().clamp(min=1)`), or compute it outside the compiled module"
                + tail)
    eager_experts = sorted({type(m).__name__ for m in (model.modules() if model is not None else ())
                            if getattr(getattr(m, "config", None), "_experts_implementation", None) == "eager"
                            and type(m).__name__.endswith("Experts")})
    if "data-dependent" in str(error) and eager_experts:  # (found by a probe: Mixtral's were told to write torch.where)
        return (f"{eager_experts[0]} runs transformers' `eager` experts, which loop over the experts the router "
                "picked (`nonzero()`), a number a graph cannot hold. Build the model with "
                "`experts_implementation=\"grouped_mm\"` (transformers' default) or `\"batched_mm\"`, which run every "
                "expert as one batched op" + tail)
    # (found by a probe: F.gaussian_nll_loss's `var < 0` check in a loss_fn was told to move its check out, with the
    # loss computed by a loss_fn: it was one, and torch's; torch's losses only: a pool sized by the user's `.item()`
    # is the user's line's, a review)
    functional = os.path.join("torch", "nn", "functional.py")
    checks = ([f.name for f in _chain_frames(error) if f.filename.endswith(functional)] or
              re.findall(r"Caused by: \S*nn/functional\.py:\d+ in (\w+)", str(error))) \
        if "data-dependent" in str(error) and "_local_scalar_dense" not in str(error) else []
    origin = _unbacked_origin(error) if checks and checks[-1].endswith("_loss") else None
    if origin:  # (found by a probe: `repeat_interleave` by a tensor of counts, told F.mse_loss checked values)
        op, line = origin
        return (f"{op}'s output shape depends on its input values{f' ({line})' if line else ''}, and "
                f"`F.{checks[-1]}` compares that size with a fixed one, which a graph cannot hold. Replace the op with "
                "ops of a fixed shape (counts known in Python: `index_select` of the positions they repeat, "
                "`torch.tensor([i for i, k in enumerate(counts) for _ in range(k)])`; `torch.where` over a mask in "
                "place of indexing by it), or compute it outside the compiled module" + tail)
    if checks and checks[-1].endswith("_loss"):
        return (f"torch's own `F.{checks[-1]}` checks its arguments' values in Python, and a graph holds one "
                "outcome. Compile with `training=True` and no `loss_fn`, and compute the loss after the call on the "
                "gathered outputs (`F.{0}(compiled.gather_outputs(out), ...)`, then `.backward()`), or write it as "
                "tensor ops".format(checks[-1]) + tail)
    if "data-dependent" in str(error):
        line = _model_line(error)
        where = f"`{line}`" if line else "the line torch names above (\"Caused by\")"
        return (f"{where} reads a tensor's values in Python (a branch, or a size), "
                "and a graph holds one outcome. Write it as tensor ops (`torch.where`), or keep it out of the "
                "forward: a check of the inputs (transformers' `labels.max() >= vocab_size`) belongs in the training "
                "loop, with the loss computed by a `loss_fn` from the model's output (the labels not passed to the "
                "model)" + tail)
    if "expected compiled_fn to be GraphModule" in str(error) and model is not None:
        names: dict[int, list[str]] = {}
        for name, m in model.named_modules(remove_duplicate=False):
            if any(True for _ in m.buffers(recurse=False)):
                names.setdefault(id(m), []).append(name)
        shared = [found for found in names.values() if len(found) > 1]
        if shared:  # (found by a probe: an ALBERT-style shared layer with a batch norm, told of control flow)
            return (f"{shared[0][0]} is one module under {len(shared[0])} names ({', '.join(shared[0][1:3])}"
                    f"{', ...' if len(shared[0]) > 3 else ''} too), called more than once, and holds buffers a "
                    "forward may update in place (a batch norm's statistics): torch.export fails to lower such a "
                    "forward (its own assertion, above). Give each use a module of its own, or compile in eval mode, "
                    "where a batch norm updates nothing" + tail)
    attribute = re.search(r"'(?:FakeTensor|FunctionalTensor|Parameter)' object has no attribute '(\w+)'", str(error))
    if attribute and not attribute.group(1).startswith("_"):  # (found by a probe: told of control flow)
        line = _model_line(error)
        return (f"{'`' + line + '` reads' if line else 'the forward reads'} `{attribute.group(1)}`, a Python attribute "
                "set on a tensor (a parameter's `p.gscale = 0.5`): the trace runs the forward on stand-ins of the "
                "model's tensors, which do not carry it. Keep such a number on the module (`self.gscale = 0.5`), "
                "or in a buffer for a tensor" + tail)
    if re.search(r"must be Tensor, not (list|tuple)", str(error)):  # (found by a probe: `spmd.compile(m, mesh, [x])`)
        return ("a list or tuple reached an op that takes a tensor. If the example inputs were given as a list: "
                "spmd.compile takes the positional example inputs as a tuple, `(x,)` or `(x, y)`, and a list given "
                "there is one input (`([x1, x2],)` for a forward that takes a list)")
    # (example inputs that do not fit the forward, in Python's words or, where torch.export binds them first,
    # inspect's; found by a probe: told to remove data-dependent control flow)
    call = re.search(r"\b(\w+)\.forward\(\) (missing \d+ required [\w-]+ arguments?: .+|got an unexpected keyword "
                     r"argument '\w+'|takes (?:from \d+ to )?\d+ positional arguments? but \d+ (?:was|were) given)",
                     str(error))
    bound = re.fullmatch(r"too many positional arguments|missing a required argument: '\w+'|got an unexpected "
                         r"keyword argument '\w+'", str(error).strip()) if isinstance(error, TypeError) else None
    if model is not None and (bound or (call and call.group(1) in {c.__name__ for c in type(model).__mro__})):
        return (f"the example inputs do not match {type(model).__name__}.forward's arguments "
                f"({call.group(2) if call else bound.group(0)}): spmd.compile "
                "calls the forward with `example_inputs` (positional) and `example_kwargs` (by keyword), as the "
                "training loop will; give it one example of each argument the forward takes (with a `loss_fn`, the "
                "targets come after the model's inputs)")
    kind = type(error).__name__
    if kind in ("DataDependentOutputException", "PendingUnbackedSymbolNotFound"):
        # (found by a probe: torch.cov / torch.corrcoef, which check their weights with `aten.equal`, and
        # torch.combinations, which selects its pairs with a mask, were told to remove control flow, and no line)
        line = _model_line(error)
        where = f"`{line}` runs" if line else "the forward runs"
        if kind == "DataDependentOutputException" and re.search(r"\b(cov|corrcoef)\(", line or ""):
            return (f"{where} torch code that calls {getattr(error, 'func', 'an op')}, which gives a Python value "
                    "made from its inputs' values (torch.cov and torch.corrcoef check their weights with it), and a "
                    "graph holds one outcome. Write the computation as tensor ops (a covariance of the rows of x: "
                    "`xc = x - x.mean(1, keepdim=True)`, then `xc @ xc.T / (x.shape[1] - 1)`), or compute it outside "
                    "the compiled module" + tail)
        if kind == "DataDependentOutputException":  # (the user's own `torch.equal`, `torch.allclose`: a review)
            return (f"{where} {getattr(error, 'func', 'an op')}, which gives a Python value made from its inputs' "
                    "values (`torch.equal`, `torch.allclose`), and a graph holds one outcome. Keep it a tensor "
                    "(`(a == b).all()`, `torch.isclose(a, b).all()`) and choose with `torch.where`, or compute it "
                    "outside the compiled module" + tail)
        return (f"{where} torch code that makes a shape from its inputs' values on the way (torch.combinations picks "
                "its pairs with a mask), which torch's tracing cannot follow. Write it with ops of a fixed shape (the "
                "pairs of n rows: `i, j = torch.triu_indices(n, n, 1)`, then `x[i]`, `x[j]`), or compute it outside "
                "the compiled module" + tail)
    raised = _raised_by_the_model(error, model)
    if raised:  # (found by a probe: T5 without decoder_start_token_id, told of torch.export's control flow)
        return (f"`{raised}` raised it, in the model's own code (or its library's), not in torch's tracing: run the "
                "model eagerly on the same example inputs; if it fails there too, what it needs is in its inputs or "
                "config" + tail)
    return "make the forward traceable by torch.export (no data-dependent Python control flow" + (
        f"; {otherwise})" if otherwise else ")")


_PLAIN_ERRORS = ("AttributeError", "KeyError", "ValueError", "TypeError", "IndexError", "AssertionError",
                 "NotImplementedError", "ZeroDivisionError")


def _raised_by_the_model(error: BaseException, model: torch.nn.Module | None) -> str | None:
    """`file:line: code` where a plain Python error (an AttributeError, a ValueError, ...) was raised, when that is
    in the model's code or its library's (the package of one of its module classes: transformers for its models; not
    sympy or the standard library, which torch's tracing calls too; a review), and nothing in it speaks of tracing."""
    if model is None or type(error).__name__ not in _PLAIN_ERRORS or re.search(
            r"Fake|SymInt|SymBool|Proxy|[Ff]unctional|trac", str(error)):
        return None
    roots = set()
    for cls in {type(m) for m in model.modules()}:
        top = sys.modules.get((cls.__module__ or "").split(".")[0])
        where = getattr(top, "__file__", None)
        if where and top.__name__ != "torch":
            roots.add(os.path.dirname(where) + os.sep if os.path.basename(where) == "__init__.py" else where)
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return None
    path = tb.tb_frame.f_code.co_filename
    if path.startswith(_torch_and_spmd()) or not any(path == root or path.startswith(root) for root in roots):
        return None
    return f"{path}:{tb.tb_lineno}: {linecache.getline(path, tb.tb_lineno).strip()}"


def distinct_inputs(example_inputs: tuple, example_kwargs: dict | None = None) -> tuple[tuple, dict]:
    """The example inputs with each tensor that shares memory with an earlier one (the same tensor passed
    twice, e.g. transformers' `input_ids=ids, labels=ids`, or a view of another input) replaced by a copy.
    torch.export traces inputs that alias as one: every read of them reads the last placeholder, so a
    graph traced from `(t, t)` and run on `(a, b)` computed with `b` for both (a training step's loss
    came out wrong, silently). Copied, each input has its own placeholder, as the user's calls do."""
    leaves, spec = torch.utils._pytree.tree_flatten((tuple(example_inputs), dict(example_kwargs or {})))
    seen: set[int] = set()
    for k, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            continue
        try:
            storage = x.untyped_storage()._cdata  # (the storage itself: meta and fake tensors have no data pointer)
        except (NotImplementedError, RuntimeError):  # (a sparse tensor has none: not one that aliases)
            continue
        if storage in seen:
            with torch.no_grad():
                leaves[k] = x.clone().requires_grad_(x.requires_grad)
        seen.add(storage)
    return torch.utils._pytree.tree_unflatten(leaves, spec)


_PY_RANDOM = ("random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample", "gauss",
              "normalvariate", "lognormvariate", "betavariate", "gammavariate", "expovariate", "vonmisesvariate",
              "paretovariate", "weibullvariate", "triangular", "getrandbits", "randbytes")
_NP_RANDOM = ("rand", "randn", "random", "random_sample", "ranf", "sample", "randint", "random_integers", "choice",
              "permutation", "shuffle", "uniform", "normal", "binomial", "poisson", "beta", "exponential", "gamma",
              "laplace", "multinomial", "standard_normal", "bytes")
_naming_lock = threading.Lock()


def _generator_states() -> tuple:
    """Python's and numpy's global generators, as they are now (comparable: numpy's key array as bytes)."""
    import random

    states = [random.getstate()]
    try:
        import numpy as np
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        states.append((kind, keys.tobytes(), pos, has_gauss, gauss))
    except ImportError:
        pass
    return tuple(states)


def _set_generator_states(states: tuple) -> None:
    import random

    random.setstate(states[0])
    if len(states) > 1:
        import numpy as np
        kind, keys, pos, has_gauss, gauss = states[1]
        np.random.set_state((kind, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, gauss))


class random_draws:
    """What Python's and numpy's global generators did while it was open. A trace keeps what they returned as
    constants, and every call of the compiled graph would reuse them. `unseeded`: the draws this thread made
    through the generators' functions with no seed set before them in the same block ("np.random.rand at
    file:line"; numbers drawn after the model's own `np.random.seed(k)` are the same at every call);
    `unnamed`: the generators moved and no such call says why (a function bound before the block, as
    `from random import random`, or another thread's draw). Functions are patched meanwhile, one block at a
    time (a lock)."""

    def __enter__(self) -> "random_draws":
        import random

        self.events: list[tuple[str, str]] = []
        self.thread = threading.get_ident()
        self.patched = []
        owners = [(random, "random", _PY_RANDOM + ("seed",))]
        try:
            import numpy as np
            owners.append((np.random, "np.random", _NP_RANDOM + ("seed",)))
        except ImportError:
            pass
        _naming_lock.acquire()
        try:
            self.before = _generator_states()
            for owner, prefix, names in owners:
                for name in names:
                    fn = getattr(owner, name, None)
                    if fn is not None:
                        self.patched.append((owner, name, fn))
                        setattr(owner, name, self._noting(fn, f"{prefix}.{name}", "seed" if name == "seed" else "draw"))
        except BaseException:
            for owner, name, fn in reversed(self.patched):
                setattr(owner, name, fn)
            _naming_lock.release()
            raise
        return self

    def _noting(self, fn, label: str, kind: str):
        def drawn(*args, **kwargs):
            if threading.get_ident() == self.thread:
                # (a seed with no value is drawn from the system: the numbers after it differ at every call)
                seeded = kind == "seed" and (args[0] if args else kwargs.get("a", kwargs.get("seed"))) is not None
                self.events.append(("seed" if seeded else "draw", f"{label} at {_caller()}"))
            return fn(*args, **kwargs)

        return drawn

    def __exit__(self, *exc) -> None:
        try:
            for owner, name, fn in reversed(self.patched):
                setattr(owner, name, fn)
            moved = _generator_states() != self.before
        finally:
            _naming_lock.release()
        seeded = False
        self.unseeded = []
        for kind, what in self.events:
            seeded |= kind == "seed"
            if kind == "draw" and not seeded:
                self.unseeded.append(what)
        self.unnamed = moved and not any(kind == "draw" for kind, _ in self.events)


def _caller() -> str:
    """file:line of the innermost frame outside this file, torch and numpy (the model's line that drew)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path != __file__ and "/torch/" not in path and "/numpy/" not in path and not path.endswith("random.py"):
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def graph_signature(gm: fx.GraphModule, constants: dict | None = None):
    """What two traces of one model must share to be the same graph: the code, and the values of the tensor
    constants (attributes the graph reads, or torch.export's lifted `constants`). None where a constant's
    values are not known (a fake tensor): no two such graphs are known to be the same."""
    tensors = {f"{path}.{n.target}": getattr(m, n.target, None) for path, m in gm.named_modules()
               if isinstance(m, fx.GraphModule) for n in m.graph.nodes if n.op == "get_attr"}
    tensors.update(constants or {})
    values = []
    for name, t in sorted(tensors.items()):
        if isinstance(t, torch.Tensor):
            if torch._subclasses.fake_tensor.is_fake(t) or t.is_meta:
                return None
            values.append((name, str(t.dtype), tuple(t.shape), t.detach().cpu().contiguous().view(-1).view(torch.uint8)
                           .numpy().tobytes() if t.numel() else b""))
    # (and the bodies of its higher-order ops: a `torch.no_grad()` block in torch.export's graph is a submodule,
    # whose slice of a buffer at a Python pointer the top-level code does not show; found by a review)
    code = "".join(m.code for _, m in gm.named_modules() if isinstance(m, fx.GraphModule))
    return code, tuple(values)


def _live_signature(ep) -> tuple | None:
    """`graph_signature` of an export's graph without the ops nothing reads: a value computed and only kept on
    the model at the first call (`self.input_scale = x.std()` under a flag) leaves a dead op in the export's
    graph, which the compiled graph drops (found by a review: such a flag was refused)."""
    graph, env = fx.Graph(), {}
    graph.output(graph.graph_copy(ep.graph_module.graph, env))
    # (a higher-order op's body may write a buffer in place, its result unread: kept)
    graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or (
        n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)))
    return graph_signature(fx.GraphModule(ep.graph_module, graph), ep.constants)


def draws_change_the_graph(trace, signature, named: list[str]) -> list[str]:
    """`trace()` again, twice, with Python's and numpy's generators seeded apart from the first trace, whose
    `signature` (`graph_signature`) is given: [] where every graph is the same (the draws reached nothing the
    graph keeps: a value only training reads), else the draws named (`named`, or those the retraces saw).
    The generators are left as the first trace left them."""
    import random

    states = _generator_states()
    try:
        for seed in (0x5EED, 0xD1CE):
            random.seed(seed)
            try:
                import numpy as np
                np.random.seed(seed)
            except ImportError:
                pass
            with random_draws() as again:
                other = trace()
            if signature is None or other != signature:
                return named or again.unseeded or [
                    "a draw from the global generators (a function bound before the trace, or another thread's)"]
        return []
    finally:
        _set_generator_states(states)


def refuse_random_draws(draws: list[str], model: torch.nn.Module) -> None:
    if draws:
        listed = ", ".join(dict.fromkeys(draws[:8]))
        raise SpmdError(
            f"the forward of {type(model).__name__} draws random numbers with Python's or numpy's generator "
            f"({listed}). A trace keeps those numbers as constants, so every call of the compiled module would "
            "reuse them (the same mask, the same dropped layers at every step), without a word. What to do: draw "
            "them with torch (torch.rand, torch.randint, torch.bernoulli), which the graph draws anew at each "
            "call; or draw them outside the model and pass them in as an input (transformers' wav2vec2 takes "
            "`mask_time_indices`); or turn the feature off (transformers' SpecAugment: "
            "`apply_spec_augment=False`).")


MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# the tables of the hooks every module runs (`torch.nn.modules.module.register_module_forward_hook` and its kin)
GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                "_global_backward_hooks")


# hooks that only compute values (all of it in the graph): transformers' `enable_input_require_grads`, torch's
# weight_norm / spectral_norm (the old, hook-based ones)
_VALUE_ONLY_HOOKS = ("make_inputs_require_grads", "WeightNorm", "SpectralNorm")


def _hook_name(hook) -> str:
    fn = getattr(hook, "__func__", hook)
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def user_hook(hook) -> bool:
    """Not spmd's own guard (runtime/source_guard.py) nor a hook known to compute values only."""
    return not getattr(hook, "spmd_guard", False) and not any(k in _hook_name(hook) for k in _VALUE_ONLY_HOOKS)


def warn_module_hooks(model: torch.nn.Module) -> None:
    """A module hook runs while the model is traced: what it computes into the values is in the graph, and
    anything else it does (record an activation, print, count, append an auxiliary loss to a list) happened
    then and never again. Say so, naming the modules and hooks (global ones too), since nothing else would."""
    from torch.nn.modules import module as nn_module

    hooked = {}
    for name, m in model.named_modules():
        for h in MODULE_HOOKS:
            for hook in getattr(m, h).values():
                if user_hook(hook):
                    hooked.setdefault(f"{name or type(model).__name__} ({_hook_name(hook)})", None)
    for h in GLOBAL_HOOKS:
        for hook in getattr(nn_module, h, {}).values():
            if user_hook(hook):
                hooked.setdefault(f"every module ({_hook_name(hook)})", None)
    if hooked:
        names = list(hooked)
        warnings.warn(
            f"{len(names)} forward or backward hook(s) on the model ({', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''}): what they compute into the values is compiled into the "
            "graph, but they ran only while it was traced (several times): a Python number they read or change "
            "(a counter, a schedule) stays in the graph as the trace left it. Anything else they do (record "
            "activations, print, count, store an auxiliary loss) will not happen when the compiled module is "
            "called. What to do: "
            "return such values from the forward.", stacklevel=user_stacklevel())


@functools.cache
def _graph_module_names() -> frozenset[str]:
    """The attributes a GraphModule has and a plain module has not (`code`, `graph`, `meta`, ...)."""
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    return frozenset(dir(gm)) - frozenset(dir(torch.nn.Module()))


class _Holder(torch.nn.Module):
    """The model as the only child `m`, with the model's own signature (export names inputs by it)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.m = model

        def forward(*args, **kwargs):
            return model(*args, **kwargs)
        forward.__signature__ = inspect.signature(model.forward)
        self.forward = forward


def _held(model: torch.nn.Module) -> torch.nn.Module:
    """`model`, or where one of its own names is an attribute of GraphModule (a submodule named `code` or
    `graph`), `_Holder(model)`: torch.export's decomposition unlifts the graph into a GraphModule holding
    `code.weight` under its own `code` and fails its lint (found by a probe; torch's own bug). Under a holder
    every name starts with `m.`, which `_unheld` takes off again."""
    own = {*model._modules, *model._parameters, *model._buffers}
    return _Holder(model) if own & _graph_module_names() else model


def _unheld(ep) -> None:
    """The names of a graph traced through `_Holder`, made the model's own: `m.` off the signature's
    targets, the lifted constants and the module stacks (the holder's own entry dropped)."""
    def strip(name):
        return name[2:] if isinstance(name, str) and name.startswith("m.") else name

    for spec in (*ep.graph_signature.input_specs, *ep.graph_signature.output_specs):
        if getattr(spec, "target", None) is not None:
            spec.target = strip(spec.target)
    for key in list(ep.constants):
        ep.constants[strip(key)] = ep.constants.pop(key)
    for node in ep.graph_module.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            paths = [("" if path == "m" else strip(path), kind) for path, kind in stack.values() if path != ""]
            node.meta["nn_module_stack"] = {"L__self__" + path: (path, kind) for path, kind in paths}


def refuse_rnn_dropout(model: torch.nn.Module) -> None:
    """Refuse a recurrent module of several layers with dropout between them, in train mode: torch's decomposition
    of aten.lstm/gru/rnn (`_rnn_helper`, which both traces apply) never draws that dropout, so the graph ran
    without it (a GRU's loss 1.027 where eager gave 1.053, weights 3.2e-3 off after 3 steps, silently; found by a
    probe; forward-only in train mode too, found by a review)."""
    for path, m in model.named_modules():
        if isinstance(m, torch.nn.RNNBase) and m.training and m.dropout > 0 and m.num_layers > 1:
            raise SpmdError(
                f"`{path}` ({type(m).__name__}, num_layers={m.num_layers}, dropout={m.dropout}) drops out between its "
                "layers in train mode, which torch's decomposition of the recurrent op that graphs are traced through "
                "leaves out: the compiled graph would run without that dropout. What to do: stack "
                f"single-layer {type(m).__name__}s with an nn.Dropout({m.dropout}) between them (the same computation), or "
                "set dropout=0.")


def positional(fn) -> list[str]:
    """The names of `fn`'s positional parameters (none where it has no signature to read)."""
    try:
        return [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return []


def forward_names(model: torch.nn.Module, n: int) -> list[str]:
    """The names of the first `n` positional parameters of `model`'s forward, `arg<i>` past them; a torch.compile'd
    model's (its forward takes `*args`) are the model's it wraps (found by a probe: `args_0` / `arg0`)."""
    wrapped = getattr(model, "_orig_mod", None)
    names = positional((wrapped if isinstance(wrapped, torch.nn.Module) else model).forward)[:n]
    return names + [f"arg{i}" for i in range(len(names), n)]


def refuse_script_modules(model: torch.nn.Module) -> None:
    """Refuse a TorchScript module in the model (`torch.jit.script(Sub())`, `torch.jit.trace(sub, x)`): neither of
    the trace's roads goes into one (a probe: a raw TypeError from a ScriptModule's buffer table in training, and
    advice on Python control flow for inference). Scripted functions (`@torch.jit.script def bias_gelu`) trace."""
    scripted: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule) and not any(name.startswith(f"{s}.") or s == "" for s in scripted):
            scripted.append(name)
    scripted = [name or "the model" for name in scripted]
    if scripted:
        shown = ", ".join(f"`{n}`" for n in scripted[:3]) + (" and others" if len(scripted) > 3 else "")
        raise SpmdError(
            f"{shown} {'is a TorchScript module' if len(scripted) == 1 else 'are TorchScript modules'} "
            "(torch.jit.script or torch.jit.trace of a module), which torch.export and AOTAutograd do not trace into. "
            "What to do: compile the model with the eager module it was made from (leave out the torch.jit call; "
            "a scripted function, `@torch.jit.script def f(...)`, may stay).")


def refuse_lazy_modules(model: torch.nn.Module) -> None:
    """Refuse a lazy module whose parameters have no shape yet (`nn.LazyLinear` before its first forward): there is
    nothing to split (a probe: torch's raw "Attempted to use an uninitialized parameter" from inside the trace,
    after a warning about the lazy module's own shape-inferring hook)."""
    from torch.nn.parameter import UninitializedTensorMixin

    lazy = [f"{name} ({type(m).__name__})" for name, m in model.named_modules()
            if any(isinstance(t, UninitializedTensorMixin) for t in (*m._parameters.values(), *m._buffers.values()))]
    if lazy:
        raise SpmdError(
            f"{', '.join(lazy[:3])}{' and others' if len(lazy) > 3 else ''}: a lazy module whose parameters have no "
            "shape yet (they are made at its first forward). What to do: call the model once on an example batch "
            "before compiling (`model(x)`; a model built on meta takes inputs on meta), or give the module its sizes "
            "(`nn.Linear(in_features, out)` for `nn.LazyLinear(out)`).")


def refuse_shared_memory(model: torch.nn.Module) -> None:
    """Refuse a parameter whose memory overlaps another parameter's or a buffer's without being the same tensor
    (`out.weight = nn.Parameter(emb.weight.data)`; a buffer that views a parameter, `w.detach()[:, :4]`). On one
    device the two names are one memory, so each update reaches both; a compiled module holds each name in
    pieces of its own, and they drifted apart without a word (0.13 off after 3 SGD steps; the view kept its first
    values: found by a probe). Tensors over disjoint parts of one storage (cuDNN's flattened RNN weights) are
    left alone; the same tensor under two names is a tie (`shared_names`)."""
    by_storage: dict[int, list] = {}
    named = [*((n, t, "parameter") for n, t in model.named_parameters()),
             *((n, t, "buffer") for n, t in model.named_buffers())]
    for name, t, kind in named:
        if t.layout != torch.strided or t.numel() == 0:
            continue
        try:
            key = t.untyped_storage()._cdata
        except (NotImplementedError, RuntimeError):
            continue
        for other, u, other_kind in by_storage.get(key, ()):
            if (kind == "parameter" or other_kind == "parameter") and _overlap(t, u):
                a, b = (other, name) if other_kind == "parameter" else (name, other)
                what = "buffer" if "buffer" in (kind, other_kind) else "parameter"
                raise SpmdError(
                    f"parameter `{a}` shares its memory with the {what} `{b}`, which is another tensor: on one "
                    "device a change of either shows in both, and a compiled module holds each in pieces of its "
                    "own, which would drift apart silently. What to do: "
                    + ("tie them by assigning the same Parameter (`model.out.weight = model.emb.weight`), or give "
                       "each its own copy (`.clone()`)" if what == "parameter" else
                       f"compute `{b}` in the forward from `{a}` (a slice or view of it), or register a copy "
                       "(`.clone()`) if it is meant to keep its first values") + ".")
        by_storage.setdefault(key, []).append((name, t, kind))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors over one storage share an element (exactly where their byte ranges meet)."""
    def span(t):
        start = t.storage_offset() * t.element_size()
        extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
        return start, start + extent * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if a.dtype != b.dtype or a.numel() > 1 << 22 or b.numel() > 1 << 22 or a.device.type == "meta":
        return True  # (a conservative answer for large, mixed or data-less tensors)

    def offsets(t):
        index = torch.zeros((), dtype=torch.int64)
        for n, s in zip(t.shape, t.stride()):
            index = index.unsqueeze(-1) + torch.arange(n) * s
        return index.flatten() + t.storage_offset()

    return bool(torch.isin(offsets(a), offsets(b)).any())


def _tensor_ids(value) -> tuple | None:
    """The ids of the tensors `value` is, or holds at its first level (a list, tuple or dict, its first 64 items:
    an anchor kept as `[w]`); None where it holds none."""
    if isinstance(value, torch.Tensor):
        return (id(value),)
    if not isinstance(value, (list, tuple, dict)):
        return None
    items = value.values() if isinstance(value, dict) else value
    return tuple(id(x) for x in itertools.islice(items, 64) if isinstance(x, torch.Tensor)) or None


class state_assigned:
    """The state a forward replaces, found by comparing, around each module's forward, the tensors its subtree
    holds; a list of (module, name, how) entries: a buffer given a new tensor (`self.scale = self.scale * 0.5`,
    where a batch norm updates its statistics in place), "buffer"; a parameter given one (`self.emb.weight =
    nn.Parameter(new)`, a VQ-VAE's EMA codebook), "parameter"; a parameter or buffer given new data (`self.ema.data
    = new`), "parameter.data" / "buffer.data" (found by a probe: the graph kept the old values, 0.4 off after 3
    steps); with `attributes`, a plain tensor attribute given a new tensor, ("attribute", the old tensor).
    AOTAutograd over the module sees no mutation there (the tensor it traced through is untouched) and puts the
    module's tensors back after the call, so the new value would be lost; torch.export records a buffer's as a
    mutation (`refuse_state_assigned_in_eval`)."""

    def __init__(self, attributes: bool = False):
        self.attributes = attributes
        # (module, name) of the tensors a forward made where it had none: a plain attribute absent or not a tensor
        # before, or a buffer registered as None (`passes/made_state.py`)
        self.made: list[tuple] = []
        # (module, name) of the plain attributes a forward gave a tensor that requires grad, alone or in a list or
        # dict it holds (`self.aux_loss = ...`), other than the module's own parameters and buffers (nn.LSTM's
        # `_flat_weights`) and a weight torch's utilities recompute in a pre-hook (`_recomputed_weight`)
        self.kept_with_grad: list[tuple] = []

    @staticmethod
    def _storage(t) -> int | None:
        try:
            return t.untyped_storage()._cdata
        except (NotImplementedError, RuntimeError):
            return None

    def __enter__(self) -> list[tuple]:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        found, before, made, with_grad = [], {}, {}, {}
        self._made, self._with_grad = made, with_grad

        def snapshot(module):
            return [(m, {**m._parameters, **m._buffers},
                     {n: self._storage(t) for table in (m._parameters, m._buffers) for n, t in table.items()
                      if t is not None},
                     {n: t for n, t in m.__dict__.items() if isinstance(t, torch.Tensor)},
                     {n: ids for n, v in m.__dict__.items() if (ids := _tensor_ids(v)) is not None})
                    for m in module.modules()]

        def pre(module, args):
            if torch.compiler.is_dynamo_compiling():  # (a torch.cond branch's modules: dynamo refuses the write)
                return
            before.setdefault(id(module), []).append(snapshot(module))

        def post(module, args, output):
            if torch.compiler.is_dynamo_compiling():
                return
            stack = before.get(id(module))
            if not stack:
                return
            for m, tensors, storages, attributes, held in stack.pop():
                if self.attributes:
                    found.extend((m, n, ("attribute", t)) for n, t in attributes.items() if m.__dict__.get(n) is not t)
                # made where there was none; and a list or dict of tensors given others (a memory bank refilled at
                # each call, `self.bank = [h.mean(0)]` or `.append(...)`, read at the next; a review found it missed)
                made.update(((m, n), None) for n, v in m.__dict__.items() if (ids := _tensor_ids(v)) is not None
                            and (n not in held or (held[n] != ids and not isinstance(v, torch.Tensor)
                                                   and n not in _REGISTRIES)))
                made.update(((m, n), None) for n, t in m._buffers.items() if t is not None and n in tensors
                            and tensors[n] is None)
                with_grad.update(((m, n), None) for n, v in m.__dict__.items() if _new_with_grad(m, n, v, held.get(n)))
                for table, kind in ((m._buffers, "buffer"), (m._parameters, "parameter")):
                    for n, t in table.items():
                        if tensors.get(n) is None or t is None:  # (not a cache made lazily)
                            continue
                        if t is not tensors[n]:
                            found.append((m, n, kind))
                        elif self._storage(t) != storages.get(n):
                            found.append((m, n, kind + ".data"))

        self.handles = (register_module_forward_pre_hook(pre), register_module_forward_hook(post))
        return found

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.made = list(self._made)
        self.kept_with_grad = list(self._with_grad)


def _new_with_grad(m: torch.nn.Module, name: str, value, held: tuple | None) -> bool:
    """Whether `m.name` (`value`, its tensors' ids `held` before the forward) holds a tensor that requires grad which
    it did not hold before, and which is none of `m`'s parameters and buffers (`state_assigned.kept_with_grad`)."""
    ids = _tensor_ids(value)
    if ids is None or ids == held or name in _REGISTRIES or _recomputed_weight(m, name):
        return False
    items = [value] if isinstance(value, torch.Tensor) else list(value.values() if isinstance(value, dict) else value)
    before = set(held or ())
    new = {id(t) for t in items[:64] if isinstance(t, torch.Tensor) and id(t) not in before and t.requires_grad}
    return bool(new) and not new <= {id(t) for sub in m.modules() for table in (sub._parameters, sub._buffers)
                                     for t in table.values()}


def _recomputed_weight(module: torch.nn.Module, name: str) -> bool:
    """Whether `name` is a weight torch's utilities compute from parameters of the module in a forward pre-hook, which
    the graph computes too: `weight_norm`'s (`weight_g`, `weight_v`), `spectral_norm`'s and pruning's (`weight_orig`).
    (Such a hook runs after the snapshot before the forward: a review found them warned.)"""
    params = module._parameters
    return name + "_orig" in params or (name + "_g" in params and name + "_v" in params)


def described(entry: tuple) -> str:
    """"buffer BatchNorm1d.scale" for a `state_assigned` entry."""
    m, name, how = entry
    kind, _, data = how.partition(".")
    return f"{kind} {type(m).__name__}.{name}{'.data' if data else ''}"


def refuse_state_assigned_in_eval(entries: list[tuple], model: torch.nn.Module, mutated: set[str],
                                  constants=()) -> None:
    """A forward-only graph (torch.export) carries a buffer assigned through `self.name = new` out as a mutation
    (`mutated`: those buffers' names), and nothing else: a parameter given a new tensor, a tensor given new `.data`,
    a buffer set through `self._buffers[name] = new` (found by a probe: outputs 0.065-0.23 off from the second
    call, silently). Refused with the way out."""
    paths = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}
    read = {id(t) for t in constants}
    for m, name, how in entries:
        fqn = f"{paths[id(m)]}.{name}" if paths.get(id(m)) else name
        if how == "buffer" and fqn in mutated:
            continue
        if isinstance(how, tuple):  # a plain tensor attribute the graph reads as a constant (a streaming mean)
            if id(how[1]) not in read:
                continue  # (one only written, `self.last_attention = a`, changes no graph)
            raise SpmdError(
                f"trace_module: the forward gives {fqn}, a plain tensor attribute the graph reads, a new tensor: the "
                "graph holds the value the trace saw as a constant, so every call would read it (0.065-0.11 off from "
                f"the second call, in a probe). What to do: register it as a buffer (`self.register_buffer("
                f"{name!r}, tensor)`) and update it in place under torch.no_grad() (`self.{name}.copy_(new)`), which "
                f"inference and training graphs carry out (an inference graph also carries out `self.{name} = new`; "
                "a training graph refuses it).")
        what = {"buffer": f"buffer {fqn} a new tensor through `_buffers`", "parameter": f"parameter {fqn} a new tensor"
                }.get(how, f"{fqn} new `.data`")
        raise SpmdError(
            f"trace_module: the forward gives {what}, which the graph does not carry out: every call would start "
            "from the value the trace saw. What to do: update it in place under torch.no_grad() "
            f"(`self.{name}.copy_(new)`), which inference and training graphs carry out (an inference graph also "
            f"carries out a buffer assigned as `self.{name} = new`; a training graph refuses it).")


def renormalized(graph: torch.fx.Graph, placeholder: Callable[[torch.fx.Node], bool]) -> tuple | None:
    """(max_norm, norm_type) of an `embedding_renorm` the graph runs on the tensor read from the placeholder that
    `placeholder` accepts (through its detach: `F.embedding(ids, self.weight, max_norm=1.0)`), or None."""
    for node in graph.nodes:
        if node.op == "call_function" and str(node.target).split(".")[1:2] in (["embedding_renorm"], ["embedding_renorm_"]):
            source = node.args[0]
            while isinstance(source, torch.fx.Node) and source.op == "call_function" and source.args:
                source = source.args[0]
            if isinstance(source, torch.fx.Node) and source.op == "placeholder" and placeholder(source):
                return node.args[2], node.args[3]
    return None


def parameter_changed_message(where: str, model: torch.nn.Module, fqn: str, why: str, renorm: tuple | None = None
                              ) -> str:
    """The refusal of a forward that changes parameter `fqn` in place (`why` the graph cannot follow it): renormalized
    by an Embedding with max_norm, or by `F.embedding(..., max_norm=)` on a parameter of the user's (`renorm`: its
    max_norm and norm_type, from `renormalized`), or an update of the user's (weight clipping, `.data.mul_`, a target
    network's momentum step; a probe found those told about max_norm)."""
    try:
        owner = model.get_submodule(fqn.rpartition(".")[0]) if "." in fqn else model
    except AttributeError:
        owner = None
    if renorm is not None and not isinstance(owner, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        max_norm, norm_type = renorm
        return (f"{where}: the forward of {type(model).__name__} changes parameter {fqn} in place (`F.embedding` with "
                f"max_norm renormalizes the rows it looks up), and {why}. What to do: call `F.embedding` without "
                "max_norm in the forward and renormalize before each call, on every rank, with the ids that call "
                f"looks up: `compiled.embedding_renorm_({fqn!r}, ids, max_norm={max_norm}"
                f"{'' if norm_type == 2.0 else f', norm_type={norm_type}'})` (the rows any rank looks up, as one device "
                f"renormalizes the whole batch's). It needs whole rows on each rank: pin `param_placements={{{fqn!r}: "
                "[Shard(0)]}` (or [Replicate()]; one per mesh axis) if the plan cuts them.")
    if isinstance(owner, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and owner.max_norm is not None:
        module = fqn.rpartition(".")[0]  # (an EmbeddingBag's too: a probe found it told of weight clipping)
        return (f"{where}: the forward of {type(model).__name__} changes parameter {fqn} in place (an "
                f"{type(owner).__name__} with max_norm renormalizes the rows it looks up), and {why}. What to do: "
                f"compile it without max_norm (`model.{module}.max_norm = None`) and renormalize before each call, on "
                f"every rank, with the ids that call looks up: `compiled.embedding_renorm_({fqn!r}, ids, max_norm={owner.max_norm}"
                f"{'' if owner.norm_type == 2.0 else f', norm_type={owner.norm_type}'})` (the rows any rank looks up, as "
                "one device renormalizes the whole batch's). It needs whole rows on each rank: pin "
                f"`param_placements={{{fqn!r}: [Shard(0)]}}` (or [Replicate()]; one per mesh axis) if the plan cuts them. "
                "Renormalizing after the optimizer's step is not the same: max_norm applies to the weights each "
                "forward reads.")
    return (f"{where}: the forward of {type(model).__name__} changes parameter {fqn} in place (a weight clipped or "
            f"scaled there, `.data` given new values, a target network's momentum update), and {why}. What to do: make "
            "the update outside the forward, after the optimizer's step, on the compiled module's piece under "
            f"torch.no_grad() (`compiled.get_parameter({fqn!r}).clamp_(...)`): an update element by element (a clamp, a "
            "scale, a momentum step from another parameter of the same placements) is the same on each piece; one that "
            f"needs the whole tensor (a norm) needs it pinned whole, `param_placements={{{fqn!r}: [Replicate()]}}` "
            "(one per mesh axis).")


def trace_module(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict | None = None) -> TracedGraph:
    with kernels_kept_whole(), parametrizations_uncached(), partial_graphs_unprinted():
        return _trace_module(model, example_inputs, example_kwargs)


def _trace_module(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict | None) -> TracedGraph:
    example_inputs, example_kwargs = distinct_inputs(example_inputs, example_kwargs)
    held = _held(model)

    def export():
        with buffers_through_aliases(held), encoder_fast_path_as_eager(held), dataclass_outputs_registered(held):
            return torch.export.export(held, tuple(example_inputs), kwargs=example_kwargs or {}, strict=False)

    def signature_again():
        with state_kept(held):
            again = export()
        return _live_signature(again)

    try:
        watch = state_assigned(attributes=True)
        with random_draws() as drew, watch as assigned, state_kept(held) as kept:
            ep = export()
        if kept.counted:  # (a warm-up factor from a call counter: found by a probe, the same every call, silently)
            refuse_counted(kept.counted, signature_again, _live_signature(ep), model, "trace_module")
        refuse_made_snapshots(watch.made, held, model,
                              lambda: held(*example_inputs, **(example_kwargs or {})),
                              [*example_inputs, *(example_kwargs or {}).values()], "trace_module", training=False)
        if drew.unseeded or drew.unnamed:  # (does the graph keep what Python's or numpy's generators drew?)
            refuse_random_draws(draws_change_the_graph(
                lambda: graph_signature((again := export()).graph_module, again.constants),
                graph_signature(ep.graph_module, ep.constants), drew.unseeded), model)
        with warnings.catch_warnings():  # (torch's own deepcopy of the export's call graph warns, once per compile)
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                    category=FutureWarning)
            ep = ep.run_decompositions(_decomposition_table())
        if held is not model:
            _unheld(ep)
        refuse_state_assigned_in_eval(assigned, model, set(ep.graph_signature.buffers_to_mutate.values()),
                                      ep.constants.values())
    except SpmdError:
        raise
    except Exception as e:  # torch's own message says which line failed to trace
        raise SpmdError(untraceable_message(
            f"trace_module: torch.export could not trace {type(model).__name__}", e,
            untraceable_way_out(e, 'for transformers models pass use_cache=False'
                                if any(c.__module__.startswith(("transformers.", "peft."))
                                       for c in type(model).__mro__) else '', model))) from e

    _drop_assertions(ep.graph_module)
    sig = ep.graph_signature
    _drop_effect_tokens(ep.graph_module, {spec.arg.name for spec in sig.input_specs if spec.kind == InputKind.TOKEN})
    renamed = _fx_placeholder_names(ep.graph_module)
    kinds = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer",
             InputKind.CONSTANT_TENSOR: "constant", InputKind.USER_INPUT: "input"}
    inputs = []
    # (a torch.compile'd model's forward takes `*args`, which torch.export names args_0, ...: its own names, as
    # training's trace gives them)
    n_user = sum(spec.kind == InputKind.USER_INPUT for spec in sig.input_specs)
    compiled = isinstance(getattr(model, "_orig_mod", None), torch.nn.Module)
    user_names = iter(forward_names(model, n_user) if compiled else ())
    for spec in sig.input_specs:
        if spec.kind == InputKind.TOKEN:
            continue  # dropped with the checks it ordered (_drop_effect_tokens)
        if spec.kind == InputKind.CUSTOM_OBJ:
            raise SpmdError(
                f"trace_module: the forward of {type(model).__name__} makes or holds an object torch traces as a "
                f"script object ({spec.arg.name}: a torch.Generator made in the forward, say), which a graph of "
                "tensors cannot hold. What to do: draw random numbers with torch's generator, seeded outside the "
                "forward (`torch.manual_seed`), not with one the forward makes.")
        if spec.kind not in kinds:
            raise SpmdError(f"trace_module: unsupported graph input kind {spec.kind} for {spec.arg.name}")
        name = spec.target if spec.kind != InputKind.USER_INPUT else next(user_names, spec.arg.name)
        inputs.append(GraphInput(renamed.get(spec.arg.name, spec.arg.name), kinds[spec.kind], name))
    outputs, user = [], 0
    for spec in sig.output_specs:
        if spec.kind == OutputKind.TOKEN:
            continue
        if spec.kind == OutputKind.BUFFER_MUTATION:  # (batch norm's running statistics in train mode)
            outputs.append(GraphOutput("buffer_update", spec.target))
        elif spec.kind == OutputKind.USER_OUTPUT:
            outputs.append(GraphOutput("output", f"output_{user}"))
            user += 1
        elif spec.kind == OutputKind.PARAMETER_MUTATION:  # (found by a probe: the message named no cause)
            placeholder = {i.target: i.arg.name for i in sig.input_specs}.get(spec.target)
            raise SpmdError(parameter_changed_message(
                "trace_module", model, spec.target, "a compiled module's parameters are pieces the graph only reads",
                renormalized(ep.graph, lambda n: n.name == placeholder)))
        elif spec.kind == OutputKind.USER_INPUT_MUTATION and (unset := _buffer_names(model, kept.made)):
            # (torch.export's words for a buffer registered as None and assigned in the forward, a cache made
            # at the first call; found by a probe: the message named an input the forward never touched)
            raise SpmdError(
                f"trace_module: torch.export reports input {spec.target} changed in place, which it says where the "
                f"forward assigns a buffer registered as None ({', '.join(f'`{n}`' for n in unset[:3])}): a cache "
                "made at the first call. What to do: keep the cache as a plain attribute (`self.cache = None` in "
                "__init__, assigned in the forward), or register the buffer with its value in __init__.")
        else:
            raise SpmdError(
                f"trace_module: the model mutates state ({spec.kind.name} of {spec.target}); only buffers may be "
                "updated in place. What to do: compute the new value as an output instead."
            )

    state: dict[str, torch.Tensor] = {}
    state.update(dict(model.named_parameters(remove_duplicate=False)))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    state.update(ep.constants)
    gm = ep.graph_module
    tensor_info = tensor_infos(gm)
    call_sig = ep.module_call_graph[0].signature
    frozen = frozenset(k for k, v in model.named_parameters(remove_duplicate=False) if not v.requires_grad)
    updates = any(o.kind == "buffer_update" for o in outputs)
    if updates:
        outputs = user_outputs_first(ep.graph_module, outputs)
    return TracedGraph(gm, tuple(inputs), {k: v.detach() for k, v in state.items()},
                       call_sig.out_spec, call_sig.in_spec, tensor_info, tuple(outputs) if updates else (),
                       frozen=frozen, aliases=shared_names(model), module_types=module_types(model))


def _buffer_names(model: torch.nn.Module, buffers: list[tuple]) -> list[str]:
    """The paths in `model` of (module, buffer name) pairs."""
    paths = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}
    return [f"{paths[id(m)]}.{key}".lstrip(".") for m, key in buffers if id(m) in paths]


def _fx_placeholder_names(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Where torch.export named a placeholder as FX itself never would (a Python builtin's name:
    nn.Sequential's `input`, `forward(self, sum)`), the graph is copied as the passes' copies will copy
    it, so every graph made from this one knows each node by one name (`input_1`; an op node export had
    already suffixed keeps its name, and the copy's names are registered as taken); returns old -> new
    for the placeholders renamed."""
    scratch = torch.fx.Graph()
    if all(scratch.placeholder(n.name).name == n.name for n in gm.graph.find_nodes(op="placeholder")):
        return {}
    old_output = gm.graph.output_node()
    graph, env = torch.fx.Graph(), {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out, type_expr=old_output.type).meta = dict(old_output.meta)
    renamed = {old.name: env[old].name for old in gm.graph.find_nodes(op="placeholder") if env[old].name != old.name}
    gm.graph = graph  # (recompiles)
    return renamed


def module_types(model: torch.nn.Module, prefix: str = "") -> dict[str, str]:
    """module path -> class name, every module under every name; `prefix` (a wrapper's child) stripped and the
    wrapper itself left out."""
    out = {}
    for path, m in model.named_modules(remove_duplicate=False):
        if prefix and path == prefix.rstrip("."):
            path = ""
        elif prefix and path.startswith(prefix):
            path = path[len(prefix):]
        elif prefix and not path.startswith("loss_fn"):
            continue
        out.setdefault(path, type(m).__name__)
    return out


def shared_names(model: torch.nn.Module, prefix: str = "") -> dict[str, str]:
    """alias -> canonical FQN for every parameter or buffer reachable under several names (tied weights).
    The canonical name is the first, as `named_parameters()` reports it; `prefix` is stripped."""
    first: dict[int, str] = {}
    aliases = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in named:
        name = name[len(prefix):] if prefix and name.startswith(prefix) else name
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
    return aliases
