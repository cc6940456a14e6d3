"""bf16 and fp16 on gloo ranks: forward and training equal one device within the dtype's rounding.

What a user can expect of the reductions (spmd/core/collectives.py, spmd/passes/rules/cast.py):
  * A Partial value is reduced in its own dtype, as DTensor does: the all_reduce of a bf16 matmul's
    partial sums is a bf16 all_reduce (gloo sums bf16 and fp16 on CPU; measured, torch 2.13), and no
    cast is added around it. Each rank's partial sum is rounded to bf16 before the reduction, and the
    sum once more, where one device rounds the whole sum once: results differ from one device by about
    one rounding of the partial sums per reduction, never by more than a few eps of the values' scale.
  * Where the model itself computes in a wider dtype (the losses' fp32 accumulation, a layer kept in
    fp32), the reduction may run in that wider dtype: a Partial passes a widening cast (exact), so it is
    never less precise than one device.
  * A Partial never passes a narrowing cast (fp32 -> bf16): an fp32 sum the model rounds to bf16 once
    is reduced in fp32, then cast, as the user's program does. DTensor lets Partial through it, and the
    solver used to prefer reducing after the downcast (half the bytes): a bf16 all_reduce of fp32 sums,
    each part rounded before the sum (`Downcast` below checks that fix).
  * Order: along each mesh axis gloo sums the ranks' parts in a fixed order and hands every rank the same
    bits; on a 2-D mesh a value Partial on both axes is reduced one axis after the other. So every rank
    holds bitwise the same replicated outputs and weights, step after step (no drift between replicas).

Every case forces sharded plans (the compute or the Megatron profile with odd sequence lengths, so
weights must split) and checks that the plan has all_reduces; every collective that runs is recorded
with its dtype.
"""
from __future__ import annotations

import collections
import copy
import hashlib
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

# Tolerances, in units of the dtype's eps (bf16 2**-7 = 7.8e-3, fp16 2**-10 = 9.8e-4), relative to the
# scale (max |value|) of the single-device tensor compared:
#   forward outputs and losses: each reduced value is off by at most about one rounding of its partial
#   sums (<= eps * scale for parts no larger than the sum), and two transformer blocks carry that through
#   residual adds with gain about 1: a few eps. Measured: <= 0.9 eps (outputs), <= 0.8 eps (losses).
#   weights after 2 SGD steps (momentum 0.9): measured <= 1.7 eps of each tensor's scale.
#   Gradients after the first backward: backward reduces more (every weight gradient of a batch split
#   on dp, every input gradient of a column-parallel matmul), measured <= 2.9 eps; their scale is each
#   tensor's own, but at least 1% of the model's largest gradient: a gradient that is zero in exact
#   arithmetic (the attention key's bias: softmax ignores a constant added to every key) is rounding
#   noise on one device too, 300-1300 eps of its own tiny scale apart.
# A wrong reduction (a part missed or counted twice, a missing 1/n) is off by O(scale): 64 eps is half
# the scale in bf16, so even the loosest of these would see it.
FORWARD_EPS = 4.0
LOSS_EPS = 4.0
WEIGHT_EPS = 4.0
GRAD_EPS = 8.0
GRAD_FLOOR = 0.01
STEPS = 2


class Downcast(nn.Module):
    """An fp32 Linear whose output the model rounds to bf16 for a bf16 Linear (a layer kept in fp32)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 64, bias=False)
        self.fc2 = nn.Linear(64, 64, bias=False).to(torch.bfloat16)

    def forward(self, x):
        return self.fc2(self.fc1(x).to(torch.bfloat16))


class _Recording:
    """Stands in for `torch.ops._c10d_functional` in spmd.core.collectives: records each collective's
    name and input dtype, then runs it."""

    def __init__(self, real, log: collections.Counter):
        self._real, self._log = real, log

    def __getattr__(self, name):
        fn = getattr(self._real, name)
        if name == "wait_tensor":
            return fn

        def call(x, *args, **kwargs):
            self._log[(name, str(x.dtype).removeprefix("torch."))] += 1
            return fn(x, *args, **kwargs)
        return call


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _build(model: str, mesh_shape: tuple[int, ...], dtype: torch.dtype):
    """(model in `dtype`, the same model in float64, inputs, targets, loss_fn, mesh spec, pins)."""
    from torch.distributed.tensor import Shard

    from tests.models import GPT, MLP, GPTConfig
    from tests.support import lm_loss, megatron_spec, spec

    names = ("dp", "tp")[-len(mesh_shape):]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    pins = {}
    if model == "gpt":  # odd sequence: weights must split (tensor parallel), batch 2 splits on dp
        net = GPT(GPTConfig(seq=32))
        batch = 2 if len(mesh_shape) == 2 else 1
        inputs = (torch.randint(0, 128, (batch, 31), generator=g),)
        targets = (torch.randint(0, 128, (batch, 31), generator=g),)
        loss_fn, mesh_spec = lm_loss, (megatron_spec() if len(mesh_shape) == 2 else spec(mesh_shape, names))
    elif model == "mlp":  # batch 3: nothing splits it evenly, so the weights do
        net = MLP(16, 64)
        inputs, targets = (torch.randn(3, 16, generator=g),), (torch.randn(3, 16, generator=g),)
        loss_fn, mesh_spec = F.mse_loss, spec(mesh_shape, names)
    else:  # downcast: fc1 row-parallel (its output is a Partial fp32 sum), pinned
        net = Downcast()
        inputs, targets = (torch.randn(3, 64, generator=g),), (torch.randn(3, 64, generator=g),)
        loss_fn, mesh_spec = F.mse_loss, spec(mesh_shape, names)
        pins = {"param_placements": {"fc1.weight": [Shard(1)]}, "in_placements": {"x": [Shard(1)]}}
    truth = copy.deepcopy(net).double() if model != "downcast" else None  # mixed dtypes: no fp64 twin
    if model != "downcast":
        net = net.to(dtype)
        inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    targets = tuple(t.to(dtype) if t.is_floating_point() else t for t in targets)
    return net, truth, inputs, targets, loss_fn, mesh_spec, pins


def _double(ts):
    return tuple(t.double() if t.is_floating_point() else t for t in ts)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _scale(t: torch.Tensor) -> float:
    return float(t.detach().double().abs().max())


def run_low_precision(rank: int, world: int, model: str, mesh_shape: tuple[int, ...], dtype_name: str) -> dict:
    import spmd
    import spmd.core.collectives as C
    from spmd.runtime.distribute import gather_full

    dtype = getattr(torch, dtype_name)
    names = ("dp", "tp")[-len(mesh_shape):]
    net, truth, inputs, targets, loss_fn, mesh_spec, pins = _build(model, mesh_shape, dtype)
    reference = copy.deepcopy(net)
    mesh = spmd.init_mesh(mesh_shape, names)
    real, fwd_log, train_log = C._c10d, collections.Counter(), collections.Counter()
    out: dict = {}
    clock = {"start": time.perf_counter()}
    try:
        # ---- forward
        C._c10d = _Recording(real, fwd_log)
        compiled = spmd.compile(net, mesh, example_inputs=inputs, mesh_spec=mesh_spec, **pins)
        with torch.no_grad():
            full = compiled.gather_outputs(compiled(*compiled.shard_inputs(*inputs)))
            single = reference(*inputs)
            exact = truth(*_double(inputs)) if truth is not None else single
        out["forward"] = {"dtype": str(full.dtype), "err": _err(full, single), "scale": _scale(single),
                          "single_vs_fp64": _err(single, exact), "sharded_vs_fp64": _err(full, exact),
                          "digest": _digest([full]), "plan": dict(compiled.plan.collective_summary())}
        del compiled
        clock["forward"] = time.perf_counter()

        # ---- training: the first step's gradients, then STEPS SGD steps
        C._c10d = _Recording(real, train_log)
        compiled = spmd.compile(net, mesh, example_inputs=inputs + targets, loss_fn=loss_fn, mesh_spec=mesh_spec,
                                **pins)
        clock["compile_train"] = time.perf_counter()
        opt = torch.optim.SGD(compiled.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        local = compiled.shard_inputs(*inputs, *targets)
        before = {k: v.detach().clone() for k, v in reference.named_parameters()}
        losses, ref_losses, grad_err = [], [], {}
        for step in range(STEPS):
            loss = compiled(*local)
            loss.backward()
            ref_loss = loss_fn(reference(*inputs), *targets)
            ref_loss.backward()
            if step == 0:
                for fqn, attr in compiled._param_names.items():
                    p = compiled.get_parameter(fqn)
                    if p.grad is None:
                        continue
                    g = gather_full(p.grad, compiled._state_placements[fqn], compiled.mesh_spec, compiled.coord,
                                    compiled.group_names)
                    want = reference.get_parameter(fqn).grad
                    grad_err[fqn] = (_err(g, want), _scale(want), str(g.dtype))
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
        clock["steps"] = time.perf_counter()
        state = compiled.full_state_dict()
        ref_params = dict(reference.named_parameters())
        out["train"] = {
            "losses": losses, "ref_losses": ref_losses, "grads": grad_err,
            "weights": {k: (_err(state[k], v), _scale(v), _err(v, before[k]), str(state[k].dtype))
                        for k, v in ref_params.items()},
            "digest": _digest([state[k] for k in sorted(state)]),
            "plan": dict(compiled.plan.collective_summary())}
    finally:
        C._c10d = real
    out["collectives"] = {"forward": dict(fwd_log), "train": dict(train_log)}
    clock["end"] = time.perf_counter()
    names = list(clock)
    out["seconds"] = {b: round(clock[b] - clock[a], 2) for a, b in zip(names, names[1:])}
    return out


CASES = [
    # (model, mesh, dtype, dtypes the training step's collectives may run in besides the model's)
    # the cross-entropy's log-softmax computes in fp32 for bf16/fp16 logits (its decomposition upcasts, as
    # the fused kernel accumulates in fp32): where the logits are split, its max and sum-of-exp (and the
    # gradient's sum) are reduced in fp32, or the fp32 logits gathered where the solver finds that cheaper
    ("gpt", (2,), "bfloat16", ("float32",)),
    ("gpt", (2,), "float16", ("float32",)),
    ("gpt", (2, 2), "bfloat16", ("float32",)),
    ("gpt", (2, 2), "float16", ("float32",)),
    # mse_loss computes in fp32 for bf16/fp16 inputs (as eager does): its fp32 sum is reduced in fp32
    ("mlp", (2, 2), "bfloat16", ("float32",)),
    ("mlp", (2, 2), "float16", ("float32",)),
]


def _eps(dtype_name: str) -> float:
    return torch.finfo(getattr(torch, dtype_name)).eps


def _worst_grad(grads: dict, eps: float) -> float:
    floor = GRAD_FLOOR * max(scale for _, scale, _ in grads.values())
    return max(err / (eps * max(scale, floor)) for err, scale, _ in grads.values())


def _check_agreement(results) -> None:
    """Every rank holds bitwise the same full outputs and weights."""
    assert len({r["forward"]["digest"] for r in results}) == 1, "ranks' outputs differ"
    assert len({r["train"]["digest"] for r in results}) == 1, "ranks' weights drifted apart"


@pytest.mark.parametrize("model,mesh_shape,dtype_name,wider", CASES,
                         ids=[f"{m}-{'x'.join(map(str, s))}-{d}" for m, s, d, _ in CASES])
def test_low_precision_matches_one_device(ranks, model, mesh_shape, dtype_name, wider):
    world = 1
    for s in mesh_shape:
        world *= s
    results = ranks(world).run(run_low_precision, model, mesh_shape, dtype_name)
    eps = _eps(dtype_name)
    r = results[0]
    fwd, train = r["forward"], r["train"]
    print(f"{model} {mesh_shape} {dtype_name}: forward err {fwd['err'] / (eps * fwd['scale']):.2f} eps*scale "
          f"(vs fp64: one device {fwd['single_vs_fp64']:.2e}, sharded {fwd['sharded_vs_fp64']:.2e}); losses "
          f"{train['losses']} vs {train['ref_losses']}; worst grad "
          f"{_worst_grad(train['grads'], eps):.2f} eps*scale; worst weight "
          f"{max(e / (eps * s) for e, s, _, _ in train['weights'].values()):.2f} eps*scale; collectives "
          f"{r['collectives']}; seconds {r['seconds']}")
    # the plans really communicate: partial sums are all_reduced
    assert any(kind == "all_reduce" for kind, _ in fwd["plan"]), fwd["plan"]
    assert any(kind == "all_reduce" for kind, _ in train["plan"]), train["plan"]
    # every collective runs in the model's dtype (or a wider one the model's own ops compute in)
    assert {dt for _, dt in r["collectives"]["forward"]} == {dtype_name}, r["collectives"]
    assert {dt for _, dt in r["collectives"]["train"]} <= {dtype_name, *wider}, r["collectives"]
    for rank, r in enumerate(results):
        fwd, train = r["forward"], r["train"]
        assert fwd["dtype"] == f"torch.{dtype_name}"
        assert fwd["err"] <= FORWARD_EPS * eps * fwd["scale"], (rank, fwd)
        assert train["losses"] == pytest.approx(train["ref_losses"], rel=LOSS_EPS * eps), (rank, train)
        floor = GRAD_FLOOR * max(scale for _, scale, _ in train["grads"].values())
        for fqn, (err, scale, dt) in train["grads"].items():
            scale = max(scale, floor)
            assert dt == f"torch.{dtype_name}" and err <= GRAD_EPS * eps * scale, (rank, fqn, err / (eps * scale))
        for fqn, (err, scale, _, dt) in train["weights"].items():
            assert dt == f"torch.{dtype_name}" and err <= WEIGHT_EPS * eps * scale, (rank, fqn, err / (eps * scale))
    _check_agreement(results)


def test_an_fp32_sum_the_model_rounds_to_bf16_is_reduced_in_fp32(ranks):
    """`Downcast`: fc1 row-parallel makes its fp32 output a Partial sum, which the model casts to bf16.
    Its reduction (an all_reduce, or a reduce_scatter with the cast on the shards) runs in fp32 before the
    cast (one rounding to bf16, as on one device), not in bf16 after it; the result is within one bf16
    rounding of one device's."""
    results = ranks(2).run(run_low_precision, "downcast", (2,), "bfloat16")
    eps = _eps("bfloat16")
    for r in results:
        fwd = r["forward"]
        reductions = {dt for (name, dt) in r["collectives"]["forward"] if name in ("all_reduce", "all_reduce_", "reduce_scatter_tensor")}
        assert reductions == {"float32"}, r["collectives"]
        assert fwd["err"] <= eps * fwd["scale"], fwd
        assert r["train"]["losses"] == pytest.approx(r["train"]["ref_losses"], rel=LOSS_EPS * eps)
    _check_agreement(results)
