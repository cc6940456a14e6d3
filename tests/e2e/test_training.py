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


def _solve_once(rank: int, world: int, fail: bool) -> dict:
    import numpy as np

    from spmd.cost_model.solver import IlpResult
    from spmd.runtime.agreement import Rendezvous

    calls = []

    def solve():
        calls.append(rank)
        if fail:
            raise ValueError("the program is broken")
        return IlpResult(np.full(3, float(rank)), 1.0, 1.0, 0.0, 0.1, "Optimal", 3, 0, 1)

    try:
        result = Rendezvous().solve_on_rank0(solve, 3)
    except Exception as e:
        return {"calls": calls, "error": f"{type(e).__name__}: {e}"}
    return {"calls": calls, "values": list(result.values)}


def test_rank0_solves_and_every_rank_takes_its_answer(ranks):
    """Tied optimal plans come back from the solver differently per process (timing); every rank must
    run rank 0's, or collectives mismatch and gradients go silently wrong (the old 2-D gloo 'desync').
    Only rank 0 solves: ranks sharing a host's cores no longer race each other through the solver."""
    assert ranks(2).run(_solve_once, False) == [{"calls": [0], "values": [0.0] * 3},
                                                {"calls": [], "values": [0.0] * 3}]
    # rank 0's solver fails: every rank raises (none waits forever for an answer)
    zero, one = ranks(2).run(_solve_once, True)
    assert zero == {"calls": [0], "error": "ValueError: the program is broken"}
    assert one == {"calls": [], "error": "SpmdError: rank 0 could not solve the placement program: "
                                         "ValueError: the program is broken"}
