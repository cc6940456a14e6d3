"""The solver's helper threads and the end of the process: a plan followed at once by the end of the
script must exit cleanly. The interior point solve started beside a large program's first relaxation
(`solver._Beside`) was a daemon thread; stopped while still in HiGHS's presolve (which no callback
interrupts), it was killed inside HiGHS at exit and the process aborted ("terminate called without an
active exception", exit status 134) after a plan that had succeeded."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import time
    import highspy
    import numpy as np
    from spmd.cost_model import solver

    # a program whose presolve takes ~0.5 s: the instance is still in it when the process ends
    rng = np.random.default_rng(0)
    m, n, per = 100_000, 200_000, 4
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, m
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = rng.random(n), np.zeros(n), np.ones(n)
    lp.row_lower_, lp.row_upper_ = np.ones(m), np.full(m, highspy.kHighsInf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.arange(0, per * n + 1, per, dtype=np.int32)
    lp.a_matrix_.index_ = np.concatenate([np.sort(rng.choice(m, per, replace=False)) for _ in range(n)]).astype(np.int32)
    lp.a_matrix_.value_ = rng.random(per * n)

    def make():
        h = solver._highs(60.0, presolve=True)
        h.setOptionValue("solver", "ipm")
        h.passModel(lp)
        return h

    beside = solver._Beside(make, after=0.0)
    time.sleep(0.05)
    beside.stop()  # (does not wait for an instance in its presolve)
    print("done", flush=True)
""")


def test_a_process_ending_right_after_stopping_the_interior_point_exits_cleanly():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "done" in done.stdout
