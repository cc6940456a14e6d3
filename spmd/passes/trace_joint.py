"""trace_joint: nn.Module (+ loss) + example inputs -> the joint forward+backward ATen graph.

Before: an eager module, example inputs and optionally a loss function. After: a `TracedGraph` like
`trace_module`'s, with `joint=True`: its outputs are the forward outputs (the loss, when a loss_fn is
given) followed by one gradient per trainable parameter (`GraphOutput("grad", fqn)`) and per example input
that requires grad (`GraphOutput("input_grad", input name)`: placed as the input); before them, the new
value of each buffer the forward updates in place (`GraphOutput("buffer_update", fqn)`: batch norm's
running statistics, placed as the buffer, copied into it by the runtime); one `tangent`
placeholder per forward output carries the incoming gradient; every node has
`meta["partitioner_tag"]` (is_forward / is_backward) and the user's stack trace.

How: AOTAutograd's `aot_export_joint_with_descriptors` over the module itself, with core-ATen
decompositions (minus fused attention and the fused backward kernels in `KEPT_WHOLE`), as torch.export
would trace it (`torch.compiler.is_exporting()` true) and recording what torch.export records (each
node's module stack and the user's source lines; backward nodes take their forward op's). Where that
fails, or for a model with a submodule registered under two names (which AOTAutograd over the module
breaks), torch.export (non-strict) first and AOTAutograd over the exported module, the road every model
took before (0.2 s more of LLaMA3-8B's 0.8 s trace). Either way the model's attributes, parameters and
buffers are as they were after the trace (`state_kept`). Example inputs that share memory are traced
as separate inputs (`distinct_inputs`).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import os
import re
import sys
import threading
import types
import warnings

import torch
import torch.fx.traceback as fx_traceback
from torch._export.utils import _compiling_state_context
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch.overrides import TorchFunctionMode

from spmd.core.autocast import autocast_off, autocast_on, autocast_state
from spmd.core.errors import TORCH_DIR, SpmdError, user_stacklevel
from spmd.core.shared_patch import SharedPatch, class_attribute_patch, collecting
from spmd.passes.kept_state import _REGISTRIES, refuse_counted, state_kept
from spmd.passes.made_state import refuse_made_snapshots
from spmd.passes.trace_module import (DRAWN_WHOLE, WRONG_IN_TORCH, GraphInput, GraphOutput, TracedGraph,
                                      _drop_assertions, _drop_effect_tokens, dataclass_outputs_registered, described,
                                      distinct_inputs, draws_change_the_graph, forward_names, graph_signature,
                                      kernels_kept_whole, module_types, parameter_changed_message, parametrizations_uncached,
                                      partial_graphs_unprinted, positional, renormalized, random_draws,
                                      refuse_random_draws, shared_names, state_assigned, tensor_infos,
                                      untraceable_message, untraceable_way_out, user_outputs_first,
                                      without_decompositions)

_PREFIX = "model."
OUTPUT_COPY = "spmd_output_copy"  # node meta: a copy of a user's output the trace made (`_with_own_outputs`)


class WithLoss(torch.nn.Module):
    """`forward(*inputs, *targets) = loss_fn(model(*inputs), *targets)`."""

    def __init__(self, model: torch.nn.Module, loss_fn, n_targets: int):
        super().__init__()
        self.model, self.loss_fn, self.n_targets = model, loss_fn, n_targets

    def forward(self, *args):
        inputs, targets = args[: len(args) - self.n_targets], args[len(args) - self.n_targets:]
        return self.loss_fn(self.model(*inputs), *targets)


def with_loss(model: torch.nn.Module, loss_fn) -> torch.nn.Module:
    """What the joint graph traces: `model`, or `model` followed by `loss_fn` (a `WithLoss`)."""
    return model if loss_fn is None else WithLoss(model, loss_fn, loss_targets(loss_fn))


def loss_targets(loss_fn) -> int:
    """How many trailing inputs are targets: the loss function's required positional parameters - 1 (a loss
    module's forward's: the module itself shows torch's `(*args, **kwargs)`, which counted one target for
    `nn.TripletMarginLoss`'s two, found by a probe). None for a loss of the output alone (`loss_fn(out)`, or
    `loss_fn(out, target=None)`): at least one was counted, so a probe's model ran without its last input, a
    mask, which the loss took as its target (0.77 where eager gave 0.33). One where the signature does not say
    (none known, or `*args`)."""
    try:
        params = inspect.signature(loss_fn.forward if isinstance(loss_fn, torch.nn.Module) else loss_fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    params = list(params)
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) <= 1 and any(p.kind == p.VAR_POSITIONAL for p in params):
        return 1  # (`loss(*args)`, `loss(out, *targets)`: as many as given cannot be told; one, as always)
    return max(0, len(required) - 1)


# Backward kernels kept whole. Their core-ATen decompositions split each into 5-30 small ops (110 extra
# call nodes in a 2-layer GPT's training step, +23% compute at tiny sizes), and every one has a sharding
# rule that keeps what the decomposition allowed: batch-sharded inputs give Partial weight gradients, and
# each is linear in its incoming gradient, so a Partial gradient passes through (rules/norm.py,
# rules/pointwise.py, rules/softmax.py, rules/indexing.py; nll_loss_backward is DTensor's rule: batch-
# sharded like its input, with the global total weight). nll_loss_forward stays decomposed: with
# reduction="mean" its only sharded form is DTensor's Partial(avg) of per-shard means, which is wrong when
# shards hold different numbers of counted targets (ignore_index, class weights); decomposed, the sum and
# the count are reduced separately and divided after.
KEPT_WHOLE = ("native_layer_norm_backward", "gelu_backward", "_softmax_backward_data", "embedding_dense_backward",
              "nll_loss_backward")

# Decomposed although core ATen keeps them: log_softmax over a class dim split by vocabulary (a vocab-
# parallel LM head) is then amax -> all_reduce(max), exp -> sum -> all_reduce(sum), each a small edge the
# solver prices, instead of a gather of the logits; its backward g - exp(y) * sum(g) likewise.
DECOMPOSED = ("_log_softmax",)

# Fused attention: its CPU forward decomposes into math whose softmax would then be fed to the
# still-fused backward as its logsumexp (wrong gradients), and attention has rules of its own anyway.
ATTENTION = ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


def _decompositions():
    """Core ATen and the ops in DECOMPOSED, except fused attention, the fused kernels and the random ops kept
    whole (a copy of the table made once per process: making it took 20-30 ms of each trace)."""
    return dict(_decomposition_table())


@functools.cache
def _decomposition_table():
    aten = torch.ops.aten
    table = dict(torch._decomp.core_aten_decompositions())
    table.update(torch._decomp.get_decompositions([getattr(aten, name) for name in DECOMPOSED]))
    return without_decompositions(table, ATTENTION + KEPT_WHOLE + DRAWN_WHOLE + WRONG_IN_TORCH)


def _param_placeholder(target: str):
    """Whether a joint graph's placeholder is parameter `target`'s (its name as the trace spells it)."""
    return lambda node: type(node.meta.get("desc")).__name__ == "ParamAOTInput" and node.meta["desc"].target == target


def trace_joint(model: torch.nn.Module, example_inputs: tuple, loss_fn=None) -> TracedGraph:
    with kernels_kept_whole(), parametrizations_uncached(), partial_graphs_unprinted():
        return _trace_joint(model, example_inputs, loss_fn)


def _trace_joint(model: torch.nn.Module, example_inputs: tuple, loss_fn) -> TracedGraph:
    root = with_loss(model, loss_fn)
    example_inputs, _ = distinct_inputs(example_inputs)
    counted: list[tuple] = []  # (the numbers the forward changed: `refuse_counted`)
    made: list[tuple] = []  # (the tensors it made where it had none: `refuse_made_snapshots`)
    with checkpoints_run_through(root) as checkpoints:
        stored: list[tuple] = []  # (the tensors with a gradient the forward keeps on its modules: a warning)
        with random_draws() as drew:
            gm, out_spec, applied, assigned = _with_own_outputs(model, root, example_inputs, counted, made, stored)
        _warn_grads_stored(model, stored)
        if counted:  # (traced again as this trace was: its checkpoints run through)
            refuse_counted(counted, lambda: graph_signature(_with_own_outputs(model, root, example_inputs)[0]),
                           graph_signature(gm), model)
        refuse_made_snapshots(made, root, model, lambda: root(*example_inputs), list(example_inputs), "trace_joint")
    # Python's or numpy's generators: in training, a draw without a seed of the model's own before it is a
    # layer drop or a mask that must change at every step (refused); where the draws cannot be named, the
    # graph traced again with the generators seeded apart says whether it keeps them
    refuse_random_draws(drew.unseeded, model)
    if drew.unnamed:
        refuse_random_draws(draws_change_the_graph(
            lambda: graph_signature(_with_own_outputs(model, root, example_inputs)[0]), graph_signature(gm), []), model)
    if assigned:  # (neither road carries the assignment out: the new value would be lost, silently)
        raise SpmdError(
            f"trace_joint: the forward assigns a new tensor to {described(assigned[0])} (`self.name = new`, or `.data "
            "= new`); "
            "a training graph keeps the module's own tensor, so the new value would be lost. What to do: update "
            "the buffer (or parameter) in place under torch.no_grad() (`self.name.copy_(new)`, as batch norm updates its "
            "statistics), reading a clone (`self.name.clone()`) where the forward uses its old value for "
            "gradients.")

    prefix = _PREFIX if root is not model else ""
    strip = lambda fqn: fqn[len(prefix):] if prefix and fqn.startswith(prefix) else fqn  # noqa: E731
    arg_names = argument_names(model, len(example_inputs), loss_fn)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_descs = [d for d in out_node.meta.get("desc") or [] if not type(d).__name__.endswith("TokenAOTOutput")]
    _drop_effect_tokens(gm, {n.name for n in gm.graph.nodes if n.op == "placeholder"
                             and type(n.meta.get("desc")).__name__.endswith("TokenAOTInput")})
    inputs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        desc = node.meta.get("desc")
        kind = type(desc).__name__
        if kind == "ParamAOTInput":
            inputs.append(GraphInput(node.name, "parameter", strip(desc.target)))
        elif kind == "BufferAOTInput":
            inputs.append(GraphInput(node.name, "buffer", strip(desc.target)))
        elif kind == "PlainAOTInput":
            inputs.append(GraphInput(node.name, "input", arg_names[desc.idx]))
        elif kind == "TangentAOTInput" and type(desc.output).__name__ == "PlainAOTOutput":
            inputs.append(GraphInput(node.name, "tangent", f"output_{desc.output.idx}"))
        elif kind == "TangentAOTInput" and "ParamAOTInput" in repr(desc.output):
            target = re.search(r"target='([^']+)'", repr(desc.output))
            raise SpmdError(parameter_changed_message(
                "trace_joint", model, strip(target.group(1)) if target else "?",
                "a training graph cannot differentiate through a parameter it also updates",
                target and renormalized(gm.graph, _param_placeholder(target.group(1)))))
        else:
            raise SpmdError(f"trace_joint: unsupported graph input {node.name} ({desc}). What to do: report "
                            "this model; inputs that are mutated or tensor subclasses are not supported yet.")
    outputs = []
    for k, desc in enumerate(out_descs):
        kind = type(desc).__name__
        if desc is None:  # the gradient of an input that does not require one
            outputs.append(GraphOutput("none", ""))
        elif kind == "PlainAOTOutput":
            outputs.append(GraphOutput("output", f"output_{desc.idx}"))
        elif kind == "GradAOTOutput" and type(desc.grad_of).__name__ == "PlainAOTInput":
            # an input that required grad in the example: its gradient, placed as the input
            outputs.append(GraphOutput("input_grad", arg_names[desc.grad_of.idx]))
        elif kind == "GradAOTOutput":
            outputs.append(GraphOutput("grad", strip(getattr(desc.grad_of, "target", None) or str(desc.grad_of))))
        elif kind == "InputMutationAOTOutput" and type(desc.mutated_input).__name__ == "BufferAOTInput":
            # a buffer the forward updates in place (batch norm's running statistics): its new value, which
            # the runtime copies into the buffer's piece after the forward (placed as the buffer)
            outputs.append(GraphOutput("buffer_update", strip(desc.mutated_input.target)))
        else:
            mutated = type(getattr(desc, "mutated_input", None)).__name__
            if mutated == "ParamAOTInput":  # (a frozen one: a target network's momentum update; a probe)
                raise SpmdError(parameter_changed_message(
                    "trace_joint", model, strip(desc.mutated_input.target),
                    "a training graph takes its parameters as pieces it only reads",
                    renormalized(gm.graph, _param_placeholder(desc.mutated_input.target))))
            what = {"PlainAOTInput": "an input"}.get(mutated, "state")
            raise SpmdError(f"trace_joint: unsupported graph output {k} ({desc}): the model updates {what} in "
                            "place. What to do: return the new value instead of updating in place (buffers may "
                            "be updated in place).")
    outputs = user_outputs_first(gm, outputs)
    _warn_updates_in_checkpoints(outputs, {strip(p) for p in checkpoints.updated},
                                 [strip(p) for p in checkpoints.norms])
    inputs, constants = _lift_constants(gm, inputs)
    _drop_assertions(gm)
    state = dict(constants)
    state.update({strip(k): v for k, v in root.named_parameters(remove_duplicate=False)})
    state.update({strip(k): v for k, v in root.named_buffers(remove_duplicate=False)})
    tensor_info = tensor_infos(gm)
    frozen = frozenset(strip(k) for k, v in root.named_parameters(remove_duplicate=False) if not v.requires_grad)
    return TracedGraph(gm, tuple(inputs), {k: v.detach() for k, v in state.items()}, out_spec,
                       None, tensor_info, tuple(outputs), frozen=frozen, joint=True,
                       aliases=shared_names(root, prefix), module_types=module_types(root, prefix),
                       custom_functions=tuple(sorted(applied)),
                       checkpoints=tuple(dict.fromkeys(checkpoints)), reentrant=checkpoints.reentrant,
                       loss=loss_fn is not None)


def _warn_updates_in_checkpoints(outputs: list, updated: set[str], norms: list[str]) -> None:
    """Warn where the forward updates a buffer in place inside a module torch.utils.checkpoint runs (a custom op
    that accumulates into one, a running mean of its own): eager updates it again when backward recomputes the
    module, and a forward that reads it after the update computes other values there, so eager's gradients differ
    too; the compiled module updates it once (found by a probe: a buffer 0.099 and weights 3.8e-3 off eager after 3
    steps, with no word). Batch norm's statistics have their own warning (`checkpoints_run_through`). `updated`:
    the buffers written in place while a checkpointed call ran (a checkpointed lambda's or method's too), by
    their version counters: a buffer its parent updates outside its module's checkpoint is none (a review: the
    checkpointed module's path alone missed the lambdas; the modules that ran inside named the parent's update)."""
    inside = [o.name for o in outputs if o.kind == "buffer_update" and o.name in updated
              and not any(o.name.startswith(n + ".") for n in norms)]
    if inside:
        warnings.warn(
            f"{', '.join(f'`{n}`' for n in inside[:3])}{' and more' if len(inside) > 3 else ''} "
            f"{'is a buffer' if len(inside) == 1 else 'are buffers'} the forward updates in place inside "
            "torch.utils.checkpoint: eager PyTorch makes the update twice per training step (in forward, and again "
            "when backward recomputes the checkpointed part), the compiled module once, as without checkpointing; "
            "where the forward reads the buffer after updating it, eager's recomputed values and gradients differ "
            "from its forward's too. What to do: update the buffer outside the checkpointed call for eager's "
            "numbers to be the compiled module's.", stacklevel=4)


def _lift_constants(gm: torch.fx.GraphModule, inputs: list) -> tuple[list, dict]:
    """The tensor constants the trace made (an index given as a Python list, Falcon's `qkv[..., [-2], :]`:
    `get_attr` of `_tensor_constant0`) as inputs of kind "constant", as torch.export lifts them: placeholders
    before the tangents, their values in the state (the runtime holds them as buffers). Returns (inputs,
    {name: tensor})."""
    graph = gm.graph
    lifted = [n for n in graph.nodes if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), torch.Tensor)]
    if not lifted:
        return inputs, {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    at = next((k for k, gi in enumerate(inputs) if gi.kind == "tangent"), len(inputs))
    anchor = placeholders[at] if at < len(placeholders) else next(n for n in graph.nodes if n.op != "placeholder")
    constants, new, placed = {}, [], {}
    for node in lifted:  # (one constant can be read by several get_attr nodes: a loss_fn's tensor, forward and
        ph = placed.get(node.target)  # backward; found by a probe, a raw AttributeError at the second)
        if ph is None:
            with graph.inserting_before(anchor):
                ph = placed[node.target] = graph.placeholder(node.target)
            ph.meta = {k: v for k, v in node.meta.items() if k != "partitioner_tag"}  # (an input: forward's)
            constants[node.target] = getattr(gm, node.target).detach()
            new.append(GraphInput(ph.name, "constant", node.target))
        node.replace_all_uses_with(ph)
        graph.erase_node(node)
    for target in placed:
        delattr(gm, target)
    gm.recompile()
    return inputs[:at] + new + inputs[at:], constants


def _aot_over_module(root: torch.nn.Module, example_inputs: tuple) -> tuple:
    """(joint graph, out_spec, custom Functions applied): AOTAutograd over `root` itself, as torch.export
    would see it (`torch.compiler.is_exporting()` true: models skip their data-dependent shortcuts for
    export, e.g. transformers' causal-mask check), with the module stack and source lines torch.export
    would have recorded (`source_meta`). A `torch.autograd.Function` keeps the backward it defines."""
    with custom_functions() as applied, contextlib.ExitStack() as stack, fx_traceback.preserve_node_meta(), \
            _compiling_state_context():  # (torch.export's own: is_compiling() and is_exporting() true)
        with source_meta(root):
            joint = aot_export_joint_with_descriptors(stack, root, example_inputs, decompositions=_decompositions())
        _backward_meta_from_forward(joint.graph_module.graph)
        _drop_disable_notes(joint.graph_module.graph)
        return joint.graph_module, joint.out_spec, applied


def _warn_grads_stored(model: torch.nn.Module, stored: list[tuple]) -> None:
    """A forward that keeps a tensor with a gradient on its module (a Switch layer's `self.aux_loss`;
    `state_assigned.kept_with_grad`): the compiled call runs the graph, not the forward, and the attribute keeps
    what it held before compiling, so a loss on it would train nothing (a probe: the gate never trained, 3.9e-2 off
    after 3 steps, silently). Said once, at compile time; the attribute is the model's business (many keep an
    attention map to look at)."""
    paths = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}
    names = list(dict.fromkeys(f"{paths[id(m)] + '.' if paths.get(id(m)) else ''}{name}" for m, name in stored
                               if id(m) in paths))
    if not names:
        return
    shown = ", ".join(f"`{name}`" for name in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    warnings.warn(
        f"trace_joint: the forward keeps a tensor that requires grad on {shown} (`self.name = ...`, or appended to a "
        "list the module holds). A compiled call runs the traced graph, not the forward, so the attribute keeps what it "
        "held before compiling: read after a call it is stale, and a loss on it (an auxiliary loss a layer keeps on "
        "itself) would train nothing. What to do: return it from the forward, as an output of the model (or of its "
        "`output.loss`), and add it to the loss from there; an attribute no one reads after the call (a cached view "
        "of a weight) can be left as it is.", stacklevel=user_stacklevel())


def _with_own_outputs(model: torch.nn.Module, root: torch.nn.Module, example_inputs: tuple,
                      counted: list | None = None, made: list | None = None, stored: list | None = None) -> tuple:
    """`_either_road` with every floating output of the user's traced as a copy, and the copies then dropped
    where the output was its own tensor (`_needless_copies_dropped`). A copy stays where the output is a view
    of another output or of a value computed in the forward (`return y, y.t()`; a Linear's 3-D logits, a view
    of its matmul), or a parameter or an input itself or viewed (`return y, self.logit_bias`; a block's
    `return out, x`): AOTAutograd regenerates such aliases outside its graph, which a compiled module does
    not, and gives them no incoming gradient, so a loss on one would reach no parameter (SigLIP's logit_bias
    never trained) or input (the residual's share of x.grad was dropped: 7.41 off). Copied before the trace,
    one trace serves where such outputs were found after it and traced again (transformers' causal LMs: the
    trace was half of a 2-layer Llama's plan)."""
    with _outputs_copied(root):
        gm, *rest = _either_road(model, root, example_inputs, counted, made, stored)
    _needless_copies_dropped(gm)
    return (gm, *rest)


def _needless_copies_dropped(gm: torch.fx.GraphModule) -> None:
    """Each user output copied by `_outputs_copied` (a clone only the output reads) that is a value computed
    in the forward, or a buffer, and not through a view: returned itself, the copy erased. Others keep it."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    for k, (arg, desc) in enumerate(zip(outs, out_node.meta.get("desc") or [])):
        if type(desc).__name__ != "PlainAOTOutput" or not isinstance(arg, torch.fx.Node) or \
                arg.target is not torch.ops.aten.clone.default or len(arg.users) != 1:
            continue
        node, through_view = arg.args[0], False
        while node.op == "call_function" and getattr(node.target, "is_view", False):
            node, through_view = node.args[0], True
        source = type(node.meta.get("desc")).__name__ if node.op == "placeholder" else "computed"
        if source not in ("ParamAOTInput", "PlainAOTInput") and not (through_view and source == "computed"):
            outs[k] = arg.args[0]
        else:
            arg.meta[OUTPUT_COPY] = True  # (the runtime tells it from a copy the user's forward made)
    dropped = [arg for arg, out in zip(out_node.args[0], outs) if arg is not out]
    if dropped:
        out_node.args = (type(out_node.args[0])(outs),) + tuple(out_node.args[1:])
        for copy in dropped:
            gm.graph.erase_node(copy)
        gm.recompile()


@contextlib.contextmanager
def _root_call(root: torch.nn.Module, wrap):
    """Within: calling `root` runs `wrap(call)(*args, **kwargs)`, `call` being its own call (`_call_impl`,
    where its hooks run too; the compiled call `model.compile()` left, which nn.Module calls instead)."""
    attr = "_compiled_call_impl" if getattr(root, "_compiled_call_impl", None) is not None else "_call_impl"
    own = root.__dict__.get(attr)
    root.__dict__[attr] = wrap(getattr(root, attr))
    try:
        yield
    finally:
        if own is not None:
            root.__dict__[attr] = own
        else:
            root.__dict__.pop(attr, None)


def _outputs_copied(root: torch.nn.Module):
    """Within: the root's call returns a copy of each of its flat floating outputs (`_with_own_outputs`)."""
    def wrap(inner):
        def call(*args, **kwargs):
            flat, spec = torch.utils._pytree.tree_flatten(inner(*args, **kwargs))
            return torch.utils._pytree.tree_unflatten(
                [t.clone() if isinstance(t, torch.Tensor) and t.dtype.is_floating_point else t for t in flat], spec)
        return call
    return _root_call(root, wrap)


def _either_road(model: torch.nn.Module, root: torch.nn.Module, example_inputs: tuple,
                 counted: list | None = None, made: list | None = None, stored: list | None = None) -> tuple:
    """(joint graph module, out spec, custom Functions applied, buffers the forward assigned) from AOTAutograd
    over the module, or, where that road fails, over torch.export's module."""
    # (mkldnn off: torch's decomposition of aten.lstm picks oneDNN's kernel for an input that needs no gradient
    # and traces it without the workspace its backward takes, so training an nn.LSTM failed in the backward;
    # found by a probe. The regular kernels are what the graph then runs)
    # (a dataclass the model returns, registered with torch's pytree as the forward-only trace does: a training
    # compile with no loss_fn failed with torch's words unless a forward-only one had run first; found by a probe)
    # (only where the output leaves the graph as it is: a loss_fn takes it apart itself, and torch's registration is
    # for good, which a user's own `register_dataclass` of the class after it would find taken; a review)
    registered = dataclass_outputs_registered(model) if root is model else contextlib.nullcontext()
    with _autocast_in_forward(root), _ONEDNN_OFF, registered, _masked_writes_as_where():
        return _either_road_as_eager(model, root, example_inputs, counted, made, stored)


def _onednn_disabled() -> bool:
    before = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    return before


# oneDNN's kernels off, and only that (torch.backends.mkldnn.flags also sets its TF32 flag, which warns); put back
# when the last of overlapping traces ends (two threads' traces left it off for good: a review)
_ONEDNN_OFF = SharedPatch(_onednn_disabled, torch._C._set_mkldnn_enabled)


@contextlib.contextmanager
def _autocast_in_forward(root: torch.nn.Module):
    """Under torch.autocast, the trace runs the forward (the model with its hooks, and its loss) under it and
    the backward outside it, as eager training does (`with autocast: loss = ...; loss.backward()`): autocast's
    casts in the backward would round regions the model keeps in fp32 (`torch.autocast(enabled=False)` around
    them) in bf16. The root's call is wrapped (`_call_impl`, where its hooks run too; the compiled call
    `model.compile()` left, which nn.Module calls instead). Nothing where autocast is off."""
    state = autocast_state()
    if not state:
        yield
        return

    def wrap(inner):
        def call(*args, **kwargs):
            with autocast_on(state):
                return inner(*args, **kwargs)
        return call
    with _root_call(root, wrap), autocast_off():
        yield


def _either_road_as_eager(model: torch.nn.Module, root: torch.nn.Module, example_inputs: tuple,
                          counted: list | None = None, made: list | None = None, stored: list | None = None) -> tuple:
    assigned: list[tuple] = []  # state the forward replaced (on either road: `state_assigned`)
    kept = state_kept(root)
    try:
        if _shares_submodules(root):
            raise _NotThisRoad("a submodule registered under two names")
        watch = state_assigned()
        with kept, watch as assigned:
            gm, out_spec, applied = _aot_over_module(root, example_inputs)
        if kept.registered_changed and not assigned:
            raise _NotThisRoad("the trace left other parameters or buffers on the model")
    except Exception as direct:  # (what torch.export's tracing steers around, where the road above does not)
        try:
            kept, watch = state_kept(root), state_assigned()
            with kept, watch as assigned:  # (the hooks a forward registers, too)
                gm, out_spec, applied = _aot_over_export(root, example_inputs)
        except Exception as e:
            if isinstance(e, _DropsBackward):  # (the direct road's error is the one that says what went wrong)
                e = direct
            attrs = _tensor_attributes(model)
            captured = _captured_tensors(root.loss_fn, model) if isinstance(root, WithLoss) else []
            read = _forward_captured(model, str(e)) if "FakeTensor" in str(e) and not attrs else []
            named = ", ".join(f"`{a}`" for a in (attrs or captured)[:3]) + (
                " and others" if len(attrs or captured) > 3 else "")
            if read:
                shown = ", ".join(f"`{name}` ({where})" for where, name in read[:3]) + (
                    " and others" if len(read) > 3 else "")
                way_out = (f"the forward reads {shown}, a tensor of its globals or a closure's, not one of the "
                           "model's parameters or buffers nor an input, which is likely what the trace met: a training "
                           "graph takes tensors only so. Register it on the module that reads it "
                           "(`self.register_buffer(name, tensor, persistent=False)`, then `self.name`), or pass it as "
                           "an input")
            elif attrs and "FakeTensor" in str(e):
                way_out = (f"register {named} as {'buffers' if len(attrs) > 1 else 'a buffer'} "
                           "(`self.register_buffer(name, tensor, persistent=False)`): a training graph takes tensors "
                           "the model holds only as parameters or buffers")
            elif captured and "FakeTensor" in str(e):
                way_out = (f"the loss_fn reads {named}, a tensor it captured (not one of its inputs), and a training "
                           "graph takes tensors only as inputs, parameters or buffers: give the loss a module that "
                           "holds it (`loss_fn=nn.CrossEntropyLoss(weight=w)`, `nn.BCEWithLogitsLoss(pos_weight=w)`), "
                           "or make the loss_fn an nn.Module holding it as a buffer (`self.register_buffer('w', w)`)" +
                           (", or the module that holds it as a submodule (`self.loss = ...`)" if "." in named else ""))
            else:
                way_out = untraceable_way_out(e, model=model)
            raise SpmdError(untraceable_message(
                f"trace_joint: could not trace the forward+backward graph of {type(model).__name__}", e, way_out)) from e
    if counted is not None:
        counted += kept.counted
    if made is not None:
        made += watch.made
    if stored is not None:
        stored += watch.kept_with_grad
    return gm, out_spec, applied, assigned


def refuse_gradient_hooks(model: torch.nn.Module) -> None:
    """A hook registered on a parameter of the model (`p.register_hook`, `p.register_post_accumulate_grad_hook`)
    is the parameter's own: the compiled module holds new tensors (this rank's pieces), so the hook would never
    run, and the gradients it masks or scales, or the optimizer step it takes in backward, would not happen,
    silently. Refused, naming the parameters and the way out."""
    hooked = [name for name, p in model.named_parameters(remove_duplicate=False)
              if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)]
    if hooked:
        raise SpmdError(
            f"trace_joint: {len(hooked)} parameter(s) of {type(model).__name__} carry gradient hooks "
            f"({', '.join(hooked[:4])}{', ...' if len(hooked) > 4 else ''}: `register_hook` or "
            "`register_post_accumulate_grad_hook`). The compiled module trains its own pieces of the parameters, "
            "so these hooks would never run: the gradients they change, or the optimizer step they take in "
            "backward, would not happen. What to do: register the hooks after compiling, on the compiled "
            "module's parameters (`compiled.parameters()`: a hook there gets this rank's piece of the full "
            "gradient), and not on the model's.")


def _aot_over_export(root: torch.nn.Module, example_inputs: tuple) -> tuple:
    """The same through torch.export (non-strict) first, then AOTAutograd over the exported module: the
    road for what only torch.export's tracing handles. It inlines a custom Function's forward and drops its
    backward, so a model applying one fails here (the road above failed first)."""
    with custom_functions() as applied, _tensor_hooks() as hooked:
        ep = torch.export.export(root, example_inputs, strict=False)
    if applied or hooked or any(m._backward_hooks or m._backward_pre_hooks for m in root.modules()):
        raise _DropsBackward(applied)  # (so do gradient hooks: a plan from here would train otherwise than eager)
    with contextlib.ExitStack() as stack, fx_traceback.preserve_node_meta():
        joint = aot_export_joint_with_descriptors(stack, ep.module(), example_inputs, decompositions=_decompositions())
        return joint.graph_module, ep.module_call_graph[0].signature.out_spec, applied


_DISABLE_NOTES = ("_torchdynamo_disable", "_torchdynamo_disable_recursive", "_torchdynamo_disable_method")


def _drop_disable_notes(graph: torch.fx.Graph) -> None:
    """torch notes on every node traced while `is_exporting()` that the trace ran under `torch._dynamo.disable`
    (`meta["custom"]`); torch.export's own road drops them. Anything else the user annotated stays."""
    for n in graph.nodes:
        custom = n.meta.get("custom")
        if isinstance(custom, dict) and any(k in custom for k in _DISABLE_NOTES):
            custom = {k: v for k, v in custom.items() if k not in _DISABLE_NOTES}
            if custom:
                n.meta["custom"] = custom
            else:
                del n.meta["custom"]


def _captured_tensors(fn, model: torch.nn.Module | None = None) -> list[str]:
    """Names of the tensors a loss function reads besides its inputs: its closure's and globals' (a lambda's
    class weights), a `functools.partial`'s arguments, a loss module's plain attributes. Tensors alone first,
    then those of modules it reaches; not the traced `model`'s own (an L2 penalty over `model.parameters()`
    traces: found by a review)."""
    if isinstance(fn, torch.nn.Module):
        return _tensor_attributes(fn)
    if isinstance(fn, functools.partial):
        return [f"{k}=" for k, v in fn.keywords.items() if isinstance(v, torch.Tensor)] + [
            f"argument {k}" for k, v in enumerate(fn.args) if isinstance(v, torch.Tensor)]
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    own = set() if model is None else {id(t) for t in (*model.parameters(), *model.buffers())}

    def held(name: str, value) -> list[str]:
        """`name` itself, or the tensors of a module reached by it (a global `nn.CrossEntropyLoss(weight=w)` the
        function calls: found by a probe, whose refusal advised against data-dependent control flow)."""
        if isinstance(value, torch.Tensor):
            return [name] if id(value) not in own else []
        if isinstance(value, torch.nn.Module):
            return [f"{name}.{n}" for n, t in (*value.named_parameters(), *value.named_buffers()) if id(t) not in own] + [
                f"{name}.{n}" for n in _tensor_attributes(value)]
        return []

    values = list(_closure(fn).items())
    found = getattr(fn, "__globals__", {})
    values += [(n, found.get(n)) for n in code.co_names]
    return [t for name, v in values if isinstance(v, torch.Tensor) for t in held(name, v)] + [
        t for name, v in values if not isinstance(v, torch.Tensor) for t in held(name, v)]


def _forward_captured(model: torch.nn.Module, error: str) -> list[tuple[str, str]]:
    """(where, name) of the tensors the forwards of `model`'s modules load as globals or from their closures, once
    per module class (a module-level `K` in `F.conv1d(h, K)`: found by a probe; an inference graph holds it as a
    constant, and the training trace refused it with advice about control flow). Where torch's `error` names the
    sizes of the real tensors it met (`size=(6, 4, 3)`), only those of such a size."""
    import dis

    def loaded(code) -> set[str]:
        names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_DEREF")}
        for const in code.co_consts:  # (comprehensions and lambdas inside the forward)
            if hasattr(const, "co_code"):
                names |= loaded(const)
        return names

    def on_self(code) -> set[str]:
        """The attributes `code` reads from its first argument (`self.shuffle`)."""
        if not code.co_argcount:
            return set()
        ops = list(dis.get_instructions(code))
        return {b.argval for a, b in zip(ops, ops[1:]) if a.opname == "LOAD_FAST" and a.argval == code.co_varnames[0]
                and b.opname in ("LOAD_ATTR", "LOAD_METHOD")}

    def visit(fn, where: str, owner: type, depth: int, method: bool = True) -> None:
        fn = inspect.unwrap(getattr(fn, "__func__", fn))  # (a staticmethod's or classmethod's function)
        code = getattr(fn, "__code__", None)
        module = getattr(fn, "__module__", None) or ""
        if code is None or code in seen or module == "torch" or module.startswith("torch."):
            return
        seen.add(code)
        cells = _closure(fn)
        for name in sorted(loaded(code)):
            value = cells[name] if name in cells else fn.__globals__.get(name)
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                found.append((where, name, tuple(value.shape)))
            elif isinstance(value, types.FunctionType) and depth < 3:  # (a helper the forward calls, and its own)
                visit(value, f"{value.__qualname__}, called from {where.split(',')[0]}", owner, depth + 1, False)
        if method and depth < 3:  # (a method of the module's the forward calls: `self.shuffle(h)`)
            for name in sorted(on_self(code) - {"forward"}):
                attr = inspect.getattr_static(owner, name, None)
                if isinstance(attr, (types.FunctionType, staticmethod, classmethod)):
                    visit(attr, f"{owner.__name__}.{name}, called from {where.split(',')[0]}", owner, depth + 1)

    found, seen = [], set()
    for module in model.modules():
        forward = getattr(type(module), "forward", None)
        if forward is not None:
            visit(forward, f"{type(module).__name__}.forward", type(module), 0)
    sized = [f for f in found if f"size={f[2]}" in error]
    return [(where, name) for where, name, _ in (sized or found)]


def _closure(fn) -> dict:
    """The values `fn`'s closure holds, by name (not a cell not filled yet)."""
    values = {}
    for name, cell in zip(fn.__code__.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            values[name] = cell.cell_contents
        except ValueError:
            pass
    return values


def _tensor_attributes(model: torch.nn.Module) -> list[str]:
    """Paths of the tensors the model's modules hold as plain attributes (not parameters or buffers), alone or in a
    dict, list or tuple (peft's prompt tuning keeps `prompt_tokens = {"default": tensor}`: found by a probe, whose
    refusal then named nothing and advised against data-dependent control flow). A module's own parameter or
    buffer held again so (nn.RNN's `_flat_weights`) is none: a probe's packed-sequence GRU was told to register
    its own weights as buffers."""
    registered = {id(t) for t in (*model.parameters(), *model.buffers())}
    found = []
    for path, m in model.named_modules():
        for name, value in vars(m).items():
            at = f"{path}.{name}" if path else name
            if isinstance(value, torch.Tensor) and id(value) not in registered:
                found.append(at)
            elif isinstance(value, (dict, list, tuple)) and name not in _REGISTRIES:
                items = value.items() if isinstance(value, dict) else enumerate(value)
                found += [f"{at}[{key!r}]" for key, v in items if isinstance(v, torch.Tensor) and id(v) not in registered]
    return found


class _NotThisRoad(Exception):
    """The direct road cannot be trusted with this model: the road through torch.export traces it."""


def _shares_submodules(root: torch.nn.Module) -> bool:
    """One submodule registered under two names (ALBERT's shared layer, `self.b = self.a`). AOTAutograd over
    such a module swapped its parameters for its tracer's and did not put them all back (torch 2.13), which
    broke the model; torch.export traces it."""
    seen: set[int] = set()
    for _, m in root.named_modules(remove_duplicate=False):
        if id(m) in seen:
            return True
        seen.add(id(m))
    return False


class _DropsBackward(Exception):
    """torch.export inlined the forward of these custom Functions and dropped their backward (or the model
    has gradient hooks, which it drops too)."""


_hooks_here = threading.local()  # .open: the lists of this thread's open `_tensor_hooks`


def _register_hook_noted(self, hook):
    for hooked in getattr(_hooks_here, "open", ()):
        hooked.append(True)
    return _TENSOR_HOOKS.saved(self, hook)


_TENSOR_HOOKS = class_attribute_patch(torch.Tensor, "register_hook", _register_hook_noted)


def _tensor_hooks():
    """Whether the forward registers a gradient hook on a tensor (`tensor.register_hook`) while this is open, on
    this thread (a list that gets an entry per hook)."""
    return collecting(_TENSOR_HOOKS, _hooks_here, [])


def argument_names(model: torch.nn.Module, n: int, loss_fn=None) -> list[str]:
    """Names of the `n` example inputs: the model's own parameter names, then, with a loss_fn, the
    targets (`target_names`); `arg<i>` for a model without names."""
    n_targets = loss_targets(loss_fn) if loss_fn is not None else 0
    names = forward_names(model, n - n_targets)
    return names + target_names(loss_fn, n_targets, names)


def target_names(loss_fn, n_targets: int, taken) -> list[str]:
    """The loss's targets by its parameter names after the first (`def lm_loss(logits, labels)`: `labels`);
    `target0`, `target1`, ... for a loss without usable names or with names in `taken` (the model's inputs)."""
    if not n_targets:
        return []
    targets = positional(loss_fn)[1: 1 + n_targets]
    if len(targets) != n_targets or set(targets) & set(taken):
        targets = [f"target{i}" for i in range(n_targets)]
    return targets


_checkpoints_here = threading.local()  # .calls: this thread's innermost trace's list, else absent


def _checkpoints_patched() -> tuple:
    """torch.utils.checkpoint made to run its function through (`checkpoints_run_through`) on the threads tracing;
    returns what puts torch's own back."""
    import torch.utils.checkpoint as ckpt

    reentrant = ckpt.CheckpointFunction
    own_apply, torch_apply = reentrant.__dict__.get("apply"), reentrant.apply
    torch_generator = getattr(ckpt, "_checkpoint_without_reentrant_generator", None)

    def apply(cls, function, preserve_rng_state, *args):
        here = getattr(_checkpoints_here, "calls", None)
        if here is None:
            return torch_apply(function, preserve_rng_state, *args)
        here[0].append(here[1](function))
        here[0].reentrant = True
        ckpt.check_backward_validity(args)  # (torch's warning where none requires grad)
        grad = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        with _inside_checkpoint(), torch.set_grad_enabled(grad):
            return function(*args)

    def without_reentrant(function, *args, **kwargs):  # (checkpoint() runs it between its two steps)
        here = getattr(_checkpoints_here, "calls", None)
        if here is None:
            yield from torch_generator(function, *args, **kwargs)
            return
        here[0].append(here[1](function))
        with _inside_checkpoint():
            yield

    def norm_inside(module, args):
        here = getattr(_checkpoints_here, "calls", None)
        if here is not None and getattr(_checkpoints_here, "inside", 0) and module.training and \
                isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            here[0].norms.setdefault(here[1](module) or type(module).__name__, type(module).__name__)

    reentrant.apply = classmethod(apply)
    if torch_generator is not None:
        ckpt._checkpoint_without_reentrant_generator = without_reentrant
    hook = torch.nn.modules.module.register_module_forward_pre_hook(norm_inside)
    return reentrant, own_apply, torch_generator, hook


def _checkpoints_restored(saved: tuple) -> None:
    import torch.utils.checkpoint as ckpt

    reentrant, own_apply, torch_generator, hook = saved
    hook.remove()
    if own_apply is not None:
        reentrant.apply = own_apply
    else:
        del reentrant.apply
    if torch_generator is not None:
        ckpt._checkpoint_without_reentrant_generator = torch_generator


# (process-wide while any thread traces; only the tracing threads' checkpoints run through)
_CHECKPOINTS = SharedPatch(_checkpoints_patched, _checkpoints_restored)


@contextlib.contextmanager
def checkpoints_run_through(root: torch.nn.Module):
    """While this is open, `torch.utils.checkpoint.checkpoint(fn, *args)` on this thread calls `fn(*args)`, and
    what it yields lists each call's module under `root` (its path; "" where `fn` is no module's). Other
    threads' checkpoints work as torch's own. Its reentrant form (`use_reentrant=True`, torch's default
    where unset) runs `fn` under no_grad and differentiates it again inside its own backward, which
    AOTAutograd cannot trace: the trace fell back to torch.export's road, which inlined that no_grad
    forward, and the module compiled for training had no gradient at all (its first backward failed). The
    non-reentrant form's saved-tensor hooks (and a selective `context_fn`) are left out too: which layers
    backward runs again is the plan's to say (`find_recomputable_layers`: every layer, where the model
    checkpoints every one and no memory budget asks otherwise). The values are the same: checkpointing runs
    the same ops, with the random state it had in forward. Two differences from eager are kept apart: a
    reentrant checkpoint none of whose tensor arguments requires grad gives what it runs no gradient in eager
    (torch warns), so it runs under no_grad here too (a probe: a checkpointed stem trained only when compiled,
    3.3e-3 off after 3 steps); and eager updates a batch norm's running statistics twice per step inside a
    checkpoint (in forward and again in backward's recompute, pytorch/pytorch#96136), where the graph updates
    them once, which is said in a warning (found by a probe)."""
    paths = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    calls = _Calls(root)

    def owner(function) -> str:
        """The path of the module `function` runs: the module, its bound method, or transformers'
        `partial(forward, layer, **kwargs)`."""
        for candidate in (function, getattr(function, "__self__", None), getattr(function, "func", None),
                          *getattr(function, "args", ())[:1]):
            if isinstance(candidate, torch.nn.Module) and id(candidate) in paths:
                return paths[id(candidate)]
            if getattr(candidate, "__self__", None) is not None and id(candidate.__self__) in paths:
                return paths[id(candidate.__self__)]
        return ""

    with _CHECKPOINTS:
        outer = getattr(_checkpoints_here, "calls", None)
        _checkpoints_here.calls = (calls, owner)
        try:
            yield calls
            if calls.norms:
                named = ", ".join(f"`{path.removeprefix(_PREFIX) if isinstance(root, WithLoss) else path}` ({kind})"
                                  for path, kind in list(calls.norms.items())[:3])
                warnings.warn(
                    f"{named}{' and more' if len(calls.norms) > 3 else ''} update{'s' if len(calls.norms) == 1 else ''} "
                    "running statistics inside torch.utils.checkpoint: eager PyTorch updates them twice per training step there (in forward, and "
                    "again when backward recomputes the checkpointed part; pytorch/pytorch#96136), the compiled module "
                    "once, as without checkpointing. Losses and gradients are the same; the running statistics (and "
                    "num_batches_tracked) differ from an eager run's.")
        finally:
            _checkpoints_here.calls = outer
            if outer is None:
                del _checkpoints_here.calls


class _Calls(list):
    """The paths of the modules checkpoints ran (`checkpoints_run_through`), whether one was reentrant, each
    batch norm updating its statistics inside one (path -> class), and the buffers written in place inside one
    (`updated`: paths under `root`, whose in-place updates eager makes twice)."""

    reentrant = False

    def __init__(self, root: torch.nn.Module):
        super().__init__()
        # (path, module, key) of each buffer, walked once: read at every checkpointed call (a review: a walk of the
        # tree per call grew as layers x buffers)
        self._slots = [(f"{path}.{key}" if path else key, module, key)
                       for path, module in root.named_modules(remove_duplicate=False) for key in module._buffers]
        self.norms: dict[str, str] = {}
        self.updated: set[str] = set()

    def buffers(self):
        """(path, tensor) of every buffer under the root, as the trace holds them now."""
        return [(path, b) for path, module, key in self._slots if (b := module._buffers.get(key)) is not None]


@contextlib.contextmanager
def _inside_checkpoint():
    """Counts, on this thread, the checkpointed calls running (`checkpoints_run_through`'s batch norm watch),
    and adds the buffers the call writes in place to `_Calls.updated`: their version counters move (the traced
    buffers' too), whichever module's code writes them, and only then (a parent's update of its child's buffer
    outside the child's checkpoint is none)."""
    calls = _checkpoints_here.calls[0]
    before = {name: _writes(b) for name, b in calls.buffers()}
    _checkpoints_here.inside = getattr(_checkpoints_here, "inside", 0) + 1
    try:
        yield
    finally:
        _checkpoints_here.inside -= 1
        calls.updated.update(name for name, b in calls.buffers() if name in before and _writes(b) != before[name])


def _writes(t: torch.Tensor) -> tuple[int, int]:
    """What moves when `t` is written in place: its version counter, and where the trace gives it as a functional
    tensor, its storage's mutation counter too (a write through `.data` gets a fresh version counter and moved
    none: a review)."""
    inner = getattr(t, "elem", None)
    functional = isinstance(inner, torch.Tensor) and torch._is_functional_tensor(inner)
    return t._version, torch._functionalize_mutation_counter(inner) if functional else 0


_functions_here = threading.local()  # .open: the sets of this thread's open `custom_functions`


def _apply_noted(cls, *args, **kwargs):
    if not cls.__module__.startswith("torch."):  # (torch's own, a higher-order op's autograd, export keeps)
        for applied in getattr(_functions_here, "open", ()):
            applied.add(cls.__qualname__)
    return _FUNCTION_APPLY.saved.__func__(cls, *args, **kwargs)


_FUNCTION_APPLY = class_attribute_patch(torch.autograd.Function, "apply", classmethod(_apply_noted))


def custom_functions():
    """The names of the user's `torch.autograd.Function`s the model applies on this thread while this is open.
    torch.export (non-strict) inlines their forward and drops their backward; AOTAutograd over the module itself
    keeps the backward they define (`trace_joint`'s first road; its second, through torch.export, refuses them).
    (`Function.apply` is patched process-wide while any thread traces; another thread's Functions are not this
    trace's: before, a model compiled in one thread was taken to apply the Functions of one another compiled.)"""
    return collecting(_FUNCTION_APPLY, _functions_here, set())


_masked_here = threading.local()  # .open: this thread's open traces (only these rewrite)


def _masked_writes_as_where():
    """While this is open, on this thread, `x[mask] = v` (a bool mask over x's first dims, `v` a tensor of x's dtype
    with a gradient, the same for every position the mask picks: it broadcasts to one position's shape) runs as
    `x.copy_(torch.where(mask, v, x))`, the same values and gradients. Its own backward (`index_put` by a bool
    mask) finds the picked positions for v's gradient with `nonzero`, a shape from the mask's values, which a
    training graph cannot hold (found by a probe: Wav2Vec2's SpecAugment,
    `hidden_states[mask_time_indices] = self.masked_spec_embed`, refused in training). Anything else goes as it is.
    (`Tensor.__setitem__` itself, set process-wide while any thread traces: not a TorchFunctionMode, whose frame
    sits under every op, and which torch named as the cause of every data-dependent failure.)"""
    return collecting(_MASKED_WRITES, _masked_here, object())


def _set_masked_as_where(x, index, value):
    mask = index[0] if isinstance(index, tuple) and len(index) == 1 else index
    if not getattr(_masked_here, "open", ()) or not _picks_rows(x, mask, value):
        return (_MASKED_WRITES.saved or torch._C.TensorBase.__setitem__)(x, index, value)
    where = mask.reshape(tuple(mask.shape) + (1,) * (x.dim() - mask.dim()))
    if torch._C._is_alias_of(value, x):  # (a part of x, `h[mask] = h[0, 0]`: read before the write, as eager reads
        value = value.clone()            # it; where eager refuses an overlap, it then writes what it read)
    x.copy_(torch.where(where, value, x))


# (a setitem of torch's own subclass, or a user's, set before: kept, called, and put back)
_MASKED_WRITES = class_attribute_patch(torch.Tensor, "__setitem__", _set_masked_as_where)


def _picks_rows(x, mask, value) -> bool:
    """Whether `x[mask] = value` writes one value over every position a bool `mask` of x's first dims picks, where
    eager would write it (no error of its own to keep: the dtypes match, x's elements are each its own memory and
    the mask is on x's device)."""
    if not (isinstance(x, torch.Tensor) and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
            and 0 < mask.dim() <= x.dim() and tuple(mask.shape) == tuple(x.shape[:mask.dim()])
            and mask.device == x.device):
        return False
    if not isinstance(value, torch.Tensor) or not value.requires_grad or value.dtype != x.dtype:
        return False
    rest = tuple(x.shape[mask.dim():])
    shape = tuple(value.shape)
    if len(shape) == len(rest) + 1 and shape[0] == 1:  # (a leading 1 for the picked positions)
        shape = shape[1:]
    if len(shape) > len(rest) or not all(a == 1 or a == b for a, b in zip(reversed(shape), reversed(rest))):
        return False
    return torch._debug_has_internal_overlap(x) == 0  # (an expanded x: eager warns and writes; copy_ refuses)


class _StackTraces(TorchFunctionMode):
    """Every traced op carries the Python stack of the torch call that made it, as torch.export's
    `stack_trace` has it (for our error messages and dumps): the frames outside torch, outermost first,
    each `File "path", line n, in fn` and its code, from the model's forward in (not the frames that called
    the trace). Formatted once per call site (the same frames
    recur across layers): `traceback.format_stack` at each call cost a third of tracing LLaMA3-8B."""

    def __init__(self):
        super().__init__()
        self._formatted: dict[tuple, str] = {}
        # the frames that called the trace: not the model's, so not recorded. Held while the trace runs, so
        # that no frame made during it takes the address of one (contextlib's `__enter__` ends before it)
        self._held, frame = [], sys._getframe(1)
        while frame is not None:
            self._held.append(frame)
            frame = frame.f_back
        self._callers = {id(f) for f in self._held}

    def release(self) -> None:
        self._held, self._callers = [], set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        fx_traceback.current_meta["stack_trace"] = self._text()
        return func(*args, **(kwargs or {}))

    @torch._dynamo.disable  # (inside a submodule the user torch.compile'd, dynamo would trace this and guard on
    def _text(self) -> str:  # the cache's keys of code objects: ~25 lines of guard errors per compile; a probe)
        sites, frame = [], sys._getframe(1)
        while frame is not None and id(frame) not in self._callers:
            code = frame.f_code
            if not code.co_filename.startswith(TORCH_DIR + os.sep) and code is not _MODE_CODE:
                sites.append((code, frame.f_lineno))
            frame = frame.f_back
        key = tuple(sites)
        text = self._formatted.get(key)
        if text is None:
            text = self._formatted[key] = "".join(
                f'  File "{code.co_filename}", line {line}, in {code.co_name}\n'
                f'    {linecache.getline(code.co_filename, line).strip()}\n' for code, line in reversed(sites))
        return text


_MODE_CODE = _StackTraces.__torch_function__.__code__


@contextlib.contextmanager
def source_meta(root: torch.nn.Module):
    """While AOTAutograd traces `root` itself (not an exported graph), record on each forward node what
    torch.export records: `nn_module_stack` ({key: (module path, class)}, outermost first) and
    `stack_trace`. Needs `fx_traceback.preserve_node_meta()`: the tracer copies `current_meta` onto
    each node it makes."""
    stack: list[tuple[str, str]] = []

    def publish():
        if stack:
            fx_traceback.current_meta["nn_module_stack"] = {f"L__self__{p}": (p, t) for p, t in stack}
        else:  # (outside the model, as the backward's nodes and the placeholders are)
            fx_traceback.current_meta.pop("nn_module_stack", None)

    def enter(module, path):
        stack.append((path, f"{type(module).__module__}.{type(module).__qualname__}"))
        publish()

    def leave(*_):
        stack.pop()
        publish()

    handles = []
    for path, module in root.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, args, path=path: enter(m, path)))
        handles.append(module.register_forward_hook(leave))
    mode = _StackTraces()
    try:
        with mode:
            yield
    finally:
        mode.release()
        for h in handles:
            h.remove()
        fx_traceback.current_meta.pop("nn_module_stack", None)
        fx_traceback.current_meta.pop("stack_trace", None)


def _backward_meta_from_forward(graph: torch.fx.Graph) -> None:
    """As torch.export's road leaves them: a backward node has no module stack of its own (AOTAutograd
    put the forward one in `fwd_nn_module_stack`) and the stack trace of the forward op it differentiates."""
    forward_trace = {}
    for n in graph.nodes:  # (the first op of a number made its autograd node: the ops after it that make none,
        # as a rotary cache built after the embedding, carry the same number until the next one is made)
        if n.meta.get("partitioner_tag") == "is_forward" and "seq_nr" in n.meta and n.meta.get("stack_trace"):
            forward_trace.setdefault(n.meta["seq_nr"], n.meta["stack_trace"])
    for n in graph.nodes:
        if n.meta.get("partitioner_tag") == "is_backward":
            n.meta.pop("nn_module_stack", None)
            n.meta["stack_trace"] = forward_trace.get(n.meta.get("seq_nr"), n.meta.get("stack_trace"))
