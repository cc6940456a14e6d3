"""`compiled.verify(*inputs)` on gloo ranks: a correct plan passes in both modes, and a plan made wrong on
purpose (a collective that takes the max where it should sum) is caught, naming the first node it spoils."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd
from spmd.core import collectives as C
from tests.models import GPT, MLP, GPTConfig
from tests.support import lm_loss, megatron_spec, spec


def _verify(rank: int, world: int, what: str, mode: str, corrupt: bool) -> dict:
    torch.manual_seed(0)
    if what == "gpt-train":
        model = GPT(GPTConfig())
        g = torch.Generator().manual_seed(1)
        inputs = (torch.randint(0, 128, (2, 31), generator=g), torch.randint(0, 128, (2, 31), generator=g))
        mesh = spmd.init_mesh((2, 2), ("dp", "tp"))
        compiled = spmd.compile(model, mesh, inputs, loss_fn=lm_loss, mesh_spec=megatron_spec())
    elif what == "bn-transposed":
        model = _TransposedNorm()
        inputs = (torch.randn(4, 6, 8), torch.randn(4, 6, 4))
        mesh = spmd.init_mesh((2,), ("dp",))
        compiled = spmd.compile(model, mesh, inputs, loss_fn=F.mse_loss, mesh_spec=spec((2,), ("dp",)))
    elif what == "dropout-train":
        model = _DropoutMLP()
        inputs = (torch.randn(8, 16), torch.randn(8, 16))
        mesh = spmd.init_mesh((2,), ("dp",))
        compiled = spmd.compile(model, mesh, inputs, loss_fn=F.mse_loss, mesh_spec=spec((2,), ("dp",)),
                                in_placements={"x": [Shard(0)]})
    else:  # "mlp": Megatron's pair; "mlp-then": an op after it reads the value reduced in place
        model = MLP(16, 64) if what == "mlp" else _Then(MLP(16, 64, bias=False))
        inputs = (torch.randn(4, 16),)
        mesh = spmd.init_mesh((2,), ("tp",))
        at = "" if what == "mlp" else "inner."
        compiled = spmd.compile(model, mesh, inputs, mesh_spec=spec((2,), ("tp",)),
                                param_placements={f"{at}fc1.weight": [Shard(0)], f"{at}fc2.weight": [Shard(1)],
                                                  **({"fc1.bias": [Shard(0)]} if what == "mlp" else {})},
                                **({} if what == "mlp" else dict(in_placements={"x": [Replicate()]},
                                                                  out_placements=[[Replicate()]])))
    if corrupt:  # the reduction after the row-parallel matmul now takes the max of the partial sums
        for node in compiled.graph_module.graph.nodes:
            if node.target in (C.all_reduce, C.reduce_scatter) and node.kwargs.get("reduce_op") == "sum":
                node.kwargs = {**node.kwargs, "reduce_op": "max"}
                break
        else:
            raise AssertionError("no reduction to corrupt:\n" + compiled.code)
        compiled.graph_module.recompile()
    before = {k: v.clone() for k, v in compiled.state_dict().items()}
    report = compiled.verify(*inputs, mode=mode)
    unchanged = all(torch.equal(before[k], v) for k, v in compiled.state_dict().items())
    return {"ok": report.ok, "mode": report.mode, "text": str(report), "max_error": report.max_error,
            "n_outputs": len(report.outputs), "n_grads": len(report.gradients),
            "worst": report.worst.node if report.worst else None, "nodes": report.nodes_compared,
            "random": list(report.random_ops), "unchanged": unchanged,
            "in_place": any(n.kwargs.get("inplace") for n in compiled.graph_module.graph.nodes)}


class _DropoutMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(F.dropout(F.gelu(self.fc1(x)), 0.2, training=True))


class _TransposedNorm(torch.nn.Module):
    """Batch norm over a transposed activation: its CPU kernel returns a contiguous tensor where the trace's fake
    one kept the input's strides, so the traced `view` after it cannot view the real value."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.head = torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.bn(self.fc(x).transpose(1, 2)).transpose(1, 2))


class _Then(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.tanh(self.inner(x))


@pytest.mark.parametrize("what", ["mlp", "mlp-then"])
@pytest.mark.parametrize("mode", ["one device", "op by op"])
def test_a_correct_plan_passes(ranks, mode, what):
    """"mlp-then": the row-parallel matmul's partial sums are all_reduced in place (passes/reduce_in_place.py), and
    op by op read them back for the tanh after the reduction: summed once more, a false MISMATCH (Mixtral's
    aux loss, 0.155)."""
    results = ranks(2).run(_verify, what, mode, False)
    for r in results:
        assert r["ok"] and r["mode"] == mode and r["unchanged"], r["text"]
        assert r["in_place"] or what == "mlp", r["text"]
        assert r["max_error"] < 1e-5 and r["n_outputs"] == 1 and r["nodes"] >= 4, r["text"]
    assert results[0]["text"] == results[1]["text"]  # one report, on every rank


def test_training_a_gpt_on_a_2x2_mesh_passes(ranks):
    r = ranks(4).run(_verify, "gpt-train", "auto", False)[0]
    assert r["ok"] and r["mode"] == "one device" and r["unchanged"], r["text"]
    assert r["n_outputs"] == 1 and r["n_grads"] >= 10 and r["max_error"] < 1e-4, r["text"]


def test_a_kernel_that_lays_its_output_out_otherwise_than_the_trace_is_checked(ranks):
    """Found by a probe: the single-device reference ran the traced `view` after a batch norm over a transposed
    activation on the kernel's contiguous output, and verify stopped with an SpmdInternalError (the rank graphs
    run it as a reshape, as the reference now does)."""
    r = ranks(2).run(_verify, "bn-transposed", "one device", False)[0]
    assert r["ok"] and r["n_grads"] == 6, r["text"]


def test_dropout_draws_are_adopted_and_what_follows_is_compared(ranks):
    r = ranks(2).run(_verify, "dropout-train", "one device", False)[0]
    assert r["ok"] and r["random"] and r["n_grads"] == 4, r["text"]


@pytest.mark.parametrize("mode", ["one device", "op by op"])
def test_a_wrong_collective_is_caught(ranks, mode):
    results = ranks(2).run(_verify, "mlp", mode, True)
    r = results[0]
    assert not r["ok"], r["text"]
    assert "MISMATCH" in r["text"] and "BAD" in r["text"], r["text"]
    assert r["max_error"] > 0.1, r["text"]
    bad = [line for line in r["text"].splitlines() if line.startswith("  BAD output 0")]
    assert bad and " then reduce_scatter_" in bad[0] or " then all_reduce_" in bad[0], r["text"]


def _verify_unseeded(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = MLP(16, 64)
    mesh = spmd.init_mesh((2,), ("tp",))
    compiled = spmd.compile(model, mesh, (torch.randn(4, 16),), mesh_spec=spec((2,), ("tp",)))
    torch.manual_seed(rank)  # (each rank draws its own "full" inputs)
    try:
        compiled.verify(torch.randn(4, 16))
    except spmd.SpmdError as e:
        return str(e)
    return "passed"


def test_full_inputs_that_differ_between_ranks_are_named_not_compared(ranks):
    """Found by a check of the docs' examples: inputs drawn unseeded on each rank gave a MISMATCH at the first op
    reading them, for a module that trains equal to one device."""
    for said in ranks(2).run(_verify_unseeded):
        assert "verify's full inputs differ between ranks ('x' along 'tp')" in said and "torch.manual_seed" in said, said
