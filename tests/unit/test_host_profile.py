"""The host's CPU profile (runtime/host.py): timed once, then fitted from the cache; the built-in or a
profile file where SPMD_CPU_PROFILE says so; on a process group, rank 0 decides and every rank gets the
same profile or the same error. The timing itself is replaced by fixed points here (no processes, no
seconds spent); tests/e2e/test_host_profile.py times for real on 2 gloo ranks."""
import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist

from spmd.core.errors import SpmdError
from spmd.core.profiles import device_profile_for, device_to_json, link_profile_for, save_profile
from spmd.runtime import host
from spmd.runtime.measure import builtin_cpu, fit_device

# what measure_device(quick=True) returns, at 200 GFLOP/s, 100 GB/s, 5 us per op, 2 us per view
POINTS = {"matmul": [(2e9, 0.01), (4e9, 0.02)], "stream": [(12e5, 12e-6), (24e5, 24e-6)],
          "dram": [(12e7, 12e-3)], "fault": [], "elementwise": {"gelu": 0.5e-9, "exp": 0.3e-9},
          "op": [(40.0, 5e-6)], "view": [(80.0, 2e-6)]}


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """SPMD_CPU_PROFILE=measured with a fresh cache; returns the list of measure_device calls."""
    monkeypatch.setenv("SPMD_CPU_PROFILE", "measured")
    monkeypatch.setenv("SPMD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(host, "_known", {})
    calls = []

    def measure_device(warmup=2, reps=9, quick=False):
        calls.append(quick)
        return POINTS
    monkeypatch.setattr(host, "measure_device", measure_device)
    return calls


def test_the_host_is_timed_once_then_fitted_from_the_cache(measured, monkeypatch):
    first = host.host_cpu_profile()
    assert measured == [True]  # the quick timing
    assert first.name == "measured-cpu" and "timed on this host" in first.source
    assert first.flops == pytest.approx(200e9, rel=1e-6)
    assert first.op_overhead_s == pytest.approx(5e-6) and first.view_overhead_s == pytest.approx(2e-6)
    kernels, builtin = dict(first.element_seconds), dict(builtin_cpu().element_seconds)
    assert kernels["gelu"] == pytest.approx(0.5e-9)
    # kernels the quick run did not time: the built-in's, times the median timed / built-in ratio
    scale = (0.5e-9 / builtin["gelu"] + 0.3e-9 / builtin["exp"]) / 2
    assert kernels["tanh"] == pytest.approx(builtin["tanh"] * scale)
    cached = json.loads(host.cache_path().read_text())
    assert cached["points"]["matmul"] == [list(p) for p in POINTS["matmul"]]  # the timings and their fit
    assert host.host_cpu_profile() == first
    monkeypatch.setattr(host, "_known", {})  # a new process: only the file is left
    assert host.host_cpu_profile() == first
    assert measured == [True]  # never timed again
    # a changed fit (or built-in) fits the cached timings again, and keeps that fit
    monkeypatch.setattr(host, "_known", {})
    monkeypatch.setattr(host, "FIT_VERSION", host.FIT_VERSION + 1)
    fits = []
    real = host._fitted
    monkeypatch.setattr(host, "_fitted", lambda points: fits.append(1) or real(points))
    assert host.host_cpu_profile() == first and fits == [1] and measured == [True]
    monkeypatch.setattr(host, "_known", {})
    assert host.host_cpu_profile() == first and fits == [1]  # the file holds the new fit


def test_a_cache_for_another_key_or_damaged_is_timed_again(measured, monkeypatch):
    path = host.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": {**host.cache_key(), "cpu": "another CPU"}, "points": POINTS}))
    host.host_cpu_profile()
    for damaged in ("{ not json", json.dumps({"key": host.cache_key(), "points": {"op": "x"}})):
        monkeypatch.setattr(host, "_known", {})
        path.write_text(damaged)
        host.host_cpu_profile()
    assert measured == [True, True, True]
    assert json.loads(path.read_text())["key"] == host.cache_key()


def test_an_unwritable_cache_warns_and_this_process_remembers(measured, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SPMD_CACHE_DIR", str(blocker / "cache"))  # a folder inside a file: cannot exist
    with pytest.warns(UserWarning, match="could not cache"):
        first = host.host_cpu_profile()
    assert host.host_cpu_profile() == first and measured == [True]


def test_the_cache_depends_on_the_ranks_sharing_the_host(measured, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    two = host.cache_path()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host.cache_path() != two  # four ranks on the cores time slower ranks than two


class FakeGroup:
    """torch.distributed as rank `rank` of `world` sees it: the other ranks' SPMD_CPU_PROFILE and what
    rank 0 broadcasts are given."""

    def __init__(self, monkeypatch, rank: int, world: int, choices: list[str], sent: list | None = None):
        self.reads = []
        self.sent = list(sent or [])
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

        def all_gather_object(out, obj, group=None):
            out[:] = choices

        def broadcast_object_list(objs, src=0, group=None):
            if rank != 0:
                objs[0] = self.sent.pop(0)
        monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
        monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
        real = host._resolve
        monkeypatch.setattr(host, "_resolve", lambda *a: self.reads.append(a) or real(*a))


def test_other_ranks_take_what_rank_0_sends(measured, monkeypatch):
    theirs = fit_device(POINTS, "rank 0's", 8e9)
    group = FakeGroup(monkeypatch, rank=1, world=2, choices=["measured", "measured"],
                      sent=[("device", device_to_json(theirs))])
    assert host.host_cpu_profile() == theirs
    assert group.reads == [] and measured == []  # rank 1 neither reads the cache nor times alone


def test_ranks_time_together_when_rank_0_says_so(measured, monkeypatch):
    theirs = fit_device(POINTS, "rank 0's", 8e9)
    FakeGroup(monkeypatch, rank=1, world=2, choices=["measured"] * 2,
              sent=[("time", None), ("device", device_to_json(theirs))])
    assert host.host_cpu_profile() == theirs
    assert measured == [True]  # it timed with rank 0, and took rank 0's fit
    assert not host.cache_path().exists()  # rank 0 writes the cache


def test_ranks_started_with_different_settings_all_fail_alike(measured, monkeypatch):
    FakeGroup(monkeypatch, rank=1, world=2, choices=["measured", "builtin"])
    with pytest.raises(SpmdError, match=r"different SPMD_CPU_PROFILE: rank 0: 'measured', rank 1: 'builtin'"):
        host.host_cpu_profile()
    assert measured == []


def test_an_error_on_rank_0_reaches_every_rank(monkeypatch, tmp_path):
    bad = str(tmp_path / "missing.json")
    monkeypatch.setenv("SPMD_CPU_PROFILE", bad)
    FakeGroup(monkeypatch, rank=1, world=2, choices=[bad, bad], sent=[("error", "SPMD_CPU_PROFILE=...: not a profile file")])
    with pytest.raises(SpmdError, match="not a profile file"):
        host.host_cpu_profile()


def test_builtin_is_the_built_in_scaled_by_the_ranks_sharing_the_cores(monkeypatch):
    monkeypatch.setenv("SPMD_CPU_PROFILE", "builtin")
    FakeGroup(monkeypatch, rank=0, world=4 * (os.cpu_count() or 1), choices=["builtin"] * 4 * (os.cpu_count() or 1))
    got = host.host_cpu_profile()  # no LOCAL_WORLD_SIZE: the group's size counts the ranks (as torch spawns them)
    assert got == device_profile_for("cpu").scaled(0.25)


def test_a_profile_file(tmp_path, monkeypatch):
    path = tmp_path / "profile.json"
    calibrated = fit_device(POINTS, "test", 8e9)
    save_profile(str(path), {"tp": link_profile_for("gloo")}, calibrated)
    monkeypatch.setenv("SPMD_CPU_PROFILE", str(path))
    assert host.host_cpu_profile() == calibrated


def test_a_bad_setting_names_the_variable_and_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_CPU_PROFILE", str(tmp_path / "missing.json"))
    with pytest.raises(SpmdError, match=r"SPMD_CPU_PROFILE=.*What to do: set it to 'measured'"):
        host.host_cpu_profile()


def test_the_suite_plans_with_the_builtin_profile():
    """conftest.py sets SPMD_CPU_PROFILE=builtin: the plans tests check must not depend on the machine."""
    assert os.environ.get("SPMD_CPU_PROFILE") == "builtin"


def test_a_graph_runs_its_kernels_slower_than_a_loop_does_and_the_profile_says_by_how_much():
    """`in_graph`: a transformer block's graph timed whole at two sizes, t = a * fixed + work + bytes / B
    of the loop-timed profile's price of it, gives a (per-node fixed costs) and B (the bandwidth at which
    a graph's ops read and write their tensors on top of their work)."""
    import math

    from spmd.cost_model.compute import compute_cost
    from spmd.core.specs import TensorInfo
    from spmd.runtime.measure import BLOCK_SIZES, _block_graph, in_graph, priced

    looped = fit_device(POINTS, "test", 8e9)
    assert math.isinf(looped.operand_bandwidth)  # (no block timings: the roofline alone)
    prices = [priced(_block_graph(*size)[0], looped) for size in BLOCK_SIZES]
    assert all(fixed > 0 and work > 0 and moved > 0 for fixed, work, moved in prices)
    assert prices[0][0] / prices[0][1] > prices[1][0] / prices[1][1]  # the small graph is its fixed costs
    timed = [(*size, 1.5 * fixed + work + moved / 20e9) for size, (fixed, work, moved) in zip(BLOCK_SIZES, prices)]
    dev = in_graph(looped, timed)
    assert dev.op_overhead_s == pytest.approx(1.5 * looped.op_overhead_s)
    assert dev.view_overhead_s == pytest.approx(1.5 * looped.view_overhead_s)
    assert dev.operand_bandwidth == pytest.approx(20e9) and dev.flops == looped.flops
    # an op then pays its bytes at that bandwidth on top of the roofline
    x = TensorInfo((256, 256), torch.float32)
    add = torch.ops.aten.add.Tensor
    extra = compute_cost(add, ((256, 256), (256, 256)), {}, [x, x], [x], dev) - \
        compute_cost(add, ((256, 256), (256, 256)), {}, [x, x], [x], looped)
    assert extra == pytest.approx(3 * x.nbytes / 20e9 + 0.5 * looped.op_overhead_s)
    for (gm, _), (*size, t) in zip((_block_graph(*size) for size in BLOCK_SIZES), timed):
        fixed, work, _ = priced(gm, dev)  # the fitted device prices each block at its time
        assert fixed + work == pytest.approx(t)
    assert in_graph(looped, timed[:1]) == looped  # one size cannot tell the two apart
    assert in_graph(looped, [(*size, 0.0) for size in BLOCK_SIZES]) == looped  # nothing positive: as timed
    assert fit_device({**POINTS, "block": timed}, "test", 8e9) == dev


def test_an_op_never_gets_cheaper_as_it_grows_past_the_caches():
    from spmd.cost_model.compute import compute_cost
    from spmd.core.specs import TensorInfo

    # (the cold rate below the caches is dearer than DRAM beyond them: the edge case)
    dev = dataclasses.replace(fit_device(POINTS, "test", 8e9), cache_bytes=8 * 2**20, operand_bandwidth=13e9,
                              dram_bandwidth=25e9)
    add = torch.ops.aten.add.Tensor
    prices = []
    for n in range(2**17, 2**21, 2**15):  # 1.5 to 24 MiB moved, across cache_bytes
        x = TensorInfo((n,), torch.float32)
        prices.append(compute_cost(add, ((n,), (n,)), {}, [x, x], [x], dev))
    assert all(b >= a for a, b in zip(prices, prices[1:]))


def test_the_graphs_it_times_trace_under_no_grad():
    """A compile under torch.no_grad() (inference code) still times the host."""
    from spmd.runtime.measure import _block_graph, _small_joint_graph

    _block_graph.cache_clear()
    with torch.no_grad():
        gm, _ = _block_graph(2, 8, 16, 2)
        small, _ = _small_joint_graph()
    assert len(gm.graph.nodes) > 100 and len(small.graph.nodes) > 50


def test_the_wrapper_around_the_graphs_is_fitted_from_its_timings():
    """Per call 6 us + 0.5 us per argument; per training step 50 us + 2 us per parameter and saved value:
    four timings (forward and training, two sizes) give back exactly those, and the plan prices them."""
    def t(training, args, params, saved):
        return 6e-6 + 0.5e-6 * args + training * (50e-6 + 2e-6 * (params + saved))
    wrapper = [(tr, a, p, s, t(tr, a, p, s)) for tr, a, p, s in ((0.0, 3.0, 2.0, 0.0), (0.0, 13.0, 12.0, 0.0),
                                                                  (1.0, 4.0, 2.0, 4.0), (1.0, 14.0, 12.0, 19.0))]
    dev = fit_device({**POINTS, "wrapper": wrapper}, "test", 8e9)
    assert dev.call_overhead_s == pytest.approx(6e-6) and dev.arg_overhead_s == pytest.approx(0.5e-6)
    assert dev.backward_overhead_s == pytest.approx(50e-6) and dev.autograd_tensor_overhead_s == pytest.approx(2e-6)
    # timings that fall with size (noise) give a flat cost, never a negative one; none: the built-in's
    flat = fit_device({**POINTS, "wrapper": [(0.0, 3.0, 2.0, 0.0, 9e-6), (0.0, 13.0, 12.0, 0.0, 5e-6),
                                             (1.0, 4.0, 2.0, 4.0, 80e-6), (1.0, 14.0, 12.0, 19.0, 70e-6)]}, "test", 8e9)
    assert (flat.call_overhead_s, flat.arg_overhead_s) == (pytest.approx(7e-6), 0.0)
    assert (flat.backward_overhead_s, flat.autograd_tensor_overhead_s) == (pytest.approx(68e-6), 0.0)
    cpu = builtin_cpu()
    assert fit_device(POINTS, "test", 8e9).backward_overhead_s == cpu.backward_overhead_s


def test_the_timed_wrappers_are_compiled_modules_with_the_counts_plans_price():
    from spmd.runtime.measure import WRAPPER_LAYERS, _wrapped, measure_wrapper

    points = measure_wrapper(warmup=0, reps=1, seconds=1e-4)
    assert len(points) == 2 * len(WRAPPER_LAYERS) and all(p[-1] >= 0 for p in points)
    for training in (False, True):
        compiled, inputs, _ = _wrapped(WRAPPER_LAYERS[-1], training)
        args, params, saved = compiled.plan.wrapper_counts
        assert (args, params) == (2 * WRAPPER_LAYERS[-1] + 1 + training, 2 * WRAPPER_LAYERS[-1])
        assert (saved > 0) == training
        out = compiled(*inputs)
        assert out.shape == (() if training else (4, 8))


def test_timing_the_host_leaves_the_users_random_numbers_alone(monkeypatch):
    """The probe draws random tensors; a seed the user set before compiling gives what it gave before."""
    def measure_device(**_):
        torch.randn(100)
        return dict(POINTS)
    monkeypatch.setattr(host, "measure_device", measure_device)
    torch.manual_seed(7)
    expected = torch.randn(3)
    torch.manual_seed(7)
    host._timings()
    assert torch.equal(torch.randn(3), expected)


def test_a_compiled_module_reads_a_parameter_moved_out_of_its_table():
    """The wrapper reads parameters from nn.Module's table; one a parametrization moved out is found as
    getattr finds it (the probe's tiny compiled model serves as the module)."""
    from torch.nn.utils import parametrize

    from spmd.runtime.measure import _wrapped

    compiled, inputs, _ = _wrapped.__wrapped__(1, False)  # (not the probe's cached one)
    before = compiled(*inputs).detach()
    name = next(name for name, _ in compiled.named_parameters() if name.endswith("weight"))
    holder, attr = compiled.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]

    class Doubled(torch.nn.Module):
        def forward(self, w):
            return 2 * w
    parametrize.register_parametrization(holder, attr, Doubled())
    try:
        assert attr not in holder._parameters
        assert not torch.allclose(compiled(*inputs), before)
    finally:
        parametrize.remove_parametrizations(holder, attr, leave_parametrized=False)
    assert torch.allclose(compiled(*inputs), before)
