"""Training on gloo processes: 5 optimizer steps, every loss and parameter equal to one device's."""
import pytest

from tests.e2e.training_cases import TRAIN_CASES, run_training

BUDGET = "gpt-1d4-adamw-budget"


def _check_equal_to_one_device(results) -> None:
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-9, abs=1e-12), f"rank {rank}: {r}"
        assert r["param_err"] < 1e-9, f"rank {rank}: {r}"
    assert len({r["fingerprint"] for r in results}) == 1


@pytest.mark.parametrize("name", [n for n in TRAIN_CASES if n != BUDGET])
def test_training_matches_single_device(ranks, name):
    _check_equal_to_one_device(ranks(TRAIN_CASES[name].world).run(run_training, name))


def test_tight_memory_budget_shards_parameters_on_dp(ranks):
    """Unconstrained (data parallel pinned), the cheapest plan on gloo replicates every weight; 60% of its memory forces
    weights (and with them gradients and AdamW state) to be sharded on dp, gathered where used. It trains
    equal to one device, and the plan predicts what each rank holds."""
    from torch.distributed.tensor import Shard

    results = ranks(4).run(run_training, BUDGET)
    _check_equal_to_one_device(results)
    r = results[0]
    assert sum(r["predicted"].values()) <= r["budget"]
    assert r["predicted"]["optimizer"] < 0.8 * r["unconstrained"]["optimizer"]
    sharded = [fqn for fqn, ps in r["placements"].items() if fqn.endswith("weight") and isinstance(ps[0], Shard)]
    assert len(sharded) >= 4, r["placements"]
    # the prediction is exact for what the plan lays out evenly: parameters, gradients, AdamW state
    for kind in ("parameters", "gradients", "optimizer"):
        assert r["measured"][kind] == pytest.approx(r["predicted"][kind]), (kind, r)


def _agree(rank: int, world: int) -> list:
    import numpy as np

    from spmd.runtime.agreement import Rendezvous

    return list(Rendezvous().adopt_rank0(np.full(3, float(rank))))


def test_ranks_adopt_rank0_solution(ranks):
    """Tied optimal plans come back from the solver differently per process (timing); every rank must
    run rank 0's, or collectives mismatch and gradients go silently wrong (the old 2-D gloo 'desync')."""
    assert ranks(2).run(_agree) == [[0.0] * 3, [0.0] * 3]
