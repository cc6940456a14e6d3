"""Gradient clipping by global norm on gloo processes: `compiled.clip_grad_norm_` (and `grad_norm`, the
norm alone) returns the full gradients' norm on every rank, and training with it tracks one device clipping with
`torch.nn.utils.clip_grad_norm_` (losses, parameters, and the norm of every step)."""
import pytest

from tests.e2e.training_cases import CLIP_CASES, run_training



@pytest.mark.parametrize("name", list(CLIP_CASES))
def test_clipped_training_matches_single_device(ranks, name):
    case = CLIP_CASES[name]
    results = ranks(case.world).run(run_training, name)
    for rank, r in enumerate(results):
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-9, abs=1e-12), f"rank {rank}: {r}"
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-9, abs=1e-12), f"rank {rank}: {r}"
        assert r["param_err"] < 1e-9, f"rank {rank}: {r}"
    assert len({tuple(r["norms"]) for r in results}) == 1  # bit-identical on every rank
    r = results[0]
    assert max(r["ref_norms"]) > case.clip, r["ref_norms"]  # the clip really scaled the gradients
    assert any("Shard" in ps for ps in r["grad_placements"]), r["grad_placements"]  # some norm needs a reduction
    if case.mesh == (2, 2) and case.model == "mlp":  # fc1.weight pinned [S(0), S(1)]: reduced over both axes
        assert "(Shard(dim=0), Shard(dim=1))" in r["grad_placements"], r["grad_placements"]


def _scaled_step_with_an_overflow_on_rank_0(rank: int, world: int) -> dict:
    """One GradScaler step where only rank 0's piece of a sharded gradient overflows."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard

    import spmd
    from tests.models import MLP
    from tests.support import spec

    torch.manual_seed(0)
    model = MLP(16, 64)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    mesh = spmd.init_mesh((2,), ("tp",))
    compiled = spmd.compile(model, mesh, (x, y), loss_fn=F.mse_loss, mesh_spec=spec((2,), ("tp",)),
                            param_placements={"fc1.weight": [Shard(0)]})
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(compiled(*compiled.shard_inputs(x, y))).backward()
    piece = compiled.get_parameter("fc1.weight")
    if rank == 0:
        piece.grad[0, 0] = float("inf")
    before = {n: p.detach().clone() for n, p in compiled.named_parameters()}
    scaler.step(opt)
    scaler.update()
    moved = [n for n, p in compiled.named_parameters() if not torch.equal(p.detach(), before[n])]
    return {"moved": moved, "scale": scaler.get_scale()}


def test_a_grad_scaler_skips_the_step_on_every_rank_when_one_ranks_piece_overflows(ranks):
    """GradScaler looks for non-finite values in the gradients the optimizer holds: pieces, on a rank of a
    sharded parameter. Rank 0 alone skipped its step and halved its scale while rank 1 stepped, and the
    replicas drifted apart, silently; the flag is now agreed over the mesh (runtime/scaler_guard.py)."""
    for r in ranks(2).run(_scaled_step_with_an_overflow_on_rank_0):
        assert r == {"moved": [], "scale": 512.0}, r
