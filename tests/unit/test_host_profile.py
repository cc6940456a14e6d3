"""The host's CPU profile (runtime/host.py): measured once, then read from the cache; the built-in or a
profile file where SPMD_CPU_PROFILE says so. The timing itself is replaced by fixed points here (no
processes, no seconds spent); tests/e2e/test_host_profile.py measures for real on 2 gloo ranks."""
import json
import os

import pytest

from spmd.core.errors import SpmdError
from spmd.core.profiles import link_profile_for, save_profile
from spmd.runtime import host
from spmd.runtime.measure import builtin_cpu, fit_device

# what measure_device(quick=True) returns, at 200 GFLOP/s, 100 GB/s, 5 us per op
POINTS = {"matmul": [(2e9, 0.01), (4e9, 0.02)], "stream": [(12e5, 12e-6), (24e5, 24e-6)],
          "dram": [(12e7, 12e-3)], "fault": [], "elementwise": {"gelu": 0.5e-9, "exp": 0.3e-9},
          "op": [(40.0, 5e-6)], "view": [(80.0, 2e-6)]}


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """SPMD_CPU_PROFILE=measured with a fresh cache; returns the list of measure_device calls."""
    monkeypatch.setenv("SPMD_CPU_PROFILE", "measured")
    monkeypatch.setenv("SPMD_CACHE_DIR", str(tmp_path))
    calls = []

    def measure_device(quick=False):
        calls.append(quick)
        return POINTS
    monkeypatch.setattr(host, "measure_device", measure_device)
    return calls


def test_the_host_is_measured_once_then_read_from_the_cache(measured):
    first = host.host_cpu_profile()
    assert measured == [True]  # the quick timing
    assert first.name == "measured-cpu" and "first use" in first.source
    assert first.flops == pytest.approx(200e9, rel=1e-6)
    assert first.op_overhead_s == pytest.approx(5e-6)
    assert first.view_overhead_s == pytest.approx(2e-6)
    kernels, builtin = dict(first.element_seconds), dict(builtin_cpu().element_seconds)
    assert kernels["gelu"] == pytest.approx(0.5e-9)
    # kernels the quick run did not time: the built-in's, times the median measured / built-in ratio
    scale = sorted([0.5e-9 / builtin["gelu"], 0.3e-9 / builtin["exp"]])
    assert kernels["tanh"] == pytest.approx(builtin["tanh"] * (scale[0] + scale[1]) / 2)
    assert host.cache_path().exists()
    again = host.host_cpu_profile()
    assert measured == [True]  # not measured again
    assert again == first


def test_a_cache_for_another_key_or_unreadable_is_measured_again(measured):
    path = host.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    other = {**host.cache_key(), "cpu": "another CPU"}
    path.write_text(json.dumps({"key": other, "device": {"name": "x"}}))
    host.host_cpu_profile()
    path.write_text("{ not json")
    host.host_cpu_profile()
    assert measured == [True, True]
    assert json.loads(path.read_text())["key"] == host.cache_key()


def test_the_cache_depends_on_the_ranks_sharing_the_host(measured, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    two = host.cache_path()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host.cache_path() != two  # four ranks on the cores measure slower ranks than two


def test_builtin_and_a_profile_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_CPU_PROFILE", "builtin")
    assert host.host_cpu_profile() == builtin_cpu()
    path = tmp_path / "profile.json"
    calibrated = fit_device(POINTS, "test", 8e9)
    save_profile(str(path), {"tp": link_profile_for("gloo")}, calibrated)
    monkeypatch.setenv("SPMD_CPU_PROFILE", str(path))
    assert host.host_cpu_profile().flops == pytest.approx(calibrated.flops)


def test_a_bad_setting_names_the_variable_and_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_CPU_PROFILE", str(tmp_path / "missing.json"))
    with pytest.raises(SpmdError, match=r"SPMD_CPU_PROFILE=.*What to do: set it to 'measured'"):
        host.host_cpu_profile()


def test_the_suite_plans_with_the_builtin_profile():
    """conftest.py sets SPMD_CPU_PROFILE=builtin: the plans tests check must not depend on the machine."""
    assert os.environ.get("SPMD_CPU_PROFILE") == "builtin"
