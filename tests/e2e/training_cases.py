"""Training end to end: every rank trains its shards; losses and full parameters track one device."""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from spmd.core.profiles import device_profile_for, link_profile_for
from tests.models import GPT, MLP, GPTConfig
from tests.support import lm_loss, megatron_spec, spec


@dataclass(frozen=True)
class TrainCase:
    name: str
    model: str  # mlp | gpt | gpt-softmax
    mesh: tuple[int, ...]
    names: tuple[str, ...]
    optimizer: str = "sgd"  # sgd | adamw
    profile: str = "default"  # default (the real gloo profile) | compute (slow device, fast links) |
    # megatron (slow device, latency-bound links, the outer one 10x slower: TP on tp, DP on dp) |
    # builtin (the built-in gloo and cpu profiles: the default's kind of plan, whatever the host's load)
    batch: int = 4
    in_placements: dict = field(default_factory=dict)
    param_placements: dict = field(default_factory=dict)
    budget_fraction: float | None = None  # memory_budget as a fraction of the unconstrained plan's peak
    clip: float | None = None  # clip gradients to this global norm (compiled.clip_grad_norm_) every step
    norm_type: float = 2.0
    compile_graphs: bool = False  # run the rank graphs through torch.compile (inductor)

    @property
    def world(self) -> int:
        return math.prod(self.mesh)


TRAIN_CASES = {c.name: c for c in [
    TrainCase("mlp-1d2-sgd", "mlp", (2,), ("dp",)),
    TrainCase("mlp-1d2-adamw-compute", "mlp", (2,), ("tp",), "adamw", "compute", batch=3),
    TrainCase("mlp-1d4-adamw", "mlp", (4,), ("dp",), "adamw", batch=8),
    TrainCase("mlp-dropout-1d2-sgd-compute", "mlp-dropout", (2,), ("tp",), "sgd", "compute", batch=4),
    # batch norm in training: its statistics over the whole batch, split on dp (as SyncBatchNorm), and its
    # running statistics updated in place on every rank
    TrainCase("mlp-batchnorm-2d-sgd-compute", "mlp-batchnorm", (2, 2), ("dp", "tp"), "sgd", "compute", batch=8,
              in_placements={name: [torch.distributed.tensor.Shard(0), torch.distributed.tensor.Replicate()]
                             for name in ("input", "target")}),
    TrainCase("gpt-1d2-adamw-compute", "gpt", (2,), ("tp",), "adamw", "compute", batch=1),
    TrainCase("gpt-softmax-1d2-sgd-compute", "gpt-softmax", (2,), ("tp",), "sgd", "compute", batch=2),
    TrainCase("gpt-2d-adamw-megatron", "gpt", (2, 2), ("dp", "tp"), "adamw", "megatron", batch=2),
    TrainCase("gpt-2d-sgd-default", "gpt", (2, 2), ("dp", "tp"), "sgd", batch=4),
    # data parallel pinned: unpinned, the gloo profile makes replicating everything cheapest at this size,
    # and a budget is then met by splitting the batch alone. The built-in profiles: the host's measured one
    # moves with its load, and with it the free plan the budget is a fraction of (a loaded host's free plan
    # needed so much that 0.6 of it held every kind at its most)
    TrainCase("gpt-1d4-adamw-budget", "gpt", (4,), ("dp",), "adamw", "builtin", batch=8, budget_fraction=0.6,
              in_placements={"tokens": [torch.distributed.tensor.Shard(0)]}),
    # a budget on (2, 2): the reads of small values are 29% of the program, so the price search solves its
    # pooled twin (solve_placements._Program) and lifts the twin's plans into the program
    TrainCase("gpt-2d-adamw-budget-twin", "gpt", (2, 2), ("dp", "tp"), "adamw", "builtin", batch=8,
              budget_fraction=0.7),
    # FlexAttention: head-parallel under a causal block mask; with ALiBi (reads the head index) on 2-D
    TrainCase("gpt-flex-1d2-adamw-compute", "gpt-flex", (2,), ("tp",), "adamw", "compute", batch=1),
    TrainCase("gpt-flex-alibi-2d-sgd-compute", "gpt-flex-alibi", (2, 2), ("dp", "tp"), "sgd", "compute", batch=2),
    TrainCase("gpt-1d4-sgd-fsdp-pins", "gpt", (4,), ("dp",), "sgd", batch=4,
              in_placements={"tokens": [torch.distributed.tensor.Shard(0)]},
              param_placements={f"blocks.{i}.mlp.fc1.weight": [torch.distributed.tensor.Shard(0)] for i in range(2)}),
]}


# Gradient clipping by global norm (tests/test_clip.py): max_norm below the gradients' norm, so every
# step really scales them; weights sharded on tp (1-D), on tp with dp replicas (Megatron), on both axes.
CLIP_CASES = {c.name: c for c in [
    TrainCase("gpt-1d2-adamw-clip-compute", "gpt", (2,), ("tp",), "adamw", "compute", batch=1, clip=0.5),
    TrainCase("gpt-2d-sgd-clip-megatron", "gpt", (2, 2), ("dp", "tp"), "sgd", "megatron", batch=2, clip=0.5),
    TrainCase("mlp-2d-sgd-clip-inf-compute", "mlp", (2, 2), ("dp", "tp"), "sgd", "compute", batch=3, clip=0.05,
              norm_type=float("inf"), param_placements={"fc1.weight": [torch.distributed.tensor.Shard(0),
                                                                         torch.distributed.tensor.Shard(1)]}),
]}


# The rank graphs through torch.compile (inductor): weights sharded on tp (collectives in both graphs), and
# Megatron on a 2-D mesh with a gradient bucket on dp; dropout draws the masks eager draws (inductor's own
# generator drew others: a loss 0.036 off).
COMPILED_CASES = {c.name: c for c in [
    TrainCase("mlp-dropout-1d2-sgd-compute-inductor", "mlp-dropout", (2,), ("tp",), "sgd", "compute", batch=4,
              compile_graphs=True),
    TrainCase("gpt-1d2-adamw-compute-inductor", "gpt", (2,), ("tp",), "adamw", "compute", batch=1,
              compile_graphs=True),
    TrainCase("gpt-2d-sgd-megatron-inductor", "gpt", (2, 2), ("dp", "tp"), "sgd", "megatron", batch=2,
              compile_graphs=True),
]}


def _build(case: TrainCase):
    torch.manual_seed(0)
    if case.model.startswith("mlp"):
        model = MLP(16, 64)
        if case.model == "mlp-dropout":  # random ops: dropout between the two Linears
            model = torch.nn.Sequential(model.fc1, torch.nn.GELU(), torch.nn.Dropout(0.3), model.fc2)
        if case.model == "mlp-batchnorm":
            model = torch.nn.Sequential(model.fc1, torch.nn.BatchNorm1d(64), torch.nn.GELU(), model.fc2)
        x = torch.randn(case.batch, 16, generator=torch.Generator().manual_seed(1))
        y = torch.randn(case.batch, 16, generator=torch.Generator().manual_seed(2))
        return model, (x, y), F.mse_loss
    flex = {"gpt-flex": "mask", "gpt-flex-alibi": "alibi"}.get(case.model)
    model = GPT(GPTConfig(sdpa=case.model == "gpt", seq=32, flex=flex))
    seq = 31 if case.profile in ("compute", "megatron") else 32  # odd: only weights can split the work
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (case.batch, seq), generator=g)
    targets = torch.randint(0, 128, (case.batch, seq), generator=g)
    return model, (tokens, targets), lm_loss


def run_training(rank: int, world: int, name: str, steps: int = 5) -> dict:
    case = {**TRAIN_CASES, **CLIP_CASES, **COMPILED_CASES}[name]
    torch.set_default_dtype(torch.float64)
    try:
        with flex_backward_on_cpu():
            return _run_training(case, steps)
    finally:
        torch.set_default_dtype(torch.float32)


@contextlib.contextmanager
def flex_backward_on_cpu():
    """torch refuses FlexAttention's backward on CPU at its entry point (its compiled CPU kernel has none);
    the higher-order ops run their dense reference, forward and backward, on any device."""
    import torch.nn.attention.flex_attention as flex

    check = flex._validate_device
    flex._validate_device = lambda *args: None
    try:
        yield
    finally:
        flex._validate_device = check


def _run_training(case: TrainCase, steps: int) -> dict:
    import spmd

    model, inputs, loss_fn = _build(case)
    reference = copy.deepcopy(model)
    mesh = spmd.init_mesh(case.mesh, case.names)
    mesh_spec = {"compute": lambda: spec(case.mesh, case.names), "megatron": lambda: megatron_spec(),
                 "default": lambda: spmd.MeshSpec.from_device_mesh(mesh),
                 "builtin": lambda: spmd.MeshSpec(case.mesh, case.names, (link_profile_for("gloo"),) * len(case.mesh),
                                                  device_profile_for("cpu"))}[case.profile]()
    budget, free_memory = None, {}
    if case.budget_fraction is not None:
        free = spmd.plan(model, mesh_spec, inputs, loss_fn=loss_fn, in_placements=case.in_placements,
                         param_placements=case.param_placements)  # unconstrained but for the pins
        budget, free_memory = case.budget_fraction * free.predicted_peak_bytes, dict(free.memory)
    compiled = spmd.compile(model, mesh, example_inputs=inputs, loss_fn=loss_fn,
                            in_placements=case.in_placements, param_placements=case.param_placements,
                            mesh_spec=mesh_spec, memory_budget=budget, compile_graphs=case.compile_graphs)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}[case.optimizer]
    opt, ref_opt = make(compiled.parameters()), make(reference.parameters())
    local = compiled.shard_inputs(*inputs)
    losses, ref_losses, param_err, measured = [], [], 0.0, {}
    norms, ref_norms = [], []
    for step in range(steps):
        torch.manual_seed(100 + step)  # dropout: same generator state on every rank and for the reference
        loss = compiled(*local)
        loss.backward()
        if step == 1:  # optimizer state exists from step 0 on; gradients are live right now
            measured = compiled.memory_report(opt)
        if case.clip is not None:  # (the norm alone, as a loop logs it, then clipped by it)
            logged = float(compiled.grad_norm(case.norm_type))
            norms.append(float(compiled.clip_grad_norm_(case.clip, case.norm_type)))
            assert logged == norms[-1], (logged, norms[-1])
        opt.step()
        opt.zero_grad()
        torch.manual_seed(100 + step)
        ref_loss = loss_fn(reference(*inputs[:-1]), inputs[-1])
        ref_loss.backward()
        if case.clip is not None:
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), case.clip,
                                                                  case.norm_type)))
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        full = compiled.full_state_dict()
        param_err = max(param_err, max(float((full[k] - v).abs().max()) for k, v in reference.named_parameters()))
        # buffers the forward updates (batch norm's running statistics) too
        param_err = max([param_err] + [float((full[k].double() - v.double()).abs().max())
                                       for k, v in reference.named_buffers()])
    placements = {compiled.plan.labels[n]: s.outputs[0] for n, s in compiled.plan.choices.items()
                  if n in compiled.plan.labels}
    return {"losses": losses, "ref_losses": ref_losses, "param_err": param_err,
            "norms": norms, "ref_norms": ref_norms, "grad_placements": sorted(
                {str(ps) for ps in compiled._state_placements.values()}),
            "fingerprint": compiled.plan.fingerprint(),
            "collectives": dict(compiled.plan.collective_summary()),
            "budget": budget, "predicted": dict(compiled.plan.memory), "measured": measured,
            "peak": compiled.plan.predicted_peak_bytes, "packing": compiled.plan.stats.get("bucket_packing", 0.0),
            "unconstrained": free_memory,
            "placements": placements,  # (a graph the backend failed on runs uncompiled: not counted)
            "compiled_graphs": sorted(k for k, (_, g) in compiled._compiled_graphs.items() if not g.failed)}
