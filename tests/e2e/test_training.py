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
    # (every kind at its most is over; the search does not weigh a gradient bucket's flat copy at its launch, which
    # the prediction counts: compiler/budget.py warns of it)
    assert r["peak"] - r["packing"] <= r["budget"] < sum(r["predicted"].values())
    assert r["predicted"]["optimizer"] < 0.8 * r["unconstrained"]["optimizer"]
    sharded = [fqn for fqn, ps in r["placements"].items() if fqn.endswith("weight") and isinstance(ps[0], Shard)]
    assert len(sharded) >= 4, r["placements"]
    # the prediction is exact for what the plan lays out evenly: parameters, gradients, AdamW state
    for kind in ("parameters", "gradients", "optimizer"):
        assert r["measured"][kind] == pytest.approx(r["predicted"][kind]), (kind, r)


def _share_plan(rank: int, world: int, fail: str) -> dict:
    from spmd.runtime.agreement import Rendezvous

    meeting, calls = Rendezvous(), []
    meeting.agree_on({"same": ["everywhere"]})  # the meeting before the plan

    def make():
        calls.append(rank)
        if fail == "in make":
            raise ValueError("the program is broken")
        return {"plan of rank": rank}

    try:  # what spmd.compile does: its pipeline, then the second meeting; any error goes to `fail`
        try:
            if fail == "before" and rank == 0:  # a pass before the solve, which the other ranks skip
                raise ValueError("no strategy")
            plan = meeting.share_plan(make)
            if fail == "after" and rank == 1:  # code generation, after the plan
                raise ValueError("no code")
        except Exception as e:
            meeting.fail(e)
            raise
        meeting.agree_on_plan("fingerprint")
        return {"calls": calls, "plan": plan}
    except Exception as e:
        return {"calls": calls, "error": f"{type(e).__name__}: {e}"}


def _explained(rank: int, world: int) -> dict:
    import torch
    import torch.nn.functional as F

    import spmd
    from tests.models import MLP
    from tests.support import megatron_spec

    torch.manual_seed(0)
    mesh = spmd.init_mesh((2,), ("tp",))
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    spec = megatron_spec()
    compiled = spmd.compile(MLP(16, 64), mesh, example_inputs=(x, y), loss_fn=F.mse_loss,
                            mesh_spec=type(spec)((2,), ("tp",), spec.links[1:], spec.device))
    return {"planned here": compiled.plan.sources.strategies is not None, "explain": compiled.plan.explain()}


def test_a_rank_that_took_rank0s_plan_explains_it_alike(ranks):
    """The other ranks never built the strategy and cost tables; explaining the plan there makes them
    from the rank's own trace, and says what rank 0's says."""
    zero, one = ranks(2).run(_explained)
    assert zero["planned here"] and not one["planned here"]
    assert one["explain"] == zero["explain"] and "best alternative" in zero["explain"], zero["explain"][:2000]


def test_rank0_plans_and_every_rank_takes_its_plan(ranks):
    """Tied optimal plans come back from the solver differently per process (timing); every rank must
    run rank 0's, or collectives mismatch and gradients go silently wrong (the old 2-D gloo 'desync').
    Only rank 0 plans: ranks sharing a host's cores no longer repeat the work at once. Where rank 0
    fails, inside the solve or before it, every rank raises (none waits forever for a plan)."""
    assert ranks(2).run(_share_plan, "") == [{"calls": [0], "plan": {"plan of rank": 0}},
                                              {"calls": [], "plan": {"plan of rank": 0}}]
    broken = "SpmdError: rank 0 could not plan: ValueError: "
    assert ranks(2).run(_share_plan, "in make") == [
        {"calls": [0], "error": "ValueError: the program is broken"},
        {"calls": [], "error": broken + "the program is broken"}]
    assert ranks(2).run(_share_plan, "before") == [{"calls": [], "error": "ValueError: no strategy"},
                                                   {"calls": [], "error": broken + "no strategy"}]
    # a rank failing after the plan: the others raise at the second meeting instead of waiting there
    zero, one = ranks(2).run(_share_plan, "after")
    assert zero == {"calls": [0], "error": "SpmdError: compile stopped on every rank because 1 rank(s) "
                                           "failed:\n  rank 1 could not compile: ValueError: no code"}
    assert one == {"calls": [], "error": "ValueError: no code"}
