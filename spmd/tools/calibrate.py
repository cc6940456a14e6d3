"""Calibrate the cost model on this machine: time the collectives per mesh axis and a few device ops,
fit the alpha-beta links and the device roofline, and save a profile the planner loads
(`MeshSpec.from_profile`).

    torchrun --nproc-per-node 4 -m spmd.tools.calibrate --mesh dp=2,tp=2 --out profile.json
    python -m spmd.tools.calibrate --nproc 2 --mesh tp=2 --out profile.json   # spawns gloo ranks
    spmd calibrate --nproc 2 --mesh tp=2 --out profile.json                    # the same

Collectives are the runtime's own (`spmd.core.collectives`, functional collectives + wait) on dim 0,
so no local copy terms apply and the fit uses exactly `comm.py`'s convention: with B the bytes each rank
holds before the step and n the axis size,

    all_reduce 2(n-1)/n B    reduce_scatter (n-1)/n B    all_gather (n-1) B    all_to_all (n-1)/n B

bytes on the wire, and time = latency + wire / bandwidth. Every axis is timed with all its groups running
at once (on a (2, 2) mesh, "tp" times {0,1} and {2,3} together), as they do in a real step. Each point:
warmup calls, then `reps` calls, each after a barrier and a little compute (`--gap-ms`: a collective that
follows compute finds gloo asleep more often); per call the max over all ranks; the mean over calls less
the slowest 10% (gloo here is bimodal, ~0.3 ms or several ms at any size, and a step pays the average).
The device (matmul FLOP/s, streaming bandwidth, per-op overhead) is timed on every rank at once, each call
~20 ms long so that ranks sharing a core really compete: it is measured as it will run.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import socket
import sys
import time

from spmd.core.mesh import parse_mesh
from spmd.cost_model.comm import wire_bytes
from spmd.runtime.measure import (KINDS, fit_alpha_beta, fit_device, measure_device, measure_links,  # noqa: F401
                                  measure_lockstep, memory_per_rank)


def geometric_sizes(lo: int, hi: int, count: int) -> list[int]:
    if count <= 1:
        return [lo]
    return sorted({int(round(lo * (hi / lo) ** (i / (count - 1)))) for i in range(count)})


# ---------------------------------------------------------------------------------------------------
# fitting


def fit_links(points: dict, shape: dict[str, int], source: str, small_max: int | None = None) -> dict:
    """axis name -> LinkProfile: all_reduce's fit as the default, every kind in `per_collective`.
    `small_max`: the alpha-beta line is fitted on the points of at most that many bytes per rank; the
    points beyond give each kind a second bandwidth for the wire bytes past the last small size
    (`LinkProfile.large_messages`), where they run slower than the line says."""
    from spmd.core.profiles import LinkProfile

    links = {}
    for axis, by_kind in points.items():
        n = shape[axis]
        fits, large = {}, []
        for kind, pts in by_kind.items():
            limit = max(b for b, _ in pts) if small_max is None else small_max
            small = [(wire_bytes(kind, n, b), t) for b, t in pts if b <= limit]
            lat, bw = fits[kind] = fit_alpha_beta(*zip(*small))
            w0 = max(w for w, _ in small)
            beyond = _large_message_bandwidth([(wire_bytes(kind, n, b), t) for b, t in pts], w0, lat, bw)
            if beyond is not None:
                large.append((kind, w0, beyond))
        lat, bw = fits.get("all_reduce", next(iter(fits.values())))
        links[axis] = LinkProfile(f"calibrated-{axis}-n{n}", lat, bw, source,
                                  tuple((k, a, b) for k, (a, b) in fits.items()), tuple(large))
    return links


def _large_message_bandwidth(points, w0: float, lat: float, bw: float) -> float | None:
    """The bandwidth past `w0` wire bytes that the points (wire bytes, seconds) show, beyond the line
    `lat + w / bw` (least squares through the line at w0); None when they are not slower than the line."""
    excess = [(w - w0, t - lat - w / bw) for w, t in points if w > w0]
    if not excess:
        return None
    k = sum(dw * dt for dw, dt in excess) / sum(dw * dw for dw, _ in excess)  # extra seconds per byte
    return 1.0 / (1.0 / bw + k) if k > 0 else None


def calibrate(device_mesh, sizes: list[int], kinds=KINDS, warmup: int = 3, reps: int = 15,
              device: bool = True, log=None, gap_s: float = 2e-3, large_sizes: list[int] = ()):
    """Measure and fit on every rank of `device_mesh`; returns the same `profiles.Profile` everywhere."""
    import torch
    import torch.distributed as dist

    from spmd.core.profiles import Profile, device_profile_for

    names = device_mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(device_mesh.ndim))
    shape = dict(zip(names, device_mesh.shape))
    world = dist.get_world_size()
    t0 = time.perf_counter()
    link_points = measure_links(device_mesh, sizes, kinds, warmup, reps, log, gap_s, large_sizes)
    when = datetime.datetime.now().isoformat(timespec="seconds")
    src = (f"calibrated {when} on {platform.node()}: spmd.tools.calibrate, {dist.get_backend()} functional "
           f"collectives on dim 0, {world} processes ({os.cpu_count()} cores), mesh {shape}, "
           f"{len(sizes)} sizes {sizes[0]}..{sizes[-1]} B, max over ranks, mean of {reps} calls less the slowest "
           f"10%, each after {gap_s * 1e3:g} ms of compute")
    links = fit_links(link_points, shape, src, max(sizes))
    dev_points = (measure_device(max(1, warmup // 2), max(3, reps // 2), quick=len(sizes) < 4,
                                 seconds=0.002 if len(sizes) < 4 else 0.02) if device else {})
    if device and world > 1:
        dev_points["lockstep"] = measure_lockstep(segments=10 if len(sizes) < 4 else 40)
    dev = (fit_device(dev_points, src.replace("collectives on dim 0", "mm/add/FX-node timings, all ranks at once"),
                      memory_per_rank()) if device else device_profile_for("cpu"))
    points = {"links": {a: {k: [[b, t] for b, t in pts] for k, pts in bk.items()} for a, bk in link_points.items()},
              "device": {k: dict(pts) if isinstance(pts, dict) else pts if k == "lockstep" else [list(p) for p in pts]
                         for k, pts in dev_points.items()}}
    meta = {"backend": dist.get_backend(), "world": world, "mesh": shape, "date": when, "host": platform.node(),
            "torch": torch.__version__, "cores": os.cpu_count(), "threads_per_rank": torch.get_num_threads(),
            "seconds": round(time.perf_counter() - t0, 1), "command": " ".join(sys.argv), "gap_ms": gap_s * 1e3}
    return Profile(links, dev, points, meta)


def summary(profile) -> str:
    """A table of the fitted numbers with their fit errors."""
    lines = [f"calibrated on {profile.meta.get('world')} ranks, mesh {profile.meta.get('mesh')}:",
             "| axis | collective | latency us | bandwidth GB/s | large messages GB/s | max fit error |",
             "|---|---|---|---|---|---|"]
    for axis, link in profile.links.items():
        n = profile.meta.get("mesh", {}).get(axis, 2)
        for kind, lat, bw in link.per_collective:
            pts = profile.points.get("links", {}).get(axis, {}).get(kind, [])
            big = link.large_message(kind)
            err = max((abs(lat + link.transfer_seconds(kind, wire_bytes(kind, n, b)) - t) / t for b, t in pts),
                      default=0.0)
            lines.append(f"| {axis} | {kind} | {lat * 1e6:.1f} | {bw / 1e9:.3f} | "
                         f"{f'{big[1] / 1e9:.3f} past {big[0] / 2**20:.0f} MiB' if big else '-'} | {err:.0%} |")
    d = profile.device
    lines.append(f"device: {d.flops / 1e9:.1f} GFLOP/s, {d.memory_bandwidth / 1e9:.2f} GB/s streaming in cache "
                 f"(up to {d.cache_bytes / 2**20:.1f} MiB moved), "
                 f"{(d.dram_bandwidth or d.memory_bandwidth) / 1e9:.2f} GB/s from DRAM, page faults "
                 f"{d.page_fault_bandwidth / 1e9:.2f} GB/s for outputs of {d.fresh_page_bytes / 2**20:.0f} MiB or "
                 f"more, {d.op_overhead_s * 1e6:.1f} us per (non-view) op; around the graphs "
                 f"{d.call_overhead_s * 1e6:.1f} us per call + {d.arg_overhead_s * 1e6:.2f} us per argument, per "
                 f"training step {d.backward_overhead_s * 1e6:.1f} us + {d.autograd_tensor_overhead_s * 1e6:.2f} us per "
                 f"parameter and saved value; ranks stepping together run at the slowest's pace, "
                 f"{d.lockstep_slowdown:.3f}x one rank's")
    if d.element_seconds:
        lines.append("ns per element: " + ", ".join(f"{op} {s * 1e9:.2f}" for op, s in d.element_seconds))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# command line


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spmd calibrate", description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--mesh", default=None, help="NAME=SIZE,... (default: tp=<world size>)")
    ap.add_argument("--nproc", type=int, default=None,
                    help="not under torchrun: spawn this many gloo processes (default: the mesh's size)")
    ap.add_argument("--out", default="profile.json", help="profile file to write (JSON)")
    ap.add_argument("--min-bytes", type=int, default=4096)
    ap.add_argument("--max-bytes", type=int, default=8 << 20)
    ap.add_argument("--num-sizes", type=int, default=8, help="geometric steps from --min-bytes to --max-bytes")
    ap.add_argument("--large-max-bytes", type=int, default=64 << 20,
                    help="also time doublings of --max-bytes up to this, for the links' large-message bandwidth "
                         "(0: none; runs of fewer than 4 sizes time none)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15, help="timed calls per point (median taken)")
    ap.add_argument("--gap-ms", type=float, default=2.0,
                    help="untimed compute before each timed collective (0: back to back, gloo's fast case)")
    ap.add_argument("--no-device", action="store_true", help="skip the device timings (keep the built-in cpu)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung collective fails")
    ap.add_argument("--quiet", action="store_true")
    return ap


def _worker(args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from spmd.core.profiles import save_profile

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    world, rank = dist.get_world_size(), dist.get_rank()
    shape, names = parse_mesh(args.mesh) if args.mesh else ((world,), ("tp",))
    if math.prod(shape) != world:
        raise SystemExit(f"calibrate: mesh {dict(zip(names, shape))} needs {math.prod(shape)} processes, "
                         f"the world has {world}")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    log = print if rank == 0 and not args.quiet else None
    sizes = geometric_sizes(args.min_bytes, args.max_bytes, args.num_sizes)
    large = []  # a quick run (fewer than 4 sizes: the device is timed quickly too) times no large messages
    if args.large_max_bytes and len(sizes) >= 4:
        while sizes[-1] * 2 ** (len(large) + 1) <= args.large_max_bytes:
            large.append(sizes[-1] * 2 ** (len(large) + 1))
    prof = calibrate(mesh, sizes, tuple(k for k in args.kinds.split(",") if k), args.warmup, args.reps,
                     not args.no_device, log, args.gap_ms / 1e3, large)
    if rank == 0:
        save_profile(args.out, prof.links, prof.device, prof.points, prof.meta)
        if not args.quiet:
            print(summary(prof))
            print(f"wrote {args.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    _worker(args)


def _check(ap: argparse.ArgumentParser, args) -> None:
    """Arguments that would time nothing or write a profile fitted to nothing, refused before any process
    starts (found by a probe: a raw traceback, or a profile of 1e15 B/s)."""
    try:
        shape = parse_mesh(args.mesh)[0] if args.mesh else None
    except ValueError as e:
        ap.error(f"--mesh: {e}")
    if args.nproc is not None and args.nproc < 1:
        ap.error(f"--nproc {args.nproc}: expected at least 1 process")
    if shape is not None and args.nproc is not None and math.prod(shape) != args.nproc:
        ap.error(f"--mesh {args.mesh} needs {math.prod(shape)} processes, --nproc gives {args.nproc}")
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        ap.error(f"--min-bytes {args.min_bytes} and --max-bytes {args.max_bytes}: expected 1 <= min <= max")
    if args.num_sizes < 2:
        ap.error(f"--num-sizes {args.num_sizes}: a link's latency and bandwidth need at least 2 sizes")
    if args.reps < 1 or args.warmup < 0:
        ap.error(f"--reps {args.reps}, --warmup {args.warmup}: expected reps >= 1 and warmup >= 0")


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    _check(ap, args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        _worker(args)
        return 0
    import torch.multiprocessing as mp

    from spmd.tools import calibrate as this  # pickled by its import name, also under `python -m`

    world = args.nproc or (math.prod(parse_mesh(args.mesh)[0]) if args.mesh else 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.start_processes(this._spawned, args=(world, port, args), nprocs=world, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
