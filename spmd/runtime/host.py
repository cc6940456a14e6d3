"""The CPU these ranks run on, as the cost model sees it: timed at first use, then kept on disk.

The built-in `cpu` device profile (core/profiles.py) holds one VM's numbers. Hosts differ by more than
a plan can afford: on 2026-11-27 this project's box ran fp32 matmuls at 175-188 GFLOP/s and a small ATen
op in 4.6 us, where the built-in says 58 GFLOP/s and 20 us. Priced with the built-in there, compute
looks 3x dearer against gloo's collectives than it is, and plans shard where they should not
(bench/results_predict.md). So `spmd.compile` on a CPU mesh plans with this host's own device profile,
as the environment variable SPMD_CPU_PROFILE says:

    unset or "measured"   timed here once (every rank at once, ~3-4 s; `measure.measure_device`, quick),
                          then read from the cache below
    "builtin"             the built-in `cpu`, scaled by the rank's share of the cores (the test suite
                          sets this, so its plans do not depend on the machine running it)
    a path                the device of a profile file written by `spmd calibrate`

The cache holds the timings and the profile fitted from them, stamped with the built-in numbers the
fit borrows and `FIT_VERSION`: where either changed, the timings are fitted again (and the file
rewritten). One file per (CPU model, cores this process may use, ranks on this host, threads per rank,
torch version), in $SPMD_CACHE_DIR, else
$XDG_CACHE_HOME/spmd, else ~/.cache/spmd; delete it to time again. A lock file keeps two jobs starting
on one host from timing at once (the second reads what the first wrote).

Every rank must plan with the same numbers, and no rank may wait in a collective another never joins.
So the ranks first agree on SPMD_CPU_PROFILE (all raise the same error if they differ); then rank 0
alone resolves it (builtin, file, or cache) and sends the profile, or an error every rank raises, or
"time it", and then all ranks time the device together (each timed call long enough that ranks sharing
a core compete for it, as in a step) and rank 0 fits its timings, sends the profile and writes the
cache. The links keep the built-in gloo profile: timing the collectives takes ~30 s (`spmd calibrate`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import tempfile
import warnings
from pathlib import Path

from spmd.core.autocast import autocast_off
from spmd.core.errors import SpmdError
from spmd.core.mesh import ranks_on_this_host
from spmd.core.profiles import DeviceProfile, device_from_json, device_to_json, load_profile
from spmd.runtime.measure import builtin_cpu, fit_device, measure_device, memory_per_rank

ENV = "SPMD_CPU_PROFILE"
CACHE_VERSION = 7  # raised when what is timed, or how, changes: older files are then not read
FIT_VERSION = 7  # raised when `fit_device` changes: cached timings are then fitted again
_known: dict[str, DeviceProfile] = {}  # cache file -> its profile, for this process (also when unwritable)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() in ("model name", "Model", "CPU part"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cache_key() -> dict:
    """What the timings depend on: the same key, the same file."""
    import torch

    return {"version": CACHE_VERSION, "cpu": _cpu_model(), "machine": platform.machine(), "cores": _cores(),
            "ranks_on_host": ranks_on_this_host(), "threads_per_rank": torch.get_num_threads(),
            "torch": torch.__version__.split("+")[0]}


def cache_path(key: dict | None = None) -> Path:
    base = os.environ.get("SPMD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "spmd")
    digest = hashlib.sha1(json.dumps(key or cache_key(), sort_keys=True).encode()).hexdigest()[:16]
    return Path(base) / f"cpu-{digest}.json"


def _fitted(points: dict) -> DeviceProfile:
    """The device profile of `measure_device`'s timings (read from the cache or just taken)."""
    day = points.get("day", "")
    source = (f"timed on this host ({_cpu_model()}, {ranks_on_this_host()} rank(s) at once{', ' + day if day else ''}; "
              "spmd.runtime.host): matmuls, adds in cache and from DRAM, views and a small joint graph per op, "
              "four element-wise kernels (the others scaled from the built-in), a transformer block's graph "
              "whole, a compiled module's call and training step around its graphs; the rest as the built-in "
              "cpu")
    return dataclasses.replace(fit_device(points, source, memory_per_rank()), name="measured-cpu")


def _stamp() -> str:
    """What a fit depends on beside the timings: `FIT_VERSION` and the built-in numbers it borrows."""
    doc = json.dumps([FIT_VERSION, device_to_json(builtin_cpu())], sort_keys=True)
    return hashlib.sha1(doc.encode()).hexdigest()[:16]


def _read(path: Path, key: dict) -> tuple[dict, DeviceProfile | None] | None:
    """(the cached timings, their fitted profile where it is still current), or None where there are none,
    or they are unreadable or for another key."""
    try:
        doc = json.loads(path.read_text())
        if doc["key"] != key or not isinstance(doc["points"], dict):
            return None
        fitted = doc.get("fitted") or {}
        return doc["points"], device_from_json(fitted["device"]) if fitted.get("stamp") == _stamp() else None
    except Exception:  # noqa: BLE001 - any damage to the file means timing again, never failing
        return None


def _write(path: Path, key: dict, points: dict, device: DeviceProfile) -> None:
    """Write the cache atomically (a reader never sees half a file). A cache that cannot be written
    means timing again in the next process (this one remembers), with a warning."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "points": points, "fitted": {"stamp": _stamp(), "device": device_to_json(device)}}, f)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        warnings.warn(f"spmd: could not cache this host's timings in {path} ({e}); set SPMD_CACHE_DIR to a "
                      "writable folder, or each new process times the host again (~3-4 s)", stacklevel=3)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock next to the cache file while it is read, timed and written (where locks are
    unavailable, go on without)."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_suffix(".lock"), "w")
    except (ImportError, OSError):
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def _timings() -> dict:
    """`measure_device`'s quick timings, JSON-able (every rank of the process group at once)."""
    import torch

    # the timings draw random tensors: the user's seed stays as it was; and they time fp32 kernels, whatever
    # autocast the user compiles under (a review measured the fp32 matmul at bf16 speed, cached for good)
    with torch.random.fork_rng(devices=[]), autocast_off():
        points = measure_device(warmup=1, reps=5, quick=True)  # (the median of 5: ~4 s with 2 ranks on 2 cores)
    points = {k: ([list(p) for p in v] if isinstance(v, list) else v) for k, v in points.items()}
    points["day"] = datetime.date.today().isoformat()
    return points


def _resolve(choice: str, key: dict, path: Path) -> DeviceProfile | None:
    """What `choice` gives without timing: the built-in, a file's device, or the cached timings' fit
    (None: nothing cached, time the host)."""
    if choice == "builtin":
        return builtin_cpu()
    if choice != "measured":
        try:
            return load_profile(choice).device
        except (OSError, ValueError, KeyError) as e:
            raise SpmdError(f"{ENV}={choice!r}: not a profile file ({type(e).__name__}: {e}). What to do: set "
                            "it to 'measured' (this host, timed once), 'builtin', or the path of a profile "
                            "written by `spmd calibrate`.") from e
    if str(path) in _known:
        return _known[str(path)]
    cached = _read(path, key)
    if cached is None:
        return None
    points, device = cached
    if device is None:  # the fit changed since: fit the timings again, keep that
        try:
            device = _fitted(points)
        except Exception:  # noqa: BLE001 - timings it cannot fit: time the host again
            return None
        _write(path, key, points, device)
    _known[str(path)] = device
    return device


def host_cpu_profile() -> DeviceProfile:
    """The device profile to plan this host's ranks with (see the module's docstring). Collective when a
    process group is up: every rank must call it, and every rank gets the same profile or the same error."""
    import torch.distributed as dist

    choice = os.environ.get(ENV, "measured")
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        choices = [None] * dist.get_world_size()
        dist.all_gather_object(choices, choice)
        if len(set(choices)) > 1:
            raise SpmdError(f"the ranks were started with different {ENV}: "
                            + ", ".join(f"rank {r}: {c!r}" for r, c in enumerate(choices))
                            + f". What to do: give every rank the same {ENV} (or none).")
    first = not distributed or dist.get_rank() == 0
    key = cache_key() if first else None  # (rank 0 alone reads and writes the cache)
    path = cache_path(key) if first else None
    with _locked(path) if first and choice == "measured" else contextlib.nullcontext():
        message = [None]  # what rank 0 sends: ("device", json), ("time", None) or ("error", text)
        if first:
            try:
                got = _resolve(choice, key, path)
                message[0] = ("time", None) if got is None else ("device", device_to_json(got))
            except Exception as e:  # noqa: BLE001 - every rank raises it, none is left waiting
                message[0] = ("error", str(e) if isinstance(e, SpmdError) else f"{type(e).__name__}: {e}")
        if distributed:
            dist.broadcast_object_list(message, src=0)
        kind, body = message[0]
        if kind == "time":
            points = _timings()  # every rank: ranks sharing the cores compete as in a step
            if first:
                try:
                    device = _known[str(path)] = _fitted(points)
                    message[0] = ("device", device_to_json(device))
                    _write(path, key, points, device)
                except Exception as e:  # noqa: BLE001
                    message[0] = ("error", f"timing this host failed: {type(e).__name__}: {e}")
            if distributed:
                dist.broadcast_object_list(message, src=0)
            kind, body = message[0]
    if kind == "error":
        raise SpmdError(body)
    return device_from_json(body)
