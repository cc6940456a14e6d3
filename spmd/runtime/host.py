"""The CPU these ranks run on, as the cost model sees it: measured at first use, then kept on disk.

The built-in `cpu` device profile (core/profiles.py) holds one VM's numbers. Hosts differ by more than
the plan can afford: on 2026-11-27 this project's box ran fp32 matmuls at 188 GFLOP/s and a small ATen op
in 4.4 us, where the built-in says 58 GFLOP/s and 20 us. Priced with the built-in numbers there, a plan
believes compute 3x dearer against gloo's collectives than it is (so it shards where it should not) and
predicts GPT-2-small's step at twice its measured time. So `spmd.compile` on a CPU mesh plans with
this host's own device profile, chosen by the environment variable SPMD_CPU_PROFILE:

    unset or "measured"   measured here once (every rank on the host at once, ~2 s), then read from the
                          cache below
    "builtin"             the built-in `cpu`, scaled by the rank's share of the cores (the test suite
                          sets this, so its plans do not depend on the machine running it)
    a path                the device of a profile file written by `spmd calibrate`

The cache holds one file per (CPU model, cores, ranks on this host, threads per rank, torch version),
in $SPMD_CACHE_DIR, else $XDG_CACHE_HOME/spmd, else ~/.cache/spmd; delete the file to measure again.

Every rank must plan with the same numbers, or the ranks' plans differ: rank 0 reads the cache and sends
the profile to the others. Where it has none, every rank measures at once (each timed call is long
enough that ranks sharing a core compete for it, as they do in a step: `measure.measure_device`), and
rank 0 fits its timings, sends the profile and writes the cache. The links keep the built-in gloo
profile: timing the collectives takes about 30 s (`spmd calibrate` does it).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
from pathlib import Path

from spmd.core.errors import SpmdError
from spmd.core.profiles import DeviceProfile, device_from_json, device_to_json, load_profile
from spmd.runtime.measure import builtin_cpu, fit_device, measure_device, memory_per_rank

ENV = "SPMD_CPU_PROFILE"
CACHE_VERSION = 1  # raised when what is measured, or how, changes: older files are then not read


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key() -> dict:
    """What the measured numbers depend on: the same key, the same file."""
    import torch

    return {"version": CACHE_VERSION, "cpu": _cpu_model(), "cores": os.cpu_count() or 1,
            "ranks_on_host": int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1))),
            "threads_per_rank": torch.get_num_threads(), "torch": torch.__version__.split("+")[0]}


def cache_path(key: dict | None = None) -> Path:
    base = os.environ.get("SPMD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "spmd")
    digest = hashlib.sha1(json.dumps(key or cache_key(), sort_keys=True).encode()).hexdigest()[:16]
    return Path(base) / f"cpu-{digest}.json"


def _read(path: Path, key: dict) -> dict | None:
    """The cached profile (JSON), or None where there is none, or it is unreadable or for another key."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("key") != key or not isinstance(doc.get("device"), dict):
        return None
    try:
        device_from_json(doc["device"])
    except (KeyError, TypeError, ValueError):
        return None
    return doc["device"]


def _write(path: Path, key: dict, device: dict) -> None:
    """Write the cache atomically (a reader never sees half a file); a cache that cannot be written
    only means measuring again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "device": device}, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


def measure_host() -> DeviceProfile:
    """This rank's device profile from a quick timing (every rank of the process group must call it at
    once; alone without one)."""
    points = measure_device(quick=True)
    ranks = cache_key()["ranks_on_host"]
    day = datetime.date.today().isoformat()
    source = (f"measured on this host at first use ({_cpu_model()}, {ranks} rank(s) at once, {day}; "
              "spmd.runtime.host): matmul on squares, streaming adds, a small joint graph per op, four "
              "element-wise kernels; the rest as the built-in cpu")
    return dataclasses.replace(fit_device(points, source, memory_per_rank()), name="measured-cpu")


def host_cpu_profile() -> DeviceProfile:
    """The device profile to plan this host's ranks with (see the module's docstring). Collective when a
    process group is up and SPMD_CPU_PROFILE is "measured": every rank must call it."""
    import torch.distributed as dist

    choice = os.environ.get(ENV, "measured")
    if choice == "builtin":
        return builtin_cpu()
    if choice != "measured":
        try:
            return load_profile(choice).device
        except (OSError, ValueError, KeyError) as e:
            raise SpmdError(f"{ENV}={choice!r}: not a profile file ({type(e).__name__}: {e}). What to do: set it "
                            "to 'measured' (this host, timed once), 'builtin', or the path of a profile written "
                            "by `spmd calibrate`.") from e
    distributed = dist.is_available() and dist.is_initialized()
    first = not distributed or dist.get_rank() == 0
    key = cache_key()
    path = cache_path(key)
    got = [_read(path, key) if first else None]
    if distributed:
        dist.broadcast_object_list(got, src=0)
    if got[0] is None:
        got = [device_to_json(measure_host())]
        if distributed:
            dist.broadcast_object_list(got, src=0)
        if first:
            _write(path, key, got[0])
    return device_from_json(got[0])
