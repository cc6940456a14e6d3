"""Links with a second bandwidth for large messages (gloo beyond ~8 MiB per rank): the step cost, the
symbolic formula, profile and plan files, and calibration's fit."""
from __future__ import annotations

import json

import pytest
import sympy

from spmd.core.mesh import MeshSpec
from spmd.core.profiles import DeviceProfile, LinkProfile, load_profile, save_profile
from spmd.core.redistribute import Step
from spmd.cost_model.comm import step_cost, wire_bytes

MiB = 2 ** 20
DEVICE = DeviceProfile("d", 1e11, 1e10, 0.0, 8e9)


def _mesh(link: LinkProfile) -> MeshSpec:
    return MeshSpec((2,), ("tp",), (link,), DEVICE)


def _gather(nbytes):
    return Step("all_gather", 0, 0, None, None, (nbytes // 4,), 4)


def test_the_excess_over_the_threshold_moves_at_the_large_message_bandwidth():
    link = LinkProfile("l", 1e-3, 1e9, large_messages=(("all_gather", 8 * MiB, 2e8),))
    mesh = _mesh(link)
    for nbytes in (1 * MiB, 8 * MiB):
        assert step_cost(_gather(nbytes), mesh) == pytest.approx(1e-3 + nbytes / 1e9)
    big = 64 * MiB
    assert step_cost(_gather(big), mesh) == pytest.approx(1e-3 + 8 * MiB / 1e9 + 56 * MiB / 2e8)
    # other kinds keep one bandwidth
    ar = Step("all_reduce", 0, None, None, "sum", (big // 4,), 4)
    assert step_cost(ar, mesh) == pytest.approx(1e-3 + wire_bytes("all_reduce", 2, big) / 1e9)
    with pytest.raises(ValueError):
        LinkProfile("bad", 1e-3, 1e9, large_messages=(("all_gather", 8 * MiB, 0.0),))


def test_symbolic_step_cost_matches_the_concrete_one():
    link = LinkProfile("l", 1e-3, 1e9, large_messages=(("all_gather", 8 * MiB, 2e8),))
    mesh = _mesh(link)
    b = sympy.Symbol("b", positive=True)
    step = Step("all_gather", 0, 0, None, None, (b * (MiB // 4),), 4)
    formula = step_cost(step, mesh)
    for batch in (1, 8, 64):
        assert float(formula.subs(b, batch)) == pytest.approx(step_cost(_gather(batch * MiB), mesh))


def test_profile_files_keep_large_messages(tmp_path):
    link = LinkProfile("l", 1e-3, 1e9, "t", (("all_gather", 9e-4, 1.1e9),), (("all_gather", 8 * MiB, 2e8),))
    path = tmp_path / "p.json"
    save_profile(str(path), {"tp": link}, DEVICE)
    assert load_profile(str(path)).links["tp"] == link
    doc = json.loads(path.read_text())
    del doc["links"]["tp"]["large_messages"]  # a file from before: one bandwidth
    path.write_text(json.dumps(doc))
    assert load_profile(str(path)).links["tp"].large_messages == ()


def test_plan_files_keep_large_messages(tmp_path):
    import torch

    import spmd
    from spmd.report.plan_io import load_plan
    from tests.models import MLP

    mesh = _mesh(LinkProfile("l", 1e-3, 1e9, large_messages=(("all_reduce", 8 * MiB, 5e8),)))
    plan = spmd.plan(MLP(16, 64), mesh, (torch.randn(8, 16),))
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert load_plan(str(path))[0].mesh == mesh


def test_calibration_fits_a_second_bandwidth_beyond_the_small_sizes():
    from spmd.tools.calibrate import fit_links

    def t(kind, nbytes):
        w = wire_bytes(kind, 2, nbytes)
        w0 = wire_bytes(kind, 2, 8 * MiB)
        return 1e-3 + w / 1e9 + max(0.0, w - w0) * (1 / 2e8 - 1 / 1e9)

    sizes = [64 * 1024, 1 * MiB, 8 * MiB, 32 * MiB, 64 * MiB]
    points = {"tp": {"all_gather": [(s, t("all_gather", s)) for s in sizes],
                     "all_reduce": [(s, 1e-3 + wire_bytes("all_reduce", 2, s) / 1e9) for s in sizes]}}
    link = fit_links(points, {"tp": 2}, "test", small_max=8 * MiB)["tp"]
    assert link.alpha_beta("all_gather") == pytest.approx((1e-3, 1e9), rel=1e-6)
    (kind, w0, bw), = link.large_messages  # all_reduce stays on its line: no second regime
    assert kind == "all_gather" and w0 == pytest.approx(wire_bytes("all_gather", 2, 8 * MiB))
    assert bw == pytest.approx(2e8, rel=1e-6)
