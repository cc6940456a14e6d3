"""The host's CPU profile measured for real at the first compile on 2 gloo ranks (runtime/host.py): every
rank plans with the same numbers, rank 0 writes the cache, and the next compile reads it."""
import os

import torch

from tests.models import MLP


def _compile_twice(rank: int, world: int, cache_dir: str) -> dict:
    import spmd
    from spmd.runtime import host

    os.environ.update(SPMD_CPU_PROFILE="measured", SPMD_CACHE_DIR=cache_dir)
    try:
        mesh = spmd.init_mesh((2,), ("tp",))
        torch.manual_seed(0)
        model, x = MLP(16, 64), torch.randn(8, 16)
        first = spmd.compile(model, mesh, (x,))
        cached = host.cache_path().exists()

        def refuse(quick=False):
            raise AssertionError("measured again")
        host.measure_device, measure = refuse, host.measure_device
        try:
            second = spmd.compile(model, mesh, (x,))
        finally:
            host.measure_device = measure
        out = first.gather_outputs(first(*first.shard_inputs(x)))
        return {"device": first.plan.mesh.device, "again": second.plan.mesh.device, "cached": cached,
                "close": torch.allclose(out, model(x), atol=1e-5)}
    finally:
        os.environ["SPMD_CPU_PROFILE"] = "builtin"
        os.environ.pop("SPMD_CACHE_DIR")


def test_the_first_compile_measures_the_host_and_every_rank_plans_with_it(ranks, tmp_path):
    a, b = ranks(2).run(_compile_twice, str(tmp_path))
    assert a["cached"]  # rank 0 wrote it (the ranks share this host's file system)
    assert a["device"].name.startswith("measured-cpu") and a["device"] == b["device"]
    assert a["device"].flops > 0 and a["device"].op_overhead_s > 0
    assert a["again"] == a["device"] and b["again"] == b["device"]
    assert a["close"] and b["close"]
