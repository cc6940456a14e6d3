"""enumerate_strategies: every node gets its candidate (input placements -> output placements) list.

Before: a traced graph with `TensorInfo` per node and a `MeshSpec`. After: a `StrategyTable` mapping
each node name (plus one `output_k` sink per graph output) to its strategies and the values it reads;
uneven splits are excluded, ops without a rule fall back to all-Replicate with a warning. Pins (user
inputs, parameters by FQN, outputs) restrict the choice of their node; an unpinned output a loss outside the
compiled module differentiates (it has a tangent) is whole or split on its dim 0 only.
"""
from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field
from math import prod

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.utils._pytree import tree_map

from spmd.core.errors import SpmdError, describe_node
from spmd.core.graph_facts import dropout_p, hashable_args, is_random
from spmd.core.memo import ByIdentity
from spmd.passes.check_pins import check_pins
from spmd.passes.rules import RuleInput, expand_single_dim, rule_for
from spmd.passes.rules import dtensor_adapter
from spmd.passes.rules.dtensor_adapter import TensorArg, op_name
from spmd.passes.trace_module import TracedGraph, flat_outputs
from spmd.core.specs import Pins, Placements, Strategy, TensorInfo, Value, all_placements, is_even, placements_str

class UnknownOpWarning(UserWarning):
    """An op had no sharding rule and runs replicated on every rank."""


@dataclass(frozen=True, slots=True)
class NodeStrategies:
    """One node's candidates. `variant` names the strategy list: nodes of identical layers share their
    representative's list and its variant, so later passes may work out anything that depends only on
    the list (costs, solver columns) once per variant."""

    strategies: tuple[Strategy, ...]
    inputs: tuple[Value, ...]  # the values read, aligned with Strategy.inputs
    outputs: tuple[TensorInfo | None, ...]
    source: str  # dtensor | spmd | fallback | placeholder | output | follow
    variant: int
    excluded: int = 0  # strategies dropped as uneven
    tie: str | None = None  # another node whose placements this one must equal (grad <-> parameter)
    buffer_update: bool = False  # an output tied to a buffer: its new value, made in forward (not a gradient)

    def key(self, s: Strategy) -> Placements:
        """The placements a tie compares: a placeholder's output, a sink's input."""
        return s.inputs[0] if self.source == "output" else s.outputs[0]


@dataclass(frozen=True)
class StrategyTable:
    nodes: dict[str, NodeStrategies]
    fallbacks: tuple[str, ...] = ()  # node descriptions that fell back to Replicate
    copied: int = 0  # nodes whose strategies were copied from their repeated-block representative
    merged_followers: int = 0  # nodes pruned to follow their input (merge_followers)
    _candidates: dict = field(default_factory=dict, repr=False, compare=False)  # memo of output_candidates
    # (strategy list, output index) -> its candidates: tied layers share their lists
    _by_list: ByIdentity = field(default_factory=ByIdentity, repr=False, compare=False)

    def output_candidates(self, value: Value) -> list[Placements]:
        """The placements `value` can come out in."""
        found = self._candidates.get(value)
        if found is None:
            name, idx = value
            strategies = self.nodes[name].strategies
            found = self._candidates[value] = self._by_list.get(
                strategies, idx, lambda: list(dict.fromkeys(s.outputs[idx] for s in strategies)))
        return found


def _tensor_inputs(node: fx.Node, info: dict) -> tuple[Value, ...]:
    """The tensors `node` reads, in argument order (a tensor read twice counts twice)."""
    found: list[Value] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: found.append((a.name, 0))
                    if isinstance(info.get(a.name), TensorInfo) else None)
    return tuple(found)


def strategy_key(s: Strategy) -> str:
    """A total order on strategies that is the same in every process (no hash-based ordering)."""
    return repr(s)


def _partials(cands: list[Placements]) -> set:
    return {(axis, p) for ps in cands for axis, p in enumerate(ps) if isinstance(p, Partial)}


def _partials_available(s: Strategy, producible: list[set]) -> bool:
    """Drop strategies that need a non-sum Partial input its producer never makes: R -> P(avg/max/min)
    is legal but never pays, and such strategies multiply the search space (add has 10 per axis)."""
    for ps, avail in zip(s.inputs, producible):
        for axis, p in enumerate(ps):
            if isinstance(p, Partial) and p.reduce_op != "sum" and (axis, p) not in avail:
                return False
    return True


def _uneven(pin: Placements, shape: tuple[int, ...], mesh) -> str:
    """Why an (in-range, validated) pin has no strategy: the dims it cuts do not divide."""
    cuts: dict[int, list[int]] = {}
    for axis, p in enumerate(pin):
        if isinstance(p, Shard):
            cuts.setdefault(p.dim, []).append(axis)
    why = [f"dim {d} ({shape[d]}) does not divide into {prod(mesh.shape[a] for a in axes)} pieces "
           f"({' x '.join(f'{mesh.axis_names[a]}={mesh.shape[a]}' for a in axes)})"
           for d, axes in cuts.items() if shape[d] % prod(mesh.shape[a] for a in axes)]
    return "; ".join(why) or "it is excluded"


def _restrict(strategies: list[Strategy], pin: Placements, what: str, shape, mesh) -> list:
    kept = [s for s in strategies if s.outputs[0] == pin]
    if not kept:  # (named as the user named it: not by its placeholder, `primals_3`)
        raise SpmdError(
            f"pin {placements_str(pin)} for {what} cannot be met: it has shape {shape}, and on mesh "
            f"{mesh} that placement is uneven: {_uneven(pin, shape, mesh)} (uneven shards are not supported). "
            "What to do: pin a placement whose sharded dims divide by the mesh axis sizes, or change the size.")
    return kept


def _copy_of_counterpart(nodes: dict, candidates, counterparts: list[str], inputs: tuple[Value, ...]):
    """The strategies of an identical node of an earlier layer, re-labelled for this node, when its
    inputs offer the same candidates (then every rule would answer the same). Layer 0 often differs
    from the others (its input comes from the embedding), so each distinct variant is kept."""
    def same_list(mine: Value, theirs: Value) -> bool:  # one strategy list: the same candidates
        return mine[1] == theirs[1] and nodes[mine[0]].variant == nodes[theirs[0]].variant

    # (only those already enumerated: a representative may come after its copy in the graph, as with one weight
    # tied over three layers, where a probe met a KeyError)
    for other in (nodes[name] for name in counterparts if name in nodes):
        if len(other.inputs) != len(inputs):
            continue
        if all(mine == theirs or same_list(mine, theirs) or candidates(mine) == candidates(theirs)
               for mine, theirs in zip(inputs, other.inputs)):
            return NodeStrategies(other.strategies, inputs, other.outputs, other.source, other.variant, other.excluded)
    return None


def _query_key(target, args, kwargs, in_infos, outs, candidates) -> tuple | None:
    """What a rule's answer for a node depends on: the op, its arguments with tensors as their shapes and
    dtypes, and the placements its inputs can come in; None when an argument cannot be hashed."""
    try:
        return (target, hashable_args((args, kwargs)), in_infos, outs, tuple(map(tuple, candidates)))
    except TypeError:
        return None


def _replicated_on_axes_of_one(strategies, mesh_shape) -> list[Strategy]:
    """`strategies` with every placement on a mesh axis of one device as Replicate (there a piece is the whole
    tensor and a Partial the sum of one term: every layout is the same), duplicates dropped in order. A plan on
    (1, 2) emitted and priced all_reduces on its one-device axis (a probe)."""
    if all(n > 1 for n in mesh_shape):
        return list(strategies)

    def one(ps):
        return None if ps is None else tuple(Replicate() if n == 1 else p for p, n in zip(ps, mesh_shape))

    seen, out = set(), []
    for st in strategies:
        c = Strategy(tuple(one(p) for p in st.outputs), tuple(one(p) for p in st.inputs))
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def _whole(outs, inputs, ndim: int) -> list[Strategy]:
    """The one strategy of an op run whole on every rank: every input and tensor output replicated."""
    rep = (Replicate(),) * ndim
    return [Strategy(tuple(rep if o is not None else None for o in outs), tuple(rep for _ in inputs))]


def _drops_out(node: fx.Node) -> bool:
    """An op with a `dropout_p` argument called with a non-zero one (an attention kernel or its backward)."""
    return getattr(node.target, "_schema", None) is not None and \
        dropout_p(node.target, node.args, node.kwargs) not in (0, None)


def _split_on_leading_dim_only(ps: Placements) -> bool:
    """Whole or split on dim 0 alone on every axis: the layouts an output a loss outside the compiled module reads
    may come back in unpinned. A rank's piece of a split on dim 0 (the batch, or the sequence of a sequence-first
    model) is its share of the examples, whose losses add up (DDP's way); a piece of a split on another dim (the
    vocabulary of a column-parallel head) is no loss's input: a cross-entropy of it ran on half the classes, 0.22
    off one device after 3 steps, and no error (found by a probe). `out_placements` pins any layout."""
    return all(not isinstance(p, Shard) or p.dim == 0 for p in ps)


def _replicated(ps: Placements) -> bool:
    """Replicated on every axis: the layout a loss_fn's output that is not one number comes back in unpinned (a
    per-example loss, `reduction="none"`). The loop reduces it (`.mean()`, a weighted sum), as it would the whole
    loss; a rank's piece gave each rank the mean of its own examples, and twice the gradients on two ranks (found
    by a probe: 0.03 off one device after 3 steps). `out_placements` pins any layout."""
    return all(isinstance(p, Replicate) for p in ps)


# sums whose integer output (a count) may be left Partial(sum) for its reader's all_reduce
_INTEGER_SUMS = frozenset({torch.ops.aten.sum.default, torch.ops.aten.sum.dim_IntList})


def enumerate_strategies(traced: TracedGraph, mesh, pins: Pins | None = None, blocks=None) -> StrategyTable:
    """`pins`: as the user gave them (validated here by `check_pins`). `blocks`: a `RepeatedBlocks`; nodes of
    repeated layers copy their representative's strategies."""
    pins = check_pins(pins or Pins(), traced, mesh)
    rep_of = blocks.representative if blocks is not None else {}
    variants: dict[str, list[str]] = {}  # representative -> counterparts with their own strategies
    info = traced.tensor_info
    nodes: dict[str, NodeStrategies] = {}
    table = StrategyTable(nodes)  # filled below; output_candidates reads what is entered so far
    fallbacks: list[str] = []
    copied = 0
    by_ph = traced.input_by_placeholder()
    by_fqn = {i.name: i.placeholder for i in traced.inputs if i.kind in ("parameter", "buffer", "input")}
    by_input = {i.name: i.placeholder for i in traced.inputs if i.kind == "input"}
    kinds = traced.output_kinds()
    # the outputs a loss outside the compiled module differentiates (a tangent arrives for each)
    differentiated = {gi.name for gi in traced.inputs if gi.kind == "tangent"}
    next_variant = iter(range(1 << 62)).__next__
    answers: dict[tuple, tuple] = {}  # _query_key -> (strategies, source, excluded)

    def floating_partials(s: Strategy, outs, ins, counts: bool = False) -> bool:
        """Partial only on floating-point values: a sum of bool masks is no mask, and the integer tensors
        of a graph are indices and counts, which no rule reads unreduced. `counts`: an integer sum's output may
        be Partial(sum) (each rank's count of its piece, all-reduced where it is read; a loss's count of the
        targets it does not ignore gathered a per-token mask instead, a plan-quality probe)."""
        def allowed(ps, t, output: bool) -> bool:
            if ps is None or t is None or t.dtype.is_floating_point or t.dtype.is_complex:
                return True
            partials = [p for p in ps if isinstance(p, Partial)]
            return not partials or (output and counts and all(p.reduce_op == "sum" for p in partials))

        return all(allowed(ps, t, True) for ps, t in zip(s.outputs, outs)) and \
            all(allowed(ps, t, False) for ps, t in zip(s.inputs, ins))

    def even(s: Strategy, outs, ins) -> bool:
        return all(ps is None or o is None or is_even(o.shape, ps, mesh.shape) for ps, o in zip(s.outputs, outs)) \
            and all(is_even(i.shape, ps, mesh.shape) for ps, i in zip(s.inputs, ins))

    for node in traced.graph.nodes:
        if node.op == "placeholder":
            t = info[node.name]
            gi = by_ph[node.name]
            strategies = [Strategy((ps,), ()) for ps in all_placements(len(t.shape), mesh.ndim)
                          if is_even(t.shape, ps, mesh.shape)]
            book = pins.inputs if gi.kind == "input" else pins.params
            if gi.name in book:
                strategies = _restrict(strategies, book[gi.name], f"{gi.kind} {gi.name!r}", t.shape, mesh)
            strategies = _replicated_on_axes_of_one(strategies, mesh.shape)
            # a tangent (the incoming gradient) arrives laid out like its output
            nodes[node.name] = NodeStrategies(tuple(strategies), (), (t,), "placeholder", next_variant(),
                                              tie=gi.name if gi.kind == "tangent" else None)
            continue
        if node.op == "output":
            for k, a in enumerate(flat_outputs(node)):
                if not isinstance(a, fx.Node) or not isinstance(info.get(a.name), TensorInfo):
                    continue
                t = info[a.name]
                strategies = [Strategy((), (ps,)) for ps in all_placements(len(t.shape), mesh.ndim)
                              if is_even(t.shape, ps, mesh.shape)]
                if k in pins.outputs:
                    pin = pins.outputs[k]
                    strategies = [s for s in strategies if s.inputs[0] == pin]
                    if not strategies:
                        raise SpmdError(f"pin {placements_str(pin)} for output {k} cannot be met: it has shape "
                                        f"{t.shape}, and on mesh {mesh} that placement is uneven: "
                                        f"{_uneven(pin, t.shape, mesh)}. What to do: pin an even placement.")
                elif kinds[k].kind == "output" and traced.loss and t.shape:
                    strategies = [s for s in strategies if _replicated(s.inputs[0])]
                elif kinds[k].kind == "output" and kinds[k].name in differentiated:
                    strategies = [s for s in strategies if _split_on_leading_dim_only(s.inputs[0])]
                # gradients land in their parameter's (an input's: the input's) own placements, a buffer's
                # new value in the buffer's
                strategies = _replicated_on_axes_of_one(strategies, mesh.shape)
                tie = by_fqn[kinds[k].name] if kinds[k].kind in ("grad", "buffer_update") else \
                    by_input[kinds[k].name] if kinds[k].kind == "input_grad" else None
                nodes[f"output_{k}"] = NodeStrategies(tuple(strategies), ((a.name, 0),), (), "output",
                                                      next_variant(), tie=tie,
                                                      buffer_update=kinds[k].kind == "buffer_update")
            continue
        if node.op == "get_attr" and isinstance(getattr(traced.gm, node.target, None), fx.GraphModule):
            continue  # a higher-order op's subgraph (flex_attention's score_mod): travels with its op
        if node.op != "call_function":
            raise SpmdError(f"enumerate_strategies: unsupported node kind {node.op} ({describe_node(node)})")

        node_info = info.get(node.name)
        outs = node_info if isinstance(node_info, tuple) else (node_info,)
        if node.target is operator.getitem:
            src, idx = node.args
            value = (src.name, idx)
            nodes[node.name] = NodeStrategies(tuple(Strategy((ps,), (ps,)) for ps in table.output_candidates(value)),
                                              (value,), outs, "follow", next_variant())
            continue

        inputs = _tensor_inputs(node, info)
        rep = rep_of.get(node.name)
        if rep is not None:
            copy = _copy_of_counterpart(nodes, table.output_candidates, variants.setdefault(rep, [rep]), inputs)
            if copy is not None:
                nodes[node.name] = copy
                copied += 1
                continue
            variants[rep].append(node.name)
        in_infos = tuple(info[v[0]] for v in inputs)
        counter = iter(range(len(inputs)))

        def mark(a):
            if isinstance(a, fx.Node) and isinstance(info.get(a.name), TensorInfo):
                return TensorArg(next(counter))
            return a

        m_args, m_kwargs = tree_map(mark, (tuple(node.args), dict(node.kwargs)))
        key = _query_key(node.target, m_args, m_kwargs, in_infos, outs, [table.output_candidates(v) for v in inputs])
        found = answers.get(key) if key is not None else None
        if found is not None:  # the same question asked of an earlier node (another layer's twin)
            kept, source, excluded = found
            nodes[node.name] = NodeStrategies(kept, inputs, outs, source, next_variant(), excluded)
            continue
        strategies, source = None, "spmd"
        error = None
        try:
            ours = rule_for(node.target)
            if ours is not None:
                r_args, r_kwargs = tree_map(lambda a: in_infos[a.index] if isinstance(a, TensorArg) else a,
                                            (m_args, m_kwargs), is_leaf=lambda a: isinstance(a, TensorArg))
                single = ours(RuleInput(node.target, r_args, r_kwargs, in_infos, outs))
                if not (getattr(ours, "__module__", None) or "").startswith("spmd."):  # (a user's rule)
                    single = _usable_rows(single, outs, in_infos, node)
                strategies = expand_single_dim(single, len(outs), mesh.ndim)
            elif is_random(node) or _drops_out(node):
                # a draw no rule of ours covers (multinomial, randint_like(x, low, high), CUDA attention
                # kernels with dropout): DTensor's rules cut it (it offsets a CUDA generator per shard), and a
                # rank drawing its piece from the shared generator draws the first rows' numbers for its own
                # rows. Whole on every rank, as rules/random.py draws; so is the backward of an attention kernel
                # with dropout, which draws its forward's mask again from the seed and the element's index (a
                # piece of it would draw the first rows' mask: flash attention's backward is not tagged random;
                # found by a review)
                strategies, source = _whole(outs, inputs, mesh.ndim), "random"
            else:
                cands = {j: table.output_candidates(v) for j, v in enumerate(inputs)}
                strategies = dtensor_adapter.strategies(node.target, m_args, m_kwargs, dict(enumerate(in_infos)),
                                                        cands, outs, mesh)
                source = "dtensor"
        except Exception as e:  # a rule that cannot handle these args: replicate, and say so
            error = e
            strategies = None
        if strategies is None:
            where = describe_node(node)
            reason = f"its rule failed ({type(error).__name__}: {error})" if error else "it has no sharding rule"
            # (an op with no rule on 0-d tensors alone loses nothing whole: transformers' static cache copies its
            # position into a 0-d buffer at every call, and each compile warned of it; a rule that failed still
            # warns, a review)
            if error is not None or not all(len(getattr(t, "shape", (0,))) == 0 for t in (*in_infos, *outs)
                                            if t is not None):
                qualified = (f"higher_order.{node.target.name()}" if isinstance(node.target, torch._ops.HigherOrderOperator)
                             else op_name(node.target))  # (a probe: `torch.ops.cond`, which is no op)
                # (an op writing its inputs, inside torch's wrapper: a probe was told of the wrapper alone, and
                # gave the op itself a rule, never asked for)
                inner = _functionalized_op(node)
                if inner is not None:
                    where += f", which runs `{inner}` (an op writing its inputs in place, written functionally)"
                warnings.warn(UnknownOpWarning(
                    f"{where}: {reason}; it runs replicated on every rank (correct, maybe slow). What to do: give it "
                    f"a rule from your own code, `@rule(torch.ops.{qualified})` (`from "
                    "spmd.passes.rules.registry import rule`: a function of its single-axis placements, as "
                    "spmd/passes/rules/ writes them" + (
                        f"; the wrapper's rule is asked for every such op, so it tells them apart by "
                        f"`r.args[0]`, here `torch.ops.{inner}`, and each row lists a placement per output of the "
                        "wrapper's (`r.outputs`), then per tensor input (`r.inputs`)), not a rule for the op itself, "
                        "which the graph never calls." if inner is not None else
                        "), or DTensor's `torch.distributed.tensor.experimental.register_sharding`, which spmd reads "
                        "too.")), stacklevel=2)
            fallbacks.append(where)
            strategies, source = _whole(outs, inputs, mesh.ndim), "fallback"
        producible = [_partials(table.output_candidates(v)) for v in inputs]
        usable = [s for s in strategies if len(s.inputs) == len(inputs) and len(s.outputs) == len(outs)
                  and _partials_available(s, producible)
                  and floating_partials(s, outs, in_infos, counts=node.target in _INTEGER_SUMS)]
        kept = _replicated_on_axes_of_one([s for s in usable if even(s, outs, in_infos)], mesh.shape)
        if not kept:
            kept = _whole(outs, inputs, mesh.ndim)
        kept.sort(key=strategy_key)  # DTensor's rules may list them in set order, which varies by process
        nodes[node.name] = NodeStrategies(tuple(kept), inputs, outs, source, next_variant(), len(usable) - len(kept))
        if key is not None and source != "fallback":  # a fallback warns once per node: asked again
            answers[key] = (nodes[node.name].strategies, source, len(usable) - len(kept))

    return StrategyTable(nodes, tuple(fallbacks), copied)


def _functionalized_op(node: fx.Node) -> str | None:
    """The op an `auto_functionalized` node runs (a custom op with `mutates_args`, as torch.export writes it), or
    None."""
    if getattr(node.target, "__name__", None) not in ("auto_functionalized", "auto_functionalized_v2") or \
            not node.args:
        return None
    return op_name(node.args[0]) if hasattr(node.args[0], "_schema") else None


def _usable_rows(single, outs: tuple, in_infos: tuple, node: fx.Node) -> list:
    """The rows of a user's `@rule` that can be used, a warning naming the first that cannot (a probe: rows of the
    wrong length, `Shard(5)` on a 2-D tensor or `Shard(-1)` were dropped without a word, the op run replicated
    with no warning at all where none was left; DTensor's `register_sharding` says so)."""
    kept, why = [], None
    for row in single:
        problem = _row_problem(row, outs, in_infos)
        if problem is None:
            kept.append(row)
        elif why is None:
            why = problem
    if why is not None:
        warnings.warn(UnknownOpWarning(
            f"{describe_node(node)}: its rule gave {len(single) - len(kept)} row(s) of {len(single)} that cannot be "
            f"used, dropped ({why})" + ("; it runs replicated on every rank" if not kept else "") + ". What to do: "
            "each row lists one placement per output, then one per tensor input in the order the op takes them "
            "(`RuleInput.inputs`), a `Shard(dim)` with 0 <= dim < that tensor's ndim."), stacklevel=3)
    return kept


def _row_problem(row, outs: tuple, in_infos: tuple) -> str | None:
    """Why a row of a single-axis rule cannot be used, or None."""
    if not isinstance(row, (list, tuple)):
        return f"{row!r} is not a list of placements"
    if len(row) != len(outs) + len(in_infos):
        return (f"{list(row)} has {len(row)} placement(s), the op {len(outs)} output(s) and {len(in_infos)} tensor "
                "input(s)")
    for p, t in zip(row, (*outs, *in_infos)):
        if p is None and t is None:
            continue
        if not isinstance(p, (Shard, Replicate, Partial)):
            return f"{list(row)} holds {p!r}, not a placement"
        if isinstance(p, Shard) and (t is None or not 0 <= p.dim < len(t.shape)):
            held = "a value that is no tensor" if t is None else f"a {len(t.shape)}-d tensor"
            return f"{list(row)} holds {p} for {held}"
    return None
