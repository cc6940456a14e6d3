"""Golden texts for a small model: the annotated graph after every pass (SPMD_DUMP's files) and
`plan.explain()`. A pass that changes what it produces changes a file here: review it as a diff.

Regenerate after an intended change: `SPMD_REGEN_GOLDEN=1 python -m pytest tests/golden`.
"""
import os
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import spmd
from tests.models import MLP
from tests.support import compile_graph, spec

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def _check(path: Path, text: str) -> None:
    text = text.replace(str(ROOT), "<repo>")  # source lines name files; the clone's place is not the point
    text = re.sub(r"solved in \d+\.\d+ s", "solved in <seconds>", text)  # a timing, not a result
    text = re.sub(r"(<repo>/spmd/\S+\.py):\d+", r"\1:<line>", text)  # spmd's own lines move with its edits
    if os.environ.get("SPMD_REGEN_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing: regenerate with SPMD_REGEN_GOLDEN=1"
    assert text == path.read_text(), (f"{path.name} changed; if intended, regenerate with SPMD_REGEN_GOLDEN=1 and "
                                      f"review the diff.\n--- got ---\n{text}")


def test_explain_mlp_matches_golden():
    """MLP 16 -> 64 -> 16 on (dp=2, tp=2) with the compute-bound test profile: the batch of 2 splits on
    dp (pinned: with GELU priced by its FLOPs per element, sharding the hidden dim over both axes is as
    good), fc1 is column-parallel and fc2 row-parallel on tp."""
    torch.manual_seed(0)
    plan = spmd.plan(MLP(16, 64), spec((2, 2), ("dp", "tp")), (torch.randn(2, 16),),
                     in_placements={"x": [Shard(0), Replicate()]})
    _check(HERE / "explain_mlp_2x2.txt", plan.explain())


@pytest.mark.parametrize("case", ["forward", "training"])
def test_every_pass_dump_of_a_small_model(case, tmp_path):
    """MLP on (tp=2), rank 1, compiled as spmd.compile does (forward, or training with a loss). A batch of 3
    cannot be split in two, so the weights are: the dumps show collectives and local shapes."""
    torch.manual_seed(0)
    x = torch.randn(3, 16)
    if case == "forward":
        compile_graph(MLP(16, 64), (x,), spec((2,), ("tp",)), 1, dump_dir=str(tmp_path))
    else:
        compile_graph(MLP(16, 64), (x, x), spec((2,), ("tp",)), 1, dump_dir=str(tmp_path),
                      loss_fn=torch.nn.functional.mse_loss)
    written = sorted(tmp_path.iterdir())
    assert written, "no dumps"
    expected = sorted((HERE / "dumps" / case).glob("*.txt")) if not os.environ.get("SPMD_REGEN_GOLDEN") else []
    if expected:
        assert [p.name for p in written] == [p.name for p in expected]
    for p in written:
        _check(HERE / "dumps" / case / p.name, p.read_text())
