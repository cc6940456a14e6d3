"""A rank that dies or hangs in the middle of a training step: the others fail, fast, naming what they
were doing, and nothing is left running (docs/reliability.md has the measured times)."""
import re
import time
from pathlib import Path

import pytest

from tests.support import launch_ranks

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "dying_rank.py"


@pytest.mark.parametrize("how,limit_s", [("die", 30.0), ("hang", 20.0)])
def test_the_survivor_fails_fast_and_says_which_collective(how, limit_s):
    timeout_s = 10.0
    procs = launch_ranks([str(SCRIPT), how, str(timeout_s)])
    try:
        out0, err0 = procs[0].communicate(timeout=180)
        t_end = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # the hanging rank: a real job's launcher does this
        out1, _ = procs[1].communicate(timeout=60)
    assert procs[0].returncode not in (0, None), out0 + err0
    t_event = float(next(line for line in out1.splitlines() if "at step 2" in line).split(", ")[-1])
    elapsed = t_end - t_event
    assert elapsed < (limit_s if how == "die" else timeout_s + limit_s), elapsed
    assert "SpmdCollectiveError" in err0, err0[-3000:]
    assert "over ranks [0, 1] failed (" in err0 and "spmd.init_mesh(..., timeout=" in err0, err0[-3000:]
    message = next(line for line in err0.splitlines() if "SpmdCollectiveError:" in line)
    assert "on mesh axis dp" in message or "a bucket of" in message, message
    print(message)
    assert "rank 0 finished" not in out0
    print(f"{how}: the survivor failed {elapsed:.1f} s after rank 1 stopped")


_AXIS_TIMEOUTS = """
import datetime, torch, spmd
from spmd.runtime.meshes import device_mesh
spmd.init_mesh((2, 2), ("dp", "tp"), timeout=datetime.timedelta(seconds=7))
mesh, cpu = device_mesh((2, 2), ("dp", "tp"), "cpu"), torch.device("cpu")
print("timeouts", [mesh.get_group(a)._get_backend(cpu).options._timeout.total_seconds() for a in ("dp", "tp")])
"""

_OTHER_MESHES = """
import os, spmd
rank = int(os.environ["RANK"])
try:
    spmd.init_mesh((2, 2) if rank < 2 else (4,), ("dp", "tp") if rank < 2 else ("tp",))
except spmd.SpmdError as e:
    print("refused", e)
"""

_TWO_MACHINES_NO_LOCAL_WORLD_SIZE = """
import os, spmd, spmd.api
from spmd.core.mesh import _axes_inside_one_host, ranks_on_this_host
del os.environ["LOCAL_WORLD_SIZE"]  # (srun and mpirun set none)
rank = int(os.environ["RANK"])
spmd.api.host_id = lambda: f"machine{rank // 2}"  # two machines of two ranks
mesh = spmd.init_mesh((2, 2), ("dp", "tp"), "cpu")
print("inside", _axes_inside_one_host((2, 2), mesh.mesh), "(4,)", _axes_inside_one_host((4,), list(range(4))),
      "local", ranks_on_this_host())
"""


def _four(code: str) -> list[str]:
    procs = launch_ranks(["-c", code], world=4)
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, out + err[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def test_the_mesh_axes_groups_wait_as_long_as_init_mesh_says():
    """Found by a probe: torch's init_device_mesh made the axes' groups of a (2, 2) mesh with torch's default
    timeout (30 minutes on gloo), so `init_mesh(timeout=...)` held for nothing there: a rank that stopped left
    the others waiting half an hour."""
    for out in _four(_AXIS_TIMEOUTS):
        assert "timeouts [7.0, 7.0]" in out, out


_USERS_GROUP_TIMEOUT = """
import datetime, torch, torch.distributed as dist, spmd
from spmd.runtime.meshes import device_mesh
dist.init_process_group("gloo")  # (the user's own, torch's 30 minutes)
spmd.init_mesh((2, 2), ("dp", "tp"))  # (asked for before: its axes' groups made with the old timeout; a review)
spmd.init_mesh((2, 2), ("dp", "tp"), timeout=datetime.timedelta(seconds=7))
mesh, cpu = device_mesh((2, 2), ("dp", "tp"), "cpu"), torch.device("cpu")
groups = [dist.distributed_c10d._get_default_group()] + [mesh.get_group(a) for a in ("dp", "tp")]
print("timeouts", [g._get_backend(cpu).options._timeout.total_seconds() for g in groups])
"""


def test_a_process_group_the_user_started_takes_the_timeout_init_mesh_is_given():
    """Found by a probe: after the user's own `dist.init_process_group("gloo")`, `init_mesh(timeout=10 s)` was
    ignored, and a rank that stopped left the others waiting 30 minutes (the probe's rank waited 100 s, until its
    peer exited). The default group and the axes' groups, of meshes made before too, now take it (the probe's
    wait: 10.0 s)."""
    for out in _four(_USERS_GROUP_TIMEOUT):
        assert "timeouts [7.0, 7.0, 7.0]" in out, out

def test_ranks_asking_for_other_meshes_are_refused_on_every_rank():
    """Found by a probe: machines started with other meshes ((2, 2) here, (4,) there) waited in the groups'
    creation until killed."""
    for out in _four(_OTHER_MESHES):
        assert re.search(r"refused init_mesh: the ranks asked for different meshes: rank 2 \{'tp': 4\} on cpu, rank 0 "
                         r"\{'dp': 2, 'tp': 2\} on cpu", out), out


def test_which_ranks_share_a_machine_comes_from_the_machines_themselves():
    """Found by a probe: launches that set no LOCAL_WORLD_SIZE (srun, mpirun) took every rank as one machine's
    (a core's share, the memory a rank may use) and priced the last mesh axis alone as NVLink. init_mesh gathers
    each rank's machine: here two of two ranks each."""
    for out in _four(_TWO_MACHINES_NO_LOCAL_WORLD_SIZE):
        assert "inside (False, True) (4,) (False,) local 2" in out, out
