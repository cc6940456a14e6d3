"""Mesh descriptions: axis names, sizes and the links between ranks on each axis. No processes.

A `MeshSpec` is what planning needs. The runtime mesh is torch's `DeviceMesh`, a separate object, so a
64-GPU mesh can be planned on a laptop.

    mesh (2, 2), axes ("dp", "tp"), rank = 2*dp + tp

              tp=0   tp=1
      dp=0  [  0  ,   1  ]     an all_reduce on "tp" runs inside each row: {0,1} and {2,3}
      dp=1  [  2  ,   3  ]     an all_reduce on "dp" runs inside each column: {0,2} and {1,3}
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from spmd.core.profiles import DeviceProfile, LinkProfile, device_profile_for, gpu_profile_name, link_profile_for


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """A logical device mesh: `shape[i]` ranks along axis `axis_names[i]`, with one link per axis.

    `links[i]` is the alpha-beta model of a collective on axis i (latency in seconds, bus bandwidth in
    bytes/s). Default links: the last (inner) axis NVLink-class, outer axes network-class; for a gloo
    mesh `MeshSpec.from_device_mesh` uses the profile measured for gloo on CPU.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    links: tuple[LinkProfile, ...] = ()
    device: DeviceProfile = field(default_factory=lambda: device_profile_for("h100"))

    def __post_init__(self):
        shape, names = tuple(self.shape), tuple(self.axis_names)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)
        if not shape or any((not isinstance(s, int)) or s < 1 for s in shape):
            raise ValueError(f"MeshSpec shape must be positive ints, got {shape}")
        if len(names) != len(shape):
            raise ValueError(f"MeshSpec has {len(shape)} axes but {len(names)} names: {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"MeshSpec axis names must be unique, got {names}")
        links = tuple(self.links)
        if not links:
            links = tuple(
                link_profile_for("nvlink" if i == len(shape) - 1 else "infiniband") for i in range(len(shape))
            )
            object.__setattr__(self, "links", links)
        if len(links) != len(shape):
            raise ValueError(f"MeshSpec has {len(shape)} axes but {len(links)} link profiles")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis(self, name_or_index: str | int) -> int:
        if isinstance(name_or_index, int):
            return name_or_index
        try:
            return self.axis_names.index(name_or_index)
        except ValueError:
            raise ValueError(f"no mesh axis named {name_or_index!r}; axes are {self.axis_names}") from None

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Row-major coordinate of `rank` (ranks numbered as in `torch.arange(size).reshape(shape)`)."""
        return coordinate(rank, self.shape)

    def __str__(self) -> str:
        return "(" + ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape)) + ")"

    @staticmethod
    def from_device_mesh(mesh, device: str | DeviceProfile | None = None) -> "MeshSpec":
        """Describe a torch `DeviceMesh` with the link and device profiles of its backend."""
        import torch.distributed as dist

        names = mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(mesh.ndim))
        backend = dist.get_backend(mesh.get_group(0)) if dist.is_initialized() else "gloo"
        if backend == "gloo" or mesh.device_type == "cpu":
            # More ranks than cores on this host: each rank gets a share of a core, and gloo's
            # latency grows about 3.4x (measured: 4.1 vs 1.2 ms per all_reduce); plan with what the ranks will really see.
            share = min(1.0, (os.cpu_count() or 1) / ranks_on_this_host())
            links = tuple(link_profile_for("gloo" if share >= 1.0 else "gloo-oversubscribed") for _ in names)
            cpu = mesh.device_type == "cpu"  # (else gloo moving CUDA tensors: the GPUs compute)
            dev = device or (device_profile_for("cpu").scaled(share) if cpu else _local_gpu())
        else:
            links = tuple(link_profile_for("nvlink" if inside else "infiniband")
                          for inside in _axes_inside_one_host(tuple(mesh.shape), mesh.mesh))
            dev = device or _local_gpu()
        dev = dev if isinstance(dev, DeviceProfile) else device_profile_for(dev)
        # the ranks step together: the step's compute runs at the slowest one's pace
        return MeshSpec(tuple(mesh.shape), tuple(names), links, dev.in_lockstep(math.prod(mesh.shape)))

    @staticmethod
    def from_profile(profile, shape, axis_names) -> "MeshSpec":
        """A mesh whose links and device come from a calibrated profile (`spmd.tools.calibrate`):
        `profile` is a path or a loaded `profiles.Profile`. Each axis takes the link measured under its
        name; a profile with a single axis serves every axis. On more than one rank the device runs at
        the pace of the slowest (`DeviceProfile.in_lockstep`)."""
        from spmd.core.profiles import Profile, load_profile

        prof = profile if isinstance(profile, Profile) else load_profile(os.fspath(profile))
        links = []
        for name in axis_names:
            if name in prof.links:
                links.append(prof.links[name])
            elif len(prof.links) == 1:
                links.append(next(iter(prof.links.values())))
            else:
                raise ValueError(f"MeshSpec.from_profile: the profile has links for axes {sorted(prof.links)}, "
                                 f"none named {name!r}; calibrate with that axis name (--mesh {name}=N,...)")
        return MeshSpec(tuple(shape), tuple(axis_names), tuple(links), prof.device.in_lockstep(math.prod(shape)))


def coordinate(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major coordinate of `rank` on a mesh of `shape` (ranks numbered as in
    `torch.arange(size).reshape(shape)`)."""
    coord = []
    for s in reversed(shape):
        coord.append(rank % s)
        rank //= s
    return tuple(reversed(coord))


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """"dp=2,tp=4" -> ((2, 4), ("dp", "tp")): how the command line writes a mesh (outer axis first)."""
    shape, names = [], []
    for part in text.split(","):
        name, eq, size = part.partition("=")
        if not eq or not name.strip() or not size.strip().isdigit():
            raise ValueError(f"mesh {text!r}: expected axis=size pairs like dp=2,tp=4")
        if int(size) < 1:
            raise ValueError(f"mesh {text!r}: axis {name.strip()!r} has size {int(size)}; each axis needs at least "
                             "one device")
        names.append(name.strip())
        shape.append(int(size))
    return tuple(shape), tuple(names)


# The machine of each rank of the default process group, as `init_mesh` gathered them (`record_hosts`): what says
# which ranks share a machine where torchrun's LOCAL_WORLD_SIZE is missing (srun, mpirun) or the machines hold
# different numbers of ranks. (id of the default group, machines), so a group destroyed and made again is not read
# (an id, not the group: a group kept alive past destroy_process_group can abort the interpreter's exit,
# runtime/meshes.py).
_HOSTS: tuple[int, tuple[str, ...]] | None = None


def host_id() -> str:
    """This machine: its kernel's boot id (shared by the containers of one machine, different on every machine),
    else its host name."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        if boot:
            return boot
    except OSError:
        pass
    return socket.gethostname()


def record_hosts(hosts) -> None:
    """The machine (`host_id()`) of each rank of the default process group, in rank order."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group

    global _HOSTS
    if dist.is_initialized() and len(hosts) == dist.get_world_size():
        _HOSTS = (id(_get_default_group()), tuple(hosts))


def recorded_hosts() -> tuple[str, ...] | None:
    """`record_hosts`'s machines, while the default process group they were gathered in lives."""
    import torch.distributed as dist

    if _HOSTS is None or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_group

    group, hosts = _HOSTS
    return hosts if group == id(_get_default_group()) and len(hosts) == dist.get_world_size() else None


def ranks_on_this_host() -> int:
    """Ranks on this machine: counted from the machines `init_mesh` gathered, else torchrun's LOCAL_WORLD_SIZE,
    else the process group's size (ranks started some other way on one host), else WORLD_SIZE, else 1."""
    import torch.distributed as dist

    hosts = recorded_hosts()
    if hosts is not None:
        return hosts.count(hosts[dist.get_rank()])
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) >= 1:
        return int(local)
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    world = os.environ.get("WORLD_SIZE", "")
    return max(1, int(world)) if world.isdigit() else 1


def _axes_inside_one_host(shape: tuple[int, ...], ranks=None) -> tuple[bool, ...]:
    """Whether each mesh axis's groups stay on one host. `ranks` is the mesh's grid of global ranks
    (`DeviceMesh.mesh`): where `init_mesh` gathered each rank's machine, an axis is inside one host when every one of
    its groups is. Else from torchrun's LOCAL_WORLD_SIZE (ranks numbered host by host, row-major over the mesh): an
    axis of stride `s` and size `n` stays inside a host of L ranks where s * n divides L. Without either, the last
    axis alone (one host per group of the innermost axis). Before, the last axis was always priced as NVLink and the
    others as InfiniBand: a (4,) mesh over 2 hosts of 2 GPUs was priced as NVLink across the hosts, and a (2, 4) mesh
    on one host of 8 as InfiniBand on dp; and srun or mpirun, which set no LOCAL_WORLD_SIZE, got the last rule."""
    hosts = recorded_hosts()
    if hosts is not None and ranks is not None:
        import torch

        grid = torch.as_tensor(ranks).reshape(shape)
        if int(grid.max()) < len(hosts):
            out = []
            for i, n in enumerate(shape):
                groups = grid.movedim(i, -1).reshape(-1, n).tolist()
                out.append(all(len({hosts[r] for r in group}) == 1 for group in groups))
            return tuple(out)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if not local or not local.isdigit() or int(local) < 1:
        return tuple(i == len(shape) - 1 for i in range(len(shape)))
    local_n = int(local)
    out = []
    for i, n in enumerate(shape):
        span = math.prod(shape[i:])  # the ranks one group of axis i reaches, from its first: stride * n
        out.append(n == 1 or (local_n % span == 0))
    return tuple(out)


def _local_gpu() -> str:
    """The built-in profile of this process's GPU (h100 where there is none: compiling for CUDA on fakes)."""
    import torch

    return gpu_profile_name(torch.cuda.get_device_name() if torch.cuda.is_available() else "")
