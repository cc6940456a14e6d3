"""Training on gloo processes: 5 optimizer steps, every loss and parameter equal to one device's."""
import pytest

from tests.training_cases import TRAIN_CASES, run_training

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("name", list(TRAIN_CASES))
def test_training_matches_single_device(ranks, name):
    results = ranks(TRAIN_CASES[name].world).run(run_training, name)
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-9, abs=1e-12), f"rank {rank}: {r}"
        assert r["param_err"] < 1e-9, f"rank {rank}: {r}"
    assert len({r["fingerprint"] for r in results}) == 1
