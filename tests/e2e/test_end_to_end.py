"""End to end on gloo processes: every rank's output equals the single-device model (float64)."""
import pytest

from tests.e2e.cases import CASES, run_case



@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_device(ranks, name):
    case = CASES[name]
    results = ranks(case.world).run(run_case, name)
    for rank, r in enumerate(results):
        assert r["max_err"] <= 1e-9 * max(1.0, r["scale"]), f"rank {rank}: {r}"
    assert len({r["fingerprint"] for r in results}) == 1, "ranks computed different plans"
    if case.sharded_params:  # the batch cannot be split, so compute is split by sharding weights
        assert all(r["param_bytes"] < r["full_param_bytes"] for r in results), results[0]
