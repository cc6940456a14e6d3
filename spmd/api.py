"""The public entry points: `init_mesh` and `compile`."""
from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.distributed as dist

from spmd.errors import SpmdError
from spmd.explain import keep_sources
from spmd.mesh import MeshSpec
from spmd.passes.enumerate_strategies import Pins
from spmd.pipeline import Compilation, run_pipeline


def init_mesh(shape: Sequence[int], axis_names: Sequence[str], device_type: str | None = None):
    """Start the process group if needed (NCCL on CUDA, gloo on CPU) and return a torch DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(shape)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise SpmdError("init_mesh: no process group and no torchrun environment (RANK unset). What to do: "
                            f"launch with `torchrun --nproc-per-node {torch.Size(shape).numel()} script.py`.")
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    world = dist.get_world_size()
    need = 1
    for s in shape:
        need *= s
    if need != world:
        raise SpmdError(f"init_mesh: mesh {shape} needs {need} processes but the world has {world}. What to do: "
                        f"launch with `torchrun --nproc-per-node {need}` or choose a mesh whose sizes multiply to {world}.")
    return init_device_mesh(device_type, shape, mesh_dim_names=tuple(axis_names))


def _check_mesh(mesh) -> None:
    if dist.is_initialized() and mesh.size() != dist.get_world_size():
        raise SpmdError(f"compile: the mesh has {mesh.size()} ranks but the world has {dist.get_world_size()}. "
                        "What to do: build the mesh over all ranks (spmd.init_mesh).")


def _agree_with_rank0(values):
    """Every rank takes rank 0's solution vector (ties between optimal plans are broken by the solver
    differently in different processes; see solve_placements)."""
    box = [(len(values), values)]
    dist.broadcast_object_list(box, src=0)
    n, chosen = box[0]
    if n != len(values):
        from spmd.errors import SpmdInternalError

        raise SpmdInternalError(f"rank {dist.get_rank()} built a placement problem with {len(values)} variables, "
                                f"rank 0 one with {n}: the ranks traced different graphs")
    return chosen


def compile(model: torch.nn.Module, mesh, example_inputs: tuple, *, in_placements: dict | None = None,
            param_placements: dict | None = None, out_placements: dict | Sequence | None = None,
            mesh_spec: MeshSpec | None = None, dump_dir: str | None = None, loss_fn=None,
            training: bool | None = None, memory_budget: float | None = None,
            optimizer_state_factor: float = 2.0, stamp_layers: bool = False):
    """Partition `model` over `mesh` and return this rank's `CompiledModule`.

    example_inputs: full-size inputs, the same on every rank (they fix the shapes the plan is for).
    in_placements / param_placements: pins by input argument name / parameter FQN, each a list with one
    placement per mesh axis. out_placements: pins by output index. mesh_spec: the link and device
    profiles to plan with (default: those of the mesh's backend).
    loss_fn: `loss_fn(model(*inputs), *targets)`: the trailing inputs are targets (as many as loss_fn has
    required parameters after the first); `compiled(*inputs, *targets)` returns the loss.
    training: compile the joint forward+backward graph so outputs support `.backward()` (default: True
    when a loss_fn is given).
    memory_budget: bytes per rank the plan's predicted peak (parameters, gradients, optimizer state,
    saved activations, inputs) must fit in; optimizer_state_factor: optimizer state per parameter in
    parameter sizes (AdamW 2, SGD with momentum 1, plain SGD 0).
    stamp_layers: trace only the first few of each stack of 8 or more identical layers and copy the
    rest (passes/stamp_layers.py): tracing a deep model gets several times faster. Off by default here,
    because a forward that reads its own depth (`len(self.layers)` in an expression) would be compiled
    with the traced depth; `spmd.plan` stamps by default.
    """
    from spmd.runtime.compiled import CompiledModule

    _check_mesh(mesh)
    spec = mesh_spec or MeshSpec.from_device_mesh(mesh)
    if tuple(spec.shape) != tuple(mesh.shape):
        raise SpmdError(f"compile: mesh_spec {spec} does not match the mesh shape {tuple(mesh.shape)}")
    if isinstance(out_placements, (list, tuple)):
        out_placements = dict(enumerate(out_placements))
    pins = Pins(dict(in_placements or {}), dict(param_placements or {}), dict(out_placements or {}))
    rank = mesh.get_rank() if dist.is_initialized() else 0
    groups = tuple(mesh.get_group(i).group_name for i in range(mesh.ndim))
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    device = None
    if mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    training = loss_fn is not None if training is None else training
    if loss_fn is not None and not training:
        raise SpmdError("compile: a loss_fn only makes sense with training=True")
    c = run_pipeline(Compilation(model, example_inputs, spec, pins, rank, groups, device=device,
                                 training=training, loss_fn=loss_fn, memory_budget=memory_budget,
                                 optimizer_state_factor=optimizer_state_factor, device_mesh=mesh,
                                 agree=_agree_with_rank0 if dist.is_initialized() else None,
                                 stamp_layers=stamp_layers),
                     dump_dir)
    return CompiledModule(c)


def fake_model(model: torch.nn.Module, example_inputs: tuple = ()) -> tuple[torch.nn.Module, tuple]:
    """A copy of a model built on the meta device (`with torch.device("meta"): model = Build(...)`) whose
    parameters, buffers and inputs are CPU fake tensors: shapes and dtypes only, no memory, so a 60B
    model is planned on a laptop. Meta tensors themselves do not do: kernels pick different
    implementations on meta (no fused CPU attention) and the joint graph loses its forward/backward
    split. Real tensors are left as they are."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t):
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return t
        with mode:
            return torch.empty(t.shape, dtype=t.dtype, device="cpu")

    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())) and \
            not any(isinstance(t, torch.Tensor) and t.is_meta for t in example_inputs):
        return model, tuple(example_inputs)
    import copy

    model = copy.deepcopy(model)  # meta: no data to copy
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                module._parameters[name] = torch.nn.Parameter(fake(p), requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = fake(b)
    return model, tuple(fake(t) for t in example_inputs)


def plan(model: torch.nn.Module, mesh_spec: MeshSpec, example_inputs: tuple, *, in_placements=None,
         param_placements=None, out_placements=None, dump_dir: str | None = None, loss_fn=None,
         training: bool | None = None, memory_budget: float | None = None, optimizer_state_factor: float = 2.0,
         tie_blocks: bool | None = None, merge_followers: bool | None = None, stamp_layers: bool = True):
    """Run the pipeline up to the plan with no processes at all; returns the `Plan`.

    A model and inputs on the meta device are planned through fake tensors (see `fake_model`).
    tie_blocks: identical layers get identical placements, which keeps the solve one layer deep (see
    passes/find_repeated_blocks.py); False solves every layer separately; None (default) ties layers
    that repeat at least 4 times. merge_followers: single-input ops follow their input's placement instead of
    choosing their own (passes/merge_followers.py: an approximation that shrinks the solve); None
    (default) does it only on graphs of more than 1500 ops. stamp_layers: a stack of 8 or more identical
    layers is traced 3 layers deep and the middle one copied up to full depth (passes/stamp_layers.py;
    the graph is the one a full trace gives); False traces every layer."""
    if isinstance(out_placements, (list, tuple)):
        out_placements = dict(enumerate(out_placements))
    pins = Pins(dict(in_placements or {}), dict(param_placements or {}), dict(out_placements or {}))
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    training = loss_fn is not None if training is None else training
    from spmd.cost_model.symbolic import Replanner

    replanner = Replanner(model, example_inputs, mesh_spec, dict(
        in_placements=in_placements, param_placements=param_placements, out_placements=out_placements,
        loss_fn=loss_fn, training=training, memory_budget=memory_budget,
        optimizer_state_factor=optimizer_state_factor, tie_blocks=tie_blocks, merge_followers=merge_followers,
        stamp_layers=stamp_layers))
    model, example_inputs = fake_model(model, example_inputs)
    c = run_pipeline(Compilation(model, example_inputs, mesh_spec, pins, training=training, loss_fn=loss_fn,
                                 memory_budget=memory_budget, optimizer_state_factor=optimizer_state_factor,
                                 tie_blocks=tie_blocks, merge_followers=merge_followers,
                                 stamp_layers=stamp_layers, plan_only=True),
                     dump_dir)
    c.plan.replanner = replanner  # plan.cost_formula and plan.crossover ask again at other batch sizes
    return keep_sources(c)  # plan.explain() and plan.visualize() read the graph and the solver's tables
