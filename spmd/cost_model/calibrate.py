"""Calibrate the cost model on this machine: time the collectives per mesh axis and a few device ops,
fit the alpha-beta links and the device roofline, and save a profile the planner loads
(`MeshSpec.from_profile`).

    torchrun --nproc-per-node 4 -m spmd.cost_model.calibrate --mesh dp=2,tp=2 --out profile.json
    python -m spmd.cost_model.calibrate --nproc 2 --mesh tp=2 --out profile.json   # spawns gloo ranks

Collectives are the runtime's own (`spmd.runtime.collectives`, functional collectives + wait) on dim 0,
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
import statistics
import sys
import time

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def wire_bytes(kind: str, n: int, nbytes: float) -> float:
    """Bytes one rank moves for collective `kind` over `n` ranks holding `nbytes` each (comm.py's factors)."""
    return {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": float(n - 1),
            "all_to_all": (n - 1) / n}[kind] * nbytes


def fit_alpha_beta(xs, ts, relative: bool = True) -> tuple[float, float]:
    """Least-squares fit of t = alpha + x / beta over points (x units, t seconds): (alpha >= 0, beta > 0).

    `relative`: minimise relative errors (each residual divided by its t). The sizes span three decades;
    plain least squares lets the largest points decide the intercept, so the latency of small messages
    (what most collectives in a step are) comes out wrong or negative. A negative intercept is clamped
    to 0 and the slope refitted through the origin; a non-positive slope (time flat in size, within
    noise) gives the largest bandwidth the points cannot tell from infinite (1e15)."""
    import numpy as np

    x, t = np.asarray(xs, float), np.asarray(ts, float)
    if len(x) == 0 or np.any(t <= 0) or np.any(x < 0):
        raise ValueError("fit_alpha_beta: need points with x >= 0 and t > 0")
    w = 1.0 / t if relative else np.ones_like(t)
    if len(x) >= 2 and np.ptp(x) > 0:
        a = np.stack([w, w * x], 1)
        alpha, slope = np.linalg.lstsq(a, w * t, rcond=None)[0]
    else:
        alpha, slope = 0.0, float(np.sum(w * w * x * t) / max(np.sum(w * w * x * x), 1e-300))
    if alpha < 0:
        alpha = 0.0
        slope = float(np.sum(w * w * x * t) / max(np.sum(w * w * x * x), 1e-300))
    if slope <= 0:
        alpha, slope = float(np.sum(w * w * t) / np.sum(w * w)), 1e-15
    return float(alpha), float(1.0 / slope)


def geometric_sizes(lo: int, hi: int, count: int) -> list[int]:
    if count <= 1:
        return [lo]
    return sorted({int(round(lo * (hi / lo) ** (i / (count - 1)))) for i in range(count)})


# ---------------------------------------------------------------------------------------------------
# measuring (every rank runs these together)


def _max_over_ranks(times: list[float]) -> list[float]:
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    return [max(ts) for ts in zip(*gathered)]


def _trimmed_mean(xs: list[float], drop: float = 0.1) -> float:
    xs = sorted(xs)
    return statistics.fmean(xs[:max(1, len(xs) - int(len(xs) * drop))])


def _timed(fn, warmup: int, reps: int, gap_s: float = 0.0, stat: str = "median") -> float:
    """The slowest rank's time per call, as the median over `reps` calls or (`stat="mean"`) their mean
    without the slowest 10% (preemptions by other processes). Each call comes after a barrier and `gap_s` of
    (untimed) compute: a collective that follows compute, as in a real step, finds gloo's threads asleep
    and costs more than one run back to back (measured here: 4 KiB all_reduce 0.4 ms back to back,
    1.5-2.5 ms after 1-5 ms of matmuls). The deadline is on the shared monotonic clock, so the ranks
    enter the call together."""
    import torch
    import torch.distributed as dist

    a = torch.randn(64, 64)

    def call():
        dist.barrier()
        deadline = time.perf_counter() + gap_s
        while time.perf_counter() < deadline:
            torch.mm(a, a)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for _ in range(warmup):
        call()
    times = [call() for _ in range(reps)]
    if not reps:
        return 0.0
    worst = _max_over_ranks(times)
    return _trimmed_mean(worst) if stat == "mean" else statistics.median(worst)


def _collective_fn(kind: str, x, group: str, n: int):
    from spmd.runtime import collectives as C

    if kind == "all_reduce":
        return lambda: C.all_reduce(x, "sum", group, n)
    if kind == "all_gather":
        return lambda: C.all_gather(x, 0, group, n)
    if kind == "reduce_scatter":
        return lambda: C.reduce_scatter(x, 0, "sum", group, n)
    return lambda: C.all_to_all(x, 0, 0, group, n)


def measure_links(device_mesh, sizes: list[int], kinds=KINDS, warmup: int = 3, reps: int = 15,
                  log=None, gap_s: float = 0.0) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """axis name -> kind -> [(bytes each rank holds, seconds)] on `device_mesh` (every rank calls this)."""
    import torch

    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    names = device_mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(device_mesh.ndim))
    # Gloo's first ~20 collectives after start-up run in its slow (ms) mode: spend them here, not on the
    # first point.
    for axis in range(device_mesh.ndim):
        n = device_mesh.shape[axis]
        x = torch.randn(max(n, max(sizes) // 4 // n * n))
        for kind in kinds:
            _timed(_collective_fn(kind, x, device_mesh.get_group(axis).group_name, n), 2 * warmup, 0)
    for axis, name in enumerate(names):
        n = device_mesh.shape[axis]
        group = device_mesh.get_group(axis).group_name
        out[name] = {}
        for kind in kinds:
            pts = []
            for nbytes in sizes:
                numel = max(n, (nbytes // 4) // n * n)  # dim 0 divisible by n: even scatters
                x = torch.randn(numel)
                # the mean, not the median: gloo is bimodal (~0.3 ms or several ms at any size) and a step
                # with many collectives pays the average of the two modes
                pts.append((numel * 4, _timed(_collective_fn(kind, x, group, n), warmup, reps, gap_s, "mean")))
            out[name][kind] = pts
            if log:
                log(f"  {name} (n={n}) {kind}: " + ", ".join(f"{b // 1024} KiB {t * 1e3:.2f} ms" for b, t in pts))
    return out


def _small_joint_graph():
    """A forward+backward graph of the ops a transformer runs (layer_norm, linear, gelu, softmax attention,
    mean), traced to ATen by make_fx on tiny tensors, and its inputs: timing it gives the fixed cost per
    node the way a generated rank graph pays it (Python line, dispatcher, kernel start-up)."""
    import torch
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w1, b1, w2, b2, lw, lb):
        h = F.layer_norm(x, (x.shape[-1],), lw, lb)
        h = F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2)
        y = x + (h @ h.transpose(-1, -2)).softmax(-1) @ h
        return torch.autograd.grad((y * y).mean(), (x, w1, b1, w2, b2, lw, lb))

    g = torch.Generator().manual_seed(0)
    shapes = [(4, 8, 16), (64, 16), (64,), (16, 64), (16,), (16,), (16,)]
    args = [torch.randn(*s, generator=g, requires_grad=True) for s in shapes]
    return make_fx(f)(*args), [a.detach() for a in args]


def _repeats(fn, seconds: float) -> int:
    """How many calls of `fn` last about `seconds`. Ranks sharing a core only
    compete if their timed calls overlap; short calls after a barrier get staggered and each sees a whole
    core (4 ranks on 2 cores measured 93 GFLOP/s per rank that way, ~50 with 20 ms calls)."""
    fn()
    t0 = time.perf_counter()
    fn()
    return max(1, round(seconds / max(time.perf_counter() - t0, 1e-7)))


def _timed_per_call(fn, warmup: int, reps: int, seconds: float) -> float:
    import torch.distributed as dist

    # every rank must repeat the same number of times: agree on the largest count
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, _repeats(fn, seconds))
    k = max(counts)

    def agreed():
        for _ in range(k):
            fn()
    return _timed(agreed, warmup, reps) / k


def measure_device(warmup: int = 2, reps: int = 9, quick: bool = False,
                   seconds: float = 0.02) -> dict[str, list[tuple[float, float]]]:
    """kind -> [(x, seconds)]: "matmul" x = FLOPs of an n x n x n fp32 mm; "stream" x = bytes an
    out-of-place add moves (2 reads + 1 write); "op" x = non-view nodes of a small joint graph, t = its
    time per call / x. Each timed call repeats the kernel for about `seconds` (see `_repeats`)."""
    import torch

    out: dict[str, list[tuple[float, float]]] = {}
    pts = []
    for n in ((64, 128, 256) if quick else (64, 128, 256, 384, 512)):
        a, b = torch.randn(n, n), torch.randn(n, n)
        pts.append((2.0 * n ** 3, _timed_per_call(lambda: torch.mm(a, b), warmup, reps, seconds)))
    out["matmul"] = pts
    pts = []
    for numel in ((1 << 18, 1 << 20) if quick else (1 << 18, 1 << 20, 1 << 21, 1 << 22)):
        a, b = torch.randn(numel), torch.randn(numel)
        pts.append((12.0 * numel, _timed_per_call(lambda: torch.add(a, b), warmup, reps, seconds)))
    out["stream"] = pts
    # compute.py charges views `view_overhead_s` (the built-in cpu's, scaled by this rank's core share)
    # and every other node a fixed cost: (seconds per call - the views') / non-view nodes
    from spmd.cost_model.compute import is_view

    gm, xs = _small_joint_graph()
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    nonview = sum(1 for n in calls if not is_view(n.target))
    per_call = _timed_per_call(lambda: gm(*xs), warmup, reps, seconds)
    views_s = (len(calls) - nonview) * _builtin_cpu().view_overhead_s
    out["op"] = [(float(nonview), max(per_call - views_s, 0.0) / nonview)]
    return out


def _builtin_cpu():
    """The built-in `cpu` profile scaled by this rank's share of the cores (as MeshSpec.from_device_mesh)."""
    from spmd.cost_model.profiles import device_profile_for

    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    return device_profile_for("cpu").scaled(min(1.0, (os.cpu_count() or 1) / max(local, 1)))


# ---------------------------------------------------------------------------------------------------
# fitting


def fit_links(points: dict, shape: dict[str, int], source: str) -> dict:
    """axis name -> LinkProfile: all_reduce's fit as the default, every kind in `per_collective`."""
    from spmd.cost_model.profiles import LinkProfile

    links = {}
    for axis, by_kind in points.items():
        n = shape[axis]
        fits = {kind: fit_alpha_beta([wire_bytes(kind, n, b) for b, _ in pts], [t for _, t in pts])
                for kind, pts in by_kind.items()}
        lat, bw = fits.get("all_reduce", next(iter(fits.values())))
        links[axis] = LinkProfile(f"calibrated-{axis}-n{n}", lat, bw, source,
                                  tuple((k, a, b) for k, (a, b) in fits.items()))
    return links


def fit_device(points: dict, source: str, memory_bytes: float):
    from spmd.cost_model.profiles import DeviceProfile

    op = points["op"][0][1]
    _, flops = fit_alpha_beta(*zip(*points["matmul"]))
    _, bandwidth = fit_alpha_beta(*zip(*points["stream"]))
    # not timed here: views, the per-call wrapper and attention's efficiency, taken from the built-in cpu
    # (scaled by the core share)
    cpu = _builtin_cpu()
    return DeviceProfile("calibrated-cpu", flops, bandwidth, op, memory_bytes, source,
                         attention_efficiency=cpu.attention_efficiency,
                         view_overhead_s=cpu.view_overhead_s, call_overhead_s=cpu.call_overhead_s,
                         arg_overhead_s=cpu.arg_overhead_s, backward_overhead_s=cpu.backward_overhead_s,
                         autograd_tensor_overhead_s=cpu.autograd_tensor_overhead_s)


def _memory_per_rank() -> float:
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = 16e9
    return float(total) / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1))))


def calibrate(device_mesh, sizes: list[int], kinds=KINDS, warmup: int = 3, reps: int = 15,
              device: bool = True, log=None, gap_s: float = 2e-3):
    """Measure and fit on every rank of `device_mesh`; returns the same `profiles.Profile` everywhere."""
    import torch
    import torch.distributed as dist

    from spmd.cost_model.profiles import Profile, device_profile_for

    names = device_mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(device_mesh.ndim))
    shape = dict(zip(names, device_mesh.shape))
    world = dist.get_world_size()
    t0 = time.perf_counter()
    link_points = measure_links(device_mesh, sizes, kinds, warmup, reps, log, gap_s)
    when = datetime.datetime.now().isoformat(timespec="seconds")
    src = (f"calibrated {when} on {platform.node()}: spmd.cost_model.calibrate, {dist.get_backend()} functional "
           f"collectives on dim 0, {world} processes ({os.cpu_count()} cores), mesh {shape}, "
           f"{len(sizes)} sizes {sizes[0]}..{sizes[-1]} B, max over ranks, mean of {reps} calls less the slowest "
           f"10%, each after {gap_s * 1e3:g} ms of compute")
    links = fit_links(link_points, shape, src)
    dev_points = (measure_device(max(1, warmup // 2), max(3, reps // 2), quick=len(sizes) < 4,
                                 seconds=0.002 if len(sizes) < 4 else 0.02) if device else {})
    dev = (fit_device(dev_points, src.replace("collectives on dim 0", "mm/add/FX-node timings, all ranks at once"),
                      _memory_per_rank()) if device else device_profile_for("cpu"))
    points = {"links": {a: {k: [[b, t] for b, t in pts] for k, pts in bk.items()} for a, bk in link_points.items()},
              "device": {k: [[x, t] for x, t in pts] for k, pts in dev_points.items()}}
    meta = {"backend": dist.get_backend(), "world": world, "mesh": shape, "date": when, "host": platform.node(),
            "torch": torch.__version__, "cores": os.cpu_count(), "threads_per_rank": torch.get_num_threads(),
            "seconds": round(time.perf_counter() - t0, 1), "command": " ".join(sys.argv), "gap_ms": gap_s * 1e3}
    return Profile(links, dev, points, meta)


def summary(profile) -> str:
    """A table of the fitted numbers with their fit errors."""
    lines = [f"calibrated on {profile.meta.get('world')} ranks, mesh {profile.meta.get('mesh')}:",
             "| axis | collective | latency us | bandwidth GB/s | max fit error |", "|---|---|---|---|---|"]
    for axis, link in profile.links.items():
        n = profile.meta.get("mesh", {}).get(axis, 2)
        for kind, lat, bw in link.per_collective:
            pts = profile.points.get("links", {}).get(axis, {}).get(kind, [])
            err = max((abs(lat + wire_bytes(kind, n, b) / bw - t) / t for b, t in pts), default=0.0)
            lines.append(f"| {axis} | {kind} | {lat * 1e6:.1f} | {bw / 1e9:.3f} | {err:.0%} |")
    d = profile.device
    lines.append(f"device: {d.flops / 1e9:.1f} GFLOP/s, {d.memory_bandwidth / 1e9:.2f} GB/s streaming, "
                 f"{d.op_overhead_s * 1e6:.1f} us per (non-view) op")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# command line


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    names, shape = [], []
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not size.isdigit() or not name:
            raise argparse.ArgumentTypeError(f"--mesh: expected NAME=SIZE[,NAME=SIZE...], got {text!r}")
        names.append(name.strip())
        shape.append(int(size))
    return tuple(shape), tuple(names)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spmd calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", default=None, help="NAME=SIZE,... (default: tp=<world size>)")
    ap.add_argument("--nproc", type=int, default=None,
                    help="not under torchrun: spawn this many gloo processes (default: the mesh's size)")
    ap.add_argument("--out", default="profile.json", help="profile file to write (JSON)")
    ap.add_argument("--min-bytes", type=int, default=4096)
    ap.add_argument("--max-bytes", type=int, default=8 << 20)
    ap.add_argument("--num-sizes", type=int, default=8, help="geometric steps from --min-bytes to --max-bytes")
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

    from spmd.cost_model.profiles import save_profile

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
    prof = calibrate(mesh, sizes, tuple(k for k in args.kinds.split(",") if k), args.warmup, args.reps,
                     not args.no_device, log, args.gap_ms / 1e3)
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        _worker(args)
        return 0
    import torch.multiprocessing as mp

    from spmd.cost_model import calibrate as this  # pickled by its import name, also under `python -m`

    world = args.nproc or (math.prod(parse_mesh(args.mesh)[0]) if args.mesh else 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.start_processes(this._spawned, args=(world, port, args), nprocs=world, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
