"""The public entry points: `init_mesh`, `compile` and `plan`.

Both `compile` and `plan` take the plan's options as keyword arguments: every field of `PlanOptions`
(in_placements, param_placements, out_placements, loss_fn, training, memory_budget,
optimizer_state_factor, tie_blocks, merge_followers, stamp_layers, bucket_bytes, defer_waits, dump_dir,
verify), or a ready `options=PlanOptions(...)` with keywords on top.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import warnings
from typing import Sequence

import torch
import torch.distributed as dist

from spmd.compiler.agreement import weights_summary
from spmd.compiler.call import positional_call
from spmd.compiler.given_plan import was_stamped
from spmd.compiler.meta import fake_model, is_meta
from spmd.compiler.options import PlanOptions, RankBinding
from spmd.compiler.pipeline import collector_paused, run_pipeline
from spmd.core.errors import SpmdError
from spmd.core.mesh import MeshSpec, host_id, record_hosts
from spmd.core.plan import Plan
from spmd.report import plan_io
from spmd.report.result import PlanReport, report_of
from spmd.report.whatif import Request
from spmd.runtime import source_guard
from spmd.runtime.agreement import Rendezvous
from spmd.runtime.compiled import CompiledModule, compiled_module_class, graph_backend
from spmd.runtime.host import host_cpu_profile
from spmd.runtime.meshes import cached_meshes, device_mesh


DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


def init_mesh(shape: Sequence[int], axis_names: Sequence[str], device_type: str | None = None,
              timeout: datetime.timedelta | None = None):
    """Start the process group if needed (NCCL on CUDA, gloo on CPU) and return a torch DeviceMesh.

    timeout: how long a collective may wait for its peers before it fails (with an error naming it,
    `SpmdCollectiveError`). torch's default is 30 minutes for gloo, 10 for NCCL: a rank that hangs
    would block the others that long. Five minutes covers a compile (ranks wait for each other at
    its start) and a training step; raise it for steps or checkpoints that take longer. A process group
    the user started keeps its own timeout unless `timeout` is given: then it takes this one (it was
    ignored there, found by a probe: a rank that stopped left the others waiting 30 minutes, not 10 s).

    Asking again for the same shape and axis names returns the same mesh (torch's init_device_mesh
    would make new process groups each time: runtime/meshes.py)."""
    shape = tuple(shape)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise SpmdError("init_mesh: no process group and no torchrun environment (RANK unset). What to do: "
                            f"launch with `torchrun --nproc-per-node {torch.Size(shape).numel()} script.py`.")
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timeout or DEFAULT_TIMEOUT)
    else:
        if timeout is not None:
            _set_timeout(timeout)
        if device_type == "cuda" and "LOCAL_RANK" in os.environ and not torch.cuda.is_initialized():
            # (a process group the user started without choosing a GPU: the comparison below runs on the current
            # device, which would be cuda:0 on every rank; torch's DeviceMesh picks LOCAL_RANK's as this does)
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    world = dist.get_world_size()
    if world > 1:  # (every rank asks for the same mesh: nodes started with other meshes waited in the groups' creation)
        # (and where each rank runs: which ranks share a machine, for the links' and the cores' prices; srun and
        # mpirun set no LOCAL_WORLD_SIZE)
        gathered = [None] * world
        dist.all_gather_object(gathered, (shape, tuple(axis_names), device_type, host_id()))
        record_hosts([g[3] for g in gathered])
        asked = [g[:3] for g in gathered]
        apart = [r for r, a in enumerate(asked) if a != asked[0]]
        if apart:
            shown = lambda a: f"{dict(zip(a[1], a[0]))} on {a[2]}"  # noqa: E731
            raise SpmdError(f"init_mesh: the ranks asked for different meshes: rank {apart[0]} "
                            f"{shown(asked[apart[0]])}, rank 0 {shown(asked[0])} (ranks that differ from rank 0: "
                            f"{apart[:8]}{' ...' if len(apart) > 8 else ''}). What to do: start every node with the same "
                            "script and arguments (the same mesh shape and axis names).")
    need = 1
    for s in shape:
        need *= s
    if need != world:
        raise SpmdError(f"init_mesh: mesh {shape} needs {need} processes but the world has {world}. What to do: "
                        f"launch with `torchrun --nproc-per-node {need}` or choose a mesh whose sizes multiply to {world}.")
    return device_mesh(shape, axis_names, device_type)


def _set_timeout(timeout: datetime.timedelta) -> None:
    """The user's own default process group takes `timeout`, and so do the axes' groups of the meshes made
    before (a new mesh's take the default group's: runtime/meshes.py). torch keeps no public way to do it;
    where its private one is gone, a warning says so."""
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timeout)
        for mesh in cached_meshes():  # (a mesh asked for before: its axes' groups, made with the old timeout; a review)
            for axis in range(mesh.ndim):
                if 1 < mesh.size(axis) < dist.get_world_size():
                    _set_pg_timeout(timeout, mesh.get_group(axis))
    except Exception as e:  # noqa: BLE001 - a torch without it: say so rather than wait 30 minutes silently
        warnings.warn(f"init_mesh: the process group was started before, and its timeout could not be set to "
                      f"{timeout} ({type(e).__name__}: {e}): collectives wait as long as it says. What to do: pass "
                      "timeout= to dist.init_process_group, or let spmd.init_mesh start the process group.",
                      stacklevel=3)


def _rank_device(mesh) -> torch.device | None:
    """This rank's CUDA device: the current one (init_mesh made it LOCAL_RANK's). With no GPU here (compiling
    for CUDA on fake tensors, as the tests do) it is LOCAL_RANK's, and CUDA is never initialized."""
    if mesh.device_type != "cuda":
        return None
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def compile(model: torch.nn.Module, mesh, example_inputs: tuple = (), *, example_kwargs: dict | None = None,
            mesh_spec: MeshSpec | None = None, src_data_rank: int | None = 0, compile_graphs: bool | str = False,
            options: PlanOptions | None = None, **kwargs) -> CompiledModule:
    """Partition `model` over `mesh` (a torch DeviceMesh, see `init_mesh`) and return this rank's
    `CompiledModule`.

    model: built for real, or on the meta device (`with torch.device("meta"): model = Build(cfg)`): then
    no rank ever holds it whole; each allocates its shards and fills them with `compiled.init_weights`
    or a checkpoint (`load_safetensors`, `load_sharded_state_dict`).
    example_inputs: full-size inputs, the same on every rank (they fix the shapes the plan is for; meta
    tensors will do). example_kwargs: keyword inputs, as a transformers model is called
    (`example_kwargs=dict(input_ids=ids, labels=labels)`); then `compiled(**local)` takes them by name,
    pins name them, and the output keeps its structure (a `ModelOutput` stays one). Training with no
    loss_fn differentiates the model's own `output.loss` (see compiler/call.py).
    mesh_spec: the link and device profiles to plan with (default: those of the mesh's backend; on CPU the
    device is this host's, measured at first use and cached, or as SPMD_CPU_PROFILE says: runtime/host.py).
    src_data_rank: a model built for real takes its weights from this rank's copy (rank 0, as DTensor's
    `distribute_tensor`), so ranks that initialized differently still agree; None: every rank uses its
    own copy (they all loaded the same checkpoint).
    compile_graphs: run this rank's forward and backward graphs through `torch.compile` (True: inductor,
    or a backend's name): fused element-wise kernels around the collectives; the first call compiles
    (seconds), later ones do not.
    Options (keywords, see `PlanOptions`): in_placements / param_placements / out_placements pins,
    loss_fn (then `compiled(*inputs, *targets)` returns the loss and trains), training, memory_budget,
    optimizer_state_factor, stamp_layers (on by default: a stack of 8 or more identical layers is traced 3
    deep and stamped to full depth, once the forward at full depth is checked to run those layers
    repeated and nothing else), plan (a plan solved before, its `PlanReport` or file path: run without
    solving, once checked against this trace), ...
    """
    # (under torch.inference_mode the pieces would be inference tensors: no version counters for the guards,
    # no autograd; compiled outside it, the module is called under it as the user likes)
    with torch.inference_mode(False):
        return _compile(model, mesh, example_inputs, example_kwargs, mesh_spec, src_data_rank, compile_graphs,
                        PlanOptions.build(options, **kwargs))


def _priced_as_given(spec: MeshSpec, options: PlanOptions) -> MeshSpec:
    """The plan given's mesh, with the link and device profiles it was priced with, where it is this mesh's
    shape and axes (else `spec`, and the pipeline refuses the plan, naming both): its explanation prices the
    alternatives as it priced its choices."""
    given = options.plan
    if given is None or (tuple(given.mesh.shape), tuple(given.mesh.axis_names)) != (tuple(spec.shape),
                                                                                   tuple(spec.axis_names)):
        return spec
    return given.mesh


def _with_plan_loaded(options: PlanOptions, ranks: bool = True) -> PlanOptions:
    """`options` with a given plan as a bare `Plan` (a file read, `plan=path`; a `PlanReport` without the graphs it
    holds), and what the plan was priced with where the options leave it at its default: the optimizer state
    factor, the gradient bucket size, and whether stacks of layers are stamped (`take_given_plan` refuses what
    differs). `ranks`: read by each rank of a compile (the error says every rank needs the file)."""
    given = options.plan
    if given is None:
        return options
    if isinstance(given, (str, os.PathLike)):
        try:
            given, _ = plan_io.load_plan(given)
        except OSError as e:  # (every rank reads it: saved on one machine's disk, the others' have none)
            way = "give every rank the file (a shared filesystem, or a copy on each machine)" if ranks else \
                "give the path of a plan file (plan.save(path), or `spmd plan ... --json path`)"
            raise SpmdError(f"plan={str(given)!r}: cannot be read ({e}). What to do: {way}, or leave plan= out to "
                            "solve.") from None
        except ValueError as e:  # (its message names the file)
            raise SpmdError(str(e)) from None
    if type(given) is not Plan:  # (a PlanReport: the plan without its sources)
        given = Plan(**{f.name: getattr(given, f.name) for f in dataclasses.fields(Plan)})
    defaults, taken = PlanOptions(), {"plan": given}
    for name in ("optimizer_state_factor", "bucket_bytes"):
        if name in given.stats and getattr(options, name) == getattr(defaults, name):
            taken[name] = given.stats[name]
    if not was_stamped(given.stats.get("stamped_layers", "")) and options.stamp_layers is None:
        taken["stamp_layers"] = False  # (solved over every layer: traced so again, the same node names)
    return dataclasses.replace(options, **taken)


def _compile(model, mesh, example_inputs, example_kwargs, mesh_spec, src_data_rank, compile_graphs,
             options: PlanOptions) -> CompiledModule:
    graph_backend(compile_graphs)  # a wrong value fails before planning
    lazy = [n for n, t in (*model.named_parameters(), *model.named_buffers())
            if isinstance(t, torch.nn.parameter.UninitializedTensorMixin)]
    if lazy:  # (`is_inference` of one raised torch's own ValueError; found by a probe)
        raise SpmdError(
            f"compile: {type(model).__name__}'s {', '.join(lazy[:3])}{', ...' if len(lazy) > 3 else ''} have no shape "
            "yet (a lazy module, nn.LazyLinear and friends, infers it at its first call). What to do: call the model "
            "once on an example batch before spmd.compile (or build it with its sizes given).")
    made_so = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_inference()]
    if made_so:
        raise SpmdError(
            f"compile: {type(model).__name__}'s {', '.join(made_so[:3])}{', ...' if len(made_so) > 3 else ''} were "
            "made under torch.inference_mode (inference tensors: no autograd, no version counters), which tracing "
            "cannot take. What to do: build or load the model outside torch.inference_mode; the compiled module "
            "can then be called under it.")
    held = [path or "the model itself" for path, m in model.named_modules() if isinstance(m, CompiledModule)]
    if held:  # (found by a probe: torch's "'FakeTensor' object has no attribute 'wait'" from the inner collectives)
        raise SpmdError(
            f"compile: {type(model).__name__} holds a module spmd.compile already compiled ({', '.join(held[:3])}), "
            "whose graph runs this rank's pieces with collectives of its own: it cannot be traced again. What to do: "
            "compile the whole model from its original modules, once (put the original module where the compiled "
            "one is, with the trained weights loaded into it: `original.load_state_dict(compiled.full_state_dict())`).")
    source_guard.check_compile(model)  # (a module compiled from it has trained: its own weights are the old ones)
    if dist.is_initialized() and mesh.size() != dist.get_world_size():
        raise SpmdError(f"compile: the mesh has {mesh.size()} ranks but the world has {dist.get_world_size()}. "
                        "What to do: build the mesh over all ranks (spmd.init_mesh).")
    _refuse_rank_layout(mesh)
    # on CPU, this host's own rates (measured once, cached: runtime/host.py), the same on every rank
    spec = mesh_spec or MeshSpec.from_device_mesh(mesh, host_cpu_profile() if mesh.device_type == "cpu" else None)
    if tuple(spec.shape) != tuple(mesh.shape):
        raise SpmdError(f"compile: mesh_spec {spec} does not match the mesh shape {tuple(mesh.shape)}. What to do: "
                        "describe the mesh you compile on (MeshSpec.from_device_mesh(mesh) gives its shape and names).")
    if mesh.mesh_dim_names and tuple(mesh.mesh_dim_names) != tuple(spec.axis_names):
        raise SpmdError(  # (found by a probe: the plan, explain() and errors named the spec's axes, by position)
            f"compile: mesh_spec names its axes {tuple(spec.axis_names)}, and the mesh {tuple(mesh.mesh_dim_names)}: "
            "the plan, its explanation and the errors would name each axis by the other's name, and each axis takes "
            "the link profile given at its position. What to do: name the spec's axes as the mesh's, in the same "
            f"order (MeshSpec(shape, {tuple(mesh.mesh_dim_names)}, links, device)).")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    c, call = _compile_for_rank(model, mesh, spec, options, example_inputs, example_kwargs, src_data_rank)
    recompile = functools.partial(_compile_with_report, model, mesh, spec)
    return compiled_module_class(model)(c, mesh, report_of(c), source_model=model, src_data_rank=src_data_rank,
                                        call=call, compile_graphs=compile_graphs, recompile=recompile)


def _refuse_rank_layout(mesh) -> None:
    """spmd places the pieces by each rank's row-major coordinate (rank = dp * tp_size + tp on (dp, tp)), as
    `init_mesh` and torch's `init_device_mesh` number a mesh. A `DeviceMesh` built from another layout
    (`DeviceMesh("cpu", [[0, 2], [1, 3]])`) runs its collectives over its own groups: ranks 1 and 2 held each
    other's pieces, and trained 0.66 off one device without a word (found by a probe)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # (compiled under a fake mode: the mesh's ranks are real numbers still)
        try:
            layout = mesh.mesh.tolist()
        except Exception:  # (a mesh of fake values has no layout to read)
            return
        in_order = torch.arange(mesh.size()).reshape(tuple(mesh.shape)).tolist()
    if layout != in_order:
        raise SpmdError(
            f"compile: the mesh numbers its ranks {layout}, not in order (row-major: {in_order}), and spmd places "
            "each rank's pieces by its row-major coordinate. What to do: build the mesh with spmd.init_mesh(shape, "
            "names) or torch's init_device_mesh; to put another axis inside a machine, order the mesh's axes otherwise (the "
            "innermost axis is the one whose ranks are neighbours).")


def _ordinary(inputs: tuple) -> tuple:
    """`inputs` with each inference tensor (made under `torch.inference_mode`: a generation loop's last output fed
    back, a batch made in an evaluation loop) copied to an ordinary one, which the trace can save for backward
    (torch.export refused it: "Inference tensors cannot be saved for backward"; found by a probe)."""
    if not any(isinstance(t, torch.Tensor) and t.is_inference() for t in inputs):
        return inputs
    with torch.inference_mode(False):
        return tuple(t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t for t in inputs)


def _compile_with_report(*args, **kwargs):
    """`_compile_for_rank`, with the plan's report (which explains and draws itself): a `CompiledModule`'s
    compilation for other input shapes (runtime/shapes.py)."""
    c, call = _compile_for_rank(*args, **kwargs)
    return c, call, report_of(c)


def _compile_for_rank(model, mesh, spec: MeshSpec, options: PlanOptions, example_inputs: tuple,
                      example_kwargs: dict | None, src_data_rank: int | None = None, weights: bool = True):
    """This rank's compilation of `model` for these example inputs, planned once (on rank 0) and agreed on by
    every rank; with the `Call` that names the inputs. `weights`: check that ranks keeping their own weights
    (`src_data_rank=None`) hold the same ones (a module compiled again for other input shapes, sharing the
    first one's pieces, has no weights of its own). A plan given (`plan=`) is read here, where a rank that
    cannot read it brings its error to the others; it is priced with its own profiles (`_priced_as_given`)."""
    view, flat_inputs, call = positional_call(model, example_inputs, example_kwargs,
                                              loss_only=options.joint and options.loss_fn is None,
                                              loss_fn=options.loss_fn if options.joint else None)
    flat_inputs = _ordinary(flat_inputs)
    device = _rank_device(mesh)
    meeting = Rendezvous() if dist.is_initialized() else None
    binding = RankBinding(mesh.get_rank() if dist.is_initialized() else 0,
                          tuple(mesh.get_group(i).group_name for i in range(mesh.ndim)), device,
                          meeting.share_plan if meeting else None, meeting.agree_on if meeting else None,
                          plans=meeting is None or meeting.plans_here())
    try:
        options = _with_plan_loaded(options)
        spec = _priced_as_given(spec, options)
        # a meta model is traced through fakes on the rank's device: CUDA kernels for a CUDA mesh (its
        # copy, like the pipeline, runs with the garbage collector paused: `collector_paused`)
        with collector_paused():
            traced_model, traced_inputs = fake_model(view, flat_inputs, device)
            c = run_pipeline(traced_model, traced_inputs, spec, options, binding)
    except BaseException as e:
        if meeting is not None:  # the other ranks wait at the meeting: bring them the error
            meeting.fail(e)
        raise
    if meeting is not None:
        meeting.agree_on_plan(c.plan.fingerprint())
        if weights and src_data_rank is None and not is_meta(model, flat_inputs):  # every rank keeps its own
            meeting.agree_on({"weights": weights_summary(c.traced.state)})
    return c, call


def plan(model: torch.nn.Module, mesh_spec: MeshSpec, example_inputs: tuple = (), *,
         example_kwargs: dict | None = None, options: PlanOptions | None = None, **kwargs) -> PlanReport:
    """Run the pipeline up to the plan with no processes at all; returns the plan, which explains, draws
    and saves itself (`PlanReport`).

    A model and inputs on the meta device are planned through fake tensors (compiler/meta.py). Options
    (keywords, see `PlanOptions`) as for `compile`; here a stack of 8 or more identical layers is traced
    3 layers deep and stamped to full depth by default (`stamp_layers`), identical layers that repeat 4
    times or more are solved once (`tie_blocks`), and graphs over 1500 ops let single-input ops follow
    their input (`merge_followers`)."""
    options = _with_plan_loaded(PlanOptions.build(options, **kwargs), ranks=False)
    mesh_spec = _priced_as_given(mesh_spec, options)
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    view, flat_inputs, _ = positional_call(model, example_inputs, example_kwargs,
                                           loss_only=options.joint and options.loss_fn is None,
                                           loss_fn=options.loss_fn if options.joint else None)
    with collector_paused():  # (the meta model's copy too: `collector_paused`)
        faked, inputs = fake_model(view, flat_inputs)
        c = run_pipeline(faked, inputs, mesh_spec, options)
    # asked again at another batch size (cost_formula, crossover), the model is faked again as given and solved
    # there: a given plan is this batch's alone
    return report_of(c, Request(view, flat_inputs, mesh_spec, dataclasses.replace(options, plan=None)))
