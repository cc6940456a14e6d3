"""`python -m spmd` (the `spmd` script): plan, explain, diff; calibrate is forwarded."""
import io
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from spmd import cli

ROOT = Path(__file__).resolve().parents[1]

BUILD = '''
import torch
import torch.nn.functional as F
from examples.models import MLP


def build():
    torch.manual_seed(0)
    return MLP(16, 64), (torch.randn(8, 16),)


def build_training():
    torch.manual_seed(0)
    return MLP(16, 64), (torch.randn(8, 16), torch.randn(8, 16)), lambda y, t: F.mse_loss(y, t)
'''


def _spmd(*args, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "spmd", *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Two plan files: forward on (dp=2, tp=2) with pictures from `python -m spmd plan` (a subprocess,
    as users run it), and training from `cli.main` in this process (the same code, no second start-up)."""
    d = tmp_path_factory.mktemp("cli")
    (d / "model.py").write_text(BUILD)
    fwd = _spmd("plan", d / "model.py:build", "--mesh", "dp=2,tp=2", "--link", "gloo", "--device", "cpu",
                "--json", d / "fwd.json", "--svg", d / "fwd.svg", "--html", d / "fwd.html")
    return d, fwd


def test_plan_prints_the_plan_and_writes_files(plans):
    d, fwd = plans
    assert fwd.returncode == 0, fwd.stderr
    assert "Plan on mesh (dp=2, tp=2)" in fwd.stdout
    assert (d / "fwd.json").exists() and (d / "fwd.html").read_text().startswith("<!doctype html>")
    picture = d / ("fwd.svg" if shutil.which("dot") else "fwd.dot")
    assert picture.exists()


def test_plan_with_a_loss_fn_plans_training_then_explain_and_diff(plans, capsys):
    d, _ = plans
    assert cli.main(["plan", f"{d / 'model.py'}:build_training", "--mesh", "dp=2", "--json",
                     str(d / "train.json"), "--explain"]) == 0
    out = capsys.readouterr().out
    assert "gradients" in out and "(backward)" in out  # --explain: the full table
    assert cli.main(["explain", str(d / "fwd.json")]) == 0
    out = capsys.readouterr().out
    assert "Modules (layout per mesh axis):" in out and "Collectives per call:" in out
    assert cli.main(["diff", str(d / "fwd.json"), str(d / "fwd.json")]) == 0
    assert "plans are the same" in capsys.readouterr().out
    # as a subprocess: diff's exit status is 1 when the plans differ, like diff(1)
    diff = _spmd("diff", d / "fwd.json", d / "train.json")
    assert diff.returncode == 1 and "mesh: (dp=2, tp=2) -> (dp=2)" in diff.stdout
    assert "only in b" in diff.stdout and "estimated time:" in diff.stdout


def test_user_errors_say_what_to_do(tmp_path, capsys):
    assert cli.main(["plan", "x.py:build", "--mesh", "dp:2"]) == 2
    assert "expected axis=size pairs like dp=2,tp=4" in capsys.readouterr().err
    assert cli.main(["plan", str(tmp_path / "missing.py") + ":build", "--mesh", "dp=2"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli.main(["explain", str(tmp_path / "none.json")]) == 2
    assert cli.parse_mesh("dp=2,tp=4") == ((2, 4), ("dp", "tp"))


def test_calibrate_is_forwarded_or_explained(monkeypatch, capsys):
    calls = []
    fake = type(sys)("spmd.cost_model.calibrate")
    fake.main = lambda argv: calls.append(argv) or 0
    monkeypatch.setitem(sys.modules, "spmd.cost_model.calibrate", fake)
    assert cli.main(["calibrate", "--help", "--reps", "3"]) == 0
    assert calls == [["--help", "--reps", "3"]]
    monkeypatch.setitem(sys.modules, "spmd.cost_model.calibrate", None)  # not installed
    assert cli.main(["calibrate"]) == 2
    assert "spmd.cost_model.calibrate is not part of this installation" in capsys.readouterr().err


def test_progress_line_for_slow_work():
    stream = io.StringIO()
    with cli.Progress("planning GPT", stream, after=0.0):
        pass
    assert "planning GPT" in stream.getvalue() and "done in" in stream.getvalue()
    quiet = io.StringIO()
    with cli.Progress("planning GPT", quiet, after=5.0):
        pass
    assert quiet.getvalue() == ""


def test_script_entry_point_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["spmd"] == "spmd.cli:main"
