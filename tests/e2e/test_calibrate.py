"""A tiny real calibration on 2 gloo processes: every collective fitted, a profile the planner loads."""
from spmd.core.mesh import MeshSpec
from spmd.core.profiles import load_profile
from spmd.tools.calibrate import main


def test_tiny_real_calibration_on_two_gloo_processes(tmp_path):
    out = tmp_path / "profile.json"
    assert main(["--nproc", "2", "--mesh", "tp=2", "--out", str(out), "--min-bytes", "4096", "--max-bytes",
                 "65536", "--num-sizes", "2", "--reps", "2", "--warmup", "1", "--timeout", "120", "--quiet"]) == 0
    prof = load_profile(str(out))
    link = prof.links["tp"]
    assert link.bandwidth > 0 and link.latency_s >= 0
    assert {k for k, _, _ in link.per_collective} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert all(bw > 0 for _, _, bw in link.per_collective)
    assert prof.device.flops > 0 and prof.device.memory_bandwidth > 0 and prof.device.op_overhead_s > 0
    assert len(prof.points["links"]["tp"]["all_reduce"]) == 2
    spec = MeshSpec.from_profile(prof, (2,), ("tp",))
    assert spec.links[0] is link
