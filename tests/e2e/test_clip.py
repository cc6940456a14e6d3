"""Gradient clipping by global norm on gloo processes: `compiled.clip_grad_norm_` returns the full
gradients' norm on every rank, and training with it tracks one device clipping with
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
