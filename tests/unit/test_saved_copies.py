"""Resharded copies that forward keeps for backward are saved activations, in the plan and in the budget row.

A layer norm's output all_gathered over tp for a column-parallel matmul: when the matmul reads it
through a view that backward also reads (the weight gradient's input), the rank graph keeps the
gathered copy until backward. It is as surely saved as the layer norm's own output. The budget row
used to see only the output, in its own layout, and the copy counted as a "temporary" the search met
through cuts (ViT-60B with the published 2-D layout came out at 3,912 ms with 39 GB of such
temporaries; priced in the row, 3,811 ms and 0.5 GB).

The model: ViT-60B's block (width 8192, 256 patches) on the simulated (8, 8) H100 mesh with the
published 2-D layout pinned, as bench/bench_plan.py plans it, cut to three layers and planned on meta
tensors.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd
from spmd.compiler.budget import schedule_of
from spmd.compiler.meta import fake_model
from spmd.core.graph_facts import is_view
from spmd.core.specs import pieces
from spmd.passes.solve_placements import saved_readers
from tests.models import ViT, ViTConfig
from tests.support import budget_rows, compile_graph

BATCH = 512
MESH = spmd.MeshSpec((8, 8), ("dp", "tp"))  # the default H100 / InfiniBand (dp) / NVLink (tp) profiles


def _loss(logits, labels):
    return F.cross_entropy(logits, labels)


def _model():
    cfg = ViTConfig.vit_60b(layers=3)
    with torch.device("meta"):
        model = ViT(cfg).to(torch.bfloat16)
        images = torch.empty(BATCH, cfg.channels, cfg.image, cfg.image, dtype=torch.bfloat16)
        labels = torch.randint(0, cfg.classes, (BATCH,))
    pins = {}
    for fqn, p in model.named_parameters():
        if fqn.startswith("blocks.") and any(k in fqn for k in ("q_proj", "k_proj", "v_proj", "fc1")):
            pins[fqn] = [Shard(0), Shard(0)]  # column-parallel on tp, FSDP on dp
        elif fqn.startswith("blocks.") and fqn.endswith(("o_proj.weight", "fc2.weight")):
            pins[fqn] = [Shard(0), Shard(1)]  # row-parallel
        else:
            dims = [d for d, s in enumerate(p.shape) if s % 8 == 0]
            pins[fqn] = [Shard(dims[0]), Replicate()] if dims else [Replicate(), Replicate()]
    options = dict(loss_fn=_loss, param_placements=pins, optimizer_state_factor=6.0, tie_blocks=True,
                   in_placements={"images": [Shard(0), Replicate()], "labels": [Shard(0), Replicate()]})
    return model, (images, labels), options


def _kept_copies(c) -> float:
    """Bytes per rank of the copies the plan's forward keeps for backward, found from the graph alone:
    resharded inputs of forward views that backward reads (through views), one per (value, layout). (A
    copy another op reads dies there: that op's output is what is saved.)"""
    graph = c.traced.graph
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    first_backward = min(order[n.name] for n in graph.nodes
                         if n.op == "call_function" and n.meta.get("partitioner_tag") == "is_backward")

    def read_in_backward(view) -> bool:
        return any(order[u.name] >= first_backward or u.op == "call_function" and is_view(u.target)
                   and read_in_backward(u) for u in view.users)

    kept = {}
    for e in c.plan.edges:
        node = next((n for n in graph.nodes if n.name == e.consumer), None)
        if node is None or node.meta.get("partitioner_tag") != "is_forward":
            continue
        if is_view(node.target) and read_in_backward(node):
            info = c.traced.tensor_info[e.value[0]]
            info = info[e.value[1]] if isinstance(info, tuple) else info
            kept[(e.value, e.dst)] = info.nbytes / pieces(e.dst, MESH.shape)
    return sum(kept.values())


def test_a_gathered_copy_backward_reads_is_a_saved_activation():
    """The unbudgeted plan keeps the layer norms' tp-gathered outputs for the weight gradients: they are
    counted with the saved activations (the memory row prices them on the edge's columns), and what the
    schedule holds beyond the saved activations shrinks by as much."""
    model, inputs, options = _model()
    c = compile_graph(*fake_model(model, inputs), MESH, **options)
    plan = c.plan
    kept = _kept_copies(c)
    assert kept > 0.2e9, kept  # the blocks' layer norm outputs, 8 images of 256 patches: 34 MB each
    assert saved_readers(schedule_of(c.traced))
    bases = sum(t.bytes(plan.output_placements(t.value), MESH.shape) for t in c.costs.memory
                if t.kind == "activations")
    assert plan.memory["activations"] == pytest.approx(bases + kept, rel=1e-9)
    assert plan.memory["temporaries"] < kept  # the copies are no longer "temporaries"


@pytest.mark.parametrize("recompute", [False, True, "selective"])
def test_recomputed_layers_free_their_kept_copies_in_the_row_as_in_the_plan(monkeypatch, recompute):
    """A recomputed layer keeps no copy for backward (its forward runs again there), except the last
    layer, whose rebuilt activations are held while its backward runs. The program's memory row at the
    chosen plan equals what the plan holds when backward starts (its kinds but gradients and
    temporaries): copies, and what recomputation frees of them, priced alike. (A first version let a copy's column rise with no copy behind it and
    free it in every recomputed layer: on 8 layers the row said 7.06 GB where the plan held 8.85.)"""
    model, inputs, options = _model()
    free = compile_graph(*fake_model(model, inputs), MESH, **options)
    rows = budget_rows(monkeypatch)
    c = compile_graph(*fake_model(model, inputs), MESH, recompute=recompute,  # a budget, for its row
                      memory_budget=2 * free.plan.predicted_peak_bytes, **options)
    plan = c.plan
    assert len(plan.recompute) + len(plan.recompute_selective) == (0 if recompute is False else 3)
    held = sum(b for k, b in plan.memory.items() if k not in ("gradients", "optimizer step", "temporaries"))  # when backward starts
    assert rows[-1] == pytest.approx(held, rel=1e-9)
    bases = sum(t.bytes(plan.output_placements(t.value), MESH.shape) for t in c.costs.memory
                if t.kind == "activations")
    # what the plan holds: every base and kept copy, less what the recomputed layers free
    assert plan.memory["activations"] == pytest.approx(bases + _kept_copies(c) - plan.recomputed_bytes, rel=1e-9)
