"""Calibration: the alpha-beta fit and profile files (a real run on gloo processes: tests/e2e)."""
import json
import random

import pytest

from spmd.cost_model.comm import step_cost, wire_bytes
from spmd.runtime.measure import fit_alpha_beta
from spmd.tools.calibrate import geometric_sizes
from spmd.core.profiles import (DeviceProfile, LinkProfile, load_profile, save_profile, device_profile_for)
from spmd.core.mesh import MeshSpec
from spmd.core.redistribute import Step


@pytest.mark.parametrize("alpha,bandwidth", [(3.3e-4, 1.5e9), (5e-6, 150e9), (0.0, 2e9), (5e-3, 1.1e9)])
def test_fit_recovers_known_alpha_beta(alpha, bandwidth):
    xs = geometric_sizes(4096, 8 << 20, 8)
    ts = [alpha + x / bandwidth for x in xs]
    a, b = fit_alpha_beta(xs, ts)
    assert a == pytest.approx(alpha, rel=1e-6, abs=1e-12)
    assert b == pytest.approx(bandwidth, rel=1e-6)
    a, b = fit_alpha_beta(xs, ts, relative=False)
    assert a == pytest.approx(alpha, rel=1e-6, abs=1e-12) and b == pytest.approx(bandwidth, rel=1e-6)


def test_fit_is_close_under_noise():
    rng = random.Random(0)
    xs = geometric_sizes(4096, 8 << 20, 12)
    ts = [(3e-4 + x / 1e9) * (1 + rng.uniform(-0.03, 0.03)) for x in xs]
    a, b = fit_alpha_beta(xs, ts)
    assert a == pytest.approx(3e-4, rel=0.1) and b == pytest.approx(1e9, rel=0.1)


def test_fit_clamps_a_negative_intercept_and_refits_the_slope():
    xs = [1e6, 2e6, 4e6]
    ts = [x / 1e9 - 1e-4 for x in xs]  # the line crosses zero above x = 0
    a, b = fit_alpha_beta(xs, ts)
    assert a == 0.0 and 0 < b < 1e9 * 1.2  # through the origin: slope a little above 1/1e9
    assert all(t > 0 for t in ts)


def test_fit_of_flat_times_gives_latency_and_a_huge_bandwidth():
    a, b = fit_alpha_beta([1e3, 1e4, 1e5], [2e-4, 2e-4, 2e-4])
    assert a == pytest.approx(2e-4) and b >= 1e12


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("n", [2, 4])
def test_calibration_fits_the_ring_factors_the_cost_model_prices(kind, n):
    """Calibration fits t = latency + wire / bandwidth with comm.wire_bytes; on dim 0 (no local copy) the
    cost model charges exactly that, with the ring factors of a collective over n ranks."""
    ring = {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1, "reduce_scatter": (n - 1) / n,
            "all_to_all": (n - 1) / n}[kind]
    link = LinkProfile("t", 1e-4, 1e9)
    mesh = MeshSpec((n,), ("x",), (link,), device_profile_for("cpu"))
    shape = (8 * n, 16)
    step = Step(kind, 0, 0 if kind in ("all_gather", "all_to_all") else None,
                0 if kind in ("reduce_scatter", "all_to_all") else None,
                "sum" if kind in ("all_reduce", "reduce_scatter") else None, shape, 4)
    assert wire_bytes(kind, n, step.in_bytes) == pytest.approx(ring * 8 * n * 16 * 4)
    assert step_cost(step, mesh) == pytest.approx(1e-4 + ring * 8 * n * 16 * 4 / 1e9)


def test_save_load_round_trip_and_mesh_from_profile(tmp_path):
    links = {"dp": LinkProfile("calibrated-dp", 5e-3, 1.1e9, "test", (("all_gather", 3e-3, 0.8e9),)),
             "tp": LinkProfile("calibrated-tp", 3e-4, 1.5e9, "test")}
    dev = DeviceProfile("calibrated-cpu", 9e10, 4e10, 2e-6, 8e9, "test")
    path = tmp_path / "p.json"
    save_profile(str(path), links, dev, {"links": {"tp": {"all_reduce": [[4096, 3e-4]]}}}, {"world": 4})
    prof = load_profile(str(path))
    assert prof.links == links and prof.device == dev
    assert prof.points["links"]["tp"]["all_reduce"] == [[4096, 3e-4]] and prof.meta["world"] == 4
    spec = MeshSpec.from_profile(path, (2, 2), ("dp", "tp"))
    assert spec.links == (links["dp"], links["tp"]) and spec.device == dev
    assert spec.links[0].alpha_beta("all_gather") == (3e-3, 0.8e9)
    with pytest.raises(ValueError, match="none named 'pp'"):
        MeshSpec.from_profile(prof, (2, 2), ("pp", "tp"))
    doc = json.loads(path.read_text())
    doc["version"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="re-run calibration"):
        load_profile(str(path))


def test_single_axis_profile_serves_every_axis(tmp_path):
    link = LinkProfile("calibrated-tp", 3e-4, 1.5e9)
    path = tmp_path / "p.json"
    save_profile(str(path), {"tp": link}, device_profile_for("cpu"))
    assert MeshSpec.from_profile(str(path), (2, 2), ("dp", "tp")).links == (link, link)


def test_a_gpu_is_priced_by_its_own_profile():
    """MeshSpec.from_device_mesh on CUDA takes the built-in profile named by the device (torch's name
    for it), h100 for a GPU it has none for."""
    from spmd.core.profiles import gpu_profile_name

    assert gpu_profile_name("NVIDIA H200") == "h200"
    assert gpu_profile_name("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_profile_name("NVIDIA A100-SXM4-80GB") == "a100"
    assert gpu_profile_name("Tesla T4") == gpu_profile_name("") == "h100"
    h100, h200 = device_profile_for("h100"), device_profile_for("h200")
    # measured rates, below the datasheet's 989 TFLOP/s and 3.35 / 4.8 TB/s
    assert h100.flops == h200.flops < 989e12 and h100.memory_bandwidth < 3.35e12 and h200.memory_bandwidth < 4.8e12
