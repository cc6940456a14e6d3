"""A 3-D mesh (dp, fsdp, tp) = (2, 2, 2) on 8 gloo processes: a small GPT's forward and 3 AdamW steps on
every rank equal one device's, with the plan using all three axes.

The layout is pinned the way torchtitan composes it: the batch split over dp and fsdp, every block's
Linear weights Megatron-style on tp (column-parallel q/k/v/fc1, row-parallel o_proj/fc2) and FSDP-style
on fsdp (the other dim), replicated on dp. Unpinned, the solver's program for this mesh (11.6k binaries,
336k edge columns) runs into HiGHS's 60 s limit; pinned, its relaxation is fractional and rank 0 plans it in
~12 s (branch and bound over the fractional choices, within 1% of the bound; bench/results_plan.md, session 43).
The rest (embeddings, norms, biases, every activation and collective) is the solver's."""
from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard

from tests.e2e.training_cases import TRAIN_CASES, TrainCase, run_training

_COLUMN, _ROW = [Replicate(), Shard(1), Shard(0)], [Replicate(), Shard(0), Shard(1)]
CASE = TrainCase(
    "gpt-3d-adamw-compute", "gpt", (2, 2, 2), ("dp", "fsdp", "tp"), "adamw", "compute", batch=4,
    in_placements={"tokens": [Shard(0), Shard(0), Replicate()]},
    param_placements={f"blocks.{i}.{name}.weight": (_ROW if name in ("attn.o_proj", "mlp.fc2") else _COLUMN)
                      for i in range(2) for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                                                     "mlp.fc1", "mlp.fc2")})


def _train_3d(rank: int, world: int) -> dict:
    TRAIN_CASES.setdefault(CASE.name, CASE)  # this process's table (a spawned rank imports it afresh)
    return run_training(rank, world, CASE.name, steps=3)


def test_3d_mesh_trains_equal_to_one_device(ranks):
    results = ranks(8).run(_train_3d)
    for rank, r in enumerate(results):
        assert len(r["losses"]) == 3
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-9, abs=1e-12), f"rank {rank}: {r}"
        assert r["param_err"] < 1e-9, f"rank {rank}: {r}"
    assert len({r["fingerprint"] for r in results}) == 1
    axes = {axis for _, axis in results[0]["collectives"]}
    assert {"dp", "fsdp", "tp"} <= axes, results[0]["collectives"]
