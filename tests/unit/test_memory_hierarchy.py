"""The CPU device model: cache and DRAM bandwidth by the bytes an op moves, page faults of fresh large
outputs, measured seconds per element; the same numbers through profile files, plan files, the symbolic
cost formula and calibration's fit."""
from __future__ import annotations

import json
import math

import pytest
import sympy
import torch

from spmd.core.profiles import DeviceProfile, device_from_json, device_profile_for, device_to_json, load_profile, \
    save_profile
from spmd.core.specs import TensorInfo
from spmd.cost_model.compute import compute_cost

aten = torch.ops.aten
MiB = 2 ** 20


def _cpu(**kw) -> DeviceProfile:
    fields = dict(cache_bytes=8 * MiB, dram_bandwidth=1e10, fresh_page_bytes=32 * MiB, page_fault_bandwidth=1e9,
                  element_seconds=(("exp", 2e-9),))
    fields.update(kw)
    return DeviceProfile("cpu-test", 1e11, 5e10, 0.0, 8e9, "test", **fields)


def _add(numel: int, device) -> float:
    t = TensorInfo((numel,), torch.float32)
    return compute_cost(aten.add.Tensor, ((numel,), (numel,)), {}, [t, t], [t], device)


def test_an_op_streams_from_cache_then_from_dram_then_pays_its_fresh_pages():
    dev = _cpu()
    small, large, fresh = 1 << 18, 1 << 21, 1 << 24  # 3 MiB, 24 MiB moved; a 64 MiB output
    assert _add(small, dev) == pytest.approx(12 * small / 5e10)
    assert _add(large, dev) == pytest.approx(12 * large / 1e10)
    assert _add(fresh, dev) == pytest.approx(12 * fresh / 1e10 + 4 * fresh / 1e9)
    # a device with one bandwidth and no faults (the GPU profiles) prices all three alike
    flat = DeviceProfile("flat", 1e11, 5e10, 0.0, 8e9)
    assert _add(fresh, flat) / _add(small, flat) == pytest.approx(fresh / small)


def test_measured_seconds_per_element_replace_flops_and_leave_the_bandwidth_floor():
    dev = _cpu()
    n = 1 << 16
    t = TensorInfo((n,), torch.float32)
    assert compute_cost(aten.exp.default, ((n,),), {}, [t], [t], dev) == pytest.approx(2e-9 * n)
    # not listed: one FLOP per element, bandwidth-bound
    assert compute_cost(aten.neg.default, ((n,),), {}, [t], [t], dev) == pytest.approx(8 * n / 5e10)
    cheap = _cpu(element_seconds=(("exp", 1e-15),))
    assert compute_cost(aten.exp.default, ((n,),), {}, [t], [t], cheap) == pytest.approx(8 * n / 5e10)
    # dropout's two outputs (values and mask) both count
    mask = TensorInfo((n,), torch.bool)
    drop = _cpu(element_seconds=(("native_dropout", 3e-9),))
    assert compute_cost(aten.native_dropout.default, ((n,), 0.1, True), {}, [t], [t, mask], drop) == \
        pytest.approx(3e-9 * 2 * n)


def test_the_builtin_cpu_scales_its_rates_with_the_core_share():
    cpu = device_profile_for("cpu")
    half = cpu.scaled(0.5)
    assert half.dram_bandwidth == pytest.approx(cpu.dram_bandwidth / 2)
    assert half.page_fault_bandwidth == pytest.approx(cpu.page_fault_bandwidth / 2)
    assert half.seconds_per_element("exp") == pytest.approx(2 * cpu.seconds_per_element("exp"))
    assert half.cache_bytes == cpu.cache_bytes and half.fresh_page_bytes == cpu.fresh_page_bytes


def test_symbolic_cost_equals_the_concrete_one_on_every_side_of_the_thresholds():
    dev = _cpu()
    from spmd.cost_model.symbolic import SymInfo

    b = sympy.Symbol("b", positive=True)
    sym = SymInfo((b * (1 << 16),), torch.float32)
    formula = compute_cost(aten.add.Tensor, ((b * (1 << 16),),) * 2, {}, [sym, sym], [sym], dev, symbolic=True)
    for batch in (1, 4, 32, 256):  # 0.75, 3, 24 MiB moved; a 64 MiB output
        assert float(formula.subs(b, batch)) == pytest.approx(_add(batch << 16, dev))


def test_profile_and_plan_files_keep_the_hierarchy(tmp_path):
    dev = _cpu()
    doc = device_to_json(dev)
    json.dumps(doc, allow_nan=False)  # strict JSON
    assert device_from_json(json.loads(json.dumps(doc))) == dev
    flat = DeviceProfile("flat", 1e11, 5e10, 0.0, 8e9)
    assert device_from_json(json.loads(json.dumps(device_to_json(flat), allow_nan=False))) == flat
    assert math.isinf(device_from_json(device_to_json(flat)).fresh_page_bytes)
    path = tmp_path / "p.json"
    from spmd.core.profiles import LinkProfile

    save_profile(str(path), {"tp": LinkProfile("l", 1e-3, 1e9)}, dev)
    assert load_profile(str(path)).device == dev
    # a profile file from before the hierarchy loads with none
    old = json.loads(path.read_text())
    for key in ("cache_bytes", "dram_bandwidth", "fresh_page_bytes", "page_fault_bandwidth", "element_seconds"):
        del old["device"][key]
    path.write_text(json.dumps(old))
    legacy = load_profile(str(path)).device
    assert legacy.dram_bandwidth is None and legacy.element_seconds == () and math.isinf(legacy.cache_bytes)


def test_plan_files_reload_with_the_same_device(tmp_path):
    import spmd
    from spmd.core.profiles import LinkProfile
    from spmd.report.plan_io import load_plan
    from tests.models import MLP

    mesh = spmd.MeshSpec((2,), ("tp",), (LinkProfile("l", 1e-3, 1e9),), _cpu())
    plan = spmd.plan(MLP(16, 64), mesh, (torch.randn(8, 16),))
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert load_plan(str(path))[0].mesh.device == mesh.device


def test_calibration_fits_the_dram_and_page_fault_rates_and_keeps_the_per_element_times():
    from spmd.runtime.measure import builtin_cpu, fit_device

    def line(bandwidth, sizes):
        return [(12.0 * n, 12.0 * n / bandwidth) for n in sizes]

    points = {"op": [(10.0, 5e-6)], "matmul": [(2.0 * n ** 3, 2.0 * n ** 3 / 8e10) for n in (64, 256, 512)],
              "stream": line(6e10, (1 << 15, 1 << 17)), "dram": line(1.2e10, (1 << 21, 3 << 20)),
              "fault": [(12.0 * n, 12.0 * n / 1.2e10 + 4.0 * n / 1.5e9) for n in (1 << 23, 1 << 24)],
              "elementwise": {"exp": 1.5e-9, "tanh": 3.5e-9}}
    dev = fit_device(points, "test", 8e9)
    assert dev.flops == pytest.approx(8e10) and dev.memory_bandwidth == pytest.approx(6e10)
    assert dev.dram_bandwidth == pytest.approx(1.2e10) and dev.page_fault_bandwidth == pytest.approx(1.5e9)
    kernels, builtin = dict(dev.element_seconds), dict(builtin_cpu().element_seconds)
    assert kernels["exp"] == 1.5e-9 and kernels["tanh"] == 3.5e-9  # as timed
    # the kernels not timed: the built-in's, times the median ratio timed / built-in of those timed
    scale = (1.5e-9 / builtin["exp"] + 3.5e-9 / builtin["tanh"]) / 2
    assert set(kernels) == set(builtin) and kernels["gelu"] == pytest.approx(builtin["gelu"] * scale)
    assert dev.fresh_page_bytes == 32 * MiB


def test_local_copies_and_bucket_packing_go_through_the_hierarchy():
    """A slice made contiguous reads and writes its piece; a bucketed gradient is copied into the bucket,
    read back as a view: in cache, from DRAM, and with the faults of a fresh output."""
    from spmd.core.mesh import MeshSpec
    from spmd.core.profiles import LinkProfile
    from spmd.core.redistribute import Step
    from spmd.cost_model.comm import step_cost

    dev = _cpu()
    mesh = MeshSpec((2,), ("tp",), (LinkProfile("l", 1e-3, 1e9),), dev)

    def piece_seconds(nbytes):  # read + write of `nbytes`, plus its faults if fresh
        moved = 2 * nbytes
        stream = moved / (5e10 if moved <= 8 * MiB else 1e10)
        return stream + (nbytes / 1e9 if nbytes >= 32 * MiB else 0.0)

    for full in (1 * MiB, 16 * MiB, 128 * MiB):
        s = Step("shard_local", 0, None, 0, None, (full // 4,), 4)
        assert step_cost(s, mesh) == pytest.approx(piece_seconds(full / 2))
        ar = Step("all_reduce", 0, None, None, "sum", (full // 4,), 4)
        bucket = 4 * MiB
        plain = 1e-3 + full / 1e9  # latency + 2 (n-1)/n B / b on 2 ranks
        share = min(1.0, full / bucket)
        assert step_cost(ar, mesh, bucket) == pytest.approx(
            plain - 1e-3 + share * 1e-3 + piece_seconds(full))  # into the bucket; back out as a view
