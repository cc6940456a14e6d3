"""`plan.explain()`: a golden text for a tiny model, the Megatron summary and alternatives on GPT.

Regenerate the golden file after an intended change with `SPMD_REGEN_GOLDEN=1 python -m pytest
tests/test_explain.py` and review it as a diff.
"""
import os
from pathlib import Path

import torch
import torch.nn.functional as F

import spmd
from examples.models import MLP
from tests.cases import spec
from tests.test_visualize import gpt_plan

GOLDEN = Path(__file__).parent / "golden"


def _mlp_plan():
    """MLP 16 -> 64 -> 16 on (dp=2, tp=2) with the compute-bound test profile: the batch of 2 splits on
    dp (pinned: with GELU priced by its FLOPs per element, sharding the hidden dim over both axes is as
    good), fc1 is column-parallel and fc2 row-parallel on tp."""
    from torch.distributed.tensor import Replicate, Shard

    torch.manual_seed(0)
    return spmd.plan(MLP(16, 64), spec((2, 2), ("dp", "tp")), (torch.randn(2, 16),),
                     in_placements={"x": [Shard(0), Replicate()]})


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("SPMD_REGEN_GOLDEN"):
        path.write_text(text)
    expected = path.read_text()
    assert text == expected, (f"{name} changed; if intended, regenerate with SPMD_REGEN_GOLDEN=1 and review "
                              f"the diff.\n--- got ---\n{text}")


def test_explain_mlp_matches_golden():
    _check_golden("explain_mlp_2x2.txt", _mlp_plan().explain())


def test_megatron_summary_on_gpt():
    text = gpt_plan().explain()
    for line in ("blocks.*.attn.q_proj  Linear     column-parallel on tp; replicated on dp",
                 "blocks.*.attn.o_proj  Linear     row-parallel on tp; replicated on dp; bias [R, R]",
                 "blocks.*.mlp.fc1      Linear     column-parallel on tp; replicated on dp",
                 "blocks.*.ln1          LayerNorm  replicated",
                 "input tokens [S(0), R]: batch split on dp (data parallel)",
                 "all_reduce  tp    4      31.0 KiB  4000.3 us"):
        assert line in text, line


def test_best_alternative_and_why_it_lost():
    from spmd.explain import details_of

    plan = gpt_plan()

    rows = {r.label: r for r in details_of(plan).nodes}
    q = rows["blocks.0.attn.q_proj.weight"]
    assert (q.op, q.module, q.chosen, q.alternative) == ("parameter", "blocks.0.attn.q_proj", "[R, S(0)]", "[R, R]")
    assert q.delta > 0 and q.reason.startswith(f"{q.delta * 1e6:.1f} us slower") and "communication" in q.reason
    o = rows["addmm_3"]  # o_proj: row-parallel, its Partial output is all_reduced by its consumer
    assert o.chosen == "[S(0), P]" and o.module == "blocks.0.attn.o_proj" and o.cost.comm_out > 0
    # every shown node's chosen local cost is no worse than its alternative, or the reason says why
    for r in rows.values():
        assert r.alternative is None or r.delta >= -1e-7 or "global optimum" in r.reason
    # the nodes' input resharding adds up to the plan's communication
    assert abs(sum(r.cost.comm_in for r in rows.values()) - plan.comm_cost) < 1e-9


def test_explain_training_plan_names_phases_and_modules():
    torch.manual_seed(0)
    plan = spmd.plan(MLP(16, 64), spec((2,), ("dp",)), (torch.randn(8, 16), torch.randn(8, 16)),
                     loss_fn=lambda y, t: F.mse_loss(y, t))
    text = plan.explain()
    assert "fc2 (backward)" in text and "fc1 (forward)" in text and "model." not in text
    assert "all_reduce  dp" in text  # gradient reductions, priced as bucketed


def test_repeated_layers_are_reported_once_with_their_count():
    """A 4-layer GPT ties its layers: each op of a layer is one row (`blocks.*`, x4), not four."""
    from examples.models import GPT, GPTConfig

    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (4, 32))
    plan = spmd.plan(GPT(GPTConfig(layers=4)), spec((2, 2), ("dp", "tp")), (tokens, tokens),
                     loss_fn=lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()))
    nodes = plan.explain().split("\nNodes")[1]
    assert "blocks.*.attn.q_proj.weight" in nodes and "blocks.1." not in nodes
    rows = [line for line in nodes.splitlines() if " x4 " in line or line.rstrip().endswith(" x4")]
    assert len(rows) > 20  # forward and backward ops of a layer, each once
