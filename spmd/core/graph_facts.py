"""Facts about traced graphs that several layers ask about, each answered in one place.

    op_label         "addmm", "add.Tensor": an ATen op without its namespace and default overload
    hashable_args    an op's arguments as a key: two nodes that ask a rule the same question
    module paths     which module (torch.export's `nn_module_stack`) put a node in the graph
    phase            forward or backward, in a joint graph
    view             an op whose output aliases its input (no kernel, no memory of its own)
    layers           "layers.3.attn" is layer 3 of the list "layers": keys, wildcards, renumbering
    recompute        the forward nodes of a layer its backward can run again instead of saving them
                     (all of them, or selectively: all but its matmuls and attention)
    follower         a node with one input and one strategy per placement its producer can make
    gradient sink    the output slot a parameter's gradient leaves through (tied to the parameter)
    units            seconds and bytes as people read them
"""
from __future__ import annotations

import functools
import operator
import re
from typing import Iterable

import torch
import torch.fx as fx

# ---- ops ----------------------------------------------------------------------------------------


def hashable_args(a, node=lambda n: n.name):
    """A hashable stand-in for an op's arguments, each fx.Node as `node(it)`: equal for two calls that
    ask the same of a rule or a cost formula. TypeError where an argument cannot be hashed."""
    if isinstance(a, fx.Node):
        return ("node", node(a))
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(hashable_args(x, node) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, hashable_args(v, node)) for k, v in a.items()))
    hash(a)
    return (type(a), a)  # typed: True and 1, 2 and 2.0 are other arguments


def op_label(node: fx.Node) -> str:
    """`addmm`, `add.Tensor`, `getitem`: the ATen op without its namespace and default overload."""
    target = node.target
    if hasattr(target, "_schema"):
        overload = target._overloadname
        return target.overloadpacket.__name__ + ("" if overload == "default" else f".{overload}")
    return getattr(target, "__name__", str(target))


@functools.lru_cache(maxsize=4096)
def is_view(op) -> bool:
    """The op's output aliases its first input (its schema says so): no kernel of its own, no new memory."""
    schema = getattr(op, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


# Ops that only re-lay out or pick out their input: pictures draw through them.
LAYOUT_OPS = frozenset({"view", "_unsafe_view", "reshape", "permute", "t", "transpose", "expand", "unsqueeze",
                        "squeeze", "alias", "detach", "getitem", "slice", "select", "contiguous", "clone", "split"})


def is_layout_op(node: fx.Node) -> bool:
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", getattr(node.target, "__name__", "")) in LAYOUT_OPS


# ---- where a node came from ---------------------------------------------------------------------


def _short_type(t) -> str:
    return getattr(t, "__name__", str(t)).rsplit(".", 1)[-1]


def module_stack(node: fx.Node) -> list[tuple[str, str]]:
    """(module path, class name) from outermost to innermost: `nn_module_stack` from torch.export, or
    `fwd_nn_module_stack` on backward nodes of a joint graph (the forward module they differentiate)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    return [(path, _short_type(t)) for path, t in stack.values()]


# The child a training wrapper puts the user's model under (`passes/trace_joint.py`'s `WithLoss.model`):
# every module path of a loss_fn-wrapped trace starts with it, and parameter FQNs have it removed.
WRAPPER_PREFIX = "model."


def module_tree(fqns: Iterable[str]) -> set[str]:
    """The module paths the parameter (and buffer) FQNs spell: each owner and its ancestors, "" the root."""
    tree = {""}
    for fqn in fqns:
        parts = fqn.split(".")[:-1]
        tree.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return tree


def module_prefix(graph: fx.Graph, fqns: Iterable[str]) -> str:
    """The path prefix a training wrapper added ("model." when a loss_fn wraps the model), or "".

    Decided against the user's module tree (the FQNs, which never carry the wrapper's prefix), not by the
    paths' names alone: a user model may have a child called `model` itself (transformers'
    `*ForCausalLM`, a wrapper around torchtitan's Llama), so "model.layers.0" is either that child's layer
    (as is) or, under the wrapper, the root's "layers.0". The reading that names more real modules wins;
    a tie reads the paths as they are.

        user model           traced paths                          FQNs                 prefix
        GPT + loss_fn        model, model.blocks.0.attn, loss_fn   blocks.0.attn...     "model."
        Wrap(GPT)            model, model.blocks.0.attn            model.blocks.0...    ""
        Wrap(GPT) + loss_fn  model, model.model.blocks.0.attn      model.blocks.0...    "model."
    """
    tree = module_tree(fqns)
    under = {p for n in graph.nodes for p, _ in module_stack(n) if p.startswith(WRAPPER_PREFIX)}
    as_is = sum(p in tree for p in under)
    stripped = sum(p[len(WRAPPER_PREFIX):] in tree for p in under)
    return WRAPPER_PREFIX if stripped > as_is else ""


def module_paths(graph: fx.Graph, fqns: Iterable[str]) -> tuple[dict[str, str], dict[str, str]]:
    """node name -> innermost module path, and module path -> class name, wrapper prefix removed: under a
    wrapper its root ("") is dropped and its child `model` becomes the root; the loss_fn's own modules
    ("loss_fn.ce") keep their paths."""
    fqns = list(fqns)
    prefix = module_prefix(graph, fqns)
    child = prefix.rstrip(".")

    def user_path(p: str) -> str | None:
        if not prefix:
            return p
        if p == "":
            return None  # the wrapper itself
        return "" if p == child else p.removeprefix(prefix)

    where, types = {}, {}
    for n in graph.nodes:
        stack = [(q, t) for q, t in ((user_path(p), t) for p, t in module_stack(n)) if q is not None]
        for p, t in stack:
            types.setdefault(p, t)
        if stack:
            where[n.name] = stack[-1][0]
    return where, types


def phase_of(node: fx.Node) -> str:
    """"forward" / "backward" in a joint graph (AOTAutograd's `partitioner_tag`), "" otherwise."""
    return {"is_forward": "forward", "is_backward": "backward"}.get(node.meta.get("partitioner_tag"), "")


def backward_nodes(graph: fx.Graph, tangents: Iterable[str] = ()) -> set[fx.Node]:
    """The nodes of a joint graph that run in backward: those tagged so, the `tangents` placeholders (by
    name), and every call that reads one of them (steps inserted later carry their consumer's tag)."""
    tangents = set(tangents)
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "output":
            continue
        if (node.name in tangents or node.meta.get("partitioner_tag") == "is_backward"
                or node.op == "call_function" and any(a in found for a in node.all_input_nodes)):
            found.add(node)
    return found


# ---- layers of a module list --------------------------------------------------------------------

_FIRST_INDEX = re.compile(r"^(.*?\.\d+)(?:\.|$)")  # "model.layers.3.attn.q_proj" -> "model.layers.3"
_LAST_INDEX = re.compile(r"^((?:.*\.)?)(\d+)(?:\.|$)")  # "a.blocks.3.experts.1" -> ("a.blocks.3.experts.", "1")


def layer_of(path: str) -> str | None:
    """The module-list element a path lies in, at the outermost list: "model.layers.3.attn" -> "model.layers.3"."""
    m = _FIRST_INDEX.match(path)
    return m.group(1) if m else None


def innermost_layer(path: str) -> tuple[str, int] | None:
    """(the path up to the innermost list index, that index): "a.blocks.3.mlp" -> ("a.blocks.", 3)."""
    m = _LAST_INDEX.match(path)
    return (m.group(1), int(m.group(2))) if m else None


def any_layer(path: str, every: bool = False) -> str:
    """A list index made a wildcard: "layers.0.attn" -> "layers.*.attn" (the first one, or `every` one)."""
    if every:
        return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", path)
    return re.sub(r"\.\d+(?=\.|$)", ".*", path, count=1)


def layer_stem(path: str) -> str:
    """"model.layers.3" -> "model.layers.#": elements of one list share a stem."""
    return re.sub(r"\.\d+$", ".#", path)


def renumber(text: str, list_path: str, moves: dict[int, int]) -> str:
    """Every "<list_path>.<i>" in `text` (FQNs, module paths, stack traces) with i -> moves.get(i, i)."""
    pattern = re.compile(re.escape(list_path) + r"\.(\d+)(?=\.|$)")
    return pattern.sub(lambda m: f"{list_path}.{moves.get(int(m.group(1)), int(m.group(1)))}", text)


# ---- recomputation ----------------------------------------------------------------------------------


def view_base(node: fx.Node) -> fx.Node:
    """The node whose memory `node` lives in: through views to the value that allocated it."""
    while node.op == "call_function" and is_view(node.target) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def dropout_p(op, args: tuple, kwargs: dict):
    """The dropout probability an op with a `dropout_p` argument (an attention kernel) is called with; None for
    an op without one."""
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            return args[i] if i < len(args) else kwargs.get("dropout_p", arg.default_value)
    return None


def is_random(node: fx.Node) -> bool:
    """An op that draws from the random generator (dropout): run again, it would draw other numbers.
    Attention kernels are tagged so for their dropout, and draw nothing when its probability is 0."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    return dropout_p(node.target, node.args, node.kwargs) != 0


# the namespaces of torch's own ops, whose tags say whether they draw (an op of any other, a user's
# `torch.library.custom_op`, may draw without saying so)
_TORCH_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d_functional", "_dtensor", "higher_order"})


def may_draw(node: fx.Node) -> bool:
    """A node that may draw from the random generator: `is_random`, or an op of a library's own namespace (a
    `torch.library.custom_op` calling `torch.rand_like` inside), which declares nothing. Recomputation keeps
    such a node's outputs saved: run again in backward it drew other numbers, and eager checkpointing restores
    the generator around its whole region (found by a probe: a custom op's noise under recompute=True, 8.4e-3
    off one device after 3 steps, silently)."""
    if is_random(node):
        return True
    op = node.target
    if node.op == "call_function" and getattr(op, "__name__", "").startswith("auto_functionalized") and node.args:
        op = node.args[0]  # (a custom op that mutates an argument, traced functionalized: the op it wraps; a review)
    return node.op == "call_function" and isinstance(op, torch._ops.OpOverload) and op.namespace not in _TORCH_NAMESPACES


_SELECTIVE_KEEPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "scaled_dot_product_attention",
                    "flex_attention"}


def is_selectively_kept(node: fx.Node) -> bool:
    """An op selective recomputation saves rather than runs again: a matmul, a convolution or an attention
    kernel, whose FLOPs are most of a layer's time, while the norms, activations and other elementwise ops
    between them hold as many bytes for a small share of the time (Korthikanti et al., 2022; torchtitan's
    per-op policy saves the same ops)."""
    name = getattr(getattr(node.target, "overloadpacket", node.target), "__name__", "")
    return node.op == "call_function" and (name in _SELECTIVE_KEEPS or name.startswith("_scaled_dot_product_"))


def recompute_region(layer: list[fx.Node], in_backward, keep=None) -> tuple[list[fx.Node], list[fx.Node]]:
    """The forward nodes of one layer (`layer`, in graph order) that backward can compute again instead
    of reading them saved, and the values outside that region they read (which backward then reads saved).

    Kept (never recomputed): what the forward reads outside the layer (its outputs, which the next layer
    reads before this layer's backward runs), random ops (dropout: the same mask is needed) and ops of other
    libraries that may draw (`may_draw`), the nodes
    `keep(node)` names (selective recomputation: `is_selectively_kept`), and the getitems of kept nodes.
    Recomputed: every other node of the layer that a value backward reads (`in_backward(user)`) depends
    on within the layer.

        x ─▶ norm ─▶ mm ─▶ gelu ─▶ mm ─▶ add ─▶ (next layer)      saved before: norm stats, mm, gelu...
        region: norm, mm, gelu, mm (rebuilt from x and the weights)   saved after: x (and add, the output)
        selective: norm, gelu (rebuilt from x and the first mm)       saved after: x, the first mm
    """
    members = set(layer)
    kept = {n for n in layer if may_draw(n) or (keep is not None and keep(n)) or
            any(u not in members and not in_backward(u) for u in n.users)}
    for n in layer:
        if n.target is operator.getitem and n.args[0] in kept:
            kept.add(n)
    region: set[fx.Node] = set()
    todo = [n for n in layer if n not in kept and any(in_backward(u) for u in n.users)]
    while todo:
        n = todo.pop()
        if n in region:
            continue
        region.add(n)
        todo += [a for a in n.all_input_nodes if a in members and a not in kept]
    ordered = [n for n in layer if n in region]
    frontier = list(dict.fromkeys(a for n in ordered for a in n.all_input_nodes if a not in region))
    return ordered, frontier


# ---- strategy-table facts -----------------------------------------------------------------------


def follows_input(ns, offered: Iterable) -> bool:
    """A node that merely follows its single input (views, getitem, merged followers): one strategy per
    placement its producer can make (`offered`), and no other. Such a node adds no solver variables: its
    choice is the producer's, re-labelled."""
    if len(ns.inputs) != 1 or ns.source in ("placeholder", "output"):
        return False
    ins = [s.inputs[0] for s in ns.strategies]
    return len(set(ins)) == len(ins) and set(ins) == set(offered)


def is_gradient_sink(ns) -> bool:
    """The output slot a parameter's gradient leaves through: it is tied to the parameter's placements,
    and its all_reduces are bucketed (see cost_model/comm.py). Not a buffer's new value (tied to the
    buffer, made in forward)."""
    return ns.source == "output" and ns.tie is not None and not ns.buffer_update


# ---- units --------------------------------------------------------------------------------------


def format_seconds(seconds: float) -> str:
    """"12.3 us", "4.56 ms", "1.23 s" (inf as "inf")."""
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        return str(seconds)
    a = abs(seconds)
    if a >= 1.0:
        return f"{seconds:.2f} s"
    if a >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def format_bytes(b: float) -> str:
    """"1.5 GiB", "12.0 MiB", "3.0 KiB", "512 B"."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"
