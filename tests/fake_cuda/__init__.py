"""Fake CUDA on a CPU-only torch build, for tests: after `install()`, FakeTensorMode tensors on "cuda:k"
trace forward *and backward* (torch.export, AOTAutograd) and run under FakeTensorMode, with no GPU.

A CPU-only torch build lacks (fake_cuda.cpp says why each matters): a CUDA device guard (the first
autograd node on a CUDA tensor aborts the process) and a CUDA "accelerator" (backward fails: "Cannot access
accelerator device when none is available"). A CUDA build of torch, even on a machine with no GPU, has
both: `install()` then changes nothing.

Call it BEFORE `import torch` (it registers torch's CUDA hooks the supported way, through the registry
torch reads once); after, it patches the hooks object torch already made (a vtable swap; GCC/Itanium ABI).
Either way the process is changed for good (torch believes CUDA is built; torch.cuda.is_available() stays
False, CUDA is never initialized): run it in a process of its own (tests/e2e), never in the fast tier.
Needs g++ and torch's headers (pip wheels ship them); builds once per torch version into SPMD_FAKE_CUDA_CACHE
(default ~/.cache/spmd-fake-cuda).
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cuda.cpp")
_installed: dict | None = None


def _torch_dir() -> str:
    return os.path.dirname(importlib.util.find_spec("torch").origin)  # no import: see install()


def available() -> str | None:
    """None if the shim can be built here, else why not (for pytest.skip)."""
    if shutil.which("g++") is None:
        return "no g++"
    if not os.path.isdir(os.path.join(_torch_dir(), "include", "c10")):
        return "torch ships no C++ headers"
    return None


def build() -> str:
    tdir = _torch_dir()
    version = open(os.path.join(tdir, "version.py")).read()
    tag = hashlib.sha1(open(_SRC, "rb").read() + version.encode()).hexdigest()[:12]
    cache = os.environ.get("SPMD_FAKE_CUDA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "spmd-fake-cuda")
    os.makedirs(cache, exist_ok=True)
    so = os.path.join(cache, f"fake_cuda_{tag}.so")
    if not os.path.exists(so):
        tmp = f"{so}.{os.getpid()}"
        abi = os.environ.get("SPMD_FAKE_CUDA_CXX11_ABI", "1")  # torch >= 2.7 wheels: the CXX11 ABI
        subprocess.run(["g++", "-O1", "-w", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                        "-I", os.path.join(tdir, "include"), _SRC, "-L", os.path.join(tdir, "lib"), "-lc10",
                        "-ltorch_cpu", f"-Wl,-rpath,{os.path.join(tdir, 'lib')}", "-o", tmp], check=True)
        os.replace(tmp, so)
    return so


def install(device_count: int = 8) -> dict:
    """Fake CUDA devices 0..device_count-1 for this process. Idempotent; returns what was done."""
    global _installed
    if _installed is None:
        lib = ctypes.CDLL(build())
        before = "torch" not in sys.modules
        hooks = lib.spmd_fake_cuda_register_hooks() if before else lib.spmd_fake_cuda_patch_hooks()
        if hooks < 0:
            raise RuntimeError("fake_cuda: torch's CUDA hooks could not be patched; install() before `import torch`")
        guard = lib.spmd_fake_cuda_register_guard(device_count)
        _installed = {"hooks": ("registered" if before else "patched") if hooks else "torch's own",
                      "guard": "registered" if guard else "torch's own"}
    return _installed
