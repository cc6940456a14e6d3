"""Training on gloo processes: 5 optimizer steps, every loss and parameter equal to one device's."""
import pytest

from tests.training_cases import TRAIN_CASES, run_training

pytestmark = pytest.mark.distributed


KNOWN_DESYNC = pytest.mark.xfail(
    strict=False, reason="2-D training on gloo desynchronizes collectives intermittently (a rank's forward "
    "all_to_all meets a peer's 128-byte collective: 'Received data size doesn't match'); it passes when "
    "collectives are slowed by tracing, so it is timing-dependent; under investigation. The plan and its "
    "gradients are checked in one process by test_2d_training_gradients_match_single_device.")


@pytest.mark.parametrize("name", [pytest.param(n, marks=KNOWN_DESYNC) if TRAIN_CASES[n].mesh == (2, 2) else n
                                  for n in TRAIN_CASES])
def test_training_matches_single_device(ranks, name):
    results = ranks(TRAIN_CASES[name].world).run(run_training, name)
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-9, abs=1e-12), f"rank {rank}: {r}"
        assert r["param_err"] < 1e-9, f"rank {rank}: {r}"
    assert len({r["fingerprint"] for r in results}) == 1


def test_tight_memory_budget_shards_parameters_on_dp(ranks):
    """Unconstrained, the cheapest plan on gloo replicates every weight; 60% of its memory forces
    weights (and with them gradients and AdamW state) to be sharded on dp, gathered where used."""
    from torch.distributed.tensor import Shard

    results = ranks(4).run(run_training, "gpt-1d4-adamw-budget")  # numerics: the parametrized test above
    r = results[0]
    assert sum(r["predicted"].values()) <= r["budget"]
    assert r["predicted"]["optimizer"] < 0.8 * r["unconstrained"]["optimizer"]
    sharded = [fqn for fqn, ps in r["placements"].items() if fqn.endswith("weight") and isinstance(ps[0], Shard)]
    assert len(sharded) >= 4, r["placements"]
    assert r["param_err"] < 1e-9
    # the prediction is exact for what the plan lays out evenly: parameters, gradients, AdamW state
    for kind in ("parameters", "gradients", "optimizer"):
        assert r["measured"][kind] == pytest.approx(r["predicted"][kind]), (kind, r)
