"""Test tiers, by folder:

    tests/unit      one pass, one module, one message at a time; no processes
    tests/property  hypothesis: rules, the placement algebra, the solver against brute force; no processes
    tests/golden    per-pass dumps and explanations of a small model, compared with files (SPMD_REGEN_GOLDEN=1
                    rewrites them); no processes
    tests/e2e       anything that starts a process: gloo ranks, the CLI, torchrun, the examples

The fast tier is everything but tests/e2e (`python -m pytest tests/unit tests/property tests/golden`). A
test outside tests/e2e that starts a process fails: the guard below makes process creation raise there.
Every pass's postcondition is checked as the pipeline runs (SPMD_VERIFY=1, inherited by rank processes).
"""
import multiprocessing.process
import os
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("SPMD_VERIFY", "1")
# CPU meshes plan with the built-in device profile, not this machine's measured one (runtime/host.py):
# a test's plan must not depend on the machine running it
os.environ["SPMD_CPU_PROFILE"] = "builtin"
E2E = Path(__file__).parent / "e2e"


@pytest.fixture(autouse=True)
def no_processes_outside_e2e(request, monkeypatch):
    if Path(str(request.path)).is_relative_to(E2E):
        yield
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{request.node.nodeid} starts a process: tests that do belong in tests/e2e")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield
