"""The host's CPU profile timed for real at the first compile on 2 gloo ranks (runtime/host.py): every
rank plans with the same numbers, rank 0 writes the cache, and the next compile reads it; ranks started
with different settings all fail with the same error instead of waiting for each other."""
import os

import torch

from tests.models import MLP


def _with_env(env: dict, fn, *args):
    """`fn(*args)` with `env` set, then the environment as it was (the pool's ranks keep theirs between
    tests)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn(*args)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _compile_twice(rank: int, world: int, cache_dir: str) -> dict:
    import spmd
    from spmd.runtime import host

    def run():
        mesh = spmd.init_mesh((2,), ("tp",))
        torch.manual_seed(0)
        model, x = MLP(16, 64), torch.randn(8, 16)
        first = spmd.compile(model, mesh, (x,))
        cached = host.cache_path().exists()
        host._known.clear()  # as in a new process: only the file is left

        def refuse(*args, **kwargs):
            raise AssertionError("timed again")
        host.measure_device, measure = refuse, host.measure_device
        try:
            second = spmd.compile(model, mesh, (x,))
        finally:
            host.measure_device = measure
        out = first.gather_outputs(first(*first.shard_inputs(x)))
        return {"device": first.plan.mesh.device, "again": second.plan.mesh.device, "cached": cached,
                "close": torch.allclose(out, model(x), atol=1e-5)}
    return _with_env({"SPMD_CPU_PROFILE": "measured", "SPMD_CACHE_DIR": cache_dir}, run)


def test_the_first_compile_times_the_host_and_every_rank_plans_with_it(ranks, tmp_path):
    a, b = ranks(2).run(_compile_twice, str(tmp_path))
    assert a["cached"]  # rank 0 wrote it (the ranks share this host's file system)
    assert a["device"].name.startswith("measured-cpu") and a["device"] == b["device"]
    assert a["device"].flops > 0 and a["device"].op_overhead_s > 0
    assert a["again"] == a["device"] and b["again"] == b["device"]
    assert a["close"] and b["close"]


def _compile_with(rank: int, world: int, settings: list[str], cache_dir: str) -> str:
    import spmd

    def run():
        mesh = spmd.init_mesh((2,), ("tp",))
        try:
            spmd.compile(MLP(16, 64), mesh, (torch.randn(8, 16),))
        except spmd.SpmdError as e:
            return str(e)
        return "compiled"
    return _with_env({"SPMD_CPU_PROFILE": settings[rank], "SPMD_CACHE_DIR": cache_dir}, run)


def test_ranks_with_different_settings_fail_alike_and_do_not_hang(ranks, tmp_path):
    errors = ranks(2).run(_compile_with, ["measured", "builtin"], str(tmp_path))
    assert errors[0] == errors[1] and "different SPMD_CPU_PROFILE" in errors[0], errors
    missing = str(tmp_path / "missing.json")
    errors = ranks(2).run(_compile_with, [missing, missing], str(tmp_path))  # rank 0's error, on both
    assert errors[0] == errors[1] and "not a profile file" in errors[0], errors
