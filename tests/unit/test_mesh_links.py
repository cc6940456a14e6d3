"""Which mesh axes stay inside one machine, for pricing NCCL links (NVLink inside, InfiniBand across): from
torchrun's LOCAL_WORLD_SIZE, ranks numbered machine by machine, row-major over the mesh. Found by a probe: the
last axis was always NVLink and the others InfiniBand, so a (4,) mesh over 2 machines of 2 GPUs was priced as
NVLink across them, and a (2, 4) mesh on one machine of 8 as InfiniBand on its first axis."""
import pytest

import spmd.core.mesh as mesh_module
from spmd.core.mesh import _axes_inside_one_host


@pytest.mark.parametrize("shape,local,inside", [
    ((8, 8), "8", (False, True)),       # 8 machines of 8: tp inside, dp across
    ((2, 4), "8", (True, True)),        # one machine of 8
    ((4,), "2", (False,)),              # tp over 2 machines of 2
    ((2, 2, 2), "4", (False, True, True)),
    ((1, 4), "2", (True, False)),       # a size-1 axis moves nothing
    ((8, 8), None, (False, True)),      # no torchrun: the last axis alone, as before
])
def test_axes_inside_one_machine(monkeypatch, shape, local, inside):
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert _axes_inside_one_host(shape) == inside


@pytest.mark.parametrize("hosts,shape,grid,inside", [
    ("aabb", (2, 2), [[0, 1], [2, 3]], (False, True)),     # two machines of two, tp inside each
    ("abab", (2, 2), [[0, 1], [2, 3]], (True, False)),     # ranks dealt round-robin: dp inside each
    ("aaab", (4,), [0, 1, 2, 3], (False,)),                # machines of other sizes
    ("aaaa", (2, 2), [[0, 1], [2, 3]], (True, True)),      # one machine
    ("aabb", (2, 2), [[3, 2], [1, 0]], (False, True)),     # the mesh's own numbering of the ranks
])
def test_the_machines_init_mesh_gathered_come_first(monkeypatch, hosts, shape, grid, inside):
    """Where init_mesh gathered each rank's machine, those decide, whatever LOCAL_WORLD_SIZE says (srun and
    mpirun set none; machines can hold different numbers of ranks)."""
    monkeypatch.setattr(mesh_module, "recorded_hosts", lambda: tuple(hosts))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _axes_inside_one_host(shape, grid) == inside
