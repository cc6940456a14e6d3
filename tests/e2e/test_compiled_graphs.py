"""Rank graphs through torch.compile (`spmd.compile(..., compile_graphs=True)`, inductor on CPU with gcc):
training and inference equal to one device, collectives included in what inductor compiles."""
import pytest

from tests.e2e.training_cases import COMPILED_CASES, run_training


@pytest.mark.parametrize("name", list(COMPILED_CASES))
def test_compiled_training_matches_single_device(ranks, name):
    results = ranks(COMPILED_CASES[name].world).run(run_training, name, 3)
    for rank, r in enumerate(results):
        # inductor fuses and reorders float64 reductions: equal to rounding, not bit for bit
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-9, abs=1e-12), f"rank {rank}: {r}"
        assert r["param_err"] < 1e-9, f"rank {rank}: {r}"
        assert r["compiled_graphs"] == ["backward", "forward"], r
        assert sum(r["collectives"].values()) > 0, r  # the compiled graphs hold collectives
    assert len({r["fingerprint"] for r in results}) == 1


def _inference(rank: int, world: int) -> dict:
    import torch
    from torch.distributed.tensor import Replicate, Shard

    import spmd
    from spmd.core.errors import SpmdError
    from tests.models import MLP
    from tests.support import spec

    torch.manual_seed(0)
    model = MLP(16, 64)
    x = torch.randn(6, 16)
    mesh = spmd.init_mesh((2,), ("tp",))
    with pytest.raises(SpmdError, match="compile_graphs must be"):
        spmd.compile(model, mesh, (x,), compile_graphs=3)
    # column- then row-parallel: an all_reduce inside the compiled graph
    pins = {"fc1.weight": [Shard(0)], "fc1.bias": [Shard(0)], "fc2.weight": [Shard(1)]}
    compiled = spmd.compile(model, mesh, (x,), mesh_spec=spec((2,), ("tp",)), param_placements=pins,
                            in_placements={"x": [Replicate()]}, compile_graphs=True)
    with torch.no_grad():
        out = compiled.gather_outputs(compiled(*compiled.shard_inputs(x)))
        expected = model(x)
    return {"err": float((out - expected).abs().max()), "compiled": sorted(compiled._compiled_graphs),
            "collectives": dict(compiled.plan.collective_summary())}


def test_compiled_inference_matches_single_device(ranks):
    for r in ranks(2).run(_inference):
        assert r["err"] < 1e-5, r
        assert r["compiled"] == ["graph"], r
        assert r["collectives"], r
