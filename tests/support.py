"""What the tests share: mesh specs with pinned profiles, the compiler called the way tests call it, the
numerical check of simulated training, training side by side with one device, and ranks started as
torchrun starts them. No test module imports another; they all import this."""
from __future__ import annotations

import dataclasses
import functools
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from spmd.compiler.options import PlanOptions, RankBinding
from spmd.compiler.pipeline import Compilation, run_pipeline
from spmd.core.mesh import MeshSpec
from spmd.core.profiles import DeviceProfile, LinkProfile
from spmd.passes.insert_collectives import insert_collectives
from spmd.runtime.distribute import local_shard

# A profile where compute dominates and links are fast: the solver then shards as much as it can, so
# the tests exercise many collectives (pinning a profile, never tuning the real one).
# Its optimizer steps next to free (the graph alone decides these tests' plans; at 1 GB/s an AdamW step
# would shard every parameter: tests/unit/test_optimizer_cost.py is about that).
SLOW_DEVICE = DeviceProfile("test-slow-device", 1e8, 1e9, 0.0, 1e12, optimizer_bandwidth=1e18)
# The same FLOP rate with memory traffic (local copies, gradient-bucket packing) next to free: for tests
# about FLOPs against links, where SLOW_DEVICE's 1 GB/s would let copies decide between near-equal plans.
COMPUTE_BOUND_DEVICE = dataclasses.replace(SLOW_DEVICE, name="test-compute-bound", memory_bandwidth=1e13)
FAST_LINK = LinkProfile("test-fast-link", 1e-6, 1e12)
# Latency-bound links and a slow device: tensor parallelism pays, extra collectives do not.
LATENCY_LINK = LinkProfile("test-latency-link", 1e-3, 1e11)


def spec(shape, names, link=FAST_LINK, device=SLOW_DEVICE) -> MeshSpec:
    return MeshSpec(tuple(shape), tuple(names), (link,) * len(shape), device)


def megatron_spec() -> MeshSpec:
    """(dp=2, tp=2) with latency-bound links, dp's 10x slower, and a slow device: the solver's pick is
    Megatron tensor parallelism on tp and data parallelism on dp (tests/unit/test_training_plan.py)."""
    outer = LinkProfile("test-outer", 10 * LATENCY_LINK.latency_s, LATENCY_LINK.bandwidth / 10)
    return MeshSpec((2, 2), ("dp", "tp"), (outer, LATENCY_LINK), SLOW_DEVICE)


@functools.lru_cache(maxsize=None)
def megatron_gpt_plan():
    """GPT (2 blocks) on (dp=2, tp=2): batch 2 splits on dp, the odd sequence never, so tp shards the
    weights Megatron-style (one all_reduce per attention and per MLP). Frozen, so tests may share it."""
    import spmd
    from tests.models import GPT, GPTConfig

    torch.manual_seed(0)
    return spmd.plan(GPT(GPTConfig()), megatron_spec(), (torch.randint(0, 128, (2, 31)),))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def budget_rows(monkeypatch) -> list[float]:
    """From now on, each budgeted solve appends its memory row's bytes at the solution it returns."""
    from spmd.cost_model import solver

    rows: list[float] = []
    solve = solver.IlpBuilder.solve

    def spy(self, *args, budget=None, **kwargs):
        result = solve(self, *args, budget=budget, **kwargs)
        if budget is not None:
            rows.append(sum(b * result.values[c] for c, b in budget.bytes.items()))
        return result

    monkeypatch.setattr(solver.IlpBuilder, "solve", spy)
    return rows


def choice_program(groups: list[list[tuple[float, float]]]):
    """A 0-1 program of "exactly one of" choices, (cost, bytes) per option: the builder, each choice's
    columns, and the budget row's bytes per column."""
    from spmd.cost_model.solver import IlpBuilder

    ilp, cols, weights = IlpBuilder(), [], {}
    for options in groups:
        mine = [ilp.add_var(cost, binary=True) for cost, _ in options]
        ilp.add_eq([(c, 1.0) for c in mine], 1.0)
        weights.update({c: b for c, (_, b) in zip(mine, options)})
        cols.append(mine)
    return ilp, cols, weights


def compile_graph(model, example_inputs, mesh: MeshSpec, rank: int | None = None, **options) -> Compilation:
    """The compiler as spmd.compile runs it, without processes: `rank` given, this rank's graphs are
    emitted too (process groups named g0, g1, ... per mesh axis)."""
    binding = None if rank is None else RankBinding(rank, tuple(f"g{i}" for i in range(mesh.ndim)))
    c = run_pipeline(model, tuple(example_inputs), mesh, PlanOptions(**options), binding)
    if c.global_gm is None:  # the sharded graph with explicit steps, which tests read and simulate runs
        c = dataclasses.replace(c, global_gm=insert_collectives(c.traced, c.plan))
    return c


def one_device(model, example_inputs, **options):
    """`model` compiled on a mesh of one device in this process (no process group): a `CompiledModule` to
    call as a training loop does. `options`: PlanOptions (stamping off unless given)."""
    from spmd.runtime.compiled import compiled_module_class
    from spmd.runtime.measure import builtin_cpu

    options.setdefault("stamp_layers", False)
    c = run_pipeline(model, tuple(example_inputs), MeshSpec((1,), ("dp",), device=builtin_cpu()), PlanOptions(**options),
                     RankBinding(0, ("",)), quiet=True)
    return compiled_module_class(model)(c, None, src_data_rank=None)


def check_simulated_training(c, outs, loss, model, rtol: float = 1e-9, atol: float = 1e-10) -> int:
    """Every rank's simulated loss and gradients (`outs`, from `simulate` of a joint compilation `c`)
    equal the eager `loss` (backward already run) and `model`'s gradients (and buffers the forward updated),
    each in the layout the plan gives it. Returns how many outputs were checked."""
    grads, mesh, checked = dict(model.named_parameters()), c.mesh, 0
    for k, kind in enumerate(c.traced.output_kinds()):
        if kind.kind == "none" or f"output_{k}" not in c.plan.choices:  # (a parameter no gradient reaches:
            assert all(out[k] is None for out in outs) and (kind.kind != "grad" or grads[kind.name].grad is None)
            continue                                                    # none, as in eager)
        want = loss.detach() if kind.kind == "output" else \
            dict(model.named_buffers())[kind.name] if kind.kind == "buffer_update" else grads[kind.name].grad
        ps = c.plan.choices[f"output_{k}"].inputs[0]
        for rank, out in enumerate(outs):
            torch.testing.assert_close(out[k], local_shard(want, ps, mesh.shape, mesh.coordinate(rank)),
                                       rtol=rtol, atol=atol)
        checked += 1
    return checked


def one_step_checked(compiled, reference, x, t, loss_fn=F.mse_loss, atol: float = 1e-12) -> None:
    """One call and backward of a compiled module (the runtime itself, not `simulate`) against `reference` on one
    device: the loss and every gradient equal (None where the reference's is None); both sets of gradients cleared
    after, for the next step."""
    loss = compiled(*compiled.shard_inputs(x, t))
    loss.backward()
    expected = loss_fn(reference(x), t)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=atol)
    for name, p in reference.named_parameters():
        got = compiled.get_parameter(name).grad
        assert (got is None) == (p.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(got, p.grad, rtol=0, atol=atol)
        p.grad = None
    compiled.zero_grad()


def mse_training_checked(model, x, t, mesh: MeshSpec, rank: int | None = None, **options) -> tuple[Compilation, int]:
    """`model` compiled for an MSE loss of its output for `t` (input `x`) and its training step simulated: the
    compilation, and how many of its outputs equal one device's (`check_simulated_training`)."""
    import copy

    from spmd.runtime.simulate import simulate

    reference = copy.deepcopy(model)
    loss = F.mse_loss(reference(x), t)
    loss.backward()
    c = compile_graph(model, (x, t), mesh, rank, loss_fn=F.mse_loss, **options)
    return c, check_simulated_training(c, simulate(c, (x, t, torch.ones(()))), loss, reference)


def data_parallel_training(make, x, t, link: LinkProfile = FAST_LINK) -> tuple[list, int]:
    """`make()`'s model trained with an MSE loss of its output for `t()` on (dp=2), its input `x()` and the target split
    on the batch, weights replicated: (the plan's collectives as (kind, value, consumer), outputs checked equal to one
    device by `check_simulated_training`). In float64 (the model and tensors are made in it)."""
    import inspect

    from torch.distributed.tensor import Replicate, Shard

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = make()
        c, checked = mse_training_checked(
            model, x(), t(), spec((2,), ("dp",), link),
            in_placements={name: [Shard(0)] for name in (*inspect.signature(model.forward).parameters, "target")},
            param_placements={n: [Replicate()] for n, _ in model.named_parameters()})
        return [(step.kind, edge.value[0], edge.consumer) for edge, step in c.plan.collectives()], checked
    finally:
        torch.set_default_dtype(torch.float32)


def train_side_by_side(compiled, reference, inputs: tuple, targets: tuple, loss_fn, steps: int,
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), before=None):
    """`steps` optimizer steps of `compiled` (compiled with `loss_fn`) and of `reference` on one device, on
    the same full batch; `before(local)`, if given, runs before each compiled step with this rank's inputs.
    Returns (compiled losses, reference losses, the compiled model's optimizer)."""
    opt, ref_opt = optimizer(compiled.parameters()), optimizer(reference.parameters())
    local = compiled.shard_inputs(*inputs, *targets)
    losses, ref_losses = [], []
    for _ in range(steps):
        if before is not None:
            before(local)
        for run, o, record in ((lambda: compiled(*local), opt, losses),
                               (lambda: loss_fn(reference(*inputs), *targets), ref_opt, ref_losses)):
            loss = run()
            loss.backward()
            o.step()
            o.zero_grad()
            record.append(loss.item())
    return losses, ref_losses, opt


def launch_ranks(args: list[str], world: int = 2) -> list[subprocess.Popen]:
    """`python *args` as `world` ranks on this machine, with torchrun's environment (RANK, WORLD_SIZE,
    MASTER_*) but without its agent, which would kill the survivors itself as soon as one rank exits."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, *args], cwd=Path(__file__).resolve().parents[1], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs
