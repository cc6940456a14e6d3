"""The command line as users run it: the installed `spmd` script and `python -m spmd`, as processes."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BUILD = '''
import torch
from tests.models import MLP


def build():
    torch.manual_seed(0)
    return MLP(16, 64), (torch.randn(8, 16),)
'''


def _run(*command, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([*map(str, command)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_spmd_script_plans_and_python_m_spmd_diffs(tmp_path):
    (tmp_path / "model.py").write_text(BUILD)
    script = shutil.which("spmd") or [sys.executable, "-m", "spmd"]
    script = [script] if isinstance(script, str) else script
    fwd = _run(*script, "plan", tmp_path / "model.py:build", "--mesh", "dp=2,tp=2", "--link", "gloo", "--device",
               "cpu", "--json", tmp_path / "fwd.json", "--html", tmp_path / "fwd.html")
    assert fwd.returncode == 0, fwd.stderr
    assert "Plan on mesh (dp=2, tp=2)" in fwd.stdout
    assert (tmp_path / "fwd.html").read_text().startswith("<!doctype html>")
    same = _run(sys.executable, "-m", "spmd", "diff", tmp_path / "fwd.json", tmp_path / "fwd.json")
    assert same.returncode == 0 and "plans are the same" in same.stdout
    bad = _run(sys.executable, "-m", "spmd", "explain", tmp_path / "missing.json")
    assert bad.returncode == 2 and "missing.json" in bad.stderr
