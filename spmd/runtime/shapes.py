"""What a compiled module runs for one set of input shapes (`Shapes`), and how it compiles another set over the
same pieces (`pinned_to`, `check_shared`).

A plan is for the shapes it was compiled with. An epoch's smaller last batch (a DataLoader's drop_last=False) or
bucketed sequence lengths come with others. A second `spmd.compile` would hold weights of its own, which the
optimizer over the first module's does not step. So `shard_inputs`, given full inputs of other shapes (same
dtypes and ranks), compiles the model again for them, with every parameter and buffer pinned to the layout the
first plan gave it, and the inputs to theirs where they still divide: the new graphs read the first module's
pieces, and their gradients land in its `.grad`. A call given pieces of other shapes (each rank's slice from a
data-parallel loader, whose last batch is smaller on every rank) compiles for the full shapes they are pieces
of, in the first plan's input layouts. Up to `MAX_VARIANTS` are kept, each compiled once.

    Before: the first compilation, and full inputs of other shapes.
    After: a `Shapes` whose graphs take the same state arguments, in the same order and local shapes, as the
    first's; or an `SpmdError` saying why not, with the way out (pad the batch).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch.utils._pytree import tree_unflatten

from spmd.core.errors import SpmdError
from spmd.core.specs import is_even, placements_str, shard_factor
from spmd.runtime.inputs import InputSpec, LocalCheck

# the ways out where other shapes are not compiled for (a probe found the epoch's-last-batch paragraph, which
# says a module compiled for the size would hold weights of its own, confusing here)
PAD_OR_DROP = (
    "pad the batch to shapes this module runs (the compiled ones, or others it was compiled for), with its padded "
    "targets at the loss's ignore_index (a mean cross-entropy then leaves those rows out), or drop it "
    "(a DataLoader's drop_last=True).")

# the same for a module compiled without training (serving): no targets, and nothing is dropped (a probe got the
# training words for a batch of 1 served after one of 2)
PAD_FOR_INFERENCE = (
    "pad the batch to shapes this module runs (the compiled ones, or others it was compiled for) and drop the "
    "padded rows from the outputs; batch sizes served in another order may run (a batch of 1 first is not split, "
    "and a batch of 2 split in 2 is then the one refused).")

MAX_VARIANTS = 8  # (as torch.compile's cache_size_limit: past it, shapes vary by more than buckets do)


def _pad(shapes: Shapes) -> str:
    """The way out for shapes this module cannot take: padding, worded for training or for serving."""
    return PAD_OR_DROP if shapes.split is not None else PAD_FOR_INFERENCE


@dataclass
class Shapes:
    """One set of input shapes' graphs and layouts: `graph_module` (inference) or `split` (training), the inputs'
    specs and their check, and the outputs' structure, layouts and gradients."""
    key: tuple  # the full inputs' shapes
    graph_module: torch.fx.GraphModule
    split: object  # SplitGraphs when compiled for training, else None
    input_specs: list[InputSpec]
    check: LocalCheck
    out_spec: object
    out_placements: dict[int, tuple]  # output position -> its layout
    differentiable: tuple[int, ...]  # the outputs that get a gradient (their tangents, in order)
    refused_grads: dict[int, str]  # outputs beside the model's own loss, whose gradient is refused
    buffer_updates: list[tuple[int, str]]  # an inference graph's new buffer values: (position, FQN)
    user_outputs: list[int]  # an inference graph's user outputs, by position
    traced_with_grad: set[str]  # the inputs whose gradient the graph computes
    input_flags: tuple[bool, ...]  # each input's requires_grad in the trace (a forward may branch on it)
    state: tuple  # (FQN, placements) of each state argument, in order
    order: tuple[str, ...]  # FQN or input name per placeholder (tangents left out)
    plan: object  # the plan these graphs run, as the module shows it (spmd.compile's report, which explains itself)
    graphs: dict = field(default_factory=dict)  # torch.compile'd graphs, made at first use (`CompiledModule._graph`)
    emptying: dict = field(default_factory=dict)  # graphs that empty their argument list (`_run_emptying`)
    laid_out: dict | None = None  # output position -> its layout as `CompiledModule._lay_out` records it

    @classmethod
    def of(cls, c, mesh, rank: int, device, plan) -> "Shapes":
        specs, state, order = [], [], []
        for gi in c.traced.inputs:
            if gi.kind == "tangent":
                continue
            ps = c.plan.choices[gi.placeholder].outputs[0]
            info = c.traced.tensor_info[gi.placeholder]
            order.append(gi.name)
            if gi.kind == "input":
                specs.append(InputSpec(gi.name, ps, tuple(info.shape), info.dtype))
            else:
                state.append((gi.name, tuple(ps)))
        outputs = tuple(c.traced.output_kinds())
        return cls(
            key=tuple(s.shape for s in specs), graph_module=c.rank_gm, split=c.split, input_specs=specs,
            check=LocalCheck(specs, mesh, rank, device), out_spec=c.traced.out_spec,
            out_placements={int(name.rsplit("_", 1)[1]): ch.inputs[0] for name, ch in c.plan.choices.items()
                            if name.startswith("output_") and name.rsplit("_", 1)[1].isdigit()},
            differentiable=tuple(int(gi.name.rsplit("_", 1)[1]) for gi in c.traced.inputs if gi.kind == "tangent"),
            refused_grads=_other_outputs(c) if c.traced.joint and c.options.loss_fn is None else {},
            buffer_updates=[(k, o.name) for k, o in enumerate(outputs) if o.kind == "buffer_update"],
            user_outputs=[k for k, o in enumerate(outputs) if o.kind == "output"],
            traced_with_grad={o.name for o in outputs if o.kind == "input_grad"},
            input_flags=requires_grad_flags(c.example_inputs),
            state=tuple(state), order=tuple(order), plan=plan)


def requires_grad_flags(inputs: tuple) -> tuple[bool, ...]:
    """Each of `inputs`' `requires_grad` (False for what is not a tensor)."""
    return tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)


def variant_key(flat: tuple, first: Shapes) -> tuple | None:
    """The shapes of full inputs `flat` another `Shapes` would be compiled for, or None where they are not such
    inputs (`_alike`) or are the first's."""
    if not _alike(flat, first):
        return None
    key = tuple(tuple(t.shape) for t in flat)
    return key if key != first.key else None


def full_key(pieces: tuple, first: Shapes, mesh_shape: tuple[int, ...]) -> tuple | None:
    """The full shapes of which `pieces` (a call's inputs: each rank's slice from a data-parallel loader, or whole
    inputs the plan replicates) are this rank's pieces, laid out as `first` lays out its inputs; None where they
    are not such pieces (`_alike`, and no DTensor) or are the first's."""
    if not _alike(pieces, first) or any(hasattr(t, "_local_tensor") for t in pieces):
        return None
    key = tuple(tuple(n * shard_factor(s.placements, mesh_shape, d) for d, n in enumerate(t.shape))
                for t, s in zip(pieces, first.input_specs))
    return key if key != first.key else None


def _alike(tensors: tuple, first: Shapes) -> bool:
    """A tensor for each of `first`'s inputs, of its dtype and number of dims."""
    return len(tensors) == len(first.input_specs) and all(
        isinstance(t, torch.Tensor) and t.dtype == s.dtype and t.ndim == len(s.shape)
        for t, s in zip(tensors, first.input_specs))


def pinned_to(options, first: Shapes, key: tuple, mesh_shape: tuple[int, ...]):
    """`options` with every parameter and buffer pinned to its layout in `first`, and each input to its layout
    there where that still divides its new shape; else left to the plan (the user's pin on it, met by that
    layout, is for the compiled shape: a batch of 5 cannot be split in 2). A plan given to the first compile
    (`PlanOptions.plan`) is for its shapes: the new ones are solved."""
    inputs = dict(options.in_placements or {})
    for spec, shape in zip(first.input_specs, key):
        if is_even(shape, spec.placements, mesh_shape):
            inputs[spec.name] = list(spec.placements)
        else:
            inputs.pop(spec.name, None)
    return replace(options, plan=None, param_placements={**dict(options.param_placements or {}),
                                              **{fqn: list(ps) for fqn, ps in first.state}},
                   in_placements=inputs)


def check_shared(variant: Shapes, first: Shapes, taken: list[Shapes]) -> None:
    """Refuse a variant whose graphs would not read the first module's pieces as they are, or whose inputs' local
    shapes another's take too (a call could not tell which graphs it is for)."""
    why = None
    if variant.order != first.order:
        moved = sorted(set(variant.order) ^ set(first.order))
        why = (f"its graph reads other parameters or buffers ({', '.join(moved[:4])})" if moved else
               "its graph takes its parameters and buffers in another order")
    elif variant.state != first.state:
        (fqn, ps), was = next((a, b) for a, b in zip(variant.state, first.state) if a != b)
        why = f"{fqn} would be laid out as {placements_str(ps)}, where the module holds it as {placements_str(was[1])}"
    else:
        clash = next((t for t in taken if t.check.expected == variant.check.expected), None)
        if clash is not None:
            why = (f"on this rank its inputs' pieces would have the shapes of those of the inputs "
                   f"{_shapes(clash.key)}, so a call could not tell the two apart")
    if why is not None:
        raise SpmdError(f"shard_inputs: inputs of the shapes {_shapes(variant.key)}, where the module was compiled for "
                        f"{_shapes(first.key)}, cannot run over this module's pieces: {why}. What to do: "
                        f"{_pad(first)}")


def check_room(key: tuple, first: Shapes, taken: int) -> None:
    """Refuse a set of shapes past `MAX_VARIANTS` others (`taken`)."""
    if taken < MAX_VARIANTS:
        return
    raise SpmdError(
        f"shard_inputs: inputs of the shapes {_shapes(key)}: this module was compiled for {taken + 1} set(s) of "
        f"input shapes already (the first {_shapes(first.key)}), each a compilation of its own, and takes no more "
        f"(`spmd.runtime.shapes.MAX_VARIANTS` others). What to do: bucket the shapes: {_pad(first)} To generate "
        "token by token, run one buffer of the longest length, right-padded, with its attention mask at every step "
        "(docs/huggingface.md, \"Generation\"). Or raise the limit before the call, "
        "`spmd.runtime.shapes.MAX_VARIANTS = n`: each set of shapes costs a compile and keeps its graphs.")


def verify_refusal(key: tuple, first: Shapes, runs: bool) -> SpmdError:
    """`verify` given full inputs of other shapes than the compiled ones (`runs`: the module was compiled for
    them since): it checks the compiled shapes' graphs (a probe got shard_inputs' words, to recompile)."""
    how = ("runs them too, in graphs compiled for them since over the same weights" if runs else
           "would compile for them at their first cut (`shard_inputs`), over the same weights")
    return SpmdError(
        f"verify: inputs of the shapes {_shapes(key)}, where the module was compiled for {_shapes(first.key)}: verify "
        f"checks the compiled shapes' graphs against one device; this module {how}. What to do: verify with a "
        f"batch of the compiled shapes ({_shapes(first.key)}); the graphs of other shapes are planned from the same "
        "model with the same parameter layouts.")


def _shapes(key: tuple) -> str:
    return ", ".join(str(list(s)) for s in key)


def _other_outputs(c) -> dict[int, str]:
    """{flat position: name} of the outputs beside a model's own `loss` (a ModelOutput's `logits`,
    `hidden_states[0]`, ...), which the trace detached (`compiler.call._loss_only`); {} where the output has no
    loss."""
    from torch.utils._pytree import keystr, tree_flatten_with_path

    positions = tree_unflatten(list(range(c.traced.out_spec.num_leaves)), c.traced.out_spec)
    loss = getattr(positions, "loss", None)
    if not isinstance(loss, int):
        return {}
    return {k: "out" + keystr(path) for path, k in tree_flatten_with_path(positions)[0] if k != loss}
