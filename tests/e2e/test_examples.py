"""The examples run in CI, at small sizes, as the README runs them."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*command, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*map(str, command)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_demo_on_four_gloo_ranks_matches_one_device():
    """The README's main demo, with the tiny model: torchrun, 4 ranks on a 2x2 mesh."""
    out = _run(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "examples/demo.py", "--tiny")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "OK: every rank matches the single-device model" in out.stdout
    assert out.stdout.count("max |output - single device|") == 4


def test_render_gpt_draws_the_plan(tmp_path):
    out = _run(sys.executable, "examples/render_gpt.py", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Modules (layout per mesh axis):" in out.stdout
    drawn = sorted(p.suffix for p in tmp_path.iterdir())
    assert drawn in ([".svg", ".svg"], [".dot", ".dot"]), drawn  # .dot where graphviz is not installed
