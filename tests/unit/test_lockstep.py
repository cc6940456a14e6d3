"""Ranks stepping together run at the slowest one's pace (`DeviceProfile.lockstep_slowdown`): how a
multi-rank mesh applies it, the files that keep it, and calibration's measure of it."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from spmd.core.mesh import MeshSpec
from spmd.core.profiles import (DeviceProfile, LinkProfile, Profile, device_from_json, device_profile_for,
                                device_to_json)
from spmd.core.specs import TensorInfo
from spmd.cost_model.compute import compute_cost
from spmd.runtime.measure import lockstep_slowdown

aten = torch.ops.aten
DEVICE = DeviceProfile("d", 1e11, 1e10, 5e-6, 8e9, lockstep_slowdown=1.25)


def _mm_seconds(device) -> float:
    f32 = torch.float32
    a, b, out = TensorInfo((512, 768), f32), TensorInfo((768, 768), f32), TensorInfo((512, 768), f32)
    return compute_cost(aten.mm.default, ((512, 768), (768, 768)), {}, [a, b], [out], device)


def test_several_ranks_pay_the_slowdown_on_every_op_and_one_rank_does_not():
    assert DEVICE.in_lockstep(1) is DEVICE
    slowed = DEVICE.in_lockstep(4)
    assert _mm_seconds(slowed) == pytest.approx(1.25 * _mm_seconds(DEVICE))
    assert slowed.op_overhead_s == pytest.approx(1.25 * 5e-6)
    assert slowed.lockstep_slowdown == 1.0 and slowed.in_lockstep(4) is slowed  # applied once
    even = dataclasses.replace(DEVICE, lockstep_slowdown=1.0)
    assert even.in_lockstep(8) is even
    with pytest.raises(ValueError, match="lockstep_slowdown"):
        DeviceProfile("bad", 1e11, 1e10, 0.0, 8e9, lockstep_slowdown=0.9)
    assert device_profile_for("h100").lockstep_slowdown == 1.0  # GPUs: no such waits priced


def test_meshes_made_from_a_profile_apply_it_on_several_ranks():
    prof = Profile({"tp": LinkProfile("l", 1e-3, 1e9)}, DEVICE, {}, {})
    assert MeshSpec.from_profile(prof, (2,), ("tp",)).device.flops == pytest.approx(1e11 / 1.25)
    assert MeshSpec.from_profile(prof, (1,), ("tp",)).device is DEVICE


def test_profile_files_keep_it_and_older_files_load_with_none():
    d = json.loads(json.dumps(device_to_json(DEVICE)))
    assert device_from_json(d) == DEVICE
    del d["lockstep_slowdown"]
    assert device_from_json(d).lockstep_slowdown == 1.0


def test_the_measure_is_the_slowest_ranks_sum_over_the_mean_ranks():
    # rank 0 slow in the first segment, rank 1 in the second: each segment waits for its slowest
    per_rank = [[2.0, 1.0], [1.0, 3.0]]
    assert lockstep_slowdown(per_rank) == pytest.approx((2.0 + 3.0) / (1.5 + 2.0))
    assert lockstep_slowdown([[1.0, 2.0]]) == 1.0  # one rank: no one to wait for
    assert lockstep_slowdown([[1.0, 1.0], [1.0, 1.0]]) == 1.0


def test_calibration_fits_it_from_the_segments():
    from spmd.runtime.measure import fit_device

    points = {"op": [(10.0, 5e-6)], "matmul": [(2.0 * n ** 3, 2.0 * n ** 3 / 8e10) for n in (64, 256, 512)],
              "stream": [(12.0 * n, 12.0 * n / 6e10) for n in (1 << 15, 1 << 17)],
              "lockstep": [[0.040, 0.041, 0.040], [0.044, 0.040, 0.046]]}
    dev = fit_device(points, "test", 8e9)
    assert dev.lockstep_slowdown == pytest.approx((0.044 + 0.041 + 0.046) / ((0.084 + 0.081 + 0.086) / 2))
